# SPDX-License-Identifier: Apache-2.0
# SPDX-FileCopyrightText: Copyright contributors to the vllm-afd project
"""Shared fixtures. Tests run against the *installed* vllm-afd wheel (make test
installs it), never against the repository's vendored vllm/ tree."""

import os
import sys
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(REPO / "tools"))

os.environ.setdefault("HF_HUB_OFFLINE", "1")
os.environ.setdefault("VLLM_CPU_KVCACHE_SPACE", "1")
os.environ.setdefault("VLLM_CACHE_ROOT", str(REPO / "build" / "vllm-cache"))


def pytest_configure(config):
    import importlib.util

    spec = importlib.util.find_spec("vllm")
    if os.environ.get("VLLM_AFD_TEST_SOURCE_TREE") == "1":
        return  # `make dev-test`: the vendored tree on PYTHONPATH, _C built in place
    if spec is not None and Path(spec.origin).resolve().is_relative_to(REPO / "vllm"):
        raise pytest.UsageError(
            "tests must import the installed vllm-afd wheel, not the repository's vllm/ "
            "tree; run them with `make test` (or .venv/bin/pytest from the repository root)")


# Which kernels the model tests ran (e.g. the DeepSeek MLA backend), printed
# at the end of the run: the suite runs on CPUs that pick different kernels.
KERNEL_PATHS: set[str] = set()


@pytest.fixture(scope="session")
def kernel_paths() -> set[str]:
    return KERNEL_PATHS


def pytest_terminal_summary(terminalreporter):
    if KERNEL_PATHS:
        terminalreporter.section("kernel paths")
        for line in sorted(KERNEL_PATHS):
            terminalreporter.write_line(line)


@pytest.fixture(scope="session")
def repo() -> Path:
    return REPO


@pytest.fixture(scope="session")
def models_dir() -> Path:
    from make_tiny_models import TINY, make_models

    out = REPO / "build" / "models"
    make_models(out, names=TINY)  # no-op when the stamps match
    return out
