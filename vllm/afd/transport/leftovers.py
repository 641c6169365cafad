# SPDX-License-Identifier: Apache-2.0
# SPDX-FileCopyrightText: Copyright contributors to the vllm-afd project
"""Shared-memory names of AFD's that a dead process left in /dev/shm.

AFD names the shared memory it creates after its creator: shm's ring segments
vllm-afd-<port>-<peer>-<a2f|f2a>-<pid>x<hex> and the ipc connector's CPU
regions vllm-afd-ipc-<pid>x<hex> (`owned_name`). Each is unlinked as soon as
its peer mapped it, and on close; only a process killed between creating one
and its peer mapping it leaves one behind. A server starting (the FFN's
listener, the attention side's link) removes those whose creator is gone
(`remove_dead`): checked by pid, never a live process's, nor one of another
user's (kill(pid, 0) says so). The attention side's status directories have
the same rule (attention/status.py).
"""

import logging
import os
import re
import secrets
from pathlib import Path

logger = logging.getLogger(__name__)

SHM_DIR = Path("/dev/shm")
# The creator's pid in AFD's names: "...-<pid>x<hex>" as the last dash field.
_OWNED = re.compile(r"^vllm-afd-(?:[0-9]+-[0-9]+-(?:a2f|f2a)|ipc)-(?P<pid>[0-9]+)x[0-9a-f]+$")


def owned_name(prefix: str) -> str:
    """prefix + this process's pid + a random suffix: a name remove_dead can
    tell the owner of."""
    return f"{prefix}{os.getpid()}x{secrets.token_hex(4)}"


def alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:
        return True  # another user's live process
    return True


def remove_dead(directory: Path = SHM_DIR) -> list[str]:
    """Unlink AFD's names in directory whose creator is no longer running;
    the names removed."""
    removed = []
    try:
        entries = list(directory.iterdir())
    except OSError:
        return removed  # no /dev/shm here: nothing AFD made
    for path in entries:
        match = _OWNED.match(path.name)
        if match is None or alive(int(match["pid"])):
            continue
        try:
            path.unlink()
            removed.append(path.name)
        except OSError:
            continue  # gone meanwhile, or not ours to remove
    if removed:
        logger.info("AFD: removed %d shared-memory name(s) of dead processes from %s: %s",
                    len(removed), directory, ", ".join(sorted(removed)[:8]))
    return removed
