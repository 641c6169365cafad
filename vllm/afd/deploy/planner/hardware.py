# SPDX-License-Identifier: Apache-2.0
# SPDX-FileCopyrightText: Copyright contributors to the vllm-afd project
"""Hardware profiles: one device's peak FLOP/s per dtype, memory bandwidth and size,
and its links (scale-out NIC, scale-up NVLink/HCCS, same-host shm), from a TOML
file: the built-in ones in profiles/ (vendor datasheets, each number's source in a
comment) or the `cpu` profile `vllm-afd plan --calibrate` writes.

A CPU profile also holds what a GPU's peak hides: GEMM FLOP/s per activation row
count (small-row GEMMs run far below peak on a CPU), the fixed per-layer cost of
eager operator dispatch, optionally an [engine] table of one model's layers as
plain vLLM runs them (what eager dispatch adds around the kernels, which no
roofline sees), and a [colocated] section measured with all the cores in one
engine (the plain-vLLM baseline).
"""

from __future__ import annotations

import bisect
import logging
import tomllib
from dataclasses import dataclass, field
from pathlib import Path

logger = logging.getLogger(__name__)

PROFILE_DIR = Path(__file__).parent / "profiles"
LINK_KINDS = ("scale_out", "scale_up", "same_host")


@dataclass(frozen=True)
class Link:
    bandwidth: float  # bytes/s, one direction
    latency: float  # seconds, one way, per transfer
    # Seconds a decode step's header (the micro-batch sizes, sent once before its
    # first layer) costs the attention side; absent: one small message, `latency`.
    # A cpu profile measures it: Python building and posting the frame is most of it.
    step_header: float | None = None

    def header_seconds(self) -> float:
        return self.latency if self.step_header is None else self.step_header


@dataclass(frozen=True)
class EngineTable:
    """One model's decode steps measured in plain vLLM on this device (cpu
    profiles, engine_probe.py): seconds per decode token count of one layer's
    attention half, one mlp, and the step's work outside the layers."""
    model: str  # the model directory's name
    tokens: tuple[float, ...]
    attention_layer: tuple[float, ...]
    ffn_layer: tuple[float, ...]
    step_other: tuple[float, ...]

    def at(self, part: str, tokens: float) -> float:
        """Linear in the token count between the measured ones, flat below the
        first, extrapolated from the last two above the last."""
        xs, ys = self.tokens, getattr(self, part)
        if tokens <= xs[0] or len(xs) == 1:
            return ys[0]
        i = min(max(bisect.bisect_right(xs, tokens), 1), len(xs) - 1)
        x0, x1, y0, y1 = xs[i - 1], xs[i], ys[i - 1], ys[i]
        return max(y0 + (y1 - y0) * (tokens - x0) / (x1 - x0), 0.0)


@dataclass(frozen=True)
class Hardware:
    name: str
    description: str
    kind: str
    peak_flops: dict[str, float]  # dtype -> FLOP/s
    memory_bandwidth: float
    memory_capacity: float
    links: dict[str, Link]
    # dtype -> (rows, FLOP/s) ascending; absent: the peak at every row count.
    # "<dtype>_moe": the routed experts' kernel, by rows per expert (cpu profiles)
    flops_by_rows: dict[str, tuple[tuple[float, ...], tuple[float, ...]]] = field(
        default_factory=dict)
    attention_layer_overhead: float = 0.0  # seconds per layer and micro-batch
    ffn_layer_overhead: float = 0.0
    colocated: Hardware | None = None
    engine: EngineTable | None = None  # measured layers of one model (cpu profiles)
    cpu_model: str = ""
    cpu_isa: str = ""  # calibrate.cpu_isa() of the host a cpu profile was measured on
    cpu_generation: str = ""  # calibrate.cpu_generation() of that host
    measured: str = ""
    path: str = ""

    def flops(self, dtype: str, rows: float = float("inf")) -> float:
        """FLOP/s of a GEMM whose activation has `rows` rows. A dtype the device has
        no fast path for (fp8 on A100 or Ascend) runs at its bf16 rate."""
        if dtype not in self.peak_flops:
            dtype = "bf16" if "bf16" in self.peak_flops else next(iter(self.peak_flops))
        return self._rate(self.flops_by_rows.get(dtype), self.peak_flops[dtype], rows)

    def moe_flops(self, dtype: str, rows_per_expert: float) -> float:
        """FLOP/s of the routed experts' GEMMs with `rows_per_expert` tokens per
        touched expert: the measured MoE kernel where the profile has one (a cpu
        profile: vLLM's CPU kernel, weights read from memory), else a GEMM's."""
        table = self.flops_by_rows.get(f"{dtype}_moe")
        if table is None and dtype not in self.peak_flops and "bf16_moe" in self.flops_by_rows:
            table = self.flops_by_rows["bf16_moe"]  # as flops(): no fast path for dtype
        if table is None:
            return self.flops(dtype, rows_per_expert)
        return self._rate(table, max(table[1]), rows_per_expert)

    @staticmethod
    def _rate(table, peak: float, rows: float) -> float:
        if not table:
            return peak
        rows_list, rates = table
        if rows <= rows_list[0]:
            # below the smallest measured row count the rate scales with the rows
            return rates[0] * max(rows, 1e-9) / rows_list[0]
        if rows >= rows_list[-1]:
            return rates[-1]
        i = bisect.bisect_right(rows_list, rows)
        r0, r1, f0, f1 = rows_list[i - 1], rows_list[i], rates[i - 1], rates[i]
        return f0 + (f1 - f0) * (rows - r0) / (r1 - r0)

    def engine_for(self, model_name: str) -> EngineTable | None:
        """The measured engine table when it is this model's."""
        return self.engine if self.engine and self.engine.model == model_name else None

    def link(self, kind: str) -> Link:
        if kind not in self.links:
            raise ValueError(f"{self.name} has no {kind} link (it has {', '.join(self.links)})")
        return self.links[kind]


def _parse(data: dict, name: str, path: str) -> Hardware:
    compute = data.get("compute", {})
    peaks = {k: float(v) for k, v in compute.items() if not isinstance(v, dict)}
    tables = {k.removesuffix("_by_rows"): (tuple(float(r) for r in v["rows"]),
                                           tuple(float(f) for f in v["flops"]))
              for k, v in compute.items() if isinstance(v, dict)}
    links = {k: Link(float(data[k]["bandwidth"]), float(data[k]["latency"]),
                     float(data[k]["step_header"]) if "step_header" in data[k] else None)
             for k in LINK_KINDS if k in data}
    overhead = data.get("overhead", {})
    engine = None
    if "engine" in data:
        e = data["engine"]
        engine = EngineTable(str(e["model"]), *(tuple(float(x) for x in e[k]) for k in (
            "tokens", "attention_layer", "ffn_layer", "step_other")))
    colocated = None
    if "colocated" in data:
        sub = {**{k: v for k, v in data.items() if k in LINK_KINDS}, **data["colocated"]}
        colocated = _parse({"name": f"{name} (colocated)", **sub}, f"{name}-colocated", path)
    return Hardware(
        name=str(data.get("name", name)), description=str(data.get("description", "")),
        kind=str(data.get("kind", "gpu")), peak_flops=peaks,
        memory_bandwidth=float(data["memory"]["bandwidth"]),
        memory_capacity=float(data["memory"]["capacity"]), links=links,
        flops_by_rows=tables,
        attention_layer_overhead=float(overhead.get("attention_layer", 0.0)),
        ffn_layer_overhead=float(overhead.get("ffn_layer", 0.0)),
        colocated=colocated, engine=engine, cpu_model=str(data.get("cpu_model", "")),
        cpu_isa=str(data.get("cpu_isa", "")),
        cpu_generation=str(data.get("cpu_generation", "")),
        measured=str(data.get("measured", "")), path=path)


def builtin_names() -> list[str]:
    return sorted(p.stem for p in PROFILE_DIR.glob("*.toml"))


def load_hardware(spec: str) -> Hardware:
    """A built-in name (h200, H200, ascend-910c, ...) or a path to a profile file."""
    path = Path(spec)
    if not path.is_file():
        path = PROFILE_DIR / f"{spec.lower()}.toml"
    if not path.is_file():
        hint = " (`vllm-afd plan --calibrate --out FILE` measures this host's)" \
            if spec.lower() == "cpu" else ""
        raise ValueError(f"no hardware profile {spec!r}: give a file or one of "
                         f"{', '.join(builtin_names())}{hint}")
    with path.open("rb") as f:
        data = tomllib.load(f)
    return _parse(data, path.stem, str(path))
