# SPDX-License-Identifier: Apache-2.0
# SPDX-FileCopyrightText: Copyright contributors to the vllm-afd project
"""Per-layer times of one decode micro-batch: a roofline per side.

Every GEMM-bearing part costs max(bytes read / memory bandwidth, FLOPs / FLOP/s at
its row count) plus the device's fixed per-layer cost (0 on GPU profiles: CUDA
graphs; measured on a CPU). Decode re-reads each weight once per micro-batch,
which is why splitting a batch costs weight traffic. A cpu profile's [engine]
table, measured for one model in plain vLLM (engine_probe.py), replaces the
rooflines of that model's attention layer, its FFN layer on one device and its
once-per-step work.

- attention (per attention device, b tokens, context s): projection weights +
  b s KV bytes, 2 b params + scores/sums over s;
- FFN (F devices in expert parallel, N = A b tokens arrive per micro-batch): each
  device holds E/F experts and reads the ones its tokens touch (uniform routing:
  E/F (1 - (1 - k/E)^N)), 2 N k expert FLOPs / F; shared experts, the router and
  dense layers are split tensor-parallel over the F devices;
- transfer (per direction): latency + the busier NIC's bytes / bandwidth, the
  attention device's b tokens out or an FFN device's N / F tokens in.
"""

from __future__ import annotations

from dataclasses import dataclass

from vllm.afd.deploy.planner.hardware import Hardware, Link
from vllm.afd.deploy.planner.model import ModelShape


@dataclass(frozen=True)
class Part:
    seconds: float
    bound: str  # "memory" or "compute" (which side of the roofline), "link", or "measured"


def roofline(hw: Hardware, dtype: str, bytes_read: float, flops: float, rows: float,
             moe: bool = False) -> Part:
    """moe: the routed experts, whose kernel a cpu profile measures by itself."""
    memory = bytes_read / hw.memory_bandwidth
    rate = hw.moe_flops(dtype, rows) if moe else hw.flops(dtype, rows)
    compute = flops / rate if flops else 0.0
    return Part(max(memory, compute), "memory" if memory >= compute else "compute")


def attention_layer(model: ModelShape, hw: Hardware, tokens: float, context: int) -> Part:
    """One attention layer for one micro-batch of `tokens` decode tokens."""
    if tokens <= 0:
        return Part(0.0, "memory")
    measured = hw.engine_for(model.name)
    if measured is not None:
        return Part(measured.at("attention_layer", tokens), "measured")
    params = model.attention_params()
    bytes_read = params * model.weight_bytes + tokens * context * model.kv_bytes_per_token()
    flops = 2.0 * tokens * params + tokens * model.attention_core_flops_per_token(context)
    part = roofline(hw, model.weight_dtype, bytes_read, flops, tokens)
    return Part(part.seconds + hw.attention_layer_overhead, part.bound)


def experts_touched(experts: int, top_k: int, tokens: float) -> float:
    """Expected distinct experts N tokens route to, each picking top_k of `experts`
    uniformly (balanced routing, the best case EPLB aims at)."""
    if experts <= 0 or tokens <= 0:
        return 0.0
    return experts * (1.0 - (1.0 - top_k / experts) ** tokens)


def ffn_layer(model: ModelShape, hw: Hardware, tokens: float, ffn_devices: int,
              dense: bool = False) -> Part:
    """One FFN layer for one micro-batch: `tokens` arrive in all, spread over the
    ffn_devices (expert parallel for routed experts, tensor parallel for the rest)."""
    if tokens <= 0:
        return Part(0.0, "memory")
    measured = hw.engine_for(model.name)
    if measured is not None and ffn_devices == 1 and not dense:
        return Part(measured.at("ffn_layer", tokens), "measured")
    wb = model.weight_bytes
    if dense:
        params = model.dense_mlp_params() / ffn_devices
        part = roofline(hw, model.weight_dtype, params * wb, 2.0 * tokens * params, tokens)
        return Part(part.seconds + hw.ffn_layer_overhead, part.bound)
    local_experts = model.experts / ffn_devices
    touched = local_experts * (1.0 - (1.0 - model.top_k / model.experts) ** tokens)
    pairs = tokens * model.top_k / ffn_devices
    tp_params = (model.shared_params() + model.router_params()) / ffn_devices
    rows_per_expert = pairs / touched if touched else 0.0
    experts_part = roofline(hw, model.weight_dtype, touched * model.expert_params() * wb,
                            2.0 * pairs * model.expert_params(), rows_per_expert, moe=True)
    rest = roofline(hw, model.weight_dtype, tp_params * wb, 2.0 * tokens * tp_params, tokens)
    # separate rooflines: an expert GEMM has its own tokens as rows, the shared
    # experts and the router all of them
    seconds = experts_part.seconds + rest.seconds + hw.ffn_layer_overhead
    return Part(seconds, experts_part.bound)


def transfer(bytes_per_token: float, tokens_per_nic: float, link: Link) -> tuple[float, float]:
    """(one-way seconds, seconds the link direction is busy) for one micro-batch."""
    busy = bytes_per_token * tokens_per_nic / link.bandwidth
    return link.latency + busy, busy


def lm_head(model: ModelShape, hw: Hardware, tokens: float) -> Part:
    """The attention side's once-per-step work outside the layers: the LM head over
    the batch (the embedding lookup reads one row per token, negligible); where the
    profile measured this model in vLLM, all of that step's work outside the layers
    (LM head, sampler, scheduler)."""
    measured = hw.engine_for(model.name)
    if measured is not None:
        return Part(measured.at("step_other", tokens), "measured")
    params = model.vocab * model.hidden
    return roofline(hw, model.weight_dtype, params * model.weight_bytes, 2.0 * tokens * params,
                    tokens)
