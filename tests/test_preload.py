# SPDX-License-Identifier: Apache-2.0
# SPDX-FileCopyrightText: Copyright contributors to the vllm-afd project
"""tools/serving/preload.py: a process forked from the preloader sees what a fresh
`python ...` would (argv, environment, working directory, sys.path, __main__,
streams, session, exit status, signals), only with vLLM imported already; a
command it cannot be starts as a plain subprocess."""

import os
import signal
import subprocess
import sys
import tempfile
import time

import pytest

import preload

PROBE = """
import json, os, sys
print(json.dumps({"argv": sys.argv, "cwd": os.getcwd(), "x": os.environ.get("PRELOAD_X"),
                  "path0": sys.path[0], "name": __name__,
                  "file": globals().get("__file__"), "sid": os.getsid(0) == os.getpid(),
                  "main": getattr(sys.modules["__main__"], "__file__", None)}))
sys.exit(int(os.environ.get("PRELOAD_EXIT", "0")))
"""


@pytest.fixture(autouse=True)
def preloading(monkeypatch):
    monkeypatch.setenv("VLLM_AFD_TEST_PRELOAD", "1")


def both(cmd, tmp_path):
    """(forked, fresh) results of the same command; the first really forked."""
    env = dict(os.environ, PRELOAD_X="x-value", PRELOAD_EXIT="3")
    with tempfile.TemporaryFile() as out, tempfile.TemporaryFile() as err:
        proc = preload.popen(cmd, stdin=subprocess.DEVNULL, stdout=out, stderr=err, env=env,
                             cwd=tmp_path)
        assert isinstance(proc, preload.ForkedProcess)
        proc.wait(300)
        out.seek(0)
        err.seek(0)
        forked = subprocess.CompletedProcess(cmd, proc.returncode, out.read().decode(),
                                             err.read().decode())
    fresh = subprocess.run(cmd, capture_output=True, text=True, env=env, cwd=tmp_path,
                           timeout=300)
    return forked, fresh


@pytest.mark.parametrize("form", ["script", "-c", "-m"])
def test_a_forked_process_sees_what_a_fresh_one_does(tmp_path, form):
    (tmp_path / "probe_mod.py").write_text(PROBE)
    cmd = {"script": [sys.executable, str(tmp_path / "probe_mod.py"), "a", "b"],
           "-c": [sys.executable, "-c", PROBE, "a", "b"],
           "-m": [sys.executable, "-m", "probe_mod", "a", "b"]}[form]
    forked, fresh = both(cmd, tmp_path)
    assert forked.returncode == fresh.returncode == 3, (forked, fresh)
    assert forked.stdout == fresh.stdout, (forked, fresh)
    assert '"x": "x-value"' in forked.stdout


def test_it_is_forked_with_vllm_imported(tmp_path):
    code = "import sys; print('vllm' in sys.modules)"
    proc = preload.popen([sys.executable, "-c", code], stdout=subprocess.PIPE, text=True,
                         stdin=subprocess.DEVNULL)
    assert isinstance(proc, preload.ForkedProcess)
    assert proc.stdout.read().strip() == "True" and proc.wait(60) == 0
    fresh = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True)
    assert fresh.stdout.strip() == "False"


@pytest.fixture
def sigint_handled():
    """SIGINT handled here, as in a shell's foreground: run from a background
    job the suite has it ignored, and so then does every process it starts,
    forked or fresh (test_signal_dispositions_as_in_a_fresh_process)."""
    before = signal.signal(signal.SIGINT, signal.default_int_handler)
    yield
    signal.signal(signal.SIGINT, before)


def test_exceptions_signals_and_sessions_as_in_a_fresh_process(tmp_path, sigint_handled):
    forked, fresh = both([sys.executable, "-c", "raise ValueError('boom')"], tmp_path)
    assert forked.returncode == fresh.returncode == 1
    assert "ValueError: boom" in forked.stderr
    sleeper = [sys.executable, "-c", "import time; print('up', flush=True); time.sleep(60)"]
    for sig, code in [(signal.SIGTERM, -signal.SIGTERM), (signal.SIGINT, -signal.SIGINT)]:
        proc = preload.popen(sleeper, stdout=subprocess.PIPE, start_new_session=True)
        assert isinstance(proc, preload.ForkedProcess)
        assert proc.stdout.readline() == b"up\n"
        assert proc.poll() is None
        with pytest.raises(subprocess.TimeoutExpired):
            proc.wait(0.1)
        assert os.getpgid(proc.pid) == proc.pid  # its own session and group
        t0 = time.monotonic()
        proc.send_signal(sig)
        assert proc.wait(30) == code and time.monotonic() - t0 < 30


def test_signal_dispositions_as_in_a_fresh_process(tmp_path):
    """A forked process handles signals as a fresh `python` does: above all it
    ignores SIGPIPE, so a write to a socket whose peer died raises
    BrokenPipeError instead of killing the process without a word (the
    preloader's children had SIGPIPE at its default: a test server's worker
    died so once, redialing an FFN the test had killed)."""
    names = ("SIGPIPE", "SIGXFSZ", "SIGCHLD", "SIGTERM", "SIGHUP", "SIGINT")
    code = ("import signal, socket\n"
            f"print([str(signal.getsignal(getattr(signal, n))) for n in {names!r}])\n"
            "a, b = socket.socketpair()\n"
            "b.close()\n"
            "try:\n"
            "    a.sendall(b'x' * 65536)\n"
            "    a.sendall(b'x' * 65536)\n"
            "except BrokenPipeError:\n"
            "    print('BrokenPipeError')\n")
    forked, fresh = both([sys.executable, "-c", code], tmp_path)
    assert forked.returncode == fresh.returncode == 0, (forked, fresh)  # not -SIGPIPE
    assert forked.stdout == fresh.stdout, (forked, fresh)
    assert fresh.stdout.splitlines()[-1] == "BrokenPipeError"


def test_the_test_process_importing_vllm_changes_nothing(monkeypatch):
    """vLLM's import sets variables (TORCHINDUCTOR_*, LD_LIBRARY_PATH): once
    the test process has imported it too, it has them, and still forks."""
    import vllm  # noqa: F401

    proc = preload.popen([sys.executable, "-c", "pass"])
    assert isinstance(proc, preload.ForkedProcess) and proc.wait(60) == 0
    monkeypatch.setenv("TORCHINDUCTOR_CACHE_DIR", "/elsewhere")  # a value it did not set
    proc = preload.popen([sys.executable, "-c", "pass"])
    assert type(proc) is subprocess.Popen and proc.wait(60) == 0


def test_the_test_process_building_a_vllm_config_changes_nothing(models_dir):
    """Building a config sets variables to constants (vLLM's CPU platform:
    VLLM_SSM_CONV_STATE_LAYOUT, NUMEXPR_MAX_THREADS, ...; ray's import:
    RAY_CLIENT_MODE): a preloader started before the test process built one
    still forks what it starts after (tests/afd/adapter/test_config.py builds them)."""
    from vllm.engine.arg_utils import EngineArgs

    proc = preload.popen([sys.executable, "-c", "pass"])
    assert isinstance(proc, preload.ForkedProcess) and proc.wait(60) == 0
    EngineArgs(model=str(models_dir / "tiny-qwen3-moe")).create_engine_config()
    proc = preload.popen([sys.executable, "-c", "pass"])
    assert isinstance(proc, preload.ForkedProcess) and proc.wait(60) == 0


def test_what_it_cannot_be_starts_as_a_subprocess(tmp_path):
    # Another program; an interpreter flag; a variable read while vLLM imports.
    for cmd, env in [(["true"], None), ([sys.executable, "-I", "-c", "pass"], None),
                     ([sys.executable, "-c", "pass"],
                      dict(os.environ, VLLM_LOGGING_LEVEL="ERROR"))]:
        proc = preload.popen(cmd, env=env)
        assert type(proc) is subprocess.Popen and proc.wait(60) == 0


SPAWN_PROBE = """
import multiprocessing, os, socket, sys

def child(inodes):
    links = []
    for fd in os.listdir("/proc/self/fd"):
        try:
            links.append(os.readlink(f"/proc/self/fd/{fd}"))
        except OSError:
            pass
    print("forked" if "vllm" in sys.modules else "spawned",
          *("holds" if f"socket:[{inode}]" in links else "free" for inode in inodes), flush=True)

if __name__ == "__main__":
    listening = socket.create_server(("127.0.0.1", 0))
    bound = socket.socket()  # as vLLM's HTTP socket while the engine core starts
    bound.bind(("127.0.0.1", 0))
    p = multiprocessing.get_context("spawn").Process(
        target=child, args=([os.fstat(s.fileno()).st_ino for s in (listening, bound)],))
    p.start()
    p.join(60)
    sys.exit(p.exitcode)
"""


@pytest.mark.parametrize("fork_spawn", ["1", "0"])
def test_a_process_forked_for_spawn_holds_no_server_socket(tmp_path, fork_spawn):
    """A spawned process inherits none of its parent's sockets, so the one
    forked in its place must not share the parent's HTTP socket either: vLLM's
    API server binds it before starting its engine core, and at shutdown its
    "who holds my port" check met a force-killed, unreaped worker holding it,
    and the server exited 1 (the soak test in CI). Fails without
    tools/serving/preload.py's _release_server_sockets ("forked holds holds")."""
    (tmp_path / "spawn_probe.py").write_text(SPAWN_PROBE)
    env = dict(os.environ, VLLM_AFD_TEST_FORK_SPAWN=fork_spawn)
    proc = preload.popen([sys.executable, str(tmp_path / "spawn_probe.py")],
                         stdout=subprocess.PIPE, text=True, stdin=subprocess.DEVNULL, env=env)
    assert isinstance(proc, preload.ForkedProcess)
    out = proc.stdout.read()
    assert proc.wait(120) == 0
    assert out.split() == ["forked" if fork_spawn == "1" else "spawned", "free", "free"], out
