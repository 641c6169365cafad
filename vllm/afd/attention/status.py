# SPDX-License-Identifier: Apache-2.0
# SPDX-FileCopyrightText: Copyright contributors to the vllm-afd project
"""The attention link's state, shared with the API server process.

The link lives where the model runs (the engine core or a worker process);
/health, the 503 guard for requests and /metrics live in the API server
process. The link publishes a small JSON document per attention rank (state,
peer, last error, counters) into a directory private to one API server's
process tree; the API server reads it per request (a stat and a read of a few
hundred bytes) and at each scrape.

The directory comes from VLLM_AFD_STATUS_DIR, created by the first AFD
attention config built in the API server process (before it starts its engine
processes, which inherit the variable) and removed when that process exits.
Without it (offline `LLM` use) nothing is written; the in-process link is read
directly.

Files are replaced atomically (write, then rename), so readers never see half
a document.
"""

import atexit
import json
import logging
import os
import shutil
import tempfile
import time
from pathlib import Path

from vllm.afd.transport import leftovers

logger = logging.getLogger(__name__)

ENV_STATUS_DIR = "VLLM_AFD_STATUS_DIR"
PREFIX = "vllm-afd-status-"  # then the owning API server's pid, "-", mkdtemp's suffix

# Link states, in the order a link usually goes through them.
STARTING = "starting"  # model built, first connection attempt not made yet
CONNECTING = "connecting"  # dialing / handshaking; no FFN answered yet
READY = "ready"
DOWN = "down"  # was ready; lost the FFN; reconnecting
REFUSED = "refused"  # the FFN refused the handshake (configuration mismatch)
CLOSED = "closed"  # shut down on purpose


def prepare_status_dir() -> str:
    """The status directory of this process tree, created on first use.
    Called in the API server process before it spawns its engine."""
    import multiprocessing

    owner = os.getpid()
    path = os.environ.get(ENV_STATUS_DIR)
    # The directory names its owner. vLLM's own processes (API servers of a
    # data-parallel server, engines, workers: multiprocessing children) share
    # their parent's; a server started as a new program by another AFD process
    # (a test, a launcher) inherits the variable but must not share the files.
    if path and os.path.isdir(path) and (f"-{owner}-" in os.path.basename(path)
                                         or multiprocessing.parent_process() is not None):
        return path
    base = "/dev/shm" if os.path.isdir("/dev/shm") and os.access("/dev/shm", os.W_OK) else None
    remove_orphans(Path(base or tempfile.gettempdir()))
    path = tempfile.mkdtemp(prefix=f"{PREFIX}{owner}-", dir=base)
    os.environ[ENV_STATUS_DIR] = path

    def remove() -> None:
        if os.getpid() == owner:  # not in a forked child
            shutil.rmtree(path, ignore_errors=True)

    atexit.register(remove)
    return path


def remove_orphans(base: Path) -> None:
    """Remove the status directories of API servers that are gone (killed
    with SIGKILL, their atexit never ran). One whose owner's pid is ours was
    left by an earlier process that had this pid: we are not using it yet."""
    for path in base.glob(f"{PREFIX}*-*"):
        owner = path.name[len(PREFIX):].split("-", 1)[0]
        if not owner.isdigit():
            continue
        if int(owner) != os.getpid() and leftovers.alive(int(owner)):
            continue
        logger.debug("AFD: removing %s (its server is gone)", path)
        shutil.rmtree(path, ignore_errors=True)


def status_dir() -> Path | None:
    path = os.environ.get(ENV_STATUS_DIR)
    return Path(path) if path and os.path.isdir(path) else None


def publish(name: str, document: dict) -> None:
    """Write document as <status dir>/<name>.json (no-op without a directory)."""
    directory = status_dir()
    if directory is None:
        return
    target = directory / f"{name}.json"
    tmp = directory / f".{name}.{os.getpid()}.tmp"
    try:
        tmp.write_text(json.dumps(document))
        os.replace(tmp, target)
    except OSError as e:  # the directory went away (server exiting)
        logger.debug("AFD: cannot publish %s: %s", target, e)


def read_all(prefix: str) -> list[dict]:
    """Every published document whose name starts with prefix, by name."""
    directory = status_dir()
    if directory is None:
        return []
    documents = []
    for path in sorted(directory.glob(f"{prefix}*.json")):
        try:
            documents.append(json.loads(path.read_text()))
        except (OSError, ValueError):
            continue  # replaced or removed while we read it
    return documents


def link_documents() -> list[dict]:
    """The published state of every attention rank in this process tree."""
    return read_all("link-")


def readiness() -> tuple[bool, str]:
    """(ready, reason): ready when every attention rank's link is up.
    A process tree without documents (not an AFD attention server, or the
    engine did not publish yet) is not ready."""
    documents = link_documents()
    if not documents:
        return False, "AFD: the attention link has not started yet"
    problems = [describe(d) for d in documents if d.get("state") != READY]
    return (not problems), "; ".join(problems) if problems else "ok"


def describe(document: dict) -> str:
    """One line for a link document: who, which state, why."""
    state = document.get("state", "?")
    text = (f"AFD attention rank {document.get('rank')} -> {document.get('peer')}: "
            f"{state}")
    if state != READY and document.get("since"):
        text += f" for {time.time() - document['since']:.0f}s"
    if state != READY and document.get("last_error"):
        text += f" ({document['last_error']})"
    return text
