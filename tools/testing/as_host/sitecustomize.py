# SPDX-License-Identifier: Apache-2.0
# SPDX-FileCopyrightText: Copyright contributors to the vllm-afd project
"""Kernel choices as on an older x86 host: `make test-as-host HOST=avx2|avx512`.

CI runs on whatever host a session drew: an AMD EPYC with AVX2 only (the slowest),
one with AVX-512 and bf16, an Intel Xeon with AMX. On each, torch, oneDNN and vLLM
choose other kernels; vLLM even loads another library of them (`_C` with AVX512-BF16,
`_C_AVX512` with AVX-512 alone, `_C_AVX2` without it, and fewer ops in the last two:
no C++ causal conv, so the hybrid families take vLLM's torch fallback there).

With VLLM_AFD_AS_HOST set, every Python process of the environment this file is the
sitecustomize of chooses as that older host would: ATEN_CPU_CAPABILITY and
ONEDNN_MAX_CPU_ISA cap torch's and oneDNN's dispatch, and the `torch.cpu` probes vLLM
asks (`_is_avx512_supported`, `_is_amx_tile_supported`, ...) answer as that host's
CPU. Only downward: the instructions still run on this CPU, so no host can pretend to
have AMX or AVX512-BF16 that it lacks (`tools/models/oracle.py --fake-amx linear` runs the one
AMX-host kernel that needs no tiles), and timings are this CPU's, not the older host's.
Without the variable this file does nothing.
"""

import os
import sys

# name: (ATEN_CPU_CAPABILITY, ONEDNN_MAX_CPU_ISA, the torch.cpu probes that answer False)
HOSTS = {
    "avx2": ("avx2", "AVX2", ("_is_avx512_supported", "_is_avx512_bf16_supported",
                              "_is_vnni_supported", "_is_amx_tile_supported",
                              "_is_amx_fp16_supported")),
    "avx512": ("avx512", "AVX512_CORE", ("_is_avx512_bf16_supported", "_is_vnni_supported",
                                         "_is_amx_tile_supported", "_is_amx_fp16_supported")),
}


def _refuse(reason: str) -> None:
    # Raising here would end the interpreter with "Fatal Python error" and a traceback.
    sys.stderr.write(f"VLLM_AFD_AS_HOST={os.environ['VLLM_AFD_AS_HOST']!r}: {reason}\n")
    sys.stderr.flush()
    os._exit(2)


def _as_host(name: str) -> None:
    if name not in HOSTS:
        _refuse(f"expected one of {sorted(HOSTS)} (only an older host can be pretended: "
                "the instructions run on this CPU)")
    capability, onednn_isa, probes = HOSTS[name]
    # Both are read when torch first dispatches, so they must be set before that.
    os.environ["ATEN_CPU_CAPABILITY"] = capability
    os.environ["ONEDNN_MAX_CPU_ISA"] = onednn_isa
    try:
        import torch
    except ImportError:  # pip and friends in an environment without torch
        return
    if not torch.cpu._is_avx2_supported():
        _refuse("this CPU has no AVX2")
    if name == "avx512" and not torch.cpu._is_avx512_supported():
        _refuse("this CPU has no AVX-512")
    for probe in probes:
        setattr(torch.cpu, probe, lambda: False)


if os.environ.get("VLLM_AFD_AS_HOST"):
    _as_host(os.environ["VLLM_AFD_AS_HOST"])
