# SPDX-License-Identifier: Apache-2.0
# SPDX-FileCopyrightText: Copyright contributors to the vllm-afd project
"""Start, probe and stop `vllm serve` processes (used by the demo, tests, benchmarks)."""

from __future__ import annotations

import os
import signal
import socket
import subprocess
import sys
import time
import urllib.error
import urllib.request
from pathlib import Path

import preload


def cpu(i: int) -> str:
    """The i-th CPU this process may run on (wrapping around), for
    VLLM_CPU_OMP_THREADS_BIND: never a fixed core number, which may not be in
    the CPU set a container or CI runner gives."""
    allowed = sorted(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else [0]
    return str(allowed[i % len(allowed)])


PORT_STRIDE = 8  # room for port + f (FFN rank f) of a deployment's FFN ranks
_next_port: list[int] = []
# Ports this process handed out: each held by an exclusive lock on a file of
# its own (released by the kernel when the process ends), so processes whose
# sequences meet (the suite's two workers and their subprocesses) never both
# hand out one port between its check and its server's bind.
_PORT_LOCKS = Path(os.environ.get("TMPDIR", "/tmp")) / "vllm-afd-port-locks"
_held: list[int] = []


def _claim(port: int) -> bool:
    import fcntl

    _PORT_LOCKS.mkdir(exist_ok=True)
    fd = os.open(_PORT_LOCKS / str(port), os.O_CREAT | os.O_RDWR, 0o666)
    try:
        fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
    except OSError:
        os.close(fd)
        return False
    os.set_inheritable(fd, False)
    _held.append(fd)  # open for this process's life: the claim
    return True


def _ephemeral_low() -> int:
    try:
        return int(Path("/proc/sys/net/ipv4/ip_local_port_range").read_text().split()[0])
    except (OSError, ValueError, IndexError):
        return 32768


def _bindable(port: int) -> bool:
    try:
        for p in range(port, port + PORT_STRIDE):
            with socket.socket() as s:
                s.bind(("127.0.0.1", p))
        return True
    except OSError:
        return False


def free_port() -> int:
    """A port (and the PORT_STRIDE - 1 after it) for a test server to listen
    on, race-free: taken below the kernel's ephemeral range, which port-0 binds
    and outgoing connections draw from, so nothing else is handed it between
    this check and the server's bind; never the same twice in a process (the
    start is spread by pid across processes), nor in two live processes (a
    lock file per port: _claim)."""
    low = 10000
    high = min(_ephemeral_low(), 32768) - PORT_STRIDE
    if not _next_port:
        span = (high - low) // PORT_STRIDE
        _next_port.append(low + (os.getpid() * 7919 % span) * PORT_STRIDE)
    for _ in range((high - low) // PORT_STRIDE):
        port = _next_port[0]
        _next_port[0] = port + PORT_STRIDE if port + 2 * PORT_STRIDE < high else low
        if _bindable(port) and _claim(port):
            return port
    raise RuntimeError("no free port below the ephemeral range")


def vllm_bin() -> str:
    """The `vllm` console script of the running interpreter's environment."""
    return str(Path(sys.executable).parent / "vllm")


def process_tree_rss_kib(pid: int) -> dict[str, int]:
    """VmRSS (KiB) of a process and each of its descendants, keyed "name[pid]".

    Shared memory counts in every process that maps it (the shm connector's
    rings appear in both roles): sums overstate, but they do so steadily."""
    children: dict[int, list[int]] = {}
    for stat in Path("/proc").glob("[0-9]*/stat"):
        try:
            fields = stat.read_text().rsplit(")", 1)[1].split()
        except OSError:
            continue
        children.setdefault(int(fields[1]), []).append(int(stat.parent.name))
    rss, todo = {}, [pid]
    while todo:
        p = todo.pop()
        todo += children.get(p, [])
        try:
            status = dict(line.split(":", 1) for line in
                          Path(f"/proc/{p}/status").read_text().splitlines() if ":" in line)
        except OSError:  # exited meanwhile
            continue
        if "VmRSS" in status:  # absent for zombies
            rss[f"{status['Name'].strip()}[{p}]"] = int(status["VmRSS"].split()[0])
    return rss


def tree_rss_mib(pid: int) -> float:
    """Resident memory of a process and its descendants, in MiB."""
    return sum(process_tree_rss_kib(pid).values()) / 1024


def http_get(url: str, timeout: float = 5.0) -> tuple[int, str]:
    try:
        with urllib.request.urlopen(url, timeout=timeout) as r:
            return r.status, r.read().decode()
    except urllib.error.HTTPError as e:
        return e.code, e.read().decode(errors="replace")


def status_dirs_left(pid: int, since: float) -> list[str]:
    """/dev/shm's AFD status directories owned by pid, made at or after since."""
    from vllm.afd.attention.status import PREFIX

    left = []
    for path in Path("/dev/shm").glob(f"{PREFIX}{pid}-*"):
        try:
            if path.stat().st_ctime >= since - 1:
                left.append(path.name)
        except FileNotFoundError:
            pass  # removed while we looked
    return left


def metric_samples(text: str, name: str) -> dict[tuple[tuple[str, str], ...], float]:
    """The samples named `name` in a Prometheus text scrape, by sorted labels."""
    from prometheus_client.parser import text_string_to_metric_families

    return {tuple(sorted(s.labels.items())): s.value
            for family in text_string_to_metric_families(text)
            for s in family.samples if s.name == name}


class Server:
    """One `vllm serve` process in its own session, logging to a file."""

    def __init__(self, model: str, args: list[str] | None = None, *, port: int | None = None,
                 log_path: Path, env: dict[str, str] | None = None, name: str = "vllm"):
        self.port = port or free_port()
        self.cmd = [vllm_bin(), "serve", model, "--host", "127.0.0.1", "--port",
                    str(self.port), *(args or [])]
        self.log_path = Path(log_path)
        self.env = dict(os.environ, **(env or {}))
        self.name = name
        self.proc: subprocess.Popen | None = None
        self.started_at = 0.0  # time.time() at start()

    @property
    def url(self) -> str:
        return f"http://127.0.0.1:{self.port}"

    def get(self, path: str, timeout: float = 10.0) -> tuple[int, str]:
        """GET path on this server: (status, body)."""
        return http_get(self.url + path, timeout)

    def start(self) -> Server:
        self.log_path.parent.mkdir(parents=True, exist_ok=True)
        log = open(self.log_path, "wb")
        self.started_at = time.time()
        self.proc = preload.popen(self.cmd, stdout=log, stderr=subprocess.STDOUT,
                                  stdin=subprocess.DEVNULL, env=self.env,
                                  start_new_session=True)
        log.close()
        return self

    def status_dirs_left(self) -> list[str]:
        """The AFD status directories this server made that still exist
        (vllm/afd/attention/status.py). One named by the same pid but older
        than this server was left by an earlier process that had its pid."""
        return status_dirs_left(self.proc.pid, self.started_at)

    def log_tail(self, n: int = 40) -> str:
        try:
            return "\n".join(self.log_path.read_text(errors="replace").splitlines()[-n:])
        except FileNotFoundError:
            return ""

    def wait_ready(self, timeout: float = 240.0) -> float:
        """Poll /health until it answers 200; return the seconds it took."""
        t0 = time.monotonic()
        while time.monotonic() - t0 < timeout:
            if self.proc is not None and self.proc.poll() is not None:
                raise RuntimeError(f"{self.name} exited with {self.proc.returncode} before "
                                   f"becoming ready; log tail:\n{self.log_tail()}")
            try:
                if http_get(self.url + "/health", timeout=2)[0] == 200:
                    return time.monotonic() - t0
            except (OSError, urllib.error.URLError):
                pass
            time.sleep(0.5)
        raise TimeoutError(f"{self.name} not ready after {timeout:.0f}s; log tail:\n"
                           f"{self.log_tail()}")

    def wait_http(self, timeout: float = 240.0) -> float:
        """Poll /health until the HTTP server answers at all (any status, e.g.
        503 while an AFD attention server has no FFN yet); return the seconds."""
        t0 = time.monotonic()
        while time.monotonic() - t0 < timeout:
            if self.proc is not None and self.proc.poll() is not None:
                raise RuntimeError(f"{self.name} exited with {self.proc.returncode} before "
                                   f"serving HTTP; log tail:\n{self.log_tail()}")
            try:
                http_get(self.url + "/health", timeout=2)
                return time.monotonic() - t0
            except (OSError, urllib.error.URLError):
                time.sleep(0.5)
        raise TimeoutError(f"{self.name} not serving HTTP after {timeout:.0f}s; log tail:\n"
                           f"{self.log_tail()}")

    def kill(self) -> None:
        """SIGKILL the whole process group (a crash: no goodbye, no cleanup)."""
        if self.proc is not None and self.proc.poll() is None:
            os.killpg(self.proc.pid, signal.SIGKILL)
            self.proc.wait()

    def group_alive(self) -> bool:
        """Whether any process of this server's group (children too) is left."""
        if self.proc is None:
            return False
        try:
            os.killpg(self.proc.pid, 0)
            return True
        except ProcessLookupError:
            return False

    def stop(self, timeout: float = 30.0) -> int | None:
        """SIGTERM the whole process group, SIGKILL after timeout; return the exit code."""
        if self.proc is None or self.proc.poll() is not None:
            return self.proc.returncode if self.proc else None
        os.killpg(self.proc.pid, signal.SIGTERM)
        try:
            self.proc.wait(timeout)
        except subprocess.TimeoutExpired:
            os.killpg(self.proc.pid, signal.SIGKILL)
            self.proc.wait()
        # Children (EngineCore, workers) share the group; reap stragglers.
        try:
            os.killpg(self.proc.pid, 0)
            time.sleep(2)
            os.killpg(self.proc.pid, signal.SIGKILL)
        except ProcessLookupError:
            pass
        return self.proc.returncode

    def __enter__(self) -> Server:
        return self.start()

    def __exit__(self, *exc) -> None:
        self.stop()
