# SPDX-License-Identifier: Apache-2.0
# SPDX-FileCopyrightText: Copyright contributors to the vllm-afd project
"""What a layer call costs beyond the FFN's compute, through the real link and loop.

`make bench` measures the link inside vLLM on CPU engines, where each side's
compute streams tens of MB of weights through the caches between two layer
calls, so every line of Python on the link's path runs on cold caches (and
the two cores share an L3: each side's streaming evicts the other's too). On
a GPU deployment the host CPUs run the same Python, but the weights stream
through the devices' memory: the host's caches stay warm. This benchmark
separates the two regimes with everything else held fixed:

  the attention end   vllm/afd/attention/link.py's AttentionLink (the model
                      runner's object), core 0, steps of one micro-batch
  the FFN end         vllm/afd/ffn/loop.py's FFNLoop with its batcher, in
                      another process on core 1; its `mlp` is h * 1.0 (timed)
  the link            shm, spin_us 50000 (each side has its core), B tokens of
                      hidden 2048 bf16 (the bench model's width), 8 layers

  warm   nothing between layer calls but the calls themselves
  cold   before each layer call the attention side, and inside each mlp the
         FFN side, stream --stream-mb MB through the caches (a torch add_ over
         that much memory: what a CPU layer's weights do)

The attention side calls either the link (`--through exchange`:
AttentionLink.exchange with a caller-owned output) or the model's seam
(`--through model`: the RemoteFFN module a decoder layer calls, as an eager
vLLM model does: it allocates the output and calls the exchange).

Per layer call: the attention side's round trip (`exchange`, or the RemoteFFN
forward) minus the mlp's own time, and split at the mlp: from entering `exchange` to the mlp's start
(the attention side's send path, the wake-up, the FFN loop up to the mlp) and
from the mlp's end to `exchange` returning (the FFN loop after the mlp, its
reply, the wake-up, the copy out). Both processes read CLOCK_MONOTONIC
(time.perf_counter), so the stamps compare. Median, p90 and mean over
`--steps` steps (the first tenth is warm-up), without each step's first
call: there the FFN reads the step header and prepares the step's calls,
which a serving step overlaps with its embedding and first attention (its
median is reported apart).

    make bench-layer-call                        # warm and cold, B = 1 and 8
    python benchmarks/layer_call.py --device cuda --through exchange   # a GPU host
    python benchmarks/layer_call.py --steps 400 --stream-mb 32 --tokens 1

Results: benchmarks/results/layer_call.json (and a table on stdout).
"""

import argparse
import itertools
import json
import multiprocessing as mp
import os
import statistics
import sys
import time
from pathlib import Path

from link_latency import ATTENTION_CORE, FFN_CORE, free_port, pin

HIDDEN, LAYERS = 2048, 8


def link_config(port: int, num_ubatches: int = 1, spin_us: int = 50000):
    from vllm.afd.transport.config import LinkConfig

    return LinkConfig(connector="shm", port=port, timeout_s=60, num_ubatches=num_ubatches,
                      connector_extra_config={"spin_us": spin_us})


def pin_side(first: int, cores: int) -> None:
    """Pin this process to `cores` cores from `first` (one: link_latency.pin)."""
    if cores <= 1:
        pin(first)
    elif hasattr(os, "sched_setaffinity"):
        have = os.cpu_count() or 1
        os.sched_setaffinity(0, {c for c in range(first, first + cores) if c < have} or {0})


STAGED_WRITE_ENV = "AFD_LAYER_CALL_STAGED_WRITE"
STAGED_READ_ENV = "AFD_LAYER_CALL_STAGED_READ"


def use_staging_variants() -> None:
    """The staged path's variants to compare on a GPU, in this process (the
    FFN's reads the inherited variables). Benchmark-only: the link keeps its
    own unless a GPU run shows a variant pays.

    --staged-write events: a staged send of one part takes the several-part
    path (copies, then an event and a wait), as every send did before
    2026-12-05.
    --staged-read blocking: a staged receive copies out of the slot with a
    blocking copy (torch's copy and a wait for the current stream, one host
    call) instead of an asynchronous copy, a stream lookup and an event (and
    the slot's release then finds no event to settle). Every staged send
    waits for its stream, so the stream is idle when a receive comes: the
    wait is the copy's own; what it gives up is launching the next kernels
    while the copy runs."""
    from vllm.afd.transport.buffers import HostSlots

    if os.environ.get(STAGED_WRITE_ENV) == "events":
        HostSlots._write_one = lambda self, u, part, limit: self._write_parts(u, (part,), limit)
    if os.environ.get(STAGED_READ_ENV) == "blocking":
        HostSlots.read = _blocking_read


def _blocking_read(self, u, dtype, shape, out=None):
    """HostSlots.read with one blocking copy (--staged-read blocking)."""
    from vllm.afd.transport.buffers import _nbytes

    nbytes = _nbytes(dtype, shape)
    view = self._typed(u, self._slots[u], dtype, shape, nbytes)
    if out is None:
        if self.ops.is_host:
            return view
        buffer = self._device_buffers[u]
        if buffer is None:
            buffer = self._device_buffers[u] = self.ops.empty(self.slot_bytes)
        out = self._typed(("device", u), buffer, dtype, shape, nbytes)
    out.copy_(view)
    return out


def ffn_process(port: int, max_tokens: int, stream_mb: int, ready, commands,
                num_ubatches: int = 1, device: str = "cpu", cores: int = 1,
                spin_us: int = 50000) -> None:
    """The FFN end: a real FFNLoop serving LAYERS layers; its mlp's start and
    end times are sent back when asked."""
    pin_side(FFN_CORE * cores, cores)
    use_staging_variants()
    import torch

    from vllm.afd.ffn.loop import FFNLoop
    from vllm.afd.topology import FFNPlacement
    from vllm.afd.transport.device import DeviceContext

    torch.set_num_threads(1)
    junk = torch.zeros(stream_mb << 18) if stream_mb else None  # float32: MB x 2^18
    stamps: list[tuple[float, float]] = []

    def mlp(layer, h, routing):
        t0 = time.perf_counter()
        if junk is not None:
            junk.add_(1.0)
        out = h * 1.0
        stamps.append((t0, time.perf_counter()))
        return out

    loop = FFNLoop(link_config(port, num_ubatches, spin_us).replace(role="ffn"),
                   layers=list(range(LAYERS)), compute=mlp,
                   hidden_size=HIDDEN, dtype=torch.bfloat16, max_tokens=max_tokens,
                   placement=FFNPlacement(rank=0, group=[0]), warmup_sizes=[])
    loop.start(DeviceContext.current(device))
    ready.put(loop.ready.wait(30))
    while commands.get() == "stamps":
        s = loop.stats()
        ready.put({"stamps": list(stamps), "ffn_other_s": (s.step_wall_s - s.compute_s
                                                           - s.wait_s - s.send_s),
                   "layer_calls": s.layer_calls,
                   "spin": [s.spin_preemptions, s.spin_backoffs]})
        stamps.clear()
    loop.stop()


def percentiles(values: list[float]) -> dict:
    v = sorted(values)
    return {"median_us": round(statistics.median(v), 2), "p90_us": round(v[len(v) * 9 // 10], 2),
            "mean_us": round(statistics.mean(v), 2)}


def run(tokens: int, stream_mb: int, steps: int, through: str, device: str = "cpu",
        cores: int = 1, spin_us: int = 50000) -> dict:
    import torch

    from vllm.afd.attention.link import AttentionLink, ForwardPass
    from vllm.afd.transport.device import DeviceContext

    port = free_port()
    ctx = mp.get_context("spawn")
    ready, commands = ctx.Queue(), ctx.Queue()
    proc = ctx.Process(target=ffn_process, args=(port, tokens, stream_mb, ready, commands, 1,
                                                 device, cores, spin_us), daemon=True)
    proc.start()
    try:
        if ready.get(timeout=120) is not True:
            raise RuntimeError("the FFN loop did not become ready")
        context = DeviceContext.current(device)
        link = AttentionLink(link_config(port, 1, spin_us), hidden_size=HIDDEN,
                             dtype=torch.bfloat16, max_tokens=tokens, device=context)
        seams = None  # through the link's exchange
        if through == "model":  # the modules add their layers to the process's link
            from vllm.afd.adapter.attention import runner  # vLLM's: not on a machine without it
            from vllm.afd.adapter.model.remote_ffn import RemoteFFN

            runner.install_link(link)
            seams = [RemoteFFN(layer, None) for layer in range(LAYERS)]
        else:
            for layer in range(LAYERS):
                link.add_layer(layer)
        link.start()
        junk = torch.zeros(stream_mb << 18) if stream_mb else None
        h = torch.randn(tokens, HIDDEN).to(device=device, dtype=torch.bfloat16)
        out = torch.empty_like(h)
        calls: list[tuple[float, float]] = []
        with torch.inference_mode():
            for _ in range(steps):
                link.begin_step(ForwardPass(num_tokens=(tokens,), device=context))
                for layer in range(LAYERS):
                    if junk is not None:
                        junk.add_(1.0)
                    t0 = time.perf_counter()
                    if seams is None:
                        link.exchange(layer, h, out)
                    else:
                        out = seams[layer](h)
                    calls.append((t0, time.perf_counter()))
                link.end_step()
        torch.testing.assert_close(out, h, rtol=0, atol=0)
        time.sleep(0.2)  # the FFN counts its last step after its last reply
        commands.put("stamps")
        ffn = ready.get(timeout=60)
        stats = link.stats
        if through == "model":
            runner.close_link()
        else:
            link.close()
    finally:
        commands.put("stop")
        proc.join(30)
    mlp = ffn["stamps"]
    if len(mlp) != len(calls):
        raise RuntimeError(f"{len(calls)} layer calls, {len(mlp)} mlp calls")
    skip = len(calls) // 10 // LAYERS * LAYERS  # whole steps of warm-up
    every = list(zip(calls, mlp))[skip:]
    # A step's first call waits while the FFN reads the step header and
    # prepares the step's calls; in a serving step the attention side computes
    # the embedding and the first layer's attention meanwhile. Apart.
    pairs = [p for i, p in enumerate(every) if i % LAYERS]
    firsts = [p for i, p in enumerate(every) if i % LAYERS == 0]
    return {
        "tokens": tokens, "through": through, "device": device, "stream_mb": stream_mb,
        "steps": steps,
        "layer_calls": len(pairs),
        "beyond_compute": percentiles([((a1 - a0) - (m1 - m0)) * 1e6
                                       for (a0, a1), (m0, m1) in pairs]),
        "to_the_mlp": percentiles([(m0 - a0) * 1e6 for (a0, _), (m0, _) in pairs]),
        "after_the_mlp": percentiles([(a1 - m1) * 1e6 for (_, a1), (_, m1) in pairs]),
        "mlp": percentiles([(m1 - m0) * 1e6 for _, (m0, m1) in pairs]),
        "first_call_of_a_step_beyond_compute": percentiles(
            [((a1 - a0) - (m1 - m0)) * 1e6 for (a0, a1), (m0, m1) in firsts]),
        "ffn_other_us_per_call": round(ffn["ffn_other_s"] / max(ffn["layer_calls"], 1) * 1e6, 2),
        "spin_preemptions_backoffs": {"attention": [stats.spin_preemptions,
                                                    stats.spin_backoffs],
                                      "ffn": ffn["spin"]},
    }


def run_ubatched(tokens: int, m: int, steps: int, device: str = "cpu", cores: int = 1,
                 spin_us: int = 50000) -> dict:
    """Steps of m micro-batches (tokens split as the runner splits them:
    afd_vs_colocated.split_tokens), ping-ponged as the attention runner does
    (pingpong.py), through the link's exchange; warm, and nothing computed but
    the FFN's h * 1.0. Per layer call: the step's wall time beyond the FFN's mlps, over the step's
    m x LAYERS calls: what the link, the turn hand-overs and the FFN loop add
    to a micro-batched step where neither side has work to overlap them with."""
    import torch

    from afd_vs_colocated import split_tokens

    from vllm.afd.attention.link import AttentionLink, ForwardPass
    from vllm.afd.attention.pingpong import run_micro_batches
    from vllm.afd.transport.device import DeviceContext

    port = free_port()
    ctx = mp.get_context("spawn")
    ready, commands = ctx.Queue(), ctx.Queue()
    proc = ctx.Process(target=ffn_process, args=(port, tokens, 0, ready, commands, m, device,
                                                 cores, spin_us), daemon=True)
    proc.start()
    split = split_tokens(tokens, m)
    try:
        if ready.get(timeout=120) is not True:
            raise RuntimeError("the FFN loop did not become ready")
        context = DeviceContext.current(device)
        link = AttentionLink(link_config(port, m, spin_us), hidden_size=HIDDEN,
                             dtype=torch.bfloat16, max_tokens=tokens, device=context)
        for layer in range(LAYERS):
            link.add_layer(layer)
        link.start()
        hidden = [torch.randn(n, HIDDEN).to(device=device, dtype=torch.bfloat16)
                  for n in split]
        outs = [torch.empty_like(h) for h in hidden]

        def ubatch(u: int) -> None:
            for layer in range(LAYERS):
                link.exchange(layer, hidden[u], outs[u])

        walls = []
        with torch.inference_mode():
            for _ in range(steps):
                t0 = time.perf_counter()
                link.begin_step(ForwardPass(num_tokens=tuple(split), device=context))
                run_micro_batches(split, ubatch, device=link.device)
                link.end_step()
                walls.append(time.perf_counter() - t0)
        for h, out in zip(hidden, outs):
            torch.testing.assert_close(out, h, rtol=0, atol=0)
        time.sleep(0.2)  # the FFN counts its last step after its last reply
        commands.put("stamps")
        ffn = ready.get(timeout=60)
        link.close()
    finally:
        commands.put("stop")
        proc.join(30)
    calls = m * LAYERS
    mlp = [m1 - m0 for m0, m1 in ffn["stamps"]]
    if len(mlp) != calls * steps:
        raise RuntimeError(f"{calls * steps} layer calls, {len(mlp)} mlp calls")
    per_call = [(wall - sum(mlp[i * calls:(i + 1) * calls])) / calls * 1e6
                for i, wall in enumerate(walls)][steps // 10:]
    return {"tokens": tokens, "ubatches": split, "steps": steps,
            "beyond_compute_per_call": percentiles(per_call),
            "step": percentiles([w * 1e6 for w in walls[steps // 10:]])}


def staging_floor(tokens: int, reps: int = 400) -> dict:
    """What a host-staged layer call cannot avoid on a GPU, in this process
    with no link: per direction the sender's device-to-host copy into
    page-locked memory, waited for (the peer reads it next), and the
    receiver's host-to-device copy, waited for here too. A layer call crosses
    twice: its floor is twice this round trip."""
    import torch

    h = torch.randn(tokens, HIDDEN, device="cuda").to(torch.bfloat16)
    nbytes = h.numel() * h.element_size()
    host = torch.empty(nbytes, dtype=torch.uint8, pin_memory=True)
    back = torch.empty_like(h)
    event = torch.cuda.Event()
    times = []
    for _ in range(reps):
        t0 = time.perf_counter()
        host.copy_(h.view(-1).view(torch.uint8), non_blocking=True)
        event.record()
        event.synchronize()
        back.view(-1).view(torch.uint8).copy_(host, non_blocking=True)
        event.record()
        event.synchronize()
        times.append((time.perf_counter() - t0) * 1e6)
    assert torch.equal(back, h)
    return {"tokens": tokens, "bytes": nbytes,
            "d2h_h2d_round_trip": percentiles(times[reps // 10:])}


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--tokens", default="1,8", help="tokens per layer call (default %(default)s)")
    ap.add_argument("--steps", type=int, default=300, help="steps per case (8 layer calls each)")
    ap.add_argument("--stream-mb", type=int, default=32,
                    help="cold: MB each side streams per layer call (default %(default)s)")
    ap.add_argument("--through", default="exchange,model",
                    help="what the attention side calls: the link's exchange, the model's "
                         "RemoteFFN, or both (default %(default)s)")
    ap.add_argument("--ubatches", default="2,3",
                    help="micro-batched steps (warm, through the exchange) of these counts, "
                         "B = --tokens' largest, at least the count ('' for none; default "
                         "%(default)s)")
    ap.add_argument("--device", default="cpu", choices=["cpu", "cuda"],
                    help="where both ends' tensors live (cuda: the link stages them through "
                         "pinned host memory; the warm regime only; default %(default)s)")
    ap.add_argument("--cores", type=int, default=1,
                    help="cores per side (the attention side's from 0, the FFN's after "
                         "them; a CUDA process has driver threads too; default %(default)s)")
    ap.add_argument("--spin-us", type=int, default=50000,
                    help="the shm link's spin before it sleeps, both ends (default "
                         "%(default)s: each side has its core)")
    ap.add_argument("--staged-write", default="one-copy", choices=["one-copy", "events"],
                    help="cuda: how a staged send copies into its slot: one blocking copy "
                         "(the link's), or as before 2026-12-05 (slice, byte views, an "
                         "asynchronous copy, an event and a wait), to compare on a GPU "
                         "(default %(default)s)")
    ap.add_argument("--staged-read", default="async", choices=["async", "blocking"],
                    help="cuda: how a staged receive copies out of its slot: asynchronously "
                         "with an event (the link's), or one blocking copy, to compare on a "
                         "GPU (default %(default)s)")
    ap.add_argument("--out", type=Path,
                    default=Path(__file__).parent / "results" / "layer_call.json")
    args = ap.parse_args(argv)
    if (os.cpu_count() or 1) < 2:
        print("[bench-layer-call] needs two cores", file=sys.stderr)
        return 2
    pin_side(ATTENTION_CORE, args.cores)
    # The FFN processes inherit them.
    os.environ[STAGED_WRITE_ENV], os.environ[STAGED_READ_ENV] = args.staged_write, args.staged_read
    use_staging_variants()
    import torch

    from vllm.afd.deploy.planner.calibrate import cpu_generation, cpu_isa, cpu_model

    torch.set_num_threads(1)
    results = {"benchmark": "layer_call", "machine": {
        "cpu_model": cpu_model(), "cpu_isa": cpu_isa(), "cpu_generation": cpu_generation(),
        "cpu_count": os.cpu_count(),
        "load_average_1m": os.getloadavg()[0],
        "gpu": torch.cuda.get_device_name() if args.device == "cuda" else None},
        "settings": {"hidden": HIDDEN, "layers": LAYERS, "dtype": "bfloat16",
                     "connector": "shm", "spin_us": args.spin_us, "steps": args.steps,
                     "device": args.device, "cores_per_side": args.cores,
                     "staged_write": args.staged_write, "staged_read": args.staged_read,
                     "cores": {"attention": ATTENTION_CORE, "ffn": FFN_CORE}},
        "cases": []}
    print("per layer call, us (median / p90 / mean): beyond the mlp's compute, split at it")
    throughs = args.through.split(",")
    if not set(throughs) <= {"exchange", "model"}:
        ap.error(f"--through: exchange and/or model, not {args.through!r}")
    if args.device == "cuda":
        results["staging_floor"] = []
        print("the staging floor, us (median / p90 / mean): device to pinned host and back, "
              "each waited for (a layer call crosses twice)")
        for tokens in sorted({int(t) for t in args.tokens.split(",")}):
            floor = staging_floor(tokens)
            results["staging_floor"].append(floor)
            f = floor["d2h_h2d_round_trip"]
            print(f"  B={tokens:<3} {floor['bytes']:7d} B  {f['median_us']:6.1f} / "
                  f"{f['p90_us']:6.1f} / {f['mean_us']:6.1f}", flush=True)
    regimes = (("warm", 0),) if args.device == "cuda" else (("warm", 0), ("cold", args.stream_mb))
    for tokens, through, (regime, mb) in itertools.product(
            [int(t) for t in args.tokens.split(",")], throughs, regimes):
        case = {"regime": regime, **run(tokens, mb, args.steps, through, args.device,
                                        args.cores, args.spin_us)}
        results["cases"].append(case)

        def cell(key):
            p = case[key]
            return f"{p['median_us']:6.1f} / {p['p90_us']:6.1f} / {p['mean_us']:6.1f}"

        print(f"  B={tokens:<3} {through:8} {regime:4} ({mb:2d} MB)  beyond compute "
              f"{cell('beyond_compute')}   to the mlp {cell('to_the_mlp')}   "
              f"after it {cell('after_the_mlp')}"
              f"   (mlp median {case['mlp']['median_us']:.0f}; a step's first call "
              f"{case['first_call_of_a_step_beyond_compute']['median_us']:.0f})", flush=True)
    ubatches = [int(m) for m in args.ubatches.split(",") if m]
    if ubatches:
        results["ubatched"] = []
        print("micro-batched steps, warm, per layer call, us (median / p90 / mean): the step "
              "beyond the FFN's mlps")
    for m in ubatches:
        tokens = max(m, *(int(t) for t in args.tokens.split(",")))
        case = run_ubatched(tokens, m, args.steps, args.device, args.cores, args.spin_us)
        results["ubatched"].append(case)
        p = case["beyond_compute_per_call"]
        print(f"  B={tokens:<3} m={m} {case['ubatches']}  beyond compute {p['median_us']:6.1f} / "
              f"{p['p90_us']:6.1f} / {p['mean_us']:6.1f}   (step median "
              f"{case['step']['median_us']:.0f})", flush=True)
    args.out.parent.mkdir(parents=True, exist_ok=True)
    args.out.write_text(json.dumps(results, indent=1))
    print(f"[bench-layer-call] wrote {args.out}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
