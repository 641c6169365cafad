# SPDX-License-Identifier: Apache-2.0
# SPDX-FileCopyrightText: Copyright contributors to the vllm-afd project
"""The planner's output: a table of the best deployments with the limiting regime,
or the same as JSON."""

from __future__ import annotations

import json

from vllm.afd.deploy.planner.hardware import Hardware
from vllm.afd.deploy.planner.model import ModelShape
from vllm.afd.deploy.planner.search import Estimate


def _us(s: float) -> str:
    return f"{s * 1e6:.0f}"


def table(model: ModelShape, hw: Hardware, results: list[Estimate], tpot_slo_s: float,
          context: int, link: str, top: int = 10) -> str:
    head = (f"{model.name} on {hw.name} ({hw.description}), TPOT <= {tpot_slo_s * 1e3:g} ms, "
            f"context {context}, {link} link; weights {model.weight_dtype}, KV "
            f"{model.kv_dtype}, A->F {model.a2f_dtype}, F->A {model.f2a_dtype}")
    if not results:
        return head + "\nno deployment meets the SLO"
    cols = (f"{'A':>3} {'F':>3} {'m':>2} {'batch/A':>8} {'TPOT ms':>8} {'tok/s':>9} "
            f"{'tok/s/dev':>10} {'Ta us':>6} {'Te us':>6} {'Tc us':>6} {'cycle us':>9}  regime")
    lines = [head, cols]
    for e in results[:top]:
        lines.append(
            f"{e.attention_devices:>3} {e.ffn_devices:>3} {e.microbatches:>2} {e.batch:>8} "
            f"{e.tpot_s * 1e3:>8.1f} {e.tokens_per_s:>9.0f} {e.tokens_per_s_per_device:>10.0f} "
            f"{_us(e.attention_s):>6} {_us(e.ffn_s):>6} {_us(max(e.a2f_s, e.f2a_s)):>6} "
            f"{_us(e.cycle_s):>9}  {e.regime}")
    best = results[0]
    why = {"attention-bound": "attention devices are the busiest (add A, or shorten the context)",
           "FFN-bound": "FFN devices are the busiest (add F)",
           "link-bound": "the link sets the layer cycle (more micro-batches, fp8, or a faster link)",
           "memory-capacity-bound": "the KV cache fills the attention devices' memory before the "
                                    "SLO binds (more A, fp8 KV, or shorter contexts)"}[best.regime]
    lines.append(f"limiting regime of the best: {best.regime}: {why}; its layer cycle is "
                 f"{best.limit} (Ta, Te, Tc per MoE layer and micro-batch)")
    lines.append("a roofline at the profile's peak rates: an upper bound, not a promise")
    return "\n".join(lines)


def as_json(model: ModelShape, hw: Hardware, results: list[Estimate], tpot_slo_s: float,
            context: int, link: str, top: int = 10) -> str:
    return json.dumps({
        "model": model.__dict__, "hardware": {"name": hw.name, "description": hw.description,
                                              "profile": hw.path},
        "tpot_slo_s": tpot_slo_s, "context": context, "link": link,
        "feasible": len(results), "best": [e.as_dict() for e in results[:top]],
        "regime": results[0].regime if results else None,
    }, indent=2)
