# SPDX-License-Identifier: Apache-2.0
# SPDX-FileCopyrightText: Copyright contributors to the vllm-afd project
"""Connector pairs over every transport, the stand-in NCCL communicator (no GPU
here), raw frames on a socket, routings."""

import os
import queue
import socket
import threading
import time
from collections import defaultdict

import torch

from servers import free_port  # noqa: F401  (race-free; the tests import it from here)
from vllm.afd.adapter.config import AFDConfig
from vllm.afd.transport import wire
from vllm.afd.transport.connectors import create_connector
from vllm.afd.transport.connectors.socket_stream import MAGIC, PREFIX
from vllm.afd.transport.wire import StepHeader


HIDDEN = 64


MAX_TOKENS = 32


class FakeNccl:
    """Stands in for PyNccl: communicators meet by unique id within this
    process; send() queues a copy, recv() copies it into the posted tensor and
    insists on matching shape and dtype (real NCCL would corrupt silently)."""

    device_types = ("cpu",)  # the fake moves CPU tensors

    def __init__(self) -> None:
        self.queues: dict[tuple, queue.Queue] = defaultdict(queue.Queue)
        self.lock = threading.Lock()
        self.created: list[tuple[bytes, int]] = []

    def unique_id(self) -> bytes:
        return os.urandom(128)

    def create(self, unique_id: bytes, rank: int, world_size: int, device) -> "FakeComm":
        assert world_size == 2 and rank in (0, 1) and torch.device(device).type == "cpu"
        with self.lock:
            self.created.append((unique_id, rank))
        return FakeComm(self, unique_id, rank)

    def destroy(self, comm: "FakeComm") -> None:
        comm.destroyed = True

    def queue(self, unique_id: bytes, src: int, dst: int) -> queue.Queue:
        with self.lock:
            return self.queues[(unique_id, src, dst)]


class FakeComm:
    def __init__(self, nccl: FakeNccl, unique_id: bytes, rank: int) -> None:
        self.nccl, self.unique_id, self.rank, self.destroyed = nccl, unique_id, rank, False

    def send(self, tensor: torch.Tensor, dst: int, stream=None) -> None:
        self.nccl.queue(self.unique_id, self.rank, dst).put(tensor.clone())

    def recv(self, tensor: torch.Tensor, src: int, stream=None) -> None:
        sent = self.nccl.queue(self.unique_id, src, self.rank).get(timeout=10)
        assert (sent.shape, sent.dtype) == (tensor.shape, tensor.dtype)
        tensor.copy_(sent)


FAKE_NCCL = FakeNccl()


def make(kind: str, role: str, port: int, *, dtype=torch.float32, timeout_s: float = 10,
         num_ubatches: int = 1, num_attention_ranks: int = 1, hidden_size: int = HIDDEN,
         max_tokens: int = MAX_TOKENS, transfer_dtype="auto", **kwargs):
    cfg = AFDConfig(role=role, connector=kind, port=port, timeout_s=timeout_s,
                    num_ubatches=num_ubatches, num_attention_ranks=num_attention_ranks,
                    transfer_dtype=transfer_dtype)
    if kind == "nccl":
        kwargs.setdefault("communicator_factory", FAKE_NCCL)
        kwargs.setdefault("device", "cpu")
    return create_connector(cfg, hidden_size=hidden_size, dtype=dtype,
                            max_tokens=max_tokens, **kwargs)


class Background(threading.Thread):
    """Runs fn in a thread; join_result() re-raises its exception here."""

    def __init__(self, fn, *args) -> None:
        super().__init__(daemon=True)
        self.fn, self.args, self.result, self.error = fn, args, None, None
        self.start()

    def run(self) -> None:
        try:
            self.result = self.fn(*self.args)
        except BaseException as e:  # noqa: BLE001 - handed to the test thread
            self.error = e

    def join_result(self, timeout: float = 30):
        self.join(timeout)
        assert not self.is_alive(), "background thread hung"
        if self.error is not None:
            raise self.error
        return self.result


def connect_pair(kind: str, ffn_first: bool = True, delay: float = 0.0, **kwargs):
    port = free_port()
    ffn, attn = make(kind, "ffn", port, **kwargs), make(kind, "attention", port, **kwargs)
    first, second = (ffn, attn) if ffn_first else (attn, ffn)
    waiter = Background(first.connect)
    time.sleep(delay)  # let the first side really wait
    second.connect()
    waiter.join_result()
    return attn, ffn


def recv_checked(attn, layer_id: int, ubatch_id: int):
    """The output of (layer_id, ubatch_id) as the link gets it: a failure shows
    at recv_output, or, on a connector that checks once per step
    (checks_per_step), at check_step."""
    out = attn.recv_output(layer_id, ubatch_id)
    attn.check_step()
    return out


def raw_frame(message: wire.Message, payload: bytes = b"", announced: int | None = None):
    header = wire.encode(message)
    announced = len(payload) if announced is None else announced
    return PREFIX.pack(MAGIC, len(header), announced) + header + payload


def read_message(sock: socket.socket):
    """One frame from a raw socket: the decoded header (payloads unused here)."""
    def exactly(n: int) -> bytes:
        data = b""
        while len(data) < n:
            chunk = sock.recv(n - len(data))
            assert chunk, "peer closed"
            data += chunk
        return data

    _, header_len, _ = PREFIX.unpack(exactly(PREFIX.size))
    return wire.decode(exactly(header_len))


def dial(port: int) -> socket.socket:
    deadline = time.monotonic() + 10
    while True:
        try:
            return socket.create_connection(("127.0.0.1", port), timeout=10)
        except OSError:
            assert time.monotonic() < deadline
            time.sleep(0.02)


def serve_one_layer(ffn_waiter: "Background", ffn, attn) -> None:
    """Connect attn (a well-behaved peer) to the FFN whose connect() runs in
    ffn_waiter, and exchange one layer: the FFN is still serving."""
    attn.connect()
    ffn_waiter.join_result()
    server = Background(ffn_serve, ffn, 1)
    attn.send_step(StepHeader(step_id=0, num_tokens=[2]))
    attn.send_hidden(0, 0, torch.ones(2, attn.hidden_size))
    assert attn.recv_output(0, 0).eq(2).all()
    attn.send_step(StepHeader(step_id=0, num_tokens=[], flags=wire.SHUTDOWN))
    assert server.join_result() == 1


# ------------------------------------------------------------------ routing
TOPK = 3


def routing_for(n: int, seed: int) -> wire.Routing:
    g = torch.Generator().manual_seed(seed)
    return wire.Routing(torch.rand(n, TOPK, generator=g),
                        torch.randint(0, 8, (n, TOPK), generator=g, dtype=torch.int32))


def ffn_serve(ffn, num_layers: int, seen: list | None = None) -> int:
    """The FFN loop: out = h * 2 + layer_id, plus sum(weights * ids) when the
    frame carried routing, until SHUTDOWN; returns steps served. With `seen`,
    records (layer, ubatch, routing copy or None) of every call."""
    steps = 0
    while True:
        step = ffn.recv_step(0)
        if step.is_shutdown or step.is_goodbye:
            return steps
        for layer in range(num_layers):
            for ubatch in range(len(step.num_tokens)):
                h = ffn.recv_hidden(0, layer, ubatch)
                r = ffn.routing(0, ubatch)
                if seen is not None:
                    seen.append((layer, ubatch, None if r is None else
                                 (r.topk_weights.clone(), r.topk_ids.clone())))
                out = h * 2 + layer
                if r is not None:
                    out = out + (r.topk_weights * r.topk_ids).sum(1, keepdim=True).to(h.dtype)
                ffn.send_output(0, layer, ubatch, out)
        steps += 1
