# SPDX-License-Identifier: Apache-2.0
# SPDX-FileCopyrightText: Copyright contributors to the vllm-afd project
"""Round trip of one layer call through a real connector, by payload size.

The attention side (this process, core 0) sends one micro-batch's hidden
states and waits for the answer; an echo FFN (another process, core 1) sends
every hidden state straight back: the link's own cost, no compute. Twice: as
the attention link makes a layer call of a one-micro-batch step (`round_trip`:
the connector's prepared calls: shm's lane, tcp's socket calls) and through
send_hidden + recv_output (`round_trip_general`: micro-batched steps); the
echo answers as the FFN loop does (take_call, reply_call). Each size
runs `--iters` round trips after a warm-up; median, p10 and p99 are reported.
Then the idle cost: the echo FFN waits for a step that does not come for
`--idle-s` seconds, and the CPU time it burns meanwhile is measured (a link
that spins while waiting must stop spinning when the peer goes quiet).

    make bench-link                          # shm and tcp, 1 KiB to 1 MiB
    python benchmarks/link_latency.py --connectors shm --iters 500

Results: benchmarks/results/link_latency.json (and a table on stdout).
"""

import argparse
import json
import multiprocessing as mp
import os
import socket
import statistics
import sys
import time
from pathlib import Path

HIDDEN = 512  # bf16: 1 KiB per token
TOKENS = (1, 4, 16, 64, 256, 1024)  # 1 KiB ... 1 MiB per direction
LAYERS = 50  # layer calls per step, as a model's: the step header is once per step
# --transfer-dtype: AFDConfig.transfer_dtype (fp8-to-ffn: DeepSeek-V3's dispatch
# in fp8, its combine in bf16)
TRANSFERS = {"auto": "auto", "fp8": "fp8",
             "fp8-to-ffn": {"to_ffn": "fp8", "to_attention": "auto"}}
FLOOR_EVERY = 4 * LAYERS  # shm: connector round trips between two samples of the copy floor
ATTENTION_CORE, FFN_CORE = 0, 1


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def pin(core: int) -> None:
    """Pin this process to core (where the machine has it): not only where the
    current affinity allows, since a spawned child inherits its parent's."""
    if hasattr(os, "sched_setaffinity") and core < (os.cpu_count() or 1):
        os.sched_setaffinity(0, {core})


def config(role: str, connector: str, port: int, extra: dict, transfer: str = "auto"):
    from vllm.afd.adapter.config import AFDConfig

    return AFDConfig(role=role, connector=connector, port=port, timeout_s=60,
                     connector_extra_config=extra, transfer_dtype=TRANSFERS[transfer])


def echo_ffn(connector: str, port: int, extra: dict, transfer: str, idle_s: float,
             report) -> None:
    """The FFN end: echo every layer call; after the attention side says it
    is done (a step of zero layers), time the idle wait for the next step."""
    import torch

    from vllm.afd.transport.connectors import create_connector

    pin(FFN_CORE)
    torch.set_num_threads(1)
    ffn = create_connector(config("ffn", connector, port, extra, transfer), hidden_size=HIDDEN,
                           dtype=torch.bfloat16, max_tokens=max(TOKENS))
    ffn.accept()
    while True:
        step = ffn.recv_step(0)
        if step.is_goodbye or step.is_shutdown:
            break
        if step.num_tokens == [0]:  # the idle probe: measure the wait for the next step
            cpu0, t0 = time.process_time(), time.monotonic()
            report.send("idle")
            step = ffn.recv_step(0)
            report.send({"idle_wall_s": time.monotonic() - t0,
                         "idle_cpu_s": time.process_time() - cpu0})
            if step.is_goodbye or step.is_shutdown:
                break
            continue
        # As the FFN loop does: each call's hidden states taken and its output
        # replied through the step channel (prepared calls on shm and tcp);
        # fp8 hidden states come packed and are unpacked, as the batcher does.
        for layer in range(LAYERS):
            h = ffn.take_call(0, layer, 0)
            if type(h) is not torch.Tensor:
                h = h.tensor()
            ffn.reply_call(0, layer, 0, h)
    ffn.close()


def layer_call(attn, layer: int, h, out, prepared: bool) -> None:
    """One layer call: through the step channel as the attention link makes it
    (send_call, recv_call: the connector's C calls where it has them), or,
    prepared False, through the general protocol calls the channel falls
    back on (send_hidden + recv_output)."""
    if prepared:
        attn.send_call(layer, 0, h)
        attn.recv_call(layer, 0, out)
        return
    attn.send_hidden(layer, 0, h)
    attn.recv_output(layer, 0, out=out)


def copy_floor_us(nbytes: int, calls: int, echo_spin_s: float
                  ) -> tuple[float, float] | None:
    """Medians of `calls` round trips of the copy floor (csrc/cpu/copy_floor.cpp):
    the connector's three copies and two hand-overs between threads on the two
    cores, nothing else; the copies into slots with cached stores, then with
    streamed (non-temporal) ones, the two ways the connector's copier chooses
    between (csrc/cpu/slot_copy.h). First waits out the echo FFN's spin, so that
    its thread has the FFN core alone. None where it cannot run (one core, no
    pinning)."""
    from vllm.afd import _C

    time.sleep(echo_spin_s + 0.002)
    try:
        return tuple(statistics.median(_C.copy_floor(nbytes, calls + calls // 10,
                                                     ATTENTION_CORE, FFN_CORE, streamed)) / 1e3
                     for streamed in (False, True))
    except (RuntimeError, ValueError):
        return None


def measure(connector: str, extra: dict, iters: int, idle_s: float,
            transfer: str = "auto") -> dict:
    """Round trips by payload size, both paths; with shm, the prepared path is
    interleaved with samples of the copy floor on the same cores: a VM's two
    vCPUs move between sibling threads, cores of one L3 and farther apart
    within seconds (the floor at 64 KiB: 3.5, ~20 or ~75 us on one VM), so
    only a floor taken minutes, not hours, apart from the connector says what
    the connector itself costs."""
    import torch

    from vllm.afd.transport.connectors import create_connector
    from vllm.afd.transport.wire import StepHeader

    port = free_port()
    ctx = mp.get_context("spawn")
    parent, child = ctx.Pipe()
    proc = ctx.Process(target=echo_ffn, args=(connector, port, extra, transfer, idle_s, child),
                       daemon=True)
    proc.start()
    attn = create_connector(config("attention", connector, port, extra, transfer),
                            hidden_size=HIDDEN,
                            dtype=torch.bfloat16, max_tokens=max(TOKENS))
    attn.connect()
    paths = {"round_trip": True, "round_trip_general": False}
    results, step = {}, 1
    try:
        for key, prepared in paths.items():
            sizes = results[key] = {}
            for tokens in TOKENS:
                h = torch.randn(tokens, HIDDEN).to(torch.bfloat16)
                out = torch.empty_like(h)
                # chunks: ((cached, streamed) floor us, first index of its connector chunk)
                times, chunks = [], []
                sample_floor = connector == "shm" and prepared and (os.cpu_count() or 1) > 1
                i = 0
                # Whole steps until `iters` calls are timed: not the warm-up, not
                # a step's first call (it waits while the FFN reads the step
                # header), not the step after a floor sample (the 5-15 calls
                # after one took ~1 ms each on the VM: the echo's wake-up from
                # its long sleep, and the hypervisor after two spinning vCPUs).
                while len(times) < iters or i % LAYERS:
                    layer = i % LAYERS
                    if sample_floor and i % FLOOR_EVERY == 0:
                        floor = copy_floor_us(h.nbytes, FLOOR_EVERY,
                                              extra.get("spin_us", 0) / 1e6)
                        if floor is not None:
                            chunks.append((floor, len(times)))
                    if layer == 0:
                        attn.send_step(StepHeader(step_id=step, num_tokens=[tokens]))
                        step += 1
                    t0 = time.perf_counter()
                    layer_call(attn, layer, h, out, prepared)
                    dt = time.perf_counter() - t0
                    settling = sample_floor and i % FLOOR_EVERY < LAYERS
                    if i >= iters // 10 and layer and not settling and len(times) < iters:
                        times.append(dt)
                    i += 1
                row = sizes[str(tokens * HIDDEN * 2)] = {"tokens": tokens,
                                                        **floor_columns(times, chunks)}
                times.sort()
                row.update({
                    "median_us": statistics.median(times) * 1e6,
                    "p10_us": times[len(times) // 10] * 1e6,
                    "p99_us": times[min(len(times) - 1, int(len(times) * 0.99))] * 1e6})
        attn.send_step(StepHeader(step_id=step, num_tokens=[0]))
        assert parent.recv() == "idle"
        time.sleep(idle_s)
        attn.send_step(StepHeader(step_id=step + 1, num_tokens=[0]))
        idle = parent.recv()
        link = getattr(attn, "_streams", {}).get(0)
        if hasattr(link, "copy_stats"):  # shm: how the attention side's payloads were copied
            results["attention_copies"] = link.copy_stats
    finally:
        attn.close()
        proc.join(30)
    idle["idle_cpu_percent"] = 100 * idle["idle_cpu_s"] / max(idle["idle_wall_s"], 1e-9)
    if connector == "shm" and not attn.fast_calls:
        raise RuntimeError("the shm connector's fast path was never taken")
    if connector == "tcp" and not attn.fast_calls:
        raise RuntimeError("the tcp connector's prepared calls were never taken")
    return {**results, "idle": idle}


def floor_columns(times: list[float],
                  chunks: list[tuple[tuple[float, float], int]]) -> dict:
    """The copy floor's median over the samples (the better of its cached and
    streamed copies in each sample: the floor of a connector that chooses
    between them), and the connector's time over it: the median, over the
    chunks, of (the chunk's median round trip - the floor sampled right before
    it), so a vCPU move between chunks cancels."""
    if not chunks:
        return {}
    over = []
    for k, (floors, start) in enumerate(chunks):
        end = chunks[k + 1][1] if k + 1 < len(chunks) else len(times)
        if end > start:
            over.append(statistics.median(times[start:end]) * 1e6 - min(floors))
    return {"floor_us": statistics.median(min(f) for f, _ in chunks),
            "floor_cached_us": statistics.median(f[0] for f, _ in chunks),
            "floor_streamed_us": statistics.median(f[1] for f, _ in chunks),
            "floor_samples_us": [[round(x, 2) for x in f] for f, _ in chunks],
            "over_floor_us": statistics.median(over) if over else None}


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--connectors", default="shm,tcp")
    ap.add_argument("--iters", type=int, default=2000)
    ap.add_argument("--idle-s", type=float, default=2.0)
    ap.add_argument("--extra", default='{"spin_us": 5000}',
                    help="connector_extra_config (JSON) for shm, and its spin_us for tcp "
                         "(default: %(default)s, the setting for cores of their own)")
    ap.add_argument("--transfer-dtype", choices=sorted(TRANSFERS), default="auto",
                    help="AFDConfig.transfer_dtype of both ends (fp8-to-ffn: fp8 to the "
                         "FFN, exact back)")
    ap.add_argument("--out", type=Path,
                    default=Path(__file__).parent / "results" / "link_latency.json")
    args = ap.parse_args(argv)
    pin(ATTENTION_CORE)
    import torch

    from vllm.afd.deploy.planner.calibrate import cpu_generation, cpu_isa, cpu_model

    torch.set_num_threads(1)
    results = {"benchmark": "link_latency", "machine": {
        "cpu_model": cpu_model(), "cpu_isa": cpu_isa(), "cpu_generation": cpu_generation(),
        "cpu_count": os.cpu_count(),
        "load_average_1m": os.getloadavg()[0]},
        "settings": {"hidden": HIDDEN, "dtype": "bfloat16", "iters": args.iters,
                     "transfer_dtype": args.transfer_dtype,
                     "cores": {"attention": ATTENTION_CORE, "ffn": FFN_CORE}},
        "connectors": {}}
    for name in args.connectors.split(","):
        extra = json.loads(args.extra)
        if name != "shm":  # tcp takes the spin only (its socket waits spin)
            extra = {k: v for k, v in extra.items() if k == "spin_us"}
        res = results["connectors"][name] = measure(name, extra, args.iters, args.idle_s,
                                                    args.transfer_dtype)
        res["connector_extra_config"] = extra
        print(f"{name}: round trip (us) by payload each way; idle CPU "
              f"{res['idle']['idle_cpu_percent']:.1f} % of a core over "
              f"{res['idle']['idle_wall_s']:.1f} s")
        for nbytes, r in res["round_trip"].items():
            g = res["round_trip_general"][nbytes]
            floor = (f"   copy floor {r['floor_us']:7.1f} (cached {r['floor_cached_us']:.1f}, "
                     f"streamed {r['floor_streamed_us']:.1f}; over it "
                     f"{r['over_floor_us']:6.1f})"
                     if r.get("over_floor_us") is not None else "")
            print(f"  {int(nbytes) >> 10:6d} KiB  median {r['median_us']:8.1f}  "
                  f"p10 {r['p10_us']:8.1f}  p99 {r['p99_us']:8.1f}   send_hidden + "
                  f"recv_output: median {g['median_us']:8.1f}{floor}")
    args.out.parent.mkdir(parents=True, exist_ok=True)
    args.out.write_text(json.dumps(results, indent=1))
    print(f"[bench-link] wrote {args.out}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
