# SPDX-License-Identifier: Apache-2.0
# SPDX-FileCopyrightText: Copyright contributors to the vllm-afd project
"""Both AFD roles of the reference decoder, driven through the real data plane.

The FFN role is the data plane's FFNLoop serving the model's mlps; the
attention role runs the model's attention parts and reaches the mlps through
an AttentionLink with the step API (begin_step / exchange into a caller-owned
output / end_step), micro-batches ping-ponged by the data plane's scheduler.
Nothing here imports vLLM: this is what runs on a GPU machine without it.
"""

import multiprocessing
import os

import torch

from model import MoE, TinyMoEDecoder  # noqa: I001 (tools/testing/gpu_check on sys.path)
from servers import free_port  # noqa: F401  (tools/serving on sys.path; race-free ports)
from vllm.afd.attention.link import AttentionLink, ForwardPass
from vllm.afd.attention.pingpong import run_micro_batches
from vllm.afd.ffn.loop import FFNLoop
from vllm.afd.topology import FFNPlacement
from vllm.afd.transport.config import LinkConfig
from vllm.afd.transport.device import DeviceContext
from vllm.afd.transport.wire import MAX_UBATCHES, Routing

MAX_TOKENS = 64


def link_config(connector: str, port: int, role: str, timeout_s: float = 30.0,
                transfer: str = "auto") -> LinkConfig:
    """transfer: AFDConfig.transfer_dtype for both directions ("auto", "fp8")."""
    return LinkConfig(role=role, connector=connector, port=port,
                      num_ubatches=MAX_UBATCHES, timeout_s=timeout_s,
                      transfer_to_ffn=transfer, transfer_to_attention=transfer)


def build_model(device: str, dtype: torch.dtype) -> TinyMoEDecoder:
    return TinyMoEDecoder().to(device=device, dtype=dtype).eval()


class FFNRole:
    """The FFN side: an FFNLoop serving model.layers[i].mlp."""

    def __init__(self, connector: str, port: int, device: str, dtype: torch.dtype,
                 gate_on_attention: bool = False, compute=None, on_thread=None,
                 transfer: str = "auto") -> None:
        self.model = build_model(device, dtype)
        mlps = [layer.mlp for layer in self.model.layers]

        def run_mlp(layer: int, h: torch.Tensor, routing) -> torch.Tensor:
            return mlps[layer](h, routing)

        self.loop = FFNLoop(
            link_config(connector, port, "ffn", transfer=transfer),
            layers=list(range(len(mlps))),
            compute=compute or run_mlp, hidden_size=self.model.hidden, dtype=dtype,
            max_tokens=MAX_TOKENS, placement=FFNPlacement(rank=0, group=[0]),
            routed_layers=self.model.moe_layers() if gate_on_attention else {},
            warmup_sizes=[1, 8, MAX_TOKENS], on_thread=on_thread)
        self.device = device

    def start(self, context: DeviceContext | None = None) -> "FFNRole":
        self.loop.start(context or DeviceContext.current(self.device))
        return self

    def stop(self) -> None:
        self.loop.stop()


def _ffn_process(connector: str, port: int, device: str, dtype: torch.dtype,
                 gate_on_attention: bool, threads: int, ready, stop,
                 transfer: str = "auto") -> None:
    # The parent's thread count: CPU matmuls reduce in another order with
    # another count, and the harness compares bits.
    torch.set_num_threads(threads)
    role = FFNRole(connector, port, device, dtype, gate_on_attention,
                   transfer=transfer).start()
    role.loop.ready.wait(60)
    ready.set()
    stop.wait()
    role.stop()


class FFNProcess:
    """The FFN role in its own process (shm and tcp: the roles are two
    processes, as in a deployment)."""

    def __init__(self, connector: str, port: int, device: str, dtype: torch.dtype,
                 gate_on_attention: bool = False, transfer: str = "auto") -> None:
        ctx = multiprocessing.get_context("spawn")
        self.ready, self.stop_event = ctx.Event(), ctx.Event()
        self.proc = ctx.Process(target=_ffn_process, daemon=True, args=(
            connector, port, device, dtype, gate_on_attention, torch.get_num_threads(),
            self.ready, self.stop_event, transfer))

    def start(self) -> "FFNProcess":
        self.proc.start()
        if not self.ready.wait(120):
            raise RuntimeError("the FFN process did not get ready")
        return self

    def stop(self) -> None:
        self.stop_event.set()
        self.proc.join(20)
        if self.proc.is_alive():
            self.proc.kill()


class AttentionRole:
    """The attention side: the model's attention parts, mlps over the link."""

    def __init__(self, connector: str, port: int, device: str, dtype: torch.dtype,
                 gate_on_attention: bool = False, on_thread=None,
                 context: DeviceContext | None = None, transfer: str = "auto",
                 config: LinkConfig | None = None) -> None:
        """context: the device and stream the link's threads and the steps run
        on (default: the current stream of device). config: the link's (default:
        link_config(connector, port, ...))."""
        self.model = build_model(device, dtype)
        self.device, self.dtype = device, dtype
        self.context = context
        self.gate_on_attention = gate_on_attention
        config = config or link_config(connector, port, "attention", transfer=transfer)
        self.link = AttentionLink(config,
                                  hidden_size=self.model.hidden, dtype=dtype,
                                  max_tokens=MAX_TOKENS, rank=0,
                                  device=context or DeviceContext.current(device),
                                  on_thread=on_thread)
        moe = self.model.moe_layers()
        for layer in range(len(self.model.layers)):
            self.link.add_layer(layer, routing_topk=moe.get(layer, 0) if gate_on_attention
                                else 0)
        self.link.start()
        self.on_thread = on_thread
        self.threads_seen: list = []  # (micro-batch, DeviceContext) of ping-pong threads

    def _remote_mlp(self, layer: int, y: torch.Tensor) -> torch.Tensor:
        out = torch.empty_like(y)  # the caller-owned output
        routing = None
        mlp = self.model.layers[layer].mlp
        if self.gate_on_attention and isinstance(mlp, MoE):
            weights, ids = mlp.route(y)
            routing = Routing(weights.contiguous(), ids.contiguous())
        return self.link.exchange(layer, y.contiguous(), out, routing)

    @torch.inference_mode()
    def step(self, tokens: torch.Tensor, ubatches: list[list[int]],
             kind: str = "real") -> torch.Tensor:
        """Logits of one step: ubatches are the sequence lengths of each
        micro-batch (tokens back to back)."""
        context = self.context or DeviceContext.current(self.device)
        sizes = [sum(u) for u in ubatches]
        starts = [sum(sizes[:u]) for u in range(len(sizes))]
        def run(u: int) -> torch.Tensor:
            part = tokens[starts[u]:starts[u] + sizes[u]]
            return self.model.forward(part, ubatches[u], self._remote_mlp)

        def forward() -> list[torch.Tensor]:
            if len(ubatches) == 1:
                return [run(0)]
            return run_micro_batches(sizes, run, device=context,
                                     on_thread=self._thread_started)

        if kind != "real":
            self.link.begin_step(ForwardPass(kind=kind))
            try:
                return torch.cat(forward())
            finally:
                self.link.end_step()
        return torch.cat(self.link.run_step(
            ForwardPass(num_tokens=tuple(sizes), kind=kind, device=context), forward))

    def _thread_started(self, u: int, context: DeviceContext) -> None:
        self.threads_seen.append((u, context))
        if self.on_thread is not None:
            self.on_thread(f"afd-ubatch-{u}", context)

    def close(self) -> None:
        self.link.close()


def sample_batch(num_ubatches: int, device: str, seed: int) -> tuple[torch.Tensor, list]:
    """Sequences of different lengths in num_ubatches micro-batches, at most
    MAX_TOKENS tokens in all."""
    g = torch.Generator().manual_seed(seed)
    ubatches = []
    for u in range(num_ubatches):
        count = 1 + (seed + u) % 3
        ubatches.append([int(n) for n in torch.randint(1, 6, (count,), generator=g)])
    total = sum(map(sum, ubatches))
    tokens = torch.randint(0, 96, (total,), generator=g)
    return tokens.to(device), ubatches


def pid() -> int:
    return os.getpid()
