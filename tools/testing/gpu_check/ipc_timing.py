# SPDX-License-Identifier: Apache-2.0
# SPDX-FileCopyrightText: Copyright contributors to the vllm-afd project
"""Timing the device-resident exchange (the `ipc` check's figures): a layer
call's round trip, the FFN echoing what it took (no mlp), per call, in us:

    2proc   the FFN in its own process (on one GPU without MPS: two contexts
            time-sliced, what a one-GPU deployment pays)
    1proc   both sides in this process, the FFN on a second stream (CUDA) or
            thread (CPU): the exchange's own cost, no context switch
    floor   (CUDA) two device copies of the call's bytes per call, captured
            and timed the same way: the device floor without flags

On CUDA each side's calls of a step are one captured graph, replayed per step
(the GPU's timeline: no host launch inside), timed with CUDA events around the
attention side's replay; the FFN side's replay is launched first. On the CPU
the calls run on the threads and the clock times them. Each figure is the
median over the steps after WARMUP, divided by the step's calls. NEVER RUN ON
A GPU YET.
"""

import statistics
import threading
import time
from dataclasses import dataclass

import torch

from vllm.afd.transport.ipc.calls import Exchange
from vllm.afd.transport.ipc.layout import Layout, Region
from vllm.afd.transport.ipc.memory import Control, OwnRegion
from vllm.afd.transport.ipc.op_stream import OpStream

WARMUP = 3


@dataclass(frozen=True)
class EchoCalls:
    """One step's calls of an echo: `layers` calls of rows x hidden (a
    header the FFN process gets, so it pickles)."""

    rows: int
    hidden: int
    dtype: str
    layers: int

    @property
    def torch_dtype(self) -> torch.dtype:
        return getattr(torch, self.dtype)

    def serve(self, exchange: Exchange) -> None:
        """The FFN side: each call taken, then posted back as it came."""
        for layer in range(self.layers):
            h = exchange.take(0, layer, self.torch_dtype, (self.rows, self.hidden))
            exchange.post(0, layer, h)

    def call(self, exchange: Exchange, y: torch.Tensor, out: torch.Tensor) -> None:
        """The attention side: each call posted, its answer taken into out."""
        for layer in range(self.layers):
            exchange.post(0, layer, y)
            exchange.take_into(0, layer, out)


class Replayer:
    """fn run as it is (CPU), or captured once per key and replayed (CUDA)."""

    def __init__(self, device: torch.device) -> None:
        self.device, self.graphs = device, {}

    def run(self, key, fn) -> None:
        if self.device.type != "cuda":
            fn()
            return
        graph = self.graphs.get(key)
        if graph is None:
            graph = self.graphs[key] = torch.cuda.CUDAGraph()
            with torch.cuda.graph(graph):
                fn()
        graph.replay()


def report(peer, device: torch.device) -> str:
    cuda = device.type == "cuda"
    steps = 40 if cuda else 12
    shapes = ([(h, r) for h in (2048, 7168) for r in (1, 8, 64)] if cuda
              else [(2048, r) for r in (1, 64)])
    figures = []
    for hidden, rows in shapes:
        calls = EchoCalls(rows, hidden, "bfloat16", layers=20)
        row = [f"2proc {two_processes(peer, device, calls, steps):.1f}",
               f"1proc {in_process(device, calls, steps):.1f}"]
        if cuda:
            row.append(f"floor {floor(device, calls, steps):.1f}")
        figures.append(f"h{hidden} B={rows}: " + " ".join(row))
    return (f"timing (bf16, an echo's round trip per layer call, us, median of {steps} steps "
            f"of 20 calls, {'graphs replayed' if cuda else 'the CPU as the device'}): "
            + "; ".join(figures))


def _median_per_call(times: list[float], calls: EchoCalls) -> float:
    return statistics.median(times[WARMUP:]) / calls.layers * 1e6


class _Clock:
    """Seconds a block took: CUDA events on the current stream, or the clock."""

    def __init__(self, device: torch.device) -> None:
        self.cuda = device.type == "cuda"

    def __enter__(self) -> "_Clock":
        if self.cuda:
            self.start, self.end = (torch.cuda.Event(enable_timing=True) for _ in range(2))
            self.start.record()
        else:
            self.t0 = time.perf_counter()
        return self

    def __exit__(self, *exc) -> None:
        if self.cuda:
            self.end.record()

    def seconds(self) -> float:
        if self.cuda:
            self.end.synchronize()
            return self.start.elapsed_time(self.end) / 1e3
        return time.perf_counter() - self.t0


def two_processes(peer, device: torch.device, calls: EchoCalls, steps: int) -> float:
    ex, replayer, times = peer.exchange, Replayer(device), []
    y = torch.randn(calls.rows, calls.hidden, device=device).to(calls.torch_dtype)
    out = torch.empty_like(y)
    for step in range(steps):
        peer.header(10_000 + step, calls)
        assert peer.outcome() == "armed"
        ex.begin_step(10_000 + step)
        with _Clock(device) as clock:
            replayer.run(calls, lambda: calls.call(ex, y, out))
        times.append(clock.seconds())
        assert ex.outcome() is None and peer.outcome() is None
    assert torch.equal(out, y)
    return _median_per_call(times, calls)


def in_process(device: torch.device, calls: EchoCalls, steps: int) -> float:
    layout = Layout(1, calls.rows * calls.hidden * calls.torch_dtype.itemsize)
    owned = [OwnRegion(device, layout.total) for _ in range(2)]
    for region in owned:
        region.unlink()
    regions = [Region(r.memory, layout) for r in owned]
    sides = [Exchange(role, OpStream(device), Control.on(device), regions[i], regions[1 - i],
                      30.0) for i, role in enumerate(("attention", "ffn"))]
    attn, ffn = sides
    for side in sides:
        side.set_mode(True)
    y = torch.randn(calls.rows, calls.hidden, device=device).to(calls.torch_dtype)
    out = torch.empty_like(y)
    attn_replayer, ffn_replayer = Replayer(device), Replayer(device)
    side_stream = torch.cuda.Stream(device) if device.type == "cuda" else None
    times = []
    for step in range(steps):
        if side_stream is not None:
            with torch.cuda.stream(side_stream):
                ffn.begin_step(step)
                ffn_replayer.run(calls, lambda: calls.serve(ffn))
            server = None
        else:
            ffn.begin_step(step)
            server = threading.Thread(target=calls.serve, args=(ffn,))
            server.start()
        attn.begin_step(step)
        with _Clock(device) as clock:
            attn_replayer.run(calls, lambda: calls.call(attn, y, out))
        times.append(clock.seconds())
        if server is not None:
            server.join()
        if side_stream is not None:
            side_stream.synchronize()
        assert attn.outcome() is None and ffn.outcome() is None
    assert torch.equal(out, y)
    return _median_per_call(times, calls)


def floor(device: torch.device, calls: EchoCalls, steps: int) -> float:
    y = torch.randn(calls.rows, calls.hidden, device=device).to(calls.torch_dtype)
    there, back = torch.empty_like(y), torch.empty_like(y)

    def copies() -> None:
        for _ in range(calls.layers):
            there.copy_(y)
            back.copy_(there)

    replayer, times = Replayer(device), []
    for _ in range(steps):
        with _Clock(device) as clock:
            replayer.run(calls, copies)
        times.append(clock.seconds())
    return _median_per_call(times, calls)
