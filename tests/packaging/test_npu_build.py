# SPDX-License-Identifier: Apache-2.0
# SPDX-FileCopyrightText: Copyright contributors to the vllm-afd project
"""The Ascend kernels (csrc/npu) are built where CANN (ASCEND_HOME_PATH) and
torch_npu exist: the installed op library then registers them for PrivateUse1,
the dispatch key torch_npu's devices use. Elsewhere the test skips, naming
what is missing."""

import importlib.util
import os
import subprocess
import sys

import pytest


def missing_ascend() -> list[str]:
    missing = []
    if not os.environ.get("ASCEND_HOME_PATH"):
        missing.append("ASCEND_HOME_PATH is not set (no CANN toolkit)")
    if importlib.util.find_spec("torch_npu") is None:
        missing.append("torch_npu is not installed")
    return missing


def test_npu_kernels_built_where_ascend_exists():
    missing = missing_ascend()
    if missing:
        pytest.skip("Ascend build not checked: " + "; ".join(missing))
    # A fresh interpreter outside the checkout: the installed wheel's _C.
    code = ("import torch, torch_npu, vllm.afd._C; "
            "print(all(torch._C._dispatch_has_kernel_for_dispatch_key(f'afd::{op}', "
            "'PrivateUse1') for op in ('gather_rows', 'scatter_rows')))")
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True,
                         cwd="/", timeout=300)
    assert out.returncode == 0, out.stderr[-3000:]
    assert out.stdout.strip().splitlines()[-1] == "True", (
        "ASCEND_HOME_PATH and torch_npu exist, but the installed op library has no "
        "PrivateUse1 kernels: setup.py did not build csrc/npu")
