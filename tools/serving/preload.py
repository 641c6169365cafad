# SPDX-License-Identifier: Apache-2.0
# SPDX-FileCopyrightText: Copyright contributors to the vllm-afd project
"""Start Python processes that run vLLM without paying its import each time.

Importing vLLM costs 8-19 s of CPU on the CI VMs (torch, its compiler stack,
transformers), and the suite starts well over a hundred processes that do it
(`vllm serve`, tools/models/oracle.py, probes). A *preloader* is one process per test
worker that imports vLLM once and then forks a child per request; the child
puts its argv, environment, working directory, session and standard streams
in place and runs the command as `python` would (a script, `-m module`, `-c
code`, or a console script such as `vllm`), so what runs is the same code with
the same inputs, only started from a warm interpreter. vLLM itself starts its
engine processes the same way (fork after import) when used as a library.

`popen()` and `run()` mirror subprocess.Popen and subprocess.run. A command
that is not a Python process of this interpreter, or whose environment differs
from the preloader's in a variable read while importing (logging set-up,
threading libraries, PYTHON*, most VLLM_*), gets an ordinary subprocess: the
fork would not be the same process. Only the test suite uses it, where
VLLM_AFD_TEST_PRELOAD=1 (tests/conftest.py); elsewhere popen() is Popen.

With VLLM_AFD_TEST_FORK_SPAWN=1 in its environment, a forked process also
forks the processes multiprocessing would *spawn* (vLLM's engine core and
workers: its CPU platform always spawns, and each spawned process imports vLLM
again) from itself, as multiprocessing's "fork" method does. That one is not
the same: a forked engine core inherits the server process's state, a spawned
one rebuilds it from what is pickled to it (the parent's server sockets,
which a spawned one would not have, are pointed at /dev/null in it). Tests
that must run vLLM's real start method turn it off (their environment:
VLLM_AFD_TEST_FORK_SPAWN=0), and so do all processes the suite does not start
through here (the launcher's servers under Ray, the installed wheel's `vllm
serve`).

    python tools/serving/preload.py --serve SOCKET    # the preloader (started by popen)
"""

from __future__ import annotations

import atexit
import gc
import json
import multiprocessing.popen_fork
import os
import selectors
import signal
import socket
import subprocess
import sys
import tempfile
import threading
from pathlib import Path

PRELOAD = ("torch", "vllm", "vllm.entrypoints.llm", "vllm.entrypoints.cli.main",
           "vllm.entrypoints.openai.api_server", "vllm.afd.adapter.ffn.engine",
           "vllm.afd.adapter.attention.runner")
# Variables read while the modules above import (or by libraries they load):
# a request whose value differs runs as a plain subprocess.
IMPORT_TIME_PREFIXES = ("PYTHON", "LD_", "OMP_", "GOMP_", "KMP_", "MKL_", "OPENBLAS_",
                        "TORCH", "HF_", "TRANSFORMERS_", "TOKENIZERS_", "VLLM_", "CUDA_",
                        "MALLOC_", "RAY_")
# VLLM_* variables vLLM and vllm-afd read when used (vllm.envs is lazy), not at import.
READ_WHEN_USED = ("VLLM_AFD_TEST_", "VLLM_AFD_TOKEN", "VLLM_AFD_STATUS_DIR",
                  "VLLM_CPU_OMP_THREADS_BIND", "VLLM_CPU_KVCACHE_SPACE",
                  "VLLM_ENABLE_V1_MULTIPROCESSING", "VLLM_WORKER_MULTIPROC_METHOD",
                  "VLLM_HOST_IP", "VLLM_PORT", "VLLM_CPU_NUM_OF_RESERVED_CPU")


# Set by vLLM's CPU platform while it builds a config (platforms/cpu.py,
# check_and_update_config), to constants: a test that built one in its own
# process has them from then on, and the process it starts sets them itself at
# the same point (a forked one too).
# The same for VLLM_SSM_CONV_STATE_LAYOUT ("SD" unless a NIXL connector is
# configured) and RAY_CLIENT_MODE (ray's import sets "0", its default, after
# reading it; the config imports ray): a test process that built a config had
# them, a preloader started before that had not, and every process after fell
# back to a fresh start (test_preload, after tests/afd/adapter/test_config.py).
SET_BY_CONFIG = {"TORCHINDUCTOR_COMPILE_THREADS", "TORCHINDUCTOR_CPP_DYNAMIC_THREADS",
                 "VLLM_DISABLE_SHARED_EXPERTS_STREAM", "NUMEXPR_MAX_THREADS",
                 "LOCAL_WORLD_SIZE", "VLLM_SSM_CONV_STATE_LAYOUT", "RAY_CLIENT_MODE"}


def _loaded_by_torch(ld_preload: str) -> bool:
    """LD_PRELOAD naming only torch's own OpenMP runtime (vLLM's CPU platform
    sets it so for the processes it spawns), which importing torch loads anyway."""
    libs = [p for p in ld_preload.replace(" ", ":").split(":") if p]
    return all(Path(p).name.startswith("libgomp") and "torch" in Path(p).parts for p in libs)


def _import_time_env(env: dict[str, str]) -> dict[str, str]:
    return {k: v for k, v in env.items()
            if k.startswith(IMPORT_TIME_PREFIXES) and not k.startswith(READ_WHEN_USED)
            and k not in SET_BY_CONFIG
            and not (k == "LD_PRELOAD" and _loaded_by_torch(v))}


# ---------------------------------------------------------------- the preloader

# Dispositions a process started by exec takes from its parent when they are
# SIG_IGN (and has at their default otherwise).
INHERITED_SIGNALS = (signal.SIGCHLD, signal.SIGTERM, signal.SIGHUP, signal.SIGINT)


def _run_child(request: dict, fds: list[int], own_fds: list[int],
               import_effects: dict[str, str]) -> None:
    """In the forked child: become the requested process, run it, exit."""
    code, interrupted = 1, False
    try:
        signal.set_wakeup_fd(-1)
        # As a fresh interpreter starts: default dispositions, except that
        # Python ignores SIGPIPE and SIGXFSZ (a write to a closed socket raises
        # BrokenPipeError) and raises KeyboardInterrupt on SIGINT. With SIGPIPE
        # at its default, a server's worker that wrote to a dead peer's socket
        # (a pool member redialing a killed FFN) died without a word. A signal
        # the requesting process ignores stays ignored, as it does across exec
        # (a suite started in the background has SIGINT ignored: so has every
        # `python` it starts, which then installs no KeyboardInterrupt handler).
        ignored = set(request.get("ignored", ()))
        for sig in INHERITED_SIGNALS:
            signal.signal(sig, signal.SIG_IGN if sig in ignored else signal.SIG_DFL)
        for sig in (signal.SIGPIPE, signal.SIGXFSZ):
            signal.signal(sig, signal.SIG_IGN)
        if signal.SIGINT not in ignored:
            signal.signal(signal.SIGINT, signal.default_int_handler)
        if request["new_session"]:
            os.setsid()
        for target, fd in enumerate(fds):
            os.dup2(fd, target)
        for fd in {*fds, *own_fds} - {0, 1, 2}:  # the preloader's, not the imports'
            os.close(fd)
        os.chdir(request["cwd"])
        env = dict(request["env"])
        for key, value in import_effects.items():  # what the imports set, as in a fresh start
            env.setdefault(key, value)
        os.environ.clear()
        os.environ.update(env)
        if request.get("fork_for_spawn"):
            # multiprocessing's "spawn" processes (vLLM's engine core and
            # workers: the CPU platform always spawns) forked from this process
            # instead of started anew, which would import vLLM again.
            import multiprocessing.context
            multiprocessing.context.SpawnProcess._Popen = staticmethod(_ForkLikeSpawn)
        args = request["args"]
        if args[0] == "-m":
            import runpy
            sys.argv = [args[1], *args[2:]]  # run_module puts the file name in argv[0]
            sys.path[0] = os.getcwd()
            runpy.run_module(args[1], run_name="__main__", alter_sys=True)
        elif args[0] == "-c":
            import types
            sys.argv = ["-c", *args[2:]]
            sys.path[0] = ""
            main = types.ModuleType("__main__")
            sys.modules["__main__"] = main
            exec(compile(args[1], "<string>", "exec"), main.__dict__)
        else:
            import runpy
            sys.argv = list(args)
            sys.path[0] = str(Path(args[0]).resolve().parent)
            runpy.run_path(args[0], run_name="__main__")
        code = 0
    except SystemExit as e:
        code = e.code if isinstance(e.code, int) else (0 if e.code is None else 1)
        if not isinstance(e.code, int | None):
            print(e.code, file=sys.stderr)
    except KeyboardInterrupt:
        import traceback
        traceback.print_exc()
        interrupted = True  # python dies of the signal then (returncode -2)
    except BaseException:
        import traceback
        traceback.print_exc()
        code = 1
    finally:
        # As an interpreter exits: join non-daemon threads, then atexit hooks.
        try:
            threading._shutdown()
            atexit._run_exitfuncs()
        finally:
            for stream in (sys.stdout, sys.stderr):
                try:
                    stream.flush()
                except Exception:
                    pass
            if interrupted:
                signal.signal(signal.SIGINT, signal.SIG_DFL)
                os.kill(os.getpid(), signal.SIGINT)
            os._exit(code)


def server_socket_fds() -> list[int]:
    """This process's file descriptors that are TCP server sockets: bound to a
    port and connected to nothing, listening or not yet (vLLM binds its HTTP
    socket early and uvicorn calls listen() on it later)."""
    fds = []
    for entry in Path("/proc/self/fd").iterdir():
        try:
            if not os.readlink(entry).startswith("socket:"):
                continue
            sock = socket.socket(fileno=os.dup(int(entry.name)))
        except OSError:  # the directory's own fd, closed meanwhile
            continue
        with sock:
            if (sock.family not in (socket.AF_INET, socket.AF_INET6)
                    or sock.type != socket.SOCK_STREAM or sock.getsockname()[1] == 0):
                continue
            try:
                sock.getpeername()
            except OSError:  # not connected: a server's socket
                fds.append(int(entry.name))
    return fds


def _release_server_sockets() -> None:
    """A spawned process inherits none of its parent's sockets; a forked one
    shares its server sockets until it exits. vLLM's API server binds its HTTP
    socket before it starts the engine core (and listens on it once that is
    up), so a forked engine core and its workers held the HTTP port too, and
    at shutdown vLLM's "who holds my port" check (launchers/launcher.py,
    serve_http) met the force-killed, not yet reaped worker, psutil raised
    ZombieProcess from its cmdline() and the server exited 1 (the soak test,
    once in CI). Each such fd is pointed at /dev/null rather than closed, so
    its number stays taken while the inherited socket objects still name it."""
    fds = server_socket_fds()
    if fds:
        null = os.open(os.devnull, os.O_RDWR)
        for fd in fds:
            os.dup2(null, fd)
        os.close(null)


class _ForkLikeSpawn(multiprocessing.popen_fork.Popen):
    """multiprocessing's fork start, minus the parent's server sockets."""

    def _launch(self, process_obj):
        bootstrap = process_obj._bootstrap  # runs in the child only

        def bootstrap_without_server_sockets(*args, **kwargs):
            _release_server_sockets()
            return bootstrap(*args, **kwargs)

        process_obj._bootstrap = bootstrap_without_server_sockets
        try:
            super()._launch(process_obj)
        finally:
            del process_obj._bootstrap  # the class's method again


def serve(path: str) -> None:
    base_env = dict(os.environ)
    for name in PRELOAD:
        __import__(name)
    # The imports, frozen: every child's gc.collect() skips them (vLLM calls it
    # several times while an engine starts, ~0.3 s each over a heap this size),
    # and the pages they live on stay shared with the children (no refcount
    # writes from the collector).
    gc.freeze()
    import_effects = {k: v for k, v in os.environ.items() if base_env.get(k) != v}
    print(json.dumps(import_effects), flush=True)
    listener = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
    listener.bind(path)
    listener.listen(64)
    wake_r, wake_w = os.pipe()
    os.set_blocking(wake_w, False)
    signal.set_wakeup_fd(wake_w)
    signal.signal(signal.SIGCHLD, lambda *_: None)
    children: dict[int, socket.socket] = {}
    selector = selectors.DefaultSelector()
    selector.register(listener, selectors.EVENT_READ)
    selector.register(wake_r, selectors.EVENT_READ)
    parent = os.getppid()
    print("ready", flush=True)
    while os.getppid() == parent:
        for key, _ in selector.select(timeout=1.0):
            if key.fileobj is listener:
                conn, _ = listener.accept()
                message, fds, _, _ = socket.recv_fds(conn, 1 << 16, 3)
                while not message.endswith(b"\n"):  # a stream: the rest may come later
                    chunk = conn.recv(1 << 16)
                    if not chunk:
                        break
                    message += chunk
                request = json.loads(message)
                sys.stdout.flush()
                pid = os.fork()
                if pid == 0:
                    own = [listener.fileno(), conn.fileno(), wake_r, wake_w,
                           selector.fileno(),
                           *(c.fileno() for c in children.values())]
                    _run_child(request, fds, own, import_effects)
                for fd in fds:
                    os.close(fd)
                conn.sendall(json.dumps({"pid": pid}).encode() + b"\n")
                children[pid] = conn
            else:
                os.read(wake_r, 4096)
        while children:
            try:
                pid, status = os.waitpid(-1, os.WNOHANG)
            except ChildProcessError:
                break
            if pid == 0:
                break
            conn = children.pop(pid, None)
            if conn is not None:
                try:
                    conn.sendall(json.dumps(
                        {"returncode": os.waitstatus_to_exitcode(status)}).encode() + b"\n")
                except OSError:
                    pass
                conn.close()


# ---------------------------------------------------------------- the client side

class ForkedProcess:
    """What subprocess.Popen offers the tests, for a child of the preloader."""

    def __init__(self, args: list[str], conn: socket.socket, pid: int):
        self.args = args
        self.pid = pid
        self.returncode: int | None = None
        self.stdout = None
        self._conn = conn
        self._buffer = b""

    def _read_status(self, timeout: float | None) -> None:
        self._conn.settimeout(timeout)
        try:
            while b"\n" not in self._buffer:
                chunk = self._conn.recv(4096)
                if not chunk:  # the preloader died: the child's status is lost
                    self.returncode = -signal.SIGKILL
                    return
                self._buffer += chunk
        except (TimeoutError, BlockingIOError):
            return
        self.returncode = json.loads(self._buffer.split(b"\n", 1)[0])["returncode"]
        self._conn.close()

    def poll(self) -> int | None:
        if self.returncode is None:
            self._read_status(0.0)
        return self.returncode

    def wait(self, timeout: float | None = None) -> int:
        if self.returncode is None:
            self._read_status(timeout)
            if self.returncode is None:
                raise subprocess.TimeoutExpired(self.args, timeout)
        return self.returncode

    def send_signal(self, sig: int) -> None:
        if self.poll() is None:
            os.kill(self.pid, sig)

    def terminate(self) -> None:
        self.send_signal(signal.SIGTERM)

    def kill(self) -> None:
        self.send_signal(signal.SIGKILL)


class _Preloader:
    def __init__(self):
        self.dir = tempfile.mkdtemp(prefix="vllm-afd-preload-")
        self.path = os.path.join(self.dir, "sock")
        self.env = dict(os.environ)
        self.proc = subprocess.Popen([sys.executable, __file__, "--serve", self.path],
                                     stdin=subprocess.DEVNULL, stdout=subprocess.PIPE,
                                     env=self.env)
        self.ready = False
        self.import_effects: dict[str, str] = {}
        atexit.register(self.close)

    def wait_ready(self) -> bool:
        while not self.ready:  # what the imports print comes first
            line = self.proc.stdout.readline()
            if not line:
                break
            if line.startswith(b"{"):
                self.import_effects = json.loads(line)
            self.ready = line.strip() == b"ready"
        return self.ready

    def can_become(self, env: dict[str, str]) -> bool:
        """Whether a fresh process with env would import what this one did:
        the same import-time variables, or the values the imports set (which
        the test process has too once it imported vLLM itself)."""
        mine, theirs = _import_time_env(self.env), _import_time_env(env)
        return all(mine.get(k) == theirs.get(k) or self.import_effects.get(k) == theirs.get(k)
                   for k in mine.keys() | theirs.keys())

    def close(self) -> None:
        if self.proc.poll() is None:
            self.proc.kill()
            self.proc.wait()
        try:
            os.unlink(self.path)
            os.rmdir(self.dir)
        except OSError:
            pass


_preloader: _Preloader | None = None
_lock = threading.Lock()


def _python_args(cmd: list[str]) -> list[str] | None:
    """The interpreter arguments of cmd if it is a Python process of this
    interpreter the preloader can become, else None."""
    exe = Path(sys.executable)
    first = Path(cmd[0])
    if first == exe:
        args = cmd[1:]
        if not args or args[0].startswith("-") and args[0] not in ("-m", "-c"):
            return None
        return args
    if first.parent == exe.parent and first.is_file():  # a console script (`vllm`)
        head = first.read_bytes()[:200]
        if head.startswith(b"#!") and b"python" in head.split(b"\n", 1)[0]:
            return list(cmd)
    return None


def popen(cmd: list[str], *, stdin=None, stdout=None, stderr=None, env=None, cwd=None,
          start_new_session: bool = False, text: bool = False):
    """subprocess.Popen(cmd, ...) started by the preloader where it can be (see
    the module docstring), else by subprocess. stdin/stderr: None, DEVNULL, a
    file object or an fd (stderr also STDOUT); stdout also PIPE."""
    global _preloader
    env = dict(os.environ if env is None else env)
    args = _python_args([str(c) for c in cmd])
    plain = dict(stdin=stdin, stdout=stdout, stderr=stderr, env=env, cwd=cwd,
                 start_new_session=start_new_session, text=text)
    if args is None or env.get("VLLM_AFD_TEST_PRELOAD") != "1":
        return subprocess.Popen(cmd, **plain)
    with _lock:
        if _preloader is None or _preloader.proc.poll() is not None:
            _preloader = _Preloader()
        preloader = _preloader
        ready = preloader.wait_ready()
    if not ready or not preloader.can_become(env):
        return subprocess.Popen(cmd, **plain)
    opened, pipe = [], None

    def fd_of(stream, default: int) -> int:
        nonlocal pipe
        if stream is None:
            return default
        if stream == subprocess.DEVNULL:
            f = open(os.devnull, "r+b")
            opened.append(f)
            return f.fileno()
        if stream == subprocess.PIPE:
            pipe = os.pipe()
            return pipe[1]
        return stream if isinstance(stream, int) else stream.fileno()

    fds = [fd_of(stdin, 0), fd_of(stdout, 1)]
    fds.append(fds[1] if stderr == subprocess.STDOUT else fd_of(stderr, 2))
    request = {"args": args, "env": env, "cwd": str(cwd or os.getcwd()),
               "new_session": start_new_session,
               "ignored": [int(sig) for sig in INHERITED_SIGNALS
                           if signal.getsignal(sig) == signal.SIG_IGN],
               "fork_for_spawn": env.get("VLLM_AFD_TEST_FORK_SPAWN") == "1"}
    conn = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
    try:
        conn.connect(preloader.path)
        message = json.dumps(request).encode() + b"\n"
        socket.send_fds(conn, [message[:1 << 12]], fds)
        conn.sendall(message[1 << 12:])
    finally:
        for f in opened:
            f.close()
        if pipe is not None:
            os.close(pipe[1])
    reply = b""
    while not reply.endswith(b"\n"):
        chunk = conn.recv(4096)
        if not chunk:
            raise RuntimeError("the preloader exited while forking " + " ".join(cmd))
        reply += chunk
    proc = ForkedProcess([str(c) for c in cmd], conn, json.loads(reply)["pid"])
    if pipe is not None:
        proc.stdout = open(pipe[0], "r" if text else "rb")
    return proc


def run(cmd: list[str], *, capture_output: bool = False, text: bool = False,
        timeout: float | None = None, env=None, cwd=None, check: bool = False,
        stdout=None, stderr=None) -> subprocess.CompletedProcess:
    """subprocess.run for a command popen() can start."""
    with tempfile.TemporaryFile() as out, tempfile.TemporaryFile() as err:
        if capture_output:
            stdout, stderr = out, err
        proc = popen(cmd, stdin=subprocess.DEVNULL, stdout=stdout, stderr=stderr, env=env,
                     cwd=cwd)
        try:
            proc.wait(timeout)
        except subprocess.TimeoutExpired:
            proc.kill()
            proc.wait()
            raise
        captured = []
        for f in (out, err):
            f.seek(0)
            data = f.read() if capture_output else None
            captured.append(data.decode(errors="replace") if text and data is not None
                            else data)
    result = subprocess.CompletedProcess(cmd, proc.returncode, *captured)
    if check:
        result.check_returncode()
    return result


if __name__ == "__main__":
    if len(sys.argv) == 3 and sys.argv[1] == "--serve":
        serve(sys.argv[2])
    else:
        sys.exit(__doc__)
