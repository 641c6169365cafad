# SPDX-License-Identifier: Apache-2.0
# SPDX-FileCopyrightText: Copyright contributors to the vllm-afd project
"""The device-resident exchange (vllm/afd/transport/ipc/) between two processes
on one device: the reference decoder split the AFD way, each layer's mlp input
posted into the FFN process's region and its output posted back into this
process's, every wait on local memory, the step word checked on the device.

The FFN process gets one header per step on a pipe (the step id, the
micro-batches' rows, and what to do wrong) and enqueues the whole step; the
attention side enqueues its own and reads the outcome once. On the CPU the
kernels of csrc/cpu/ipc.cpp run on the calling threads over shared-memory
regions; on CUDA those of csrc/cuda/ipc.cu (never run on a GPU before this
check), regions mapped through CUDA IPC handles.

    cases    m = 1..4 equal to the model run whole; a step id past 2**32
    stale    negative control: the FFN posts late, and a read of the slot
             without the wait sees stale data (the wait is what makes it right)
    killed   the FFN process dies mid-step: the supervisor's release ends the
             step long before its deadline, the outcome says why
    graph    (CUDA) the attention step captured as one CUDA graph, exchanges
             inside, replayed with new tokens and step ids: equal to eager
    timing   a layer call's round trip (an echo, no mlp): ipc_timing.py
"""

import multiprocessing
import multiprocessing.connection
import os
import threading
import time

import torch

from model import TinyMoEDecoder, rms_norm  # noqa: I001 (tools/testing/gpu_check on sys.path)
import ipc_timing
from ipc_timing import EchoCalls, Replayer
from roles import MAX_TOKENS, build_model, sample_batch
from vllm.afd.transport.ipc.calls import Exchange
from vllm.afd.transport.ipc.layout import Layout, Region
from vllm.afd.transport.ipc.memory import Control, OwnRegion, open_peer
from vllm.afd.transport.ipc.op_stream import OpStream

UBATCHES = 4
TIMEOUT_S = 30.0
DTYPE = torch.float32
# The regions fit the timing's largest call too (ipc_timing.py: 64 tokens of
# hidden 7168 in bf16).
SLOT_BYTES = 64 * 7168 * 2


def _layout(hidden: int) -> Layout:
    return Layout(UBATCHES, max(SLOT_BYTES, MAX_TOKENS * hidden * DTYPE.itemsize))


def _connect(role: str, device: torch.device, conn, hidden: int) -> Exchange:
    """Regions exchanged by handle over conn (the handshake's part), then
    unlinked: a process killed from here on leaves no file behind."""
    lay = _layout(hidden)
    own = OwnRegion(device, lay.total)
    conn.send(own.handle)
    peer = open_peer(device, conn.recv(), lay.total)
    conn.send("mapped")
    assert conn.recv() == "mapped"
    own.unlink()
    exchange = Exchange(role, OpStream(device), Control.on(device), Region(own.memory, lay),
                        Region(peer, lay), TIMEOUT_S)
    exchange.set_mode(True)
    return exchange


def _delay(device: torch.device, seconds: float) -> None:
    """The producer is late: on the stream (CUDA), or the thread (CPU)."""
    if device.type == "cuda":
        torch.cuda._sleep(int(seconds * 1.5e9))  # cycles, ~1.5 GHz
    else:
        time.sleep(seconds)


def _ffn_main(device: str, threads: int, conn) -> None:
    torch.set_num_threads(threads)
    dev = torch.device(device)
    model = build_model(device, DTYPE)
    exchange = _connect("ffn", dev, conn, model.hidden)
    echoes = Replayer(dev)
    with torch.inference_mode():
        while True:
            header = conn.recv()
            if header is None:
                return
            step, rows, layers, die_at, late_s = header[:5]
            if isinstance(rows, EchoCalls):  # ipc_timing.py: an echo, replayed
                # "armed": the FFN's side of the step is launched (CUDA), or
                # about to wait (the CPU, where serving blocks).
                exchange.begin_step(step)
                if dev.type != "cuda":
                    conn.send("armed")
                echoes.run(rows, lambda calls=rows: calls.serve(exchange))
                if dev.type == "cuda":
                    conn.send("armed")
                conn.send(exchange.outcome())
                continue
            exchange.begin_step(step)
            outs = [torch.empty(r, model.hidden, dtype=DTYPE, device=dev) for r in rows]
            for layer in range(layers):
                if layer == die_at:
                    if dev.type == "cuda":
                        torch.cuda.synchronize()  # what was posted has landed
                    os._exit(3)
                for u, r in enumerate(rows):
                    h = exchange.take(u, layer, DTYPE, (r, model.hidden))
                    if late_s:
                        _delay(dev, late_s)
                    outs[u].copy_(h if late_s else model.layers[layer].mlp(h))
                    exchange.post(u, layer, outs[u])
            conn.send(exchange.outcome())


class FFNPeer:
    def __init__(self, device: str, hidden: int) -> None:
        ctx = multiprocessing.get_context("spawn")
        self.conn, child = ctx.Pipe()
        self.proc = ctx.Process(target=_ffn_main, daemon=True,
                                args=(device, torch.get_num_threads(), child))
        self.proc.start()
        self.exchange = _connect("attention", torch.device(device), self.conn, hidden)

    def header(self, step, rows, layers=0, die_at=-1, late_s=0.0) -> None:
        """rows: each micro-batch's (the model's mlps; late_s > 0: an echo, late),
        or EchoCalls (ipc_timing.py)."""
        self.conn.send((step, rows, layers, die_at, late_s))

    def outcome(self, timeout: float = 60.0):
        if not self.conn.poll(timeout):
            raise TimeoutError("the FFN process sent no outcome")
        return self.conn.recv()

    def close(self) -> None:
        try:
            self.conn.send(None)
        except OSError:
            pass
        self.proc.join(10)
        if self.proc.is_alive():
            self.proc.kill()


def attention_step(exchange: Exchange, model: TinyMoEDecoder, tokens: torch.Tensor,
                   ubatches: list[list[int]]) -> torch.Tensor:
    """The model's logits, every mlp through the exchange: per layer all
    micro-batches' calls posted, then their replies taken (the begun step's)."""
    xs, start = [], 0
    for seq_lens in ubatches:
        n = sum(seq_lens)
        xs.append(model.embed(tokens[start:start + n]))
        start += n
    for i, layer in enumerate(model.layers):
        parts = [layer.attention_part(x, seq_lens) for x, seq_lens in zip(xs, ubatches)]
        for u, (_, y) in enumerate(parts):
            exchange.post(u, i, y.contiguous())
        for u, (h, y) in enumerate(parts):
            out = torch.empty_like(y)
            exchange.take_into(u, i, out)
            xs[u] = h + out
    return torch.cat([model.lm_head(rms_norm(x, model.norm)) for x in xs])


def check_ipc(args) -> str:
    device = torch.device(args.device)
    model = build_model(args.device, DTYPE)
    peer = FFNPeer(args.device, model.hidden)
    results = []
    try:
        with torch.inference_mode():
            results.append(_cases(peer, model, device))
            results.append(_stale(peer, model, device))
            if device.type == "cuda":
                results.append(_graph(peer, model, device))
            results.append(ipc_timing.report(peer, device))
            results.append(_killed(peer, model, device))
    finally:
        peer.close()
    return "; ".join(results)


def _rows(ubatches):
    return [sum(s) for s in ubatches]


def _cases(peer: FFNPeer, model, device) -> str:
    layers, done = len(model.layers), []
    for m, step in ((1, 1), (2, 2), (3, 3), (4, 2**32 + 4)):
        tokens, ubatches = sample_batch(m, device.type, seed=m)
        peer.header(step, _rows(ubatches), layers)
        peer.exchange.begin_step(step)
        got = attention_step(peer.exchange, model, tokens, ubatches)
        attn, ffn = peer.exchange.outcome(), peer.outcome()
        assert attn is None and ffn is None, (m, attn, ffn)
        want = model.reference(tokens, ubatches)
        if not torch.equal(got, want):
            raise AssertionError(f"m={m}: max |diff| {(got - want).abs().max():.3g}")
        done.append(f"m={m}")
    return f"cases {' '.join(done)} equal to the model (step id past 2**32 too)"


def _stale(peer: FFNPeer, model, device) -> str:
    """One layer call whose reply the FFN posts late: the slot read without the
    wait is stale, the take's is the answer."""
    ex, hidden = peer.exchange, model.hidden
    y = torch.randn(4, hidden, dtype=DTYPE, device=device)
    peer.header(99, [4], 1, late_s=0.5)
    ex.begin_step(99)
    ex.post(0, 0, y)
    unwaited = ex.local.payload(0, DTYPE, (4, hidden)).clone()
    waited = ex.take_into(0, 0, torch.empty_like(y))
    assert ex.outcome() is None and peer.outcome() is None
    assert torch.equal(waited, y), "the take's payload is not the posted one"
    if torch.equal(unwaited, y):
        raise AssertionError("negative control: a read without the wait saw the late reply "
                             "(the check could not tell a missing wait)")
    return "stale: a read without the wait is stale, the take's is the answer"


def _graph(peer: FFNPeer, model, device) -> str:
    """The attention step captured once (exchanges inside; the mode IDLE while
    capturing, so nothing reaches the FFN), replayed for new tokens and steps."""
    ex, layers = peer.exchange, len(model.layers)
    tokens, ubatches = sample_batch(2, device.type, seed=5)
    static_tokens = tokens.clone()
    ex.set_mode(False)
    g = torch.cuda.CUDAGraph()
    with torch.cuda.graph(g):
        static_out = attention_step(ex, model, static_tokens, ubatches)
    ex.set_mode(True)
    for step in (200, 201, 2**32 + 202):
        fresh = torch.randint(0, 96, tokens.shape, device=device)
        static_tokens.copy_(fresh)
        peer.header(step, _rows(ubatches), layers)
        ex.begin_step(step)
        g.replay()
        attn, ffn = ex.outcome(), peer.outcome()
        assert attn is None and ffn is None, (step, attn, ffn)
        want = model.reference(fresh, ubatches)
        if not torch.equal(static_out, want):
            raise AssertionError(f"graph step {step}: max |diff| "
                                 f"{(static_out - want).abs().max():.3g}")
    return "graph: a captured step replayed 3x with new tokens and step ids equals eager"


def _killed(peer: FFNPeer, model, device) -> str:
    """The FFN dies before layer 1; a supervisor thread that sees its process
    end releases the step: it ends long before the 30 s deadline."""
    ex = peer.exchange
    tokens, ubatches = sample_batch(1, device.type, seed=9)

    def supervise():
        multiprocessing.connection.wait([peer.proc.sentinel], timeout=TIMEOUT_S)
        ex.release()

    supervisor = threading.Thread(target=supervise, daemon=True)
    supervisor.start()
    peer.header(300, _rows(ubatches), len(model.layers), die_at=1)
    ex.begin_step(300)
    t0 = time.monotonic()
    attention_step(ex, model, tokens, ubatches)
    outcome = ex.outcome()
    seconds = time.monotonic() - t0
    assert outcome is not None and "released" in outcome, outcome
    assert seconds < TIMEOUT_S / 3, f"the step ended after {seconds:.1f}s"
    return f"killed: the FFN died mid-step, the step was released after {seconds:.2f}s"
