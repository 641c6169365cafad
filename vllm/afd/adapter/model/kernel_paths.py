# SPDX-License-Identifier: Apache-2.0
# SPDX-FileCopyrightText: Copyright contributors to the vllm-afd project
"""Which kernels a loaded model's layers run: the tests' evidence of what a host exercised.

vLLM's CPU backend picks kernels by host and dtype: on an Intel host with AMX
tiles and bf16 weights, small linears run SGL's AMX GEMM, attention the AMX
ISA, MLA the AMX_MLA backend and MoE experts the AMX grouped GEMM; elsewhere
oneDNN, the vector attention and the portable experts. The oracle records this
report for plain vLLM and for each AFD role, so a test can check that the split
engines picked what plain vLLM picked, and a host's log shows which kernels its
token-exact runs went through.
"""

from collections import Counter

import torch

# A CPU linear's kernel, from the name its dispatch closure calls
# (vllm/model_executor/layers/utils.py: dispatch_cpu_unquantized_gemm).
_LINEAR_KERNELS = {"weight_packed_linear_cpu": "sgl", "onednn_mm": "onednn",
                   "zentorch_linear_unary": "zentorch"}


def _linear_kernel(fn) -> str:
    code = getattr(fn, "__code__", None)
    for name in getattr(code, "co_names", ()):
        if name in _LINEAR_KERNELS:
            return _LINEAR_KERNELS[name]
    return getattr(fn, "__name__", type(fn).__name__)


def _moe_experts(quant_method) -> str | None:
    kernel = getattr(quant_method, "moe_kernel", None)
    if kernel is None:
        return None
    experts = getattr(kernel, "fused_experts", None)
    if experts is None:
        experts = getattr(getattr(kernel, "impl", None), "fused_experts", None)
    name = type(experts).__name__
    isa = getattr(experts, "isa", None)
    return f"{name}({isa})" if isa else name


def kernel_report(model: torch.nn.Module, forward_context: dict) -> dict:
    """Attention backends and ISAs, linear kernels and MoE experts, each
    counted over the model's layers (a role's model has only its own)."""
    attention = [layer for layer in forward_context.values()
                 if getattr(layer, "attn_backend", None) is not None]
    linear: Counter[str] = Counter()
    experts: Counter[str] = Counter()
    for module in model.modules():
        fn = getattr(module, "cpu_linear", None)
        if fn is not None:
            linear[_linear_kernel(fn)] += 1
        moe = _moe_experts(getattr(module, "quant_method", None))
        if moe is not None:
            experts[moe] += 1
    return {
        "attention_backends": sorted({a.attn_backend.get_name() for a in attention}),
        # CPU_ATTN's ISA is set on its layers when the metadata builder is made.
        "attention_isa": sorted({a.isa for a in attention if getattr(a, "isa", None)}),
        "linear": dict(sorted(linear.items())),
        "moe_experts": dict(sorted(experts.items())),
    }
