# SPDX-License-Identifier: Apache-2.0
# SPDX-FileCopyrightText: Copyright contributors to the vllm-afd project
"""The Ray actor that runs one server: the real `vllm serve` process on the
actor's node, in its own session, dying with the actor.

The launcher makes it a threaded Ray actor (`ray.remote(ServerProcess)`), so
`wait_exit` can block in one thread while `health` and `stop` answer in others.
"""

from __future__ import annotations

import ctypes
import json
import os
import shutil
import signal
import subprocess
import sys
import tempfile
import time
import urllib.error
import urllib.request
from pathlib import Path

PR_SET_PDEATHSIG = 1


def _die_with_parent() -> None:
    # Runs in the child before exec: if the actor dies (Ray kills it, its node
    # goes), the kernel sends the server SIGTERM; nothing is left behind.
    try:
        ctypes.CDLL("libc.so.6", use_errno=True).prctl(PR_SET_PDEATHSIG, signal.SIGTERM)
    except OSError:
        pass


def how_it_ended(returncode: int) -> str:
    return (f"killed by {signal.Signals(-returncode).name}" if returncode < 0
            else f"exited with status {returncode}")


def _write_secret(name: str, value: str) -> str:
    # tmpfs where there is one: the secret never reaches a disk.
    where = "/dev/shm" if os.access("/dev/shm", os.W_OK) else None
    fd, path = tempfile.mkstemp(prefix=f"vllm-afd-token-{name}-", dir=where)  # mode 0600
    with os.fdopen(fd, "w") as f:
        f.write(value)
    return path


def _with_token_file(argv: list[str], path: str) -> list[str]:
    at = argv.index("--afd-config") + 1
    afd = json.loads(argv[at])
    afd["token_file"] = path
    return [*argv[:at], json.dumps(afd, sort_keys=True), *argv[at + 1:]]


class ServerProcess:
    def __init__(self, name: str, argv: list[str], env: dict[str, str],
                 secret: list | None, log_dir: str | None = None,
                 shm_globs: list[str] | None = None, deployment: str = "") -> None:
        self.name = name
        # Shared-memory names the server's links use (plan.py): removed after
        # it stopped, since a server killed by SIGKILL cannot remove its own.
        self.shm_globs = list(shm_globs or [])
        # The argv names `vllm`: the executable of this node's environment.
        vllm = str(Path(sys.executable).with_name("vllm"))
        self.argv = [vllm if argv[0] == "vllm" else argv[0], *argv[1:]]
        self.port = int(argv[argv.index("--port") + 1])
        self.env = dict(os.environ, **env)
        if self.env.get("CUDA_VISIBLE_DEVICES") == "":
            # Ray hides every GPU from an actor that holds none: the front end
            # of a server whose workers are Ray actors (vLLM's Ray executor
            # places them) must still see the node's devices to pick its platform.
            del self.env["CUDA_VISIBLE_DEVICES"]
        import ray

        # A server on vLLM's Ray executor joins this cluster (its own placement
        # group for the workers), not a new local one.
        self.env.setdefault("RAY_ADDRESS", ray.get_runtime_context().gcs_address)
        self.token_path: str | None = None
        if secret:
            # The secret travels as an object reference inside a list, so the
            # actor's creation arguments never hold its value; the server reads
            # it from a file only this user can read (AFDConfig.token_file), not
            # from its environment, which vLLM copies into its Ray workers' and
            # data-parallel engines' runtime environments.
            self.env.pop("VLLM_AFD_TOKEN", None)
            self.token_path = _write_secret(f"{deployment}-{name}", ray.get(secret[0]))
            self.argv = _with_token_file(self.argv, self.token_path)
        log_dir = Path(log_dir or Path(tempfile.gettempdir()) / "vllm-afd-launch")
        log_dir.mkdir(parents=True, exist_ok=True)
        self.log_path = log_dir / f"{name}.log"
        self.proc: subprocess.Popen | None = None

    def start(self) -> dict:
        with open(self.log_path, "wb") as log:
            self.proc = subprocess.Popen(self.argv, stdout=log, stderr=subprocess.STDOUT,
                                         stdin=subprocess.DEVNULL, env=self.env,
                                         start_new_session=True, preexec_fn=_die_with_parent)
        import ray

        return {"pid": self.proc.pid, "log": str(self.log_path),
                "node": ray.util.get_node_ip_address()}

    def health(self) -> tuple[int | None, str]:
        """(HTTP status of /health, or None while nothing answers; body)."""
        if self.proc is None or self.proc.poll() is not None:
            return None, "not running"
        try:
            with urllib.request.urlopen(f"http://127.0.0.1:{self.port}/health",
                                        timeout=2) as r:
                return r.status, r.read().decode(errors="replace")
        except urllib.error.HTTPError as e:
            return e.code, e.read().decode(errors="replace")
        except (OSError, urllib.error.URLError):
            return None, "not answering yet"

    def wait_exit(self) -> dict:
        """Block until the server process exits: its exit status, the signal
        that killed it (if one did) and its log's last lines."""
        assert self.proc is not None
        code = self.proc.wait()
        self._reap_group()
        return {"pid": self.proc.pid, "returncode": code, "how": how_it_ended(code),
                "log_tail": self.log_tail()}

    def stop(self, timeout: float = 20.0) -> int | None:
        """SIGTERM the server's process group, SIGKILL what is left after timeout."""
        if self.proc is None:
            return None
        if self.proc.poll() is None:
            try:
                os.killpg(self.proc.pid, signal.SIGTERM)
            except ProcessLookupError:
                pass
            try:
                self.proc.wait(timeout)
            except subprocess.TimeoutExpired:
                pass
        self._reap_group(grace=0.0)
        try:
            self.proc.wait(5)  # reap it: its exit status, or the SIGKILL's
        except subprocess.TimeoutExpired:
            pass
        self._remove_shared_memory()
        return self.proc.poll()

    def _remove_shared_memory(self) -> None:
        assert self.proc is not None
        # The attention server's link status directory is named after its pid
        # (vllm/afd/attention/status.py).
        globs = [*self.shm_globs, f"vllm-afd-status-{self.proc.pid}-*"]
        if self.token_path:
            Path(self.token_path).unlink(missing_ok=True)
        for pattern in globs:
            for path in Path("/dev/shm").glob(pattern):
                if path.is_dir():
                    shutil.rmtree(path, ignore_errors=True)
                else:
                    path.unlink(missing_ok=True)

    def _reap_group(self, grace: float = 2.0) -> None:
        # The server's children (engine core, workers) share its process group:
        # whatever outlives the server gets SIGTERM, then SIGKILL after grace.
        assert self.proc is not None
        pgid = self.proc.pid
        try:
            os.killpg(pgid, signal.SIGTERM if grace else signal.SIGKILL)
        except ProcessLookupError:
            return
        deadline = time.monotonic() + grace
        while time.monotonic() < deadline:
            try:
                os.killpg(pgid, 0)
            except ProcessLookupError:
                return
            time.sleep(0.2)
        try:
            os.killpg(pgid, signal.SIGKILL)
        except ProcessLookupError:
            pass

    def log_tail(self, lines: int = 15) -> str:
        try:
            text = self.log_path.read_text(errors="replace")
        except OSError:
            return ""
        return "\n".join(text.splitlines()[-lines:])
