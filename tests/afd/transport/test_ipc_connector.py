# SPDX-License-Identifier: Apache-2.0
# SPDX-FileCopyrightText: Copyright contributors to the vllm-afd project
"""The ipc connector (transport/connectors/ipc.py) on the CPU: the handshake's
regions and refusals, a dead FFN process that never holds the attention side's
wait, nothing left in /dev/shm. Its layer calls run in every connector test
of test_connectors.py too (KINDS)."""

import multiprocessing
import os
import time
from pathlib import Path

import msgspec
import pytest
import torch

from servers import free_port
from vllm.afd.transport.connectors.ipc import IpcHello
from vllm.afd.transport.errors import AFDConnectionError
from vllm.afd.transport.ipc import memory
from vllm.afd.transport import wire
from vllm.afd.transport.wire import ProtocolError, StepHeader
from helpers.connectors import HIDDEN, Background, connect_pair, ffn_serve, make


def test_connected_regions_leave_no_name_behind(monkeypatch):
    made = []
    real_region = memory.OwnRegion

    class Recorded(real_region):
        def __init__(self, device, nbytes):
            super().__init__(device, nbytes)
            made.append(Path(memory.SHM_DIR) / self.handle.split(b":", 1)[1].decode())

    monkeypatch.setattr("vllm.afd.transport.connectors.ipc.OwnRegion", Recorded)
    attn, ffn = connect_pair("ipc", num_ubatches=2)
    try:
        assert len(made) == 2 and not any(p.exists() for p in made)  # mapped, names gone
        assert set(attn.exchanges) == {0} and set(ffn.exchanges) == {0}
    finally:
        attn.close()
        ffn.close()


def test_an_unmappable_region_is_refused_naming_why(monkeypatch):
    """An FFN that cannot map the attention server's memory (here: its name
    is gone, as from another /dev/shm or host) refuses the Hello with the
    reason and a way out, and goes on accepting: a good peer connects next."""
    port = free_port()
    ffn = make("ipc", "ffn", port)
    ffn.listen()
    first = Background(ffn.accept_session, 20.0)
    bad = make("ipc", "attention", port)
    real_region = memory.OwnRegion

    class GoneRegion(real_region):
        def __init__(self, device, nbytes):
            super().__init__(device, nbytes)
            self.unlink()

    monkeypatch.setattr("vllm.afd.transport.connectors.ipc.OwnRegion", GoneRegion)
    try:
        with pytest.raises(ProtocolError, match="cannot map the attention server's memory "
                                                ".* use connector 'shm' or 'tcp'"):
            bad.connect()
        assert first.join_result() is None
        assert "cannot map" in ffn.handshake.last_refusal
        monkeypatch.setattr("vllm.afd.transport.connectors.ipc.OwnRegion", real_region)
        second = Background(ffn.accept_session, 20.0)
        good = make("ipc", "attention", port)
        good.connect()
        session = second.join_result()
        server = Background(ffn_serve, session, 1)
        good.send_step(StepHeader(step_id=0, num_tokens=[2]))
        good.send_hidden(0, 0, torch.ones(2, HIDDEN))
        assert good.recv_output(0, 0).eq(2).all()
        good.close()
        assert server.join_result() == 1
        session.close()
    finally:
        bad.close()
        ffn.close()


def test_another_device_kind_is_refused():
    ffn = make("ipc", "ffn", free_port())
    hello = msgspec.msgpack.encode(IpcHello(device="cuda", num_ubatches=1, slot_bytes=1024,
                                            handle=memory.CUDA_HANDLE + bytes(64)))
    problems = ffn._transport_problems(0, hello)
    assert len(problems) == 1 and "cuda memory, this FFN server runs on cpu" in problems[0]
    hello = msgspec.msgpack.encode(IpcHello(device="cpu", num_ubatches=9, slot_bytes=1024,
                                            handle=b"cpu:x"))
    assert "ipc layout: expected at most 1 micro-batches" in ffn._transport_problems(0, hello)[0]


def _ffn_dies_after_taking(port: int) -> None:
    ffn = make("ipc", "ffn", port, timeout_s=60)
    ffn.connect()
    ffn.recv_step(0)
    ffn.recv_hidden(0, 0, 0)
    os._exit(1)  # no goodbye, no reply: a crash mid-call


def test_a_dead_ffn_never_holds_the_wait():
    """The FFN process dies after taking a call: the attention side's wait for
    its answer ends when the shm socket hangs up (the connector's watcher
    releases the exchange), long before the 20 s timeout; the step's end
    (check_step) raises the link's usual error, and the next call, which the
    released exchange would not carry, is refused."""
    port = free_port()
    proc = multiprocessing.get_context("spawn").Process(target=_ffn_dies_after_taking,
                                                        args=(port,), daemon=True)
    proc.start()
    attn = make("ipc", "attention", port, timeout_s=20)
    try:
        attn.connect()
        attn.send_step(StepHeader(step_id=1, num_tokens=[2]))
        attn.send_hidden(0, 0, torch.ones(2, HIDDEN))
        t0 = time.monotonic()
        attn.recv_output(0, 0)  # returns once released, its output unwritten
        assert time.monotonic() - t0 < 10.0
        with pytest.raises(AFDConnectionError, match="closed the connection .*released"):
            attn.check_step()
        with pytest.raises(AFDConnectionError, match="unusable after an earlier error"):
            attn.send_hidden(1, 0, torch.ones(2, HIDDEN))
    finally:
        attn.close()
        proc.join(10)


def test_one_header_per_step_and_no_message_per_call():
    """What the host sends per step is its StepHeader: the layer calls' bytes
    are payloads in the regions, with no frame of their own either way."""
    attn, ffn = connect_pair("ipc", num_ubatches=2)
    server = Background(ffn_serve, ffn, 3)
    try:
        header = StepHeader(step_id=1, num_tokens=[2, 3])
        sent, answered = attn.bytes_sent, ffn.bytes_sent
        attn.send_step(header)
        for layer in range(3):
            for u, n in enumerate(header.num_tokens):
                attn.send_hidden(layer, u, torch.full((n, HIDDEN), float(u)))
            for u, n in enumerate(header.num_tokens):
                assert attn.recv_output(layer, u).eq(2 * u + layer).all()
        payload = 3 * sum(header.num_tokens) * HIDDEN * 4
        # One message's bytes (the header and its framing) beside the payloads;
        # six calls' frames would be hundreds more.
        framing = attn.bytes_sent - sent - payload - len(wire.encode(header))
        assert 0 <= framing <= 8, framing
        assert ffn.bytes_sent - answered == payload
        attn.send_step(StepHeader(step_id=0, num_tokens=[], flags=wire.SHUTDOWN))
        assert server.join_result() == 1
    finally:
        attn.close()
        ffn.close()


def test_the_attention_host_reads_the_exchange_once_per_step(monkeypatch):
    """The attention side's layer calls only enqueue (on CUDA: no stream
    synchronization per call): its host reads the exchange's abort word once,
    at check_step; the FFN side reads it per take."""
    attn, ffn = connect_pair("ipc", num_ubatches=2)
    reads = {"attention": 0, "ffn": 0}
    for side in (attn, ffn):
        stream = side.exchanges[0].stream

        def counted(words, index, stream=stream, role=side.role, read=stream.read_word):
            reads[role] += 1
            return read(words, index)
        monkeypatch.setattr(stream, "read_word", counted)
    server = Background(ffn_serve, ffn, 3)
    try:
        attn.send_step(StepHeader(step_id=1, num_tokens=[2, 3]))
        for layer in range(3):
            for u in (0, 1):
                attn.send_hidden(layer, u, torch.full((2 + u, HIDDEN), float(layer)))
            for u in (0, 1):
                assert attn.recv_output(layer, u).eq(3.0 * layer).all()
        assert reads["attention"] == 0
        attn.check_step()
        assert reads["attention"] == 1
        attn.send_step(StepHeader(step_id=0, num_tokens=[], flags=wire.SHUTDOWN))
        assert server.join_result() == 1
        assert reads["ffn"] == 3 * 2
    finally:
        attn.close()
        ffn.close()
