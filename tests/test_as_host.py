# SPDX-License-Identifier: Apache-2.0
# SPDX-FileCopyrightText: Copyright contributors to the vllm-afd project
"""`make test-as-host`: tools/testing/as_host/sitecustomize.py makes a process choose the
kernels an older x86 host would: torch's dispatch, oneDNN's ISA and the library
of vLLM's CPU kernels it loads (`_C_AVX2` on an AVX2-only host)."""

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch

AS_HOST = Path(__file__).resolve().parents[1] / "tools" / "testing" / "as_host"
PROBE = """
import json, os, torch
from vllm.platforms import current_platform
current_platform.import_kernels()
libs = sorted({line.split()[-1].rsplit("/", 1)[-1] for line in open("/proc/self/maps")
               if "/vllm/_C" in line})
print(json.dumps({"capability": torch.backends.cpu.get_cpu_capability(), "libs": libs,
                  "avx512": torch.cpu._is_avx512_supported(),
                  "avx512_bf16": torch.cpu._is_avx512_bf16_supported(),
                  "amx": torch.cpu._is_amx_tile_supported(),
                  "onednn": os.environ.get("ONEDNN_MAX_CPU_ISA")}))
"""


def run_as(host: str, code: str) -> subprocess.CompletedProcess:
    env = {**os.environ, "PYTHONPATH": str(AS_HOST), "VLLM_AFD_AS_HOST": host}
    return subprocess.run([sys.executable, "-c", code], env=env, capture_output=True,
                          text=True, timeout=120)


@pytest.mark.parametrize("host, capability, library", [
    ("avx2", "AVX2", "_C_AVX2.abi3.so"),
    ("avx512", "AVX512", "_C_AVX512.abi3.so"),
])
def test_a_process_chooses_the_older_hosts_kernels(host, capability, library):
    if host == "avx512" and not torch.cpu._is_avx512_supported():
        pytest.skip("this CPU has no AVX-512 to choose")
    done = run_as(host, PROBE)
    assert done.returncode == 0, done.stderr[-3000:]
    seen = json.loads(done.stdout.strip().splitlines()[-1])
    assert seen == {"capability": capability, "libs": [library], "avx512": host == "avx512",
                    "avx512_bf16": False, "amx": False,
                    "onednn": {"avx2": "AVX2", "avx512": "AVX512_CORE"}[host]}, seen


def test_a_newer_host_is_refused_by_name():
    done = run_as("amx", "print('ran')")
    assert done.returncode == 2 and "ran" not in done.stdout
    assert done.stderr.strip() == (
        "VLLM_AFD_AS_HOST='amx': expected one of ['avx2', 'avx512'] (only an older host "
        "can be pretended: the instructions run on this CPU)"), done.stderr
