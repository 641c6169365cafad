# SPDX-License-Identifier: Apache-2.0
# SPDX-FileCopyrightText: Copyright contributors to the vllm-afd project
"""`vllm-afd plan --calibrate`: the `cpu` hardware profile, measured on this host.

What it measures, each on the cores an AFD role gets (one core per device, the
first cores of this process's CPU set) and on two cores (what a colocated engine
gets on the same cores):

- memory bandwidth: a streaming read of a buffer far larger than the caches;
- matmul FLOP/s per dtype as a function of the rows (tokens) of the activation:
  small-row GEMMs run far below the core's peak on a CPU, so the profile keeps a
  table instead of one number. bf16 where vLLM's CPU kernels load: vLLM's own dense
  GEMM (oneDNN, as its CPU linear layers dispatch), at the bench model's attention
  projection shapes with the weights of several layers in turn, so the rate is what
  a layer gets with its weights read from memory (which can be half what the
  streaming bandwidth alone would allow: benchmarks/notes.md). Otherwise, and for
  fp32, torch's linear on a 2048 x 2048
  weight that stays in the last-level cache (compute, not memory);
- the same-host link: round trips of a hidden-state payload through the project's
  real shm connector between two processes on two cores (attention end, echo FFN
  end), per payload size, in steps as `make bench` runs them (a header, then a
  layer call per layer); its fixed part and bandwidth by a least-squares line,
  and the step header's own cost;
- the routed experts as vLLM's CPU MoE kernel computes them (where vLLM's CPU
  kernels load): FLOP/s of `cpu_fused_moe` by rows per expert, at the bench
  model's expert shape, the weights of several layers in turn so that each call
  reads them from memory as a model's layer does. torch's own linear is no
  stand-in for it: on an AVX2-only host torch's bf16 GEMM ran 2-3x slower than
  the kernel vLLM runs, on an AVX-512 host faster;
- fixed per-layer framework cost: an eager PyTorch attention block and a MoE block
  at width 64 (compute and memory traffic negligible), i.e. what dispatching a
  layer's operators costs on this core.

Rates are the best of a few repeats: the host may be shared, and the best run is the
one least disturbed. The whole run takes well under a minute.
"""

from __future__ import annotations

import datetime
import itertools
import logging
import multiprocessing
import os
import platform
import socket
import statistics
import time
from pathlib import Path

logger = logging.getLogger(__name__)

GEMM_ROWS = (1, 2, 4, 8, 16, 32, 64, 128, 256)
GEMM_SIZE = 2048
LINK_HIDDEN = 2048  # the bench model's width; the line fit makes it general
LINK_TOKENS = (1, 8, 16, 32, 64, 128)
# Waits spin as they do in `make bench` (its --spin-us default: a core per role).
# Unspun, every message is a wake-up, which would dominate a small VM's link.
LINK_SPIN_US = 50000
LINK_LAYERS = 8
BANDWIDTH_BUFFER_BYTES = 256 << 20
# vLLM's dense CPU GEMM: the bench model's qkv and o projections (out, in), weight sets
DENSE_SHAPES = ((3072, 2048), (2048, 2048))
DENSE_WEIGHT_SETS = 8
# vLLM's CPU MoE kernel: experts, top-k, hidden, intermediate of the bench model
# (tools/models/make_tiny_models.py bench-qwen3-moe), tokens per call, weight sets rotated
MOE_SHAPE = (16, 4, 2048, 384)
MOE_TOKENS = (1, 2, 4, 8, 16, 32, 64, 128, 256)
MOE_WEIGHT_SETS = 4


def _cpuinfo(key: str) -> str | None:
    """The first `key` line's value in /proc/cpuinfo (None where there is none)."""
    try:
        for line in Path("/proc/cpuinfo").read_text().splitlines():
            name, _, value = line.partition(":")
            if name.strip() == key:
                return value.strip()
    except OSError:
        pass
    return None


def cpu_model() -> str:
    return _cpuinfo("model name") or platform.processor() or platform.machine()


def cpu_isa() -> str:
    """The widest matrix path this CPU offers torch and vLLM: amx, avx512_bf16,
    avx512, avx2 (or the machine). Hosts that one model name covers differ by
    it (an "AMD EPYC" VM with AVX-512 ran vLLM's bf16 ~6x faster than one
    without), so a profile and a bench compare only where it matches."""
    flags = set((_cpuinfo("flags") or "").split())
    for isa, flag in (("amx", "amx_bf16"), ("avx512_bf16", "avx512_bf16"),
                      ("avx512", "avx512f"), ("avx2", "avx2")):
        if flag in flags:
            return isa
    return platform.machine()


def cpu_generation() -> str:
    """The CPU's family and model numbers ("26/2"), or "" where none are
    given: hosts that one model name and ISA cover differ by them ("AMD EPYC"
    with AVX-512 bf16 has named both a Zen 4 and a Zen 5 VM, whose layers
    differ by tens of percent: benchmarks/notes.md)."""
    family, model = _cpuinfo("cpu family"), _cpuinfo("model")
    return f"{family}/{model}" if family and model else ""


def device_cores() -> list[int]:
    cores = sorted(os.sched_getaffinity(0))
    if len(cores) < 2:
        raise RuntimeError("--calibrate needs two cores (one per AFD role)")
    return cores[:2]


def _best_rate(fn, amount: float, seconds: float = 0.15, max_calls: int = 400) -> float:
    """amount / the fastest single call within about `seconds`: on a shared host the
    fastest call is the one nothing else interrupted."""
    fn()  # warm-up
    best, calls, t0 = float("inf"), 0, time.perf_counter()
    while calls < max_calls and time.perf_counter() - t0 < seconds:
        c0 = time.perf_counter()
        fn()
        best = min(best, time.perf_counter() - c0)
        calls += 1
    return amount / best


def memory_bandwidth(threads: int) -> float:
    import torch

    torch.set_num_threads(threads)
    buf = torch.ones(BANDWIDTH_BUFFER_BYTES // 4, dtype=torch.float32)
    return _best_rate(lambda: buf.sum(), BANDWIDTH_BUFFER_BYTES, seconds=0.5)


def gemm_flops(threads: int, dtype_name: str) -> dict[int, float]:
    import torch

    torch.set_num_threads(threads)
    dtype = {"bf16": torch.bfloat16, "fp32": torch.float32}[dtype_name]
    weight = torch.randn(GEMM_SIZE, GEMM_SIZE).to(dtype)
    out = {}
    for rows in GEMM_ROWS:
        x = torch.randn(rows, GEMM_SIZE).to(dtype)
        out[rows] = _best_rate(lambda: torch.nn.functional.linear(x, weight),
                               2.0 * rows * GEMM_SIZE * GEMM_SIZE, seconds=0.1)
    return out


def _vllm_cpu_kernels_loaded(what: str) -> bool:
    """Whether vLLM's CPU kernels are loaded (as its CPU platform loads them for
    this ISA); where there are none (no vLLM, a GPU build), torch stands in for
    `what` and the calibration says so. On a CPU build they must load: a failure
    there is raised, not measured around (vLLM itself could not run)."""
    try:
        from vllm.platforms import current_platform
    except ImportError as e:
        reason = str(e)
    else:
        if current_platform.is_cpu():
            current_platform.import_kernels()
            return True
        reason = "not a CPU build"
    logger.info("vLLM's %s is not available (%s): torch linear stands in", what, reason)
    return False


def vllm_dense_gemm():
    """vLLM's `_custom_ops` where its CPU linear layers dispatch to oneDNN
    (dispatch_cpu_unquantized_gemm), else None. Like that dispatch, a oneDNN
    that cannot build a bf16 matmul here (an AVX2-only CPU) means torch's
    linear, which is what vLLM's layers then run."""
    if not _vllm_cpu_kernels_loaded("oneDNN GEMM"):
        return None
    from vllm import _custom_ops as ops

    if not getattr(ops, "_supports_onednn", False):
        return None
    import torch

    try:
        ops.create_onednn_mm(torch.zeros(64, 64, dtype=torch.bfloat16).t(), 32)
    except RuntimeError as e:
        logger.info("vLLM's oneDNN GEMM cannot run bf16 here (%s): torch linear stands in",
                    str(e).split(". ")[0])
        return None
    return ops


def dense_flops(threads: int, ops) -> dict[int, float]:
    """bf16 FLOP/s of vLLM's oneDNN GEMM by activation rows, one attention
    layer's projections per call, the weights of DENSE_WEIGHT_SETS layers in turn."""
    import torch

    torch.set_num_threads(threads)
    layers = [[ops.create_onednn_mm((torch.randn(n, k) * 0.02).to(torch.bfloat16).t(), 32)
               for n, k in DENSE_SHAPES] for _ in range(DENSE_WEIGHT_SETS)]
    sets = itertools.cycle(layers)
    params = sum(n * k for n, k in DENSE_SHAPES)
    out = {}
    for rows in GEMM_ROWS:
        x = (torch.randn(rows, DENSE_SHAPES[0][1]) * 0.1).to(torch.bfloat16)

        def call():
            for handler in next(sets):
                ops.onednn_mm(handler, x, None)

        out[rows] = _best_rate(call, 2.0 * rows * params, seconds=0.1)
    return out


def vllm_moe_kernel():
    """(cpu_fused_moe, prepack, isa) from vLLM's CPU kernels as vLLM itself picks
    them (CPUUnquantizedExperts: AMX where the CPU has it, else the vector
    path), or None where they do not load (no vLLM, a GPU build)."""
    import torch

    if not _vllm_cpu_kernels_loaded("CPU MoE kernel"):
        return None
    try:
        op, prepack = torch.ops._C.cpu_fused_moe, torch.ops._C.prepack_moe_weight
    except (AttributeError, RuntimeError):  # a build of vLLM's CPU kernels without it
        return None
    return op, prepack, "amx" if torch.cpu._is_amx_tile_supported() else "vec"


def moe_flops(threads: int, kernel) -> dict[float, float]:
    """FLOP/s of the routed experts through vLLM's kernel, by rows per expert:
    T tokens each pick top-k experts round robin, so min(E, T k) experts get
    T k / min(E, T k) rows each (what cost.ffn_layer's rows_per_expert means)."""
    import torch

    torch.set_num_threads(threads)
    op, prepack, isa = kernel
    experts, top_k, hidden, inter = MOE_SHAPE
    weight_sets = []
    for _ in range(MOE_WEIGHT_SETS):
        packed = []
        for shape in ((experts, 2 * inter, hidden), (experts, hidden, inter)):
            w = (torch.randn(shape) * 0.02).to(torch.bfloat16)
            out = torch.empty_like(w)
            prepack(w, out, isa)
            packed.append(out)
        weight_sets.append(packed)
    sets = itertools.cycle(weight_sets)
    rates: dict[float, float] = {}
    for tokens in MOE_TOKENS:
        x = (torch.randn(tokens, hidden) * 0.1).to(torch.bfloat16)
        ids = ((torch.arange(tokens)[:, None] * top_k + torch.arange(top_k)) % experts)
        ids = ids.to(torch.int32).contiguous()
        weights = torch.full((tokens, top_k), 1.0 / top_k, dtype=torch.float32)
        out = torch.empty_like(x)

        def call():
            w13, w2 = next(sets)
            op(out, x, w13, w2, None, None, weights, ids, False, "silu", isa)

        pairs = tokens * top_k
        touched = min(experts, pairs)
        rows = pairs / touched
        flops = 2.0 * pairs * 3 * hidden * inter
        rates[rows] = max(rates.get(rows, 0.0), _best_rate(call, flops, seconds=0.2))
    return rates


# ------------------------------------------------------------ framework overhead
def _attention_block(torch, h, width: int, heads: int = 4, head_dim: int = 16):
    """One decoder layer's attention half as an eager engine runs it, at a width
    where compute is negligible: norm, fused qkv, q/k norms, rotary, attention over
    a short cache, output projection, residual."""
    F = torch.nn.functional
    x = F.rms_norm(h, (width,))
    qkv = F.linear(x, _attention_block.w_qkv)
    q, k, v = qkv.split([heads * head_dim, head_dim, head_dim], dim=-1)
    q = F.rms_norm(q.view(-1, heads, head_dim), (head_dim,))
    k = F.rms_norm(k.view(-1, 1, head_dim), (head_dim,))
    cos, sin = _attention_block.cos, _attention_block.sin
    q1, q2 = q.chunk(2, dim=-1)
    q = torch.cat((q1 * cos - q2 * sin, q2 * cos + q1 * sin), dim=-1)
    k1, k2 = k.chunk(2, dim=-1)
    k = torch.cat((k1 * cos - k2 * sin, k2 * cos + k1 * sin), dim=-1)
    cache_k, cache_v = _attention_block.cache_k, _attention_block.cache_v
    cache_k[:, -1:].copy_(k.transpose(0, 1))
    cache_v[:, -1:].copy_(v.view(-1, 1, head_dim).transpose(0, 1))
    o = F.scaled_dot_product_attention(q.transpose(0, 1), cache_k.expand(heads, -1, -1),
                                       cache_v.expand(heads, -1, -1))
    o = F.linear(o.transpose(0, 1).reshape(-1, heads * head_dim), _attention_block.w_o)
    return h + o


def _moe_block(torch, h, width: int, experts: int = 16, top_k: int = 4):
    """One decoder layer's MoE half, eager: norm, router, top-k, per-expert gather,
    gate/up, SiLU, down, weighted scatter-add."""
    F = torch.nn.functional
    x = F.rms_norm(h, (width,))
    logits = F.linear(x, _moe_block.w_router)
    weights, ids = torch.topk(logits.softmax(-1), top_k, dim=-1)
    weights = weights / weights.sum(-1, keepdim=True)
    out = torch.zeros_like(x)
    for e in ids.flatten().unique().tolist():
        rows, slot = (ids == e).nonzero(as_tuple=True)
        gate_up = F.linear(x[rows], _moe_block.w13[e])
        gate, up = gate_up.chunk(2, dim=-1)
        y = F.linear(F.silu(gate) * up, _moe_block.w2[e])
        out.index_add_(0, rows, y * weights[rows, slot].unsqueeze(-1))
    return h + out


def layer_overheads(threads: int) -> dict[str, float]:
    """Seconds per layer of operator dispatch alone (one decode token, width 64)."""
    import torch

    torch.set_num_threads(threads)
    width, heads, head_dim, experts = 64, 4, 16, 16
    _attention_block.w_qkv = torch.randn((heads + 2) * head_dim, width)
    _attention_block.w_o = torch.randn(width, heads * head_dim)
    _attention_block.cos = torch.ones(1, 1, head_dim // 2)
    _attention_block.sin = torch.zeros(1, 1, head_dim // 2)
    _attention_block.cache_k = torch.randn(1, 32, head_dim)
    _attention_block.cache_v = torch.randn(1, 32, head_dim)
    _moe_block.w_router = torch.randn(experts, width)
    _moe_block.w13 = torch.randn(experts, 2 * 32, width)
    _moe_block.w2 = torch.randn(experts, width, 32)
    h = torch.randn(1, width)
    with torch.inference_mode():
        attention = 1.0 / _best_rate(lambda: _attention_block(torch, h, width), 1.0)
        ffn = 1.0 / _best_rate(lambda: _moe_block(torch, h, width), 1.0)
    return {"attention_layer": attention, "ffn_layer": ffn}


# ------------------------------------------------------------------ link
def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _make_connector(role: str, port: int, max_tokens: int):
    import torch

    from vllm.afd.adapter.config import AFDConfig
    from vllm.afd.transport.connectors.registry import create_connector

    return create_connector(AFDConfig(role=role, connector="shm", port=port, timeout_s=60,
                                      connector_extra_config={"spin_us": LINK_SPIN_US}),
                            hidden_size=LINK_HIDDEN, dtype=torch.bfloat16,
                            max_tokens=max_tokens)


def _echo_ffn(port: int, core: int, max_tokens: int) -> None:
    """The FFN end: send every hidden state straight back until the goodbye."""
    os.sched_setaffinity(0, {core})
    import torch

    torch.set_num_threads(1)
    ffn = _make_connector("ffn", port, max_tokens)
    try:
        ffn.accept()
        while True:
            step = ffn.recv_step(0)
            if step.is_goodbye or step.is_shutdown:
                return
            for layer in range(LINK_LAYERS):
                ffn.send_output(0, layer, 0, ffn.recv_hidden(0, layer, 0))
    finally:
        ffn.close()


def shm_round_trips(cores: list[int], iters: int = 200) -> tuple[dict[int, float], float]:
    """({payload bytes one way: round-trip seconds}, step header seconds), measured
    as a step pays them, as `make bench`'s transfer floor does: each step sends
    its header, then LINK_LAYERS round trips. A size's round trip is the median
    over steps of the step's calls' mean, the first call included (it waits while
    the echo reads the header); the header is the median time to send it. Medians
    of single calls would leave out the header and the skew of the calls'
    distribution, and come out under the floor."""
    import torch

    from vllm.afd.transport import wire

    port, max_tokens = _free_port(), max(LINK_TOKENS)
    echo = multiprocessing.get_context("spawn").Process(
        target=_echo_ffn, args=(port, cores[1], max_tokens), daemon=True)
    echo.start()
    attn = _make_connector("attention", port, max_tokens)
    try:
        attn.connect()
        payloads = {t: torch.randn(t, LINK_HIDDEN).to(torch.bfloat16) for t in LINK_TOKENS}
        results = {t: torch.empty_like(h) for t, h in payloads.items()}
        per_call: dict[int, list[float]] = {t: [] for t in LINK_TOKENS}
        headers: list[float] = []
        step_ids = itertools.count()
        # Sizes interleaved, so a burst of load elsewhere on the host hits them all
        # alike and the line fit stays meaningful.
        for i in range(iters // LINK_LAYERS + 5):
            for tokens, h in payloads.items():
                t0 = time.perf_counter()
                attn.send_step(wire.StepHeader(step_id=next(step_ids),
                                               num_tokens=[tokens]))
                t1 = time.perf_counter()
                for layer in range(LINK_LAYERS):
                    attn.send_hidden(layer, 0, h)
                    attn.recv_output(layer, 0, out=results[tokens])
                if i >= 5:  # warm-up: the first steps map pages and wake threads
                    headers.append(t1 - t0)
                    per_call[tokens].append((time.perf_counter() - t1) / LINK_LAYERS)
        trips = {t * LINK_HIDDEN * 2: statistics.median(v) for t, v in per_call.items()}
        return trips, statistics.median(headers)
    finally:
        attn.close()
        echo.join(20)
        if echo.is_alive():
            echo.kill()


def fit_link(round_trips: dict[int, float]) -> tuple[float, float]:
    """(one-way latency s, bandwidth B/s) from round trip = 2 latency + 2 bytes / bw,
    by least squares over the payload sizes."""
    xs = [2.0 * b for b in round_trips]
    ys = list(round_trips.values())
    mx, my = statistics.fmean(xs), statistics.fmean(ys)
    sxx = sum((x - mx) ** 2 for x in xs)
    slope = sum((x - mx) * (y - my) for x, y in zip(xs, ys)) / sxx if sxx else 0.0
    intercept = my - slope * mx
    bandwidth = 1.0 / slope if slope > 0 else float("inf")
    return max(intercept, 0.0) / 2.0, bandwidth


# ------------------------------------------------------------------ profile
def _table(rows: dict[float, float]) -> str:
    keys = ", ".join(f"{r:g}" for r in rows)
    values = ", ".join(f"{v:.4g}" for v in rows.values())
    return f"{{ rows = [{keys}], flops = [{values}] }}"


def measure(model: str | None = None) -> dict:
    """Every number of the cpu profile, measured now; with `model` (a checkpoint
    directory) also its layers as plain vLLM runs them (engine_probe.py)."""
    cores = device_cores()
    t0 = time.monotonic()
    # The link first, before this process starts OpenMP threads.
    import torch

    os.sched_setaffinity(0, {cores[0]})
    # One thread: torch's intra-op threads on one core would stall the link's copies.
    torch.set_num_threads(1)
    trips, header = shm_round_trips(cores)
    latency, bandwidth = fit_link(trips)
    result = {"cores": cores, "link": {"round_trips": trips, "latency": latency,
                                       "bandwidth": bandwidth, "step_header": header}}
    kernel, dense = vllm_moe_kernel(), vllm_dense_gemm()
    for name, core_set in (("device", {cores[0]}), ("colocated", set(cores))):
        os.sched_setaffinity(0, core_set)
        threads = len(core_set)
        result[name] = {
            "threads": threads,
            "bandwidth": memory_bandwidth(threads),
            "gemm": {"bf16": dense_flops(threads, dense) if dense else gemm_flops(threads, "bf16"),
                     "fp32": gemm_flops(threads, "fp32")},
            "moe": moe_flops(threads, kernel) if kernel else {},
            "overhead": layer_overheads(threads),
        }
    if model is not None:
        from vllm.afd.deploy.planner import engine_probe

        # One core is an AFD role's: its attention half timed without mlps.
        for name, core_set in (("device", cores[:1]), ("colocated", cores)):
            result[name]["engine"] = {"model": Path(model).name, **engine_probe.run(
                model, core_set, attention_alone=name == "device")}
    result["moe_isa"] = kernel[2] if kernel else None
    result["bf16_gemm"] = "vLLM's oneDNN GEMM" if dense else "torch linear"
    result["seconds"] = time.monotonic() - t0
    return result


def profile_text(m: dict) -> str:
    """The measurement as a hardware profile (TOML, hardware.py's schema)."""
    now = datetime.datetime.now(datetime.timezone.utc).strftime("%Y-%m-%dT%H:%MZ")
    lines = [
        "# SPDX-License-Identifier: Apache-2.0",
        "# SPDX-FileCopyrightText: Copyright contributors to the vllm-afd project",
        "# Measured by `vllm-afd plan --calibrate` (vllm/afd/deploy/planner/calibrate.py); units: FLOP/s,",
        "# bytes/s, bytes, seconds. One device = one core; [colocated] = both cores in one engine.",
        'name = "cpu"',
        f'description = "{cpu_model()}, {len(m["cores"])} cores measured"',
        'kind = "cpu"',
        f'cpu_model = "{cpu_model()}"',
        f'cpu_isa = "{cpu_isa()}"',
        f'cpu_generation = "{cpu_generation()}"',
        f'measured = "{now}"',
        f"calibration_seconds = {m['seconds']:.1f}",
        "",
    ]

    def section(prefix: str, d: dict) -> None:
        gemm = d["gemm"]
        lines.extend([
            f"[{prefix}compute]  # {d['threads']} thread(s), best rate per row count; bf16: "
            f"{m['bf16_gemm']}, fp32: torch linear",
            f"bf16 = {max(gemm['bf16'].values()):.4g}",
            f"fp32 = {max(gemm['fp32'].values()):.4g}",
            f"bf16_by_rows = {_table(gemm['bf16'])}",
            f"fp32_by_rows = {_table(gemm['fp32'])}",
            *([f"# vLLM's cpu_fused_moe ({m['moe_isa']}), bench-model experts, by rows per expert",
               f"bf16_moe_by_rows = {_table(d['moe'])}"] if d["moe"] else []),
            "",
            f"[{prefix}memory]",
            f"bandwidth = {d['bandwidth']:.4g}  # streaming read of {BANDWIDTH_BUFFER_BYTES >> 20} MiB",
            f"capacity = {_memory_capacity():.4g}  # MemTotal",
            "",
            f"[{prefix}overhead]  # eager operator dispatch per layer, width 64",
            f"attention_layer = {d['overhead']['attention_layer']:.4g}",
            f"ffn_layer = {d['overhead']['ffn_layer']:.4g}",
            "",
        ])
        if "engine" in d:
            e = d["engine"]
            lines.extend([
                f"[{prefix}engine]  # {e['model']} in plain vLLM, {d['threads']} thread(s): "
                "seconds per decode token count,",
                "# one layer's attention half" + (" (every mlp an identity: an AFD attention core)"
                                                  if prefix == "" else "")
                + ", one mlp, the step's work outside the layers",
                f'model = "{e["model"]}"',
                *(f"{k} = [{', '.join(f'{v:.4g}' for v in e[k])}]"
                  for k in ("tokens", "attention_layer", "ffn_layer", "step_other")),
                "",
            ])

    section("", m["device"])
    link = m["link"]
    lines.extend([
        f"[same_host]  # the shm connector, two processes on two cores, {LINK_LAYERS} layers a step",
        f"latency = {link['latency']:.4g}  # one way: half the fitted zero-byte round trip",
        f"bandwidth = {link['bandwidth']:.4g}",
        f"step_header = {link['step_header']:.4g}  # sending a step's header, once a step",
        f"round_trip_by_bytes = {{ {', '.join(f'b{b} = {t:.4g}' for b, t in link['round_trips'].items())} }}",
        "",
        "[scale_out]  # AFD on one host: the same-host link is the only link",
        f"bandwidth = {link['bandwidth']:.4g}",
        f"latency = {link['latency']:.4g}",
        f"step_header = {link['step_header']:.4g}",
        "",
    ])
    section("colocated.", m["colocated"])
    return "\n".join(lines)


def _memory_capacity() -> float:
    try:
        for line in Path("/proc/meminfo").read_text().splitlines():
            if line.startswith("MemTotal:"):
                return float(line.split()[1]) * 1024
    except OSError:
        pass
    return 0.0


def calibrate(out: str | Path, model: str | None = None) -> Path:
    m = measure(model)
    path = Path(out)
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(profile_text(m) + "\n")
    logger.info("cpu profile written to %s (%.1f s)", path, m["seconds"])
    return path
