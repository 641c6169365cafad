# SPDX-License-Identifier: Apache-2.0
# SPDX-FileCopyrightText: Copyright contributors to the vllm-afd project
"""One deployment's decode step (evaluate), and the search over attention devices A,
FFN devices F, micro-batches m and batch for the most tokens/s per device under a
TPOT SLO.

A deployment: A attention devices (data parallel, each with its own batch of B
sequences split into m micro-batches of B/m) feeding F FFN devices (one expert-
parallel group). Per layer, each FFN device receives A B / (m F) tokens per
micro-batch. TPOT = the layers' pipeline (pipeline.py) + the LM head.
"""

from __future__ import annotations

import logging
from dataclasses import asdict, dataclass

from vllm.afd.deploy.planner import cost, pipeline
from vllm.afd.deploy.planner.hardware import Hardware
from vllm.afd.deploy.planner.model import ModelShape

logger = logging.getLogger(__name__)

#: fraction of device memory weights and KV may take (activations, buffers, fragmentation)
USABLE_MEMORY = 0.9
ATTENTION_DEVICES = (*range(1, 17), 20, 24, 28, 32, 40, 48, 56, 64)
FFN_DEVICES = (1, 2, 4, 8, 16, 32, 64)
MICROBATCHES = (1, 2, 3, 4)
REGIMES = ("attention-bound", "FFN-bound", "link-bound", "memory-capacity-bound")


@dataclass(frozen=True)
class Estimate:
    attention_devices: int
    ffn_devices: int
    microbatches: int
    batch: int  # sequences per attention device
    context: int
    tpot_s: float
    tokens_per_s: float
    tokens_per_s_per_device: float
    # per layer and micro-batch (MoE layers), seconds
    attention_s: float
    ffn_s: float
    a2f_s: float
    f2a_s: float
    cycle_s: float  # per MoE layer, all micro-batches
    lm_head_s: float
    attention_memory_bytes: float
    ffn_memory_bytes: float
    limit: str  # the largest term of the cycle: attention-bound, FFN-bound, link-bound
    regime: str = ""  # set by the search: limit, or memory-capacity-bound

    def as_dict(self) -> dict:
        return asdict(self)


def attention_memory(model: ModelShape, batch: int, context: int) -> float:
    return model.attention_weight_bytes() + batch * context * model.kv_bytes_per_token() \
        * model.layers


def evaluate(model: ModelShape, hw: Hardware, attention_devices: int, ffn_devices: int,
             microbatches: int, batch: int, context: int, link: str = "scale_out",
             ffn_hw: Hardware | None = None) -> Estimate:
    """The decode step of one deployment (ffn_hw: the FFN devices' profile when
    they differ from the attention devices')."""
    ffn_hw = ffn_hw or hw
    a, f, m = attention_devices, ffn_devices, microbatches
    b = batch / m  # tokens per micro-batch per attention device
    n = a * b  # tokens per micro-batch arriving at the FFN group
    ta = cost.attention_layer(model, hw, b, context).seconds
    te_moe = cost.ffn_layer(model, ffn_hw, n, f).seconds
    te_dense = cost.ffn_layer(model, ffn_hw, n, f, dense=True).seconds
    the_link = hw.link(link)
    # the busier NIC of each direction: an attention device's b tokens or an FFN
    # device's n / f tokens
    nic_tokens = max(b, n / f)
    a2f, a2f_busy = cost.transfer(model.a2f_bytes_per_token(), nic_tokens, the_link)
    f2a, f2a_busy = cost.transfer(model.f2a_bytes_per_token(), nic_tokens, the_link)
    busy = max(a2f_busy, f2a_busy)
    layers_time = 0.0
    for te, count in ((te_moe, model.moe_layers), (te_dense, model.dense_layers)):
        if count:
            layers_time += pipeline.step_time(ta, te, a2f, f2a, m, count, busy)
    head = cost.lm_head(model, hw, batch).seconds
    # the step's header crosses once, before the first layer (its micro-batch sizes)
    tpot = layers_time + head + the_link.header_seconds()
    cycle = pipeline.layer_cycle(ta, te_moe, a2f, f2a, m, busy)
    terms = {"attention-bound": m * ta, "FFN-bound": m * te_moe, "link-bound": m * busy}
    if ta + te_moe + a2f + f2a > max(terms.values()):
        # the micro-batches do not overlap enough: one micro-batch's serial chain sets
        # the cycle; name its largest part
        terms = {"attention-bound": ta, "FFN-bound": te_moe, "link-bound": a2f + f2a}
    limit = max(terms, key=terms.get)
    tokens_per_s = a * batch / tpot
    return Estimate(
        attention_devices=a, ffn_devices=f, microbatches=m, batch=batch, context=context,
        tpot_s=tpot, tokens_per_s=tokens_per_s, tokens_per_s_per_device=tokens_per_s / (a + f),
        attention_s=ta, ffn_s=te_moe, a2f_s=a2f, f2a_s=f2a, cycle_s=cycle, lm_head_s=head,
        attention_memory_bytes=attention_memory(model, batch, context),
        ffn_memory_bytes=model.ffn_weight_bytes() / f, limit=limit, regime=limit)


def max_batch_by_memory(model: ModelShape, hw: Hardware, context: int) -> int:
    free = USABLE_MEMORY * hw.memory_capacity - model.attention_weight_bytes()
    per_sequence = context * model.kv_bytes_per_token() * model.layers
    return max(0, int(free // per_sequence))


def best_batch(model: ModelShape, hw: Hardware, a: int, f: int, m: int, context: int,
               tpot_slo_s: float, link: str, max_batch: int) -> Estimate | None:
    """The largest batch (a multiple of m, up to max_batch) that meets the SLO; TPOT
    grows with the batch, so a bisection finds it."""
    lo, hi = 0, max_batch // m  # in units of m sequences
    best = None
    while lo < hi:
        mid = (lo + hi + 1) // 2
        est = evaluate(model, hw, a, f, m, mid * m, context, link)
        if est.tpot_s <= tpot_slo_s:
            lo, best = mid, est
        else:
            hi = mid - 1
    if best is None:
        return None
    memory_bound = best.batch + m > max_batch
    return Estimate(**{**best.as_dict(),
                       "regime": "memory-capacity-bound" if memory_bound else best.limit})


def search(model: ModelShape, hw: Hardware, tpot_slo_s: float, context: int,
           link: str = "scale_out", attention_devices=ATTENTION_DEVICES,
           ffn_devices=FFN_DEVICES, microbatches=MICROBATCHES,
           max_batch: int | None = None) -> list[Estimate]:
    """Every feasible (A, F, m) at its best batch, the most tokens/s per device first."""
    memory_batch = max_batch_by_memory(model, hw, context)
    if max_batch is not None:
        memory_batch = min(memory_batch, max_batch)
    if memory_batch < 1:
        raise ValueError(f"{model.name} does not fit one {context}-token sequence next to "
                         f"its attention weights on one {hw.name}")
    usable = USABLE_MEMORY * hw.memory_capacity
    results = []
    for f in ffn_devices:
        if model.experts and f > model.experts:
            continue
        if model.ffn_weight_bytes() / f > usable:
            continue  # the FFN weights do not fit on f devices
        for a in attention_devices:
            for m in microbatches:
                est = best_batch(model, hw, a, f, m, context, tpot_slo_s, link, memory_batch)
                if est is not None:
                    results.append(est)
    results.sort(key=lambda e: -e.tokens_per_s_per_device)
    logger.debug("%d feasible deployments", len(results))
    return results
