# SPDX-License-Identifier: Apache-2.0
# SPDX-FileCopyrightText: Copyright contributors to the vllm-afd project
"""Shared fixtures. Tests run against the *installed* vllm-afd wheel (make test
installs it), never against the repository's vendored vllm/ tree."""

import atexit
import os
import shutil
import sys
import tempfile
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parent.parent
# The tools the tests import by name (servers, preload, oracle, series, ...), from
# each folder of tools/ (tools/README.md).
TOOL_GROUPS = ("build", "models", "serving", "testing")
sys.path[:0] = [str(REPO / "tools" / group) for group in TOOL_GROUPS]

# The suite sets its own environment. What a user's shell may hold (the README's
# `export VLLM_AFD_TOKEN=...`, another server's status directory, a forced model
# runner or attention backend, a quieter log level) must not change what the
# tests see; tests that need one set it themselves.
CLEARED_ENV = ("VLLM_AFD_TOKEN", "VLLM_AFD_STATUS_DIR", "VLLM_USE_V2_MODEL_RUNNER",
               "VLLM_ATTENTION_BACKEND", "VLLM_ENABLE_V1_MULTIPROCESSING",
               "VLLM_CPU_OMP_THREADS_BIND", "VLLM_TARGET_DEVICE", "VLLM_LOGGING_LEVEL",
               "VLLM_CONFIGURE_LOGGING", "VLLM_HOST_IP", "VLLM_PORT",
               "VLLM_AFD_TRITON_INTERPRET", "TRITON_INTERPRET")
for _name in CLEARED_ENV:
    os.environ.pop(_name, None)

os.environ.setdefault("HF_HUB_OFFLINE", "1")
os.environ.setdefault("VLLM_CPU_KVCACHE_SPACE", "1")
os.environ.setdefault("VLLM_CACHE_ROOT", str(REPO / "build" / "vllm-cache"))
# Python processes the tests start (`vllm serve`, tools/models/oracle.py, probes) are
# forked from a process per test worker that has imported vLLM already
# (tools/serving/preload.py): importing it costs 8-19 s of CPU per process on the CI
# VMs, most of the suite's time otherwise. VLLM_AFD_TEST_PRELOAD=0 starts each
# one fresh. Their engine processes are forked too, not spawned
# (VLLM_AFD_TEST_FORK_SPAWN=1, tools/serving/preload.py says what that changes); the
# tests that must see vLLM's real start method set it to 0.
os.environ.setdefault("VLLM_AFD_TEST_PRELOAD", "1")
os.environ.setdefault("VLLM_AFD_TEST_FORK_SPAWN", "1")
# vLLM's ZMQ sockets (VLLM_RPC_BASE_PATH, /tmp by default) of every engine and
# server the suite starts go to a directory of this run's, removed when it ends:
# a SIGKILLed vLLM (the fault and pool tests kill servers) leaves them behind.
_RPC_DIR = tempfile.mkdtemp(prefix="afd-rpc-")
os.environ["VLLM_RPC_BASE_PATH"] = _RPC_DIR
atexit.register(shutil.rmtree, _RPC_DIR, True)


def pytest_configure(config):
    import importlib.util

    as_host = os.environ.get("VLLM_AFD_AS_HOST")
    if as_host:  # `make test-as-host`: its sitecustomize must be in this environment
        import torch

        if torch.backends.cpu.get_cpu_capability().lower() != as_host:
            raise pytest.UsageError(
                f"VLLM_AFD_AS_HOST={as_host} but torch dispatches to "
                f"{torch.backends.cpu.get_cpu_capability()}: run `make test-as-host "
                f"HOST={as_host}` (it installs tools/testing/as_host/sitecustomize.py)")

    spec = importlib.util.find_spec("vllm")
    if os.environ.get("VLLM_AFD_TEST_SOURCE_TREE") == "1":
        return  # `make dev-test`: the vendored tree on PYTHONPATH, _C built in place
    if spec is not None and Path(spec.origin).resolve().is_relative_to(REPO / "vllm"):
        raise pytest.UsageError(
            "tests must import the installed vllm-afd wheel, not the repository's vllm/ "
            "tree; run them with `make test` (or .venv/bin/pytest from the repository root)")


def pytest_addoption(parser):
    parser.addoption("--reverse-order", action="store_true",
                     help="run the collected tests last to first: no test may depend on "
                          "another having run before it (module fixtures still set up "
                          "once per module)")


def pytest_collection_modifyitems(config, items):
    if config.getoption("--reverse-order"):
        items.reverse()
        return
    # `make test` runs the modules in two xdist workers, a module at a time
    # (--dist loadfile: its fixtures set up once), handed out in this order:
    # the modules with slow tests (servers, engines: minutes) first, so the
    # short ones fill in at the end instead of one worker finishing a long
    # module alone.
    slow = {item.module.__name__ for item in items
            if item.get_closest_marker("slow") is not None and hasattr(item, "module")}
    items.sort(key=lambda item: getattr(item, "module", None) is None
               or item.module.__name__ not in slow)  # stable: file order otherwise


# Which kernels the model tests ran (e.g. the DeepSeek MLA backend) and on
# which model runner, printed at the end of the run: the suite runs on CPUs
# that pick different kernels, and Model Runner V2 runs here only through
# Triton's interpreter (tools/testing/triton_interpret).
KERNEL_PATHS: set[str] = set()


@pytest.fixture(scope="session")
def kernel_paths() -> set[str]:
    return KERNEL_PATHS


def pytest_sessionfinish(session):
    """An xdist worker hands its lines to the controller, which prints them."""
    output = getattr(session.config, "workeroutput", None)
    if output is not None:
        output["kernel_paths"] = sorted(KERNEL_PATHS)


@pytest.hookimpl(optionalhook=True)
def pytest_testnodedown(node, error):
    KERNEL_PATHS.update(getattr(node, "workeroutput", {}).get("kernel_paths", ()))


def pytest_terminal_summary(terminalreporter):
    if KERNEL_PATHS:
        terminalreporter.section("kernel paths and model runners")
        if os.environ.get("VLLM_AFD_AS_HOST"):
            terminalreporter.write_line(
                f"chosen as on an {os.environ['VLLM_AFD_AS_HOST']} host (tools/testing/as_host)")
        for line in sorted(KERNEL_PATHS):
            terminalreporter.write_line(line)


@pytest.fixture
def patient_waits(monkeypatch):
    """Prepared layer calls (step_calls.py) that wait 5 s, not
    shm_ring.FAST_WAIT_MS, before the general path takes over: for tests that
    count them, which a busy host (the suite's other worker) can delay past
    the usual bound (a correct fallback, but one call fewer counted)."""
    from vllm.afd.transport import shm_ring

    monkeypatch.setattr(shm_ring, "FAST_WAIT_MS", 5000)


@pytest.fixture(scope="session")
def repo() -> Path:
    return REPO


@pytest.fixture(scope="session")
def models_dir() -> Path:
    from make_tiny_models import TINY, make_models

    out = REPO / "build" / "models"
    make_models(out, names=TINY)  # no-op when the stamps match
    return out


@pytest.fixture(scope="module")
def ray_head():
    """A local Ray cluster (this host only) for the tests of a module that ask
    for it, stopped with every process it started after the module: an idle
    cluster costs a few percent of a core, and a start about 5 s."""
    from ray_head import RayHead

    with RayHead() as head:
        yield head
