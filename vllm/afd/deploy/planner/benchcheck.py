# SPDX-License-Identifier: Apache-2.0
# SPDX-FileCopyrightText: Copyright contributors to the vllm-afd project
"""The planner against `make bench` on this CPU: from a calibrated `cpu` profile
alone, predict benchmarks/afd_vs_colocated.py's per-step split and AFD/plain ratio
for each batch size B and micro-batch count m, and compare with its JSON.

The bench's deployment is A = F = 1 (one core each, shm link) against plain vLLM on
both cores (the profile's [colocated] section). What is compared, per decode step:

- attention: the bench's `attn` + `attn-out` (all layers' attention, the LM head
  and the engine's per-step work) against L m Ta(B/m) + LM head;
- FFN: `ffn` against L m Te(B/m);
- link: `floor` (the same run's echo steps: the header, then L m round trips) against
  L m (Tc_a2f + Tc_f2a) + the step header;
- ratio: AFD tokens/s over plain's against plain step / AFD step, the AFD step
  from the pipeline (pipeline.step_time) and plain's from L (Ta(B) + Te(B)) on
  both cores.

Nothing is fitted to the bench: every constant comes from the profile.
"""

from __future__ import annotations

import json
import logging
from dataclasses import dataclass
from pathlib import Path

from vllm.afd.deploy.planner import cost, pipeline
from vllm.afd.deploy.planner.hardware import Hardware
from vllm.afd.deploy.planner.model import ModelShape, from_hf_config

logger = logging.getLogger(__name__)

TOLERANCE = 0.15
PARTS = ("attention", "ffn", "link", "ratio")


@dataclass(frozen=True)
class Row:
    batch: int
    microbatches: int
    predicted: dict[str, float]  # seconds per step (ratio: a number)
    measured: dict[str, float]

    def error(self, part: str) -> float:
        return self.predicted[part] / self.measured[part] - 1.0


def bench_model(bench: dict) -> ModelShape:
    m = bench["model"]
    cfg = {"hidden_size": m["hidden_size"], "num_hidden_layers": m["num_hidden_layers"],
           "num_experts": m["num_experts"], "num_experts_per_tok": m["num_experts_per_tok"],
           "moe_intermediate_size": m["moe_intermediate_size"], "dtype": m["dtype"]}
    config = Path(m["path"]) / "config.json"
    if config.is_file():  # the full shape (heads, vocab) when the model is here
        cfg = {**json.loads(config.read_text()), **cfg}
    else:  # the repo's bench model (tools/models/make_tiny_models.py)
        from vllm.afd.deploy.planner.model import PRESETS

        preset = PRESETS["bench-qwen3-moe"]
        cfg.update(num_attention_heads=preset.heads, num_key_value_heads=preset.kv_heads,
                   head_dim=preset.head_dim, vocab_size=preset.vocab)
    return from_hf_config(cfg, name=Path(m["path"]).name)


def predict(model: ModelShape, hw: Hardware, batch: int, m: int, context: int) -> dict:
    """Seconds per decode step of the bench's AFD 1:1 (and plain on [colocated])."""
    m = min(m, batch)  # the bench splits B tokens into min(m, B) micro-batches
    b = batch / m
    layers = model.layers
    ta = cost.attention_layer(model, hw, b, context).seconds
    te = cost.ffn_layer(model, hw, b, 1).seconds
    link = hw.link("same_host")
    a2f, busy_a2f = cost.transfer(model.a2f_bytes_per_token(), b, link)
    f2a, busy_f2a = cost.transfer(model.f2a_bytes_per_token(), b, link)
    head = cost.lm_head(model, hw, batch).seconds
    header = link.header_seconds()  # once a step, before the first layer
    afd_step = pipeline.step_time(ta, te, a2f, f2a, m, layers,
                                  max(busy_a2f, busy_f2a)) + head + header
    plain = hw.colocated or hw
    plain_step = layers * (cost.attention_layer(model, plain, batch, context).seconds
                           + cost.ffn_layer(model, plain, batch, 1).seconds) \
        + cost.lm_head(model, plain, batch).seconds
    return {"attention": layers * m * ta + head, "ffn": layers * m * te,
            "link": layers * m * (a2f + f2a) + header, "step": afd_step, "plain_step": plain_step,
            "ratio": plain_step / afd_step}


def compare(bench: dict, hw: Hardware) -> list[Row]:
    """Predicted against measured, every (B, m) of the bench."""
    model = bench_model(bench)
    settings = bench["settings"]
    # the mean context of the decode steps: the prompt plus half the generated tokens
    context = settings["prompt_tokens"] + settings["max_tokens_N"] // 2
    rows = []
    for config in bench["afd"].values():
        for b, result in config["batches"].items():
            # the auto policy's run: the m its rule chose at this B (its
            # num_ubatches is the most it may choose)
            m = result.get("chosen_ubatches") or config["num_ubatches"]
            split = result["split_ms"]
            measured = {"attention": (split["attention_compute"]
                                      + split["attention_outside_link"]) / 1e3,
                        "ffn": split["ffn_compute"] / 1e3,
                        "link": split["transfer_floor"] / 1e3,
                        "ratio": result["ratio_vs_plain"]}
            rows.append(Row(int(b), m, predict(model, hw, int(b), m, context), measured))
    return rows


def check_host(bench: dict, hw: Hardware) -> None:
    bench_cpu = bench["machine"]["cpu_model"]
    if hw.cpu_model != bench_cpu:
        raise ValueError(f"the profile was measured on {hw.cpu_model!r}, the bench ran on "
                         f"{bench_cpu!r}: calibrate on the bench's host")
    # One model name covers hosts of different ISAs (older results lack the field).
    bench_isa = bench["machine"].get("cpu_isa")
    if hw.cpu_isa and bench_isa and hw.cpu_isa != bench_isa:
        raise ValueError(f"the profile was measured on a {hw.cpu_model} with {hw.cpu_isa}, the "
                         f"bench ran on one with {bench_isa}: calibrate on the bench's host")
    # ... and of one ISA, CPUs of different generations (nor this one).
    bench_generation = bench["machine"].get("cpu_generation")
    if hw.cpu_generation and bench_generation and hw.cpu_generation != bench_generation:
        raise ValueError(f"the profile was measured on a {hw.cpu_model} of family/model "
                         f"{hw.cpu_generation}, the bench ran on one of {bench_generation}: "
                         "calibrate on the bench's host")


def table(rows: list[Row]) -> str:
    lines = [f"{'B':>3} {'m':>2}  " + "  ".join(f"{p:>22}" for p in PARTS),
             f"{'':>6}  " + "  ".join(f"{'predicted/measured err':>22}" for _ in PARTS)]
    for r in rows:
        cells = []
        for p in PARTS:
            scale, unit = (1.0, "") if p == "ratio" else (1e3, "ms")
            cells.append(f"{r.predicted[p] * scale:7.2f}/{r.measured[p] * scale:7.2f}"
                         f"{unit:2} {r.error(p):+5.0%}")
        lines.append(f"{r.batch:>3} {r.microbatches:>2}  " + "  ".join(f"{c:>22}" for c in cells))
    return "\n".join(lines)
