# SPDX-License-Identifier: Apache-2.0
# SPDX-FileCopyrightText: Copyright contributors to the vllm-afd project
"""The GPU check: the AFD data plane on a device, without vLLM.

    python tools/testing/gpu_check [--device cuda|cpu] [--out report.json]
        [--only NAME[,NAME]] [--skip NAME[,NAME]]

One command for a machine that has torch (CUDA torch and nvcc for the GPU
parts) and neither vLLM nor a network: run it from a checkout whose vllm/
holds only vllm/afd (git tracks nothing else there), with msgspec installed.
`make test` runs the same script with --device cpu (tests/afd/test_harness.py),
so only the device-specific lines go unexercised without a GPU.

On the project's lent H200 (tools: device `run`), from the repository root, with
msgspec carried as a wheel for that machine's Python 3.12 (.whl, ignored by git),
this check and the GPU benchmark in one command (tools/testing/gpu_check/device_run.sh):

    bash tools/testing/gpu_check/device_run.sh       # results in $OUT

(the check about a minute on the H200, the op library's build 17-31 s of it;
the script about two; their output goes in the session note). First run there on 2026-12-04:
benchmarks/results/h200-host/README.md.

Checks (each passes, fails, or is skipped with the reason):
  imports       the data plane loads no vllm.* module outside vllm.afd
  kernels       the `afd` op library built against the local torch (CUDA:
                with csrc/cuda), gather/scatter against torch, a repeated
                scatter index refused
  kernels-pack  (CUDA) afd::pack / afd::unpack on the device byte for byte the
                CPU kernels' slot and tensors (exact and fp8, with and without
                routing, fp32/bf16/fp16, odd widths, unaligned slots), and their
                bandwidth as a fraction of a device-to-device copy of the same bytes
  harness-*     a reference MoE decoder split the AFD way: both roles through
                the real data plane (loopback in one process; shm and tcp as
                two processes on one device), micro-batches m = 1..4 ping-ponged,
                routing from the attention side; outputs identical to the model
                run whole, micro-batch by micro-batch; over shm and tcp every
                message end a prepared call (CUDA: staged through the pinned
                slots, fp8 and routing packed on the device first)
  dummy-runs    profile/warm-up/capture steps send no frame and need no FFN
  threads       every data-plane thread enters the device and stream it was
                handed (ping-pong workers, link supervisor, FFN loop)
  ffn-errors    an FFN-side exception reaches the attention side with its text
  stream-order  (CUDA) producers delayed with torch.cuda._sleep on a side stream:
                the transfers wait for them; a copy without the fence reads stale
                data (the negative control shows the check can fail)
  graphs        (CUDA) the attention parts captured as CUDA graphs, the exchange
                run eagerly between them (piecewise), replayed with new inputs:
                equal to eager
  ipc           the device-resident exchange (transport/ipc/) between two
                processes: m = 1..4 equal to the model, a late reply's negative
                control, (CUDA) a whole attention step captured as one graph with
                its exchanges and replayed, the FFN killed mid-step and the step
                released (ipc.py); a layer call's round trip, two processes and
                one, beside the device floor, replayed graphs on CUDA (ipc_timing.py)
Exit status 0 when nothing failed.
"""

import argparse
import json
import os
import sys
import time
import traceback
from pathlib import Path

HERE = Path(__file__).resolve().parent
REPO = HERE.parents[2]
sys.path.insert(0, str(HERE))
sys.path.insert(1, str(HERE.parents[1] / "serving"))  # tools/serving: servers.free_port
if "vllm" not in sys.modules and not (Path.cwd() / "vllm" / "__init__.py").exists():
    sys.path.insert(0, str(REPO))  # the checkout's vllm/afd (a namespace package)

import torch  # noqa: E402

DATA_PLANE = [
    "vllm.afd.transport.wire", "vllm.afd.transport.handshake", "vllm.afd.transport.auth",
    "vllm.afd.transport.buffers", "vllm.afd.transport.device", "vllm.afd.transport.config",
    "vllm.afd.transport.connectors.base", "vllm.afd.transport.connectors.shm",
    "vllm.afd.transport.connectors.tcp", "vllm.afd.transport.connectors.loopback",
    "vllm.afd.transport.connectors.nccl", "vllm.afd.attention.link",
    "vllm.afd.attention.pingpong", "vllm.afd.attention.status", "vllm.afd.ffn.loop",
    "vllm.afd.ffn.batcher", "vllm.afd.kernels.ops", "vllm.afd.observability.metrics",
    "vllm.afd.observability.stats", "vllm.afd.topology", "vllm.afd.transport.ipc.calls",
    "vllm.afd.transport.ipc.memory", "vllm.afd.transport.ipc.op_stream",
]


class Skip(Exception):
    pass


# ------------------------------------------------------------------- checks
def check_imports(args) -> str:
    import importlib

    for name in DATA_PLANE:
        importlib.import_module(name)
    foreign = sorted(m for m in sys.modules
                     if m.startswith("vllm.") and not m.startswith("vllm.afd"))
    vllm = sys.modules.get("vllm")
    init = getattr(vllm, "__file__", None)
    if foreign:
        raise AssertionError(f"the data plane loaded vLLM modules: {foreign[:10]}")
    if init and Path(init).stat().st_size > 0:
        raise AssertionError(f"vllm is a real vLLM package here ({init}); run from a tree "
                             f"with only vllm/afd")
    return f"{len(DATA_PLANE)} data-plane modules, no vllm.* module outside vllm.afd"


_build_failure: list[str] = []


def ensure_library(device: str) -> str:
    """Load the `afd` op library once: the installed vllm/afd/_C on the CPU
    where there is one (make test), else built here from csrc/ against the
    local torch (with csrc/cuda on CUDA). The path goes into the environment
    (ops.LIBRARY_ENV), so the FFN processes the harness spawns load the same
    file."""
    from vllm.afd.kernels import ops

    path = None
    if device == "cpu" or os.environ.get(ops.LIBRARY_ENV):
        try:
            path = ops.library_path()  # the one named there, else the installed one
        except ImportError:
            pass
    if path is None and _build_failure:  # once: every later check reports it
        raise RuntimeError(f"the op library did not build: {_build_failure[0]}")
    if path is None:
        from torch.utils.cpp_extension import load

        csrc = REPO / "csrc"
        sources = [csrc / "torch_bindings.cpp", *sorted((csrc / "cpu").glob("*.cpp"))]
        if device == "cuda":
            sources += sorted((csrc / "cuda").glob("*.cu"))
        build = Path(os.environ.get("AFD_GPU_CHECK_BUILD", "/tmp/afd-gpu-check-build")) / device
        build.mkdir(parents=True, exist_ok=True)
        t0 = time.monotonic()
        try:
            load(name="afd_C", sources=[str(s) for s in sources], build_directory=str(build),
                 extra_cflags=["-O3"], extra_cuda_cflags=["-O3"], with_cuda=device == "cuda",
                 is_python_module=False, verbose=False)
        except Exception as e:
            _build_failure.append(f"{type(e).__name__}: {str(e)[-2000:]}")
            raise
        path = str(build / "afd_C.so")
        print(f"  built {path} in {time.monotonic() - t0:.0f}s", flush=True)
        ops.load(path)
    os.environ[ops.LIBRARY_ENV] = path
    return path


def check_kernels(args) -> str:
    from vllm.afd.kernels import ops

    device = args.device
    path = ensure_library(device)
    # pack/unpack on the device against the torch-op implementation
    # (kernels/composite.py) on the same device: the same slot bytes, the same
    # tensors back, and unpack(pack(x)) is plain torch's fp8 round trip.
    from model import fp8_round_trip

    from vllm.afd.kernels import composite

    g = torch.Generator().manual_seed(0)
    cases = 0
    for tokens, width, group, topk in ((1, 128, 128, 0), (6, 300, 128, 2), (5, 77, 0, 4),
                                       (33, 2048, 128, 8), (0, 64, 128, 2)):
        for dtype in (torch.float32, torch.bfloat16, torch.float16):
            x = (torch.randn(tokens, width, generator=g) * 10).to(dtype).to(device)
            ids = torch.randint(0, 64, (tokens, topk), generator=g, dtype=torch.int32)
            w = torch.rand(tokens, topk, generator=g)
            ids, w = (ids.to(device), w.to(device)) if topk else (None, None)
            n = ops.PackLayout.of(tokens, width, dtype, group, topk).total
            slot = ops.pack(x, torch.empty(n, dtype=torch.uint8, device=device), group, ids, w)
            want = torch.empty_like(slot)
            composite.pack(x, ids, w, group, want)
            assert torch.equal(slot, want), ("pack", tokens, width, group, topk, dtype)
            unrouted = ops.PackLayout.of(tokens, width, dtype, group).total  # routing follows
            back = ops.unpack(slot[:unrouted], torch.empty_like(x), group)
            expected = fp8_round_trip(x, group) if group else x
            assert torch.equal(back, expected), ("unpack", tokens, width, group, dtype)
            cases += 1
    return (f"pack/unpack on {device}: {cases} cases equal to torch's (exact, fp8, routed); "
            f"library {path}")


def check_kernels_pack(args) -> str:
    """pack/unpack on the GPU against the CPU kernels (the reference): the same
    slot bytes and the same unpacked tensors. Needs the library `kernels` built."""
    if args.device != "cuda":
        raise Skip("the CUDA pack/unpack kernels need --device cuda")
    from vllm.afd.kernels import ops

    if not hasattr(torch.ops.afd, "pack"):
        raise Skip("the op library is not loaded (run the `kernels` check first)")
    g = torch.Generator().manual_seed(1)
    cases = 0
    # (tokens, hidden, group_size, topk): vectorized widths, odd ones (scalar
    # path), a short last group, one token, none.
    shapes = [(1, 128, 128, 0), (7, 4096, 128, 8), (33, 1000, 128, 4), (5, 77, 13, 2),
              (256, 7168, 128, 8), (0, 128, 128, 4), (3, 64, 0, 0), (9, 130, 0, 6)]
    for tokens, width, group, topk in shapes:
        for dtype in (torch.float32, torch.bfloat16, torch.float16):
            for ids_dtype in ((torch.int32, torch.int64) if topk else (None,)):
                x = torch.randn(tokens, width, generator=g) * 3
                if tokens:
                    x[0, : min(width, group or width)] = 0  # an all-zero group: scale 1
                    x[-1, -1] = 1e4  # beyond 448 before scaling
                x = x.to(dtype)
                ids = (torch.randint(0, 256, (tokens, topk), generator=g).to(ids_dtype)
                       if topk else None)
                w = torch.rand(tokens, topk, generator=g) if topk else None
                n = ops.PackLayout.of(tokens, width, dtype, group, topk).total
                for offset in (0, 4):  # a slot inside a larger buffer, 4-byte aligned
                    ref = ops.pack(x, torch.empty(n, dtype=torch.uint8), group, ids, w)
                    buf = torch.full((n + offset,), 0xAB, dtype=torch.uint8, device="cuda")
                    slot = buf[offset:]
                    ops.pack(x.cuda(), slot, group, None if ids is None else ids.cuda(),
                             None if w is None else w.cuda())
                    assert torch.equal(slot.cpu(), ref), (tokens, width, group, topk, dtype)
                    h_ref = torch.empty_like(x)
                    ids_ref = None if ids is None else torch.empty_like(ids)
                    w_ref = None if w is None else torch.empty_like(w)
                    ops.unpack(ref, h_ref, group, ids_ref, w_ref)
                    h = torch.empty_like(x, device="cuda")
                    ids_d = None if ids is None else torch.empty_like(ids, device="cuda")
                    w_d = None if w is None else torch.empty_like(w, device="cuda")
                    ops.unpack(slot, h, group, ids_d, w_d)
                    assert torch.equal(h.cpu().view(torch.uint8), h_ref.view(torch.uint8)), (
                        "unpack", tokens, width, group, dtype)
                    if topk:
                        assert torch.equal(ids_d.cpu(), ids_ref) and torch.equal(w_d.cpu(), w_ref)
                    cases += 1
    # Bandwidth: each op against a device-to-device copy of the bytes it moves
    # (what it reads plus what it writes, halved: a copy reads and writes each byte).
    lines = []
    for dtype, group in ((torch.bfloat16, 0), (torch.bfloat16, 128), (torch.float32, 128)):
        tokens, width, topk = 4096, 7168, 8
        x = torch.randn(tokens, width, device="cuda").to(dtype)
        ids = torch.randint(0, 256, (tokens, topk), device="cuda", dtype=torch.int32)
        w = torch.rand(tokens, topk, device="cuda")
        slot = torch.empty(ops.PackLayout.of(tokens, width, dtype, group, topk).total,
                           dtype=torch.uint8, device="cuda")
        moved = (x.numel() * x.element_size() + slot.numel() + ids.numel() * 8) // 2
        src = torch.empty(moved, dtype=torch.uint8, device="cuda")
        dst = torch.empty_like(src)

        def timed(fn, reps=20) -> float:
            fn()
            torch.cuda.synchronize()
            start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
            start.record()
            for _ in range(reps):
                fn()
            end.record()
            torch.cuda.synchronize()
            return start.elapsed_time(end) / reps

        copy_ms = timed(lambda: dst.copy_(src))
        pack_ms = timed(lambda: ops.pack(x, slot, group, ids, w))
        unpack_ms = timed(lambda: ops.unpack(slot, x, group, ids, w))
        gbs = moved / copy_ms / 1e6
        kind = "exact" if group == 0 else "fp8"
        lines.append(f"{kind} {str(dtype)[6:]}: pack {copy_ms / pack_ms:.0%}, "
                     f"unpack {copy_ms / unpack_ms:.0%} of a {gbs:.0f} GB/s copy")
    return f"{cases} cases equal to the CPU kernels; " + "; ".join(lines)


def _harness(args, connector: str, gate_on_attention: bool = False,
             transfer: str = "auto") -> str:
    """transfer "fp8": the whole model with fp8 hidden states and outputs on
    the link, against the reference that quantizes the same way in plain torch."""
    from model import fp8_round_trip
    from roles import AttentionRole, FFNProcess, FFNRole, free_port, sample_batch

    device, dtype = args.device, torch.float32
    port = free_port()
    ffn = (FFNRole(connector, port, device, dtype, gate_on_attention, transfer=transfer).start()
           if connector == "loopback" else
           FFNProcess(connector, port, device, dtype, gate_on_attention, transfer).start())
    attn = AttentionRole(connector, port, device, dtype, gate_on_attention, transfer=transfer)
    through = fp8_round_trip if transfer == "fp8" else None
    results = []
    try:
        with torch.inference_mode():
            for m in (1, 2, 3, 4):
                tokens, ubatches = sample_batch(m, device, seed=m)
                got = attn.step(tokens, ubatches)
                want = attn.model.reference(tokens, ubatches, through, gate_on_attention)
                if not torch.equal(got, want):
                    raise AssertionError(f"m={m}: max |diff| {(got - want).abs().max():.3g}")
                results.append(f"m={m}:{sum(map(sum, ubatches))}tok")
        stats = attn.link.stats
        routed = f", {stats.routed_calls} routed calls" if gate_on_attention else ""
        assert stats.steps == 4 and stats.layer_calls == 3 * (1 + 2 + 3 + 4), stats
        if gate_on_attention:
            assert stats.routed_calls == 2 * (1 + 2 + 3 + 4), stats
        # The attention side's message ends through prepared calls (shm's lane,
        # tcp's socket calls; CUDA tensors staged through pinned slots): all of
        # them but the few a busy host delays past the prepared wait's bound
        # (the general path's then); fp8 and routed frames too (on CUDA packed
        # on the device by the op library, then staged).
        lead = attn.link.pool.members[0].lead
        prepared = getattr(lead, "fast_calls", None)  # shm and tcp (step_calls.py)
        if prepared is not None:
            assert stats.layer_calls <= prepared <= 2 * stats.layer_calls, (
                prepared, stats.layer_calls)
        calls = f", {prepared} prepared message ends" if prepared is not None else ""
    finally:
        attn.close()
        ffn.stop()
    return f"identical to the whole model ({', '.join(results)}{routed}{calls})"


def check_dummy_runs(args) -> str:
    """Profile, warm-up and capture runs never reach the link: with no FFN at
    all they complete at once, and write zeros as the remote layers' output."""
    from roles import AttentionRole, free_port, sample_batch

    attn = AttentionRole("tcp", free_port(), args.device, torch.float32)
    try:
        tokens, ubatches = sample_batch(1, args.device, seed=0)
        t0 = time.monotonic()
        for kind in ("profile", "warmup", "capture"):
            attn.step(tokens, ubatches, kind=kind)
        elapsed = time.monotonic() - t0
        doc = attn.link.document()
        assert elapsed < 5 and doc["steps"] == 0 and doc["bytes_sent"] == 0, (elapsed, doc)
        assert doc["dummy_runs"] == {"profile": 1, "warmup": 1, "capture": 1}, doc
    finally:
        attn.close()
    return f"3 dummy runs without an FFN in {elapsed:.2f}s, no frame sent"


def check_threads(args) -> str:
    """Every thread the data plane starts enters the device and stream it was
    handed: on CUDA a side stream, never device 0's default stream (on the CPU
    the stream is a token, and what is checked is that the thread entered it)."""
    from roles import AttentionRole, FFNRole, free_port, sample_batch
    from vllm.afd.transport.device import DeviceContext, entered_context

    device = args.device
    handed = {"ffn": DeviceContext(device, torch.cuda.Stream() if device == "cuda"
                                   else "ffn-stream"),
              "attention": DeviceContext(device, torch.cuda.Stream() if device == "cuda"
                                         else "attention-stream")}
    seen: dict[str, tuple] = {}

    def record(name: str, context) -> None:
        current = torch.cuda.current_stream() if device == "cuda" else None
        seen[name] = (context, entered_context(), current)

    port = free_port()
    ffn = FFNRole("loopback", port, device, torch.float32, on_thread=record)
    ffn.start(handed["ffn"])
    attn = AttentionRole("loopback", port, device, torch.float32, on_thread=record,
                         context=handed["attention"])
    try:
        tokens, ubatches = sample_batch(3, device, seed=3)
        with handed["attention"].entered():  # the runner's own thread
            got = attn.step(tokens, ubatches)
        assert torch.equal(got, attn.model.reference(tokens, ubatches))
    finally:
        attn.close()
        ffn.stop()
    for u, context in attn.threads_seen:
        seen.setdefault(f"afd-ubatch-{u}", (context, context, None))
    problems = []
    for name, (context, entered, current) in seen.items():
        want = handed["ffn" if name == "afd-ffn-loop" else "attention"]
        if context is not want or entered is not want:
            problems.append(f"{name}: entered {entered}, handed {want}")
        if device == "cuda" and current is not None and current != want.stream:
            problems.append(f"{name}: current stream {current}, handed {want.stream}")
    expected = {"afd-ffn-loop", "afd-link", "afd-ubatch-0", "afd-ubatch-1", "afd-ubatch-2"}
    if expected - set(seen) or problems:
        raise AssertionError(f"missing {sorted(expected - set(seen))}; {problems}")
    return f"{len(seen)} threads entered the device and stream they were handed"


def check_ffn_errors(args) -> str:
    from roles import AttentionRole, FFNRole, free_port, sample_batch
    from vllm.afd.transport.errors import AFDLinkDown

    def broken(layer, h, routing):
        if layer == 1:
            raise ValueError("expert weights are NaN")
        return h

    port = free_port()
    ffn = FFNRole("loopback", port, args.device, torch.float32).start()
    assert ffn.loop.ready.wait(30)
    ffn.loop.compute_fn = broken  # after warm-up: the failure comes mid-step
    attn = AttentionRole("loopback", port, args.device, torch.float32)
    try:
        tokens, ubatches = sample_batch(1, args.device, seed=1)
        try:
            attn.step(tokens, ubatches)
        except AFDLinkDown as e:
            text = str(e)
        else:
            raise AssertionError("the step succeeded with a failing FFN")
    finally:
        attn.close()
        ffn.stop()
    for needle in ("the mlp of layer 1 failed", "ValueError: expert weights are NaN"):
        assert needle in text, text
    return "the attention side's error names it: " + text[text.find("FFN rank"):][:100]


def check_stream_order(args) -> str:
    if args.device != "cuda":
        raise Skip("needs CUDA streams")
    from roles import AttentionRole, FFNProcess, free_port, sample_batch

    port = free_port()
    ffn = FFNProcess("shm", port, "cuda", torch.float32).start()
    side = torch.cuda.Stream()
    try:
        with torch.cuda.stream(side):
            attn = AttentionRole("shm", port, "cuda", torch.float32)
            original = attn._remote_mlp

            def late_producer(layer, y):
                # The producer is slow: y is written only after ~10 ms of GPU time.
                late = torch.empty_like(y)
                torch.cuda._sleep(20_000_000)
                late.copy_(y)
                return original(layer, late)

            attn._remote_mlp = late_producer
            tokens, ubatches = sample_batch(2, "cuda", seed=7)
            got = attn.step(tokens, ubatches)
            want = attn.model.reference(tokens, ubatches)
            attn.close()
        assert torch.equal(got, want), (got - want).abs().max()
        # Negative control: the same copy without the fence reads stale data.
        src = torch.zeros(1 << 20, device="cuda")
        host = torch.empty(1 << 20, pin_memory=True)
        with torch.cuda.stream(side):
            torch.cuda._sleep(50_000_000)
            src.fill_(1.0)
        host.copy_(src, non_blocking=True)  # on the default stream: no wait for `side`
        torch.cuda.synchronize()
        stale = bool((host == 0).any())
    finally:
        ffn.stop()
    return ("delayed producers on a side stream: outputs identical; an unfenced copy "
            f"{'read stale data (the check can fail)' if stale else 'happened to be fresh'}")


def check_graphs(args) -> str:
    if args.device != "cuda":
        raise Skip("needs CUDA graphs")
    from model import rms_norm
    from roles import AttentionRole, FFNRole, free_port, sample_batch

    port = free_port()
    ffn = FFNRole("loopback", port, "cuda", torch.float32).start()
    attn = AttentionRole("loopback", port, "cuda", torch.float32)
    model = attn.model
    try:
        tokens, ubatches = sample_batch(1, "cuda", seed=11)
        seq_lens, n = ubatches[0], tokens.numel()
        static_tokens = tokens.clone()
        x0 = torch.empty(n, model.hidden, device="cuda")
        hs = [torch.empty(n, model.hidden, device="cuda") for _ in model.layers]
        ys = [torch.empty_like(h) for h in hs]
        outs = [torch.empty_like(h) for h in hs]
        logits = torch.empty(n, model.lm_head.out_features, device="cuda")

        def piece(i):  # the attention part of layer i, reading the previous exchange
            x = model.embed(static_tokens) if i == 0 else hs[i - 1] + outs[i - 1]
            h, y = model.layers[i].attention_part(x, seq_lens)
            hs[i].copy_(h)
            ys[i].copy_(y)

        def head():
            logits.copy_(model.lm_head(rms_norm(hs[-1] + outs[-1], model.norm)))

        graphs = []
        with torch.inference_mode():
            side = torch.cuda.Stream()
            side.wait_stream(torch.cuda.current_stream())
            with torch.cuda.stream(side):  # warm up before capture
                for i in range(len(model.layers)):
                    piece(i)
                head()
            torch.cuda.current_stream().wait_stream(side)
            for i in range(len(model.layers)):
                g = torch.cuda.CUDAGraph()
                with torch.cuda.graph(g):
                    piece(i)
                graphs.append(g)
            g_head = torch.cuda.CUDAGraph()
            with torch.cuda.graph(g_head):
                head()
            del x0
            from vllm.afd.attention.link import ForwardPass
            from vllm.afd.transport.device import DeviceContext

            for seed in (12, 13):  # replays with new inputs
                new, _ = sample_batch(1, "cuda", seed=seed)
                new = new[:n] if new.numel() >= n else torch.cat([new, new])[:n]
                static_tokens.copy_(new)
                attn.link.begin_step(ForwardPass(num_tokens=(n,),
                                              device=DeviceContext.current("cuda")))
                for i, g in enumerate(graphs):
                    g.replay()
                    attn.link.exchange(i, ys[i], outs[i])  # eager, between the graphs
                g_head.replay()
                attn.link.end_step()
                want = model.reference(static_tokens, [seq_lens])
                assert torch.equal(logits, want), (seed, (logits - want).abs().max())
    finally:
        attn.close()
        ffn.stop()
    return f"{len(graphs) + 1} graphs captured, replayed with 2 new inputs: equal to eager"


CHECKS = {
    "imports": check_imports,
    "kernels": check_kernels,
    "kernels-pack": check_kernels_pack,
    "harness-loopback": lambda a: _harness(a, "loopback"),
    "harness-shm": lambda a: _harness(a, "shm"),
    "harness-tcp": lambda a: _harness(a, "tcp"),
    "harness-shm-routed": lambda a: _harness(a, "shm", gate_on_attention=True),
    "harness-shm-fp8": lambda a: _harness(a, "shm", transfer="fp8"),
    "harness-tcp-routed-fp8": lambda a: _harness(a, "tcp", gate_on_attention=True,
                                                 transfer="fp8"),
    "harness-tcp-routed": lambda a: _harness(a, "tcp", gate_on_attention=True),
    "dummy-runs": check_dummy_runs,
    "threads": check_threads,
    "ffn-errors": check_ffn_errors,
    "stream-order": check_stream_order,
    "graphs": check_graphs,
    "ipc": lambda a: __import__("ipc").check_ipc(a),
}


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--device", default="cuda" if torch.cuda.is_available() else "cpu",
                    choices=["cuda", "cpu"])
    ap.add_argument("--out", type=Path)
    ap.add_argument("--only", default="")
    ap.add_argument("--skip", default="")
    args = ap.parse_args()
    only = [n for n in args.only.split(",") if n]
    skip = {n for n in args.skip.split(",") if n}
    torch.set_num_threads(max(1, min(4, os.cpu_count() or 1)))
    report = {"device": args.device, "torch": torch.__version__,
              "gpu": torch.cuda.get_device_name() if args.device == "cuda" else None,
              "checks": {}}
    print(f"AFD GPU check on {args.device} ({report['gpu'] or 'no GPU'}), torch "
          f"{torch.__version__}", flush=True)
    failed = 0
    for name, check in CHECKS.items():
        if (only and name not in only) or name in skip:
            continue
        t0 = time.monotonic()
        try:
            if name != "imports":  # built (or found) once, by the first check after it
                ensure_library(args.device)
            detail, status = check(args), "pass"
        except Skip as e:
            detail, status = str(e), "skip"
        except Exception as e:  # noqa: BLE001 - reported, the next check runs
            detail, status = f"{type(e).__name__}: {e}", "FAIL"
            traceback.print_exc()
            failed += 1
        seconds = time.monotonic() - t0
        report["checks"][name] = {"status": status, "detail": detail,
                                  "seconds": round(seconds, 2)}
        print(f"  {status:4}  {name:20} {seconds:6.1f}s  {detail}", flush=True)
    if args.out:
        args.out.write_text(json.dumps(report, indent=1))
    print("FAILED" if failed else "OK", flush=True)
    return 1 if failed else 0


if __name__ == "__main__":
    sys.exit(main())
