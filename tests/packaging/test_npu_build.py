# SPDX-License-Identifier: Apache-2.0
# SPDX-FileCopyrightText: Copyright contributors to the vllm-afd project
"""Ascend NPUs (PrivateUse1): the afd ops have an implementation there.

Today it is the torch-op one (vllm/afd/kernels/composite.py, registered by
ops.load() where the library brings no NPU kernel; csrc/npu/README.md), checked
here on every host. Where CANN (ASCEND_HOME_PATH) and torch_npu exist, the
installed library is also run on an NPU against the CPU kernels; elsewhere that
part skips, naming what is missing."""

import importlib.util
import os
import subprocess
import sys
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parents[2]


def missing_ascend() -> list[str]:
    missing = []
    if not os.environ.get("ASCEND_HOME_PATH"):
        missing.append("ASCEND_HOME_PATH is not set (no CANN toolkit)")
    if importlib.util.find_spec("torch_npu") is None:
        missing.append("torch_npu is not installed")
    return missing


def installed_prints_true(code: str) -> None:
    """Run code in a fresh interpreter outside the checkout (the installed
    wheel); its last line of output must be True."""
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True,
                         cwd="/", timeout=300)
    assert out.returncode == 0, out.stderr[-3000:]
    assert out.stdout.strip().splitlines()[-1] == "True"


def test_pack_has_a_privateuse1_implementation():
    """Without any NPU sources, the ops still dispatch on PrivateUse1."""
    assert not list((REPO / "csrc" / "npu").glob("*.cpp")), "update this test: NPU kernels"
    code = ("import torch; from vllm.afd.kernels import ops; ops.load(); "
            "print(all(torch._C._dispatch_has_kernel_for_dispatch_key(f'afd::{op}', "
            "'PrivateUse1') for op in ('pack', 'unpack')))")
    installed_prints_true(code)


def test_pack_on_an_npu_matches_the_cpu():
    missing = missing_ascend()
    if missing:
        pytest.skip("Ascend not checked: " + "; ".join(missing))
    code = ("import torch, torch_npu; from vllm.afd.kernels import ops; "
            "x = torch.randn(5, 300).to(torch.bfloat16); "
            "n = ops.PackLayout.of(5, 300, x.dtype, 128).total; "
            "ref = ops.pack(x, torch.empty(n, dtype=torch.uint8), 128); "
            "got = ops.pack(x.npu(), torch.empty(n, dtype=torch.uint8).npu(), 128); "
            "print(torch.equal(got.cpu(), ref))")
    installed_prints_true(code)
