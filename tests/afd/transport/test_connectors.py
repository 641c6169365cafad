# SPDX-License-Identifier: Apache-2.0
# SPDX-FileCopyrightText: Copyright contributors to the vllm-afd project
"""AFD connectors end to end: real sockets, real shared memory, real threads and
forked processes. The only stand-in is the NCCL communicator (no GPU here):
the nccl connector runs its whole protocol with FakeNccl moving the tensors."""

import logging
import multiprocessing
import os
import signal
import socket
import time
from pathlib import Path

import pytest
import torch

from vllm.afd.transport import wire
from servers import free_port  # noqa: F401  (race-free; other test modules import it from here)
from vllm.afd.adapter.config import AFDConfig
from vllm.afd.transport.connectors import (
    AFDConnectionError,
    AFDTimeoutError,
    ProtocolError,
    connector_names,
    create_connector,
    register_connector,
)
from vllm.afd.transport.connectors import base as connectors_base
from vllm.afd.transport.connectors.loopback import LoopbackConnector
from vllm.afd.transport.connectors.nccl import NcclConnector
from vllm.afd.transport.connectors.shm import ShmConnector
from vllm.afd.transport.connectors.socket_stream import MAGIC, PREFIX
from vllm.afd.transport.connectors.tcp import TcpConnector
from vllm.afd.transport.wire import LayerFrame, StepHeader
from helpers.connectors import FAKE_NCCL, HIDDEN, MAX_TOKENS, TOPK, Background, connect_pair, ffn_serve, make, raw_frame, read_message, recv_checked, routing_for, serve_one_layer
from helpers.fp8 import reference_dequantize, reference_quantize

KINDS = ["loopback", "tcp", "shm", "nccl", "ipc"]


def shm_entries(port: int) -> list[str]:
    return sorted(p.name for p in Path("/dev/shm").glob(f"vllm-afd-{port}-*"))


# ------------------------------------------------------------------ exchange
@pytest.mark.parametrize("num_ubatches, dtype", [(1, torch.float32), (2, torch.bfloat16),
                                                 (3, torch.float32), (4, torch.bfloat16)])
@pytest.mark.parametrize("kind", KINDS)
def test_full_exchange(kind, num_ubatches, dtype):
    num_layers, num_steps = 3, 3  # steps: see plans
    attn, ffn = connect_pair(kind, num_ubatches=num_ubatches, dtype=dtype)
    server = Background(ffn_serve, ffn, num_layers)
    g = torch.Generator().manual_seed(0)
    cap = MAX_TOKENS // num_ubatches
    plans = [[0] + [1] * (num_ubatches - 1),  # an empty micro-batch, decode-sized ones
             [cap] * num_ubatches,  # every slot full, max_tokens in all
             [(7 * u + 3) % cap + 1 for u in range(num_ubatches)]]  # uneven
    try:
        for step_id, tokens in enumerate(plans):
            attn.send_step(StepHeader(step_id=step_id * 10, num_tokens=tokens))
            for layer in range(num_layers):
                hidden = [torch.randn(n, HIDDEN, generator=g).to(dtype) for n in tokens]
                for u, h in enumerate(hidden):
                    attn.send_hidden(layer, u, h)
                # All outputs of the layer at once: each micro-batch's view stays
                # valid while the others arrive.
                outs = [attn.recv_output(layer, u) for u in range(num_ubatches)]
                for h, out in zip(hidden, outs, strict=True):
                    assert out.dtype == dtype and out.shape == h.shape
                    assert torch.equal(out, h * 2 + layer)
        attn.send_step(StepHeader(step_id=0, num_tokens=[], flags=wire.SHUTDOWN))
        assert server.join_result() == num_steps
        # Both ends count the same traffic (headers and payloads).
        assert attn.bytes_sent == ffn.bytes_received > 0
        assert ffn.bytes_received > 0 and attn.bytes_received == ffn.bytes_sent
    finally:
        attn.close()
        ffn.close()
        attn.close()  # idempotent


@pytest.mark.parametrize("ffn_first", [True, False], ids=["ffn-first", "attention-first"])
@pytest.mark.parametrize("kind", KINDS)
def test_either_side_starts_first(kind, ffn_first):
    attn, ffn = connect_pair(kind, ffn_first=ffn_first, delay=0.3)
    try:
        assert attn.connected_peers == [0] and ffn.connected_peers == [0]
        server = Background(ffn_serve, ffn, 1)
        attn.send_step(StepHeader(step_id=1, num_tokens=[2]))
        attn.send_hidden(0, 0, torch.ones(2, HIDDEN))
        assert attn.recv_output(0, 0).eq(2.0).all()
        attn.close()  # the FFN sees GOODBYE and returns
        assert server.join_result() == 1
    finally:
        attn.close()
        ffn.close()


@pytest.mark.parametrize("kind", KINDS)
def test_two_attention_ranks_share_one_ffn(kind):
    port = free_port()
    ffn = make(kind, "ffn", port, num_attention_ranks=2)
    attns = [make(kind, "attention", port, num_attention_ranks=2, rank=r) for r in (1, 0)]
    waiter = Background(ffn.connect)
    dialers = [Background(a.connect) for a in attns]
    try:
        waiter.join_result()
        for d in dialers:
            d.join_result()
        assert ffn.connected_peers == [0, 1]
        for a in attns:
            a.send_step(StepHeader(step_id=3, num_tokens=[a.rank + 1]))
            a.send_hidden(0, 0, torch.full((a.rank + 1, HIDDEN), float(a.rank)))
        for peer in (1, 0):  # the FFN picks which peer to serve
            assert ffn.recv_step(peer).num_tokens == [peer + 1]
            h = ffn.recv_hidden(peer, 0, 0)
            ffn.send_output(peer, 0, 0, h + 10 * peer)
        for a in attns:
            assert a.recv_output(0, 0).eq(11.0 * a.rank).all()
    finally:
        for a in attns:
            a.close()
        ffn.close()


def test_ffn_ranks_on_their_own_hosts():
    """ffn_hosts: each FFN rank listens on its own address (two loopback
    addresses stand in for two hosts) and attention rank a finds rank a % F
    there; nothing listens on the other rank's address."""
    port = free_port()
    hosts = ["127.0.0.1", "127.0.0.2"]
    cfg = dict(connector="tcp", port=port, timeout_s=10, num_attention_ranks=2,
               num_ffn_ranks=2, ffn_hosts=hosts)
    ffns = [create_connector(AFDConfig(role="ffn", ffn_rank=f, **cfg), hidden_size=HIDDEN,
                             dtype=torch.float32, max_tokens=MAX_TOKENS, rank=f)
            for f in (0, 1)]
    attns = [create_connector(AFDConfig(role="attention", **cfg), hidden_size=HIDDEN,
                              dtype=torch.float32, max_tokens=MAX_TOKENS, rank=a)
             for a in (0, 1)]
    waiters = [Background(f.connect) for f in ffns]
    try:
        for a in attns:
            a.connect()
        for w in waiters:
            w.join_result()
        assert [f.address for f in ffns] == [f"tcp://{h}:{port + i}"
                                             for i, h in enumerate(hosts)]
        assert [a.address for a in attns] == [f.address for f in ffns]
        for a in attns:
            a.send_step(StepHeader(step_id=1, num_tokens=[1]))
            a.send_hidden(0, 0, torch.full((1, HIDDEN), float(a.rank)))
        for f in ffns:  # FFN rank f's one peer is attention rank f
            r = f.ffn_rank
            assert f.connected_peers == [r]
            f.recv_step(r)
            f.send_output(r, 0, 0, f.recv_hidden(r, 0, 0) + 10 * r)
        for a in attns:
            assert a.recv_output(0, 0).eq(11.0 * a.rank).all()
        with pytest.raises(OSError):  # rank 1 is not on rank 0's address
            socket.create_connection(("127.0.0.1", port + 1), timeout=2).close()
    finally:
        for c in attns + ffns:
            c.close()


def test_nccl_exchanges_unique_ids_in_handshake():
    before = len(FAKE_NCCL.created)
    attn, ffn = connect_pair("nccl")
    attn.close()
    ffn.close()
    created = FAKE_NCCL.created[before:]
    # Two communicators (one per direction), each joined by both ranks with
    # the ids the FFN minted and sent in its HelloAck.
    assert sorted(rank for _, rank in created) == [0, 0, 1, 1]
    assert len({uid for uid, _ in created}) == 2


# ------------------------------------------------------------------ failures
@pytest.mark.parametrize("kind", KINDS)
def test_connect_timeout_names_the_address(kind, monkeypatch):
    monkeypatch.setattr(connectors_base, "LOG_INTERVAL_S", 0.3)
    records = []
    handler = logging.Handler()
    handler.emit = records.append
    base_logger = logging.getLogger(connectors_base.__name__)
    old_level = base_logger.level
    base_logger.setLevel(logging.INFO)  # the source tree may leave vllm's logging unset
    base_logger.addHandler(handler)
    try:
        lonely_ffn = make(kind, "ffn", free_port(), timeout_s=1)
        ffn_wait = Background(lonely_ffn.connect)
        lonely_attn = make(kind, "attention", free_port(), timeout_s=1)
        start = time.monotonic()
        with pytest.raises(AFDTimeoutError) as e:
            lonely_attn.connect()
        assert 0.9 < time.monotonic() - start < 3
        assert lonely_attn.address in str(e.value) and "FFN rank 0" in str(e.value)
        with pytest.raises(AFDTimeoutError) as e:
            ffn_wait.join_result()
        assert lonely_ffn.address in str(e.value) and "attention rank(s) [0]" in str(e.value)
    finally:
        base_logger.removeHandler(handler)
        base_logger.setLevel(old_level)
        lonely_ffn.close()
        lonely_attn.close()
    waiting = [r.getMessage() for r in records if "waiting for FFN rank 0" in r.getMessage()]
    assert waiting and f"at {lonely_attn.address} (" in waiting[0]
    assert waiting[0].startswith("AFD attention rank 0 waiting for FFN rank 0 at ")


@pytest.mark.parametrize("kind", KINDS)
def test_peer_closing_mid_exchange(kind):
    # The FFN leaves after layer 0: the attention's next wait fails at once.
    attn, ffn = connect_pair(kind)

    def serve_one_layer():
        ffn.recv_step(0)
        ffn.send_output(0, 0, 0, ffn.recv_hidden(0, 0, 0))
        ffn.recv_hidden(0, 1, 0)
        ffn.close()

    server = Background(serve_one_layer)
    try:
        attn.send_step(StepHeader(step_id=0, num_tokens=[4]))
        attn.send_hidden(0, 0, torch.ones(4, HIDDEN))
        attn.recv_output(0, 0)
        attn.send_hidden(1, 0, torch.ones(4, HIDDEN))
        start = time.monotonic()
        with pytest.raises(AFDConnectionError) as e:
            recv_checked(attn, 1, 0)
        assert time.monotonic() - start < 5  # not the 10 s timeout
        assert "FFN rank 0" in str(e.value) and "closed the connection" in str(e.value)
        assert ("step 0" if attn.checks_per_step
                else "output of layer 1 ubatch 0 of step 0") in str(e.value)
        server.join_result()
        with pytest.raises(AFDConnectionError, match="unusable after an earlier error"):
            attn.send_hidden(2, 0, torch.ones(4, HIDDEN))
    finally:
        attn.close()

    # The attention leaves mid-step: the FFN's recv_hidden fails the same way.
    attn, ffn = connect_pair(kind)
    try:
        attn.send_step(StepHeader(step_id=5, num_tokens=[1]))
        assert ffn.recv_step(0).step_id == 5
        attn.close()
        with pytest.raises(AFDConnectionError) as e:
            ffn.recv_hidden(0, 0, 0)
        assert "attention rank 0" in str(e.value) and "closed the connection" in str(e.value)
        assert "hidden states of layer 0 ubatch 0 of step 5" in str(e.value)
    finally:
        ffn.close()


@pytest.mark.parametrize("kind", KINDS)
def test_close_from_another_thread_interrupts_waits(kind):
    # How a server stops its FFN loop: close() while the loop thread waits.
    lonely = make(kind, "ffn", free_port())
    waiter = Background(lonely.connect)
    time.sleep(0.1)
    start = time.monotonic()
    lonely.close()
    with pytest.raises(AFDConnectionError, match="AFD ffn rank 0 was closed while it waited "
                       r"for attention rank\(s\) \[0\]"):
        waiter.join_result()
    attn, ffn = connect_pair(kind)
    try:
        waiter = Background(ffn.recv_step, 0)
        time.sleep(0.1)
        ffn.close()
        with pytest.raises(AFDConnectionError, match="AFD ffn rank 0 was closed while it "
                           "waited for the next step"):
            waiter.join_result()
        assert time.monotonic() - start < 5  # well under the 10 s timeout
    finally:
        attn.close()
        ffn.close()


@pytest.mark.parametrize("kind", KINDS)
def test_reported_error_reaches_the_peer(kind):
    attn, ffn = connect_pair(kind)
    try:
        attn.send_step(StepHeader(step_id=0, num_tokens=[3]))
        attn.send_hidden(0, 0, torch.zeros(3, HIDDEN))
        ffn.recv_step(0)
        ffn.recv_hidden(0, 0, 0)
        ffn.report_error("MoE kernel failed on layer 0")  # e.g. the FFN model raised
        waited_for = "step 0" if attn.checks_per_step else "the output of layer 0 ubatch 0 " \
            "of step 0"
        with pytest.raises(AFDConnectionError, match="FFN rank 0 reported a fatal error while "
                           f"AFD attention rank 0 waited for {waited_for}: AFD ffn rank 0: "
                           "MoE kernel failed on layer 0"):
            recv_checked(attn, 0, 0)
        with pytest.raises(AFDConnectionError, match="unusable"):
            ffn.recv_step(0)
    finally:
        attn.close()
        ffn.close()


@pytest.mark.parametrize("kind", ["tcp", "loopback"])
def test_late_answer_times_out(kind):
    attn, ffn = connect_pair(kind, timeout_s=1)
    try:
        attn.send_step(StepHeader(step_id=0, num_tokens=[3]))
        attn.send_hidden(0, 0, torch.zeros(3, HIDDEN))
        start = time.monotonic()
        with pytest.raises(AFDTimeoutError) as e:
            attn.recv_output(0, 0)  # the FFN never computes
        assert 0.9 < time.monotonic() - start < 3
        assert str(e.value).startswith("AFD attention rank 0 timed out after 1s waiting for "
                                       "the output of layer 0 ubatch 0 of step 0 from FFN "
                                       "rank 0")
        # The FFN is told why instead of waiting out its own timeout.
        ffn.recv_step(0)
        ffn.recv_hidden(0, 0, 0)
        with pytest.raises(AFDConnectionError, match="attention rank 0 reported a fatal "
                           "error.*AFDTimeoutError: AFD attention rank 0 timed out"):
            ffn.recv_hidden(0, 1, 0)
    finally:
        attn.close()
        ffn.close()


@pytest.mark.parametrize("garbage, needle", [
    (b"GET / HTTP/1.1\r\nHost: ffn\r\n\r\n",
     "expected magic b'AFD1', received b'GET '"),
    (PREFIX.pack(MAGIC, 1 << 30, 0), "frame header length from attention rank 0"),
    (PREFIX.pack(MAGIC, 3, 0) + b"\x93\x01\x02", "malformed AFD message from attention rank 0"),
    (raw_frame(LayerFrame(step_id=0, layer_id=0, ubatch_id=0, dtype="float32",
                          shape=[2**20, HIDDEN], nbytes=2**20 * HIDDEN * 4)),
     "LayerFrame.shape: expected [4, 64], received [1048576, 64]"),
    (raw_frame(LayerFrame(step_id=0, layer_id=7, ubatch_id=0, dtype="float32",
                          shape=[4, HIDDEN], nbytes=4 * HIDDEN * 4)),
     "LayerFrame.layer_id: expected 0, received 7"),
    (raw_frame(LayerFrame(step_id=0, layer_id=0, ubatch_id=0, dtype="float32",
                          shape=[4, HIDDEN], nbytes=4 * HIDDEN * 4), announced=1 << 40),
     ("payload length from attention rank 0: expected 1024 (LayerFrame.nbytes), received "
      "1099511627776")),
], ids=["http", "huge-header", "bad-msgpack", "oversized", "wrong-layer", "lying-length"])
def test_malformed_frame_on_the_socket(garbage, needle):
    attn, ffn = connect_pair("tcp")
    try:
        attn.send_step(StepHeader(step_id=0, num_tokens=[4]))
        ffn.recv_step(0)
        attn._streams[0].sock.sendall(garbage)  # bypass the connector: raw bytes
        with pytest.raises(ProtocolError) as e:
            ffn.recv_hidden(0, 0, 0)
        assert needle in str(e.value)
        # Both sides are now unusable, with clear errors, and nothing hangs.
        with pytest.raises(AFDConnectionError, match="unusable after an earlier error"):
            ffn.recv_hidden(0, 0, 0)
        with pytest.raises(AFDConnectionError, match="FFN rank 0 reported a fatal error"):
            attn.send_hidden(0, 0, torch.zeros(4, HIDDEN))
            attn.recv_output(0, 0)
    finally:
        attn.close()
        ffn.close()


def test_malformed_bytes_on_loopback():
    attn, ffn = connect_pair("loopback")
    try:
        attn.send_step(StepHeader(step_id=0, num_tokens=[4]))
        ffn.recv_step(0)
        attn._streams[0].send(b"\xc1garbage", None)
        with pytest.raises(ProtocolError, match="malformed AFD message from attention rank 0"):
            ffn.recv_hidden(0, 0, 0)
    finally:
        attn.close()
        ffn.close()


def test_stray_client_does_not_stop_the_ffn():
    port = free_port()
    ffn = make("tcp", "ffn", port)
    waiter = Background(ffn.connect)
    time.sleep(0.1)
    with socket.create_connection(("127.0.0.1", port)) as stray:
        stray.sendall(b"GET / HTTP/1.1\r\n\r\n")
        attn = make("tcp", "attention", port)
        attn.connect()
        waiter.join_result()
    try:
        server = Background(ffn_serve, ffn, 1)
        attn.send_step(StepHeader(step_id=0, num_tokens=[1]))
        attn.send_hidden(0, 0, torch.ones(1, HIDDEN))
        assert attn.recv_output(0, 0).eq(2).all()
        attn.send_step(StepHeader(step_id=0, num_tokens=[], flags=wire.SHUTDOWN))
        server.join_result()
    finally:
        attn.close()
        ffn.close()


@pytest.mark.parametrize("kind", KINDS)
def test_handshake_refuses_mismatched_peer(kind):
    """The FFN refuses a mismatched peer, naming every differing item, and then
    serves the next, well-configured one."""
    port = free_port()
    ffn = make(kind, "ffn", port, fingerprint={"model": "a", "layers": "4"})
    bad = make(kind, "attention", port, hidden_size=HIDDEN * 2,
               fingerprint={"model": "b", "extra": "1"})
    good = make(kind, "attention", port, fingerprint={"model": "a", "layers": "4"})
    waiter = Background(ffn.connect)
    try:
        start = time.monotonic()
        with pytest.raises(ProtocolError) as e:
            bad.connect()
        assert time.monotonic() - start < 10
        assert f"FFN rank 0 at {bad.address} refused AFD attention rank 0" in str(e.value)
        assert "hidden_size: expected 64, received 128" in str(e.value)
        assert "fingerprint['model']: expected 'a', received 'b'" in str(e.value)
        assert "extra" not in str(e.value) and "layers" not in str(e.value)
        assert waiter.is_alive()  # still accepting
        assert ffn.handshake.failures == 1 and ffn.handshake.auth_failures == 0
        assert ffn.handshake.last_refusal.startswith("attention rank 0")
        assert ffn.handshake.last_refusal.endswith("hidden_size: expected 64, received 128; "
                                         "fingerprint['model']: expected 'a', received 'b'")
        serve_one_layer(waiter, ffn, good)
    finally:
        bad.close()
        good.close()
        ffn.close()
    if kind == "shm":
        assert shm_entries(ffn.port) == []


def test_handshake_refuses_other_connector():
    port = free_port()
    ffn = make("nccl", "ffn", port, timeout_s=3)
    attn = make("tcp", "attention", port)
    waiter = Background(ffn.connect)
    try:
        with pytest.raises(ProtocolError, match="connector: expected 'nccl', received 'tcp'"):
            attn.connect()
        with pytest.raises(AFDTimeoutError, match=r"1 connection\(s\) dropped or refused "
                           r"during the handshake; the last refusal: attention rank 0 "
                           r"\(127.0.0.1:\d+\): connector: expected 'nccl'"):
            waiter.join_result()
    finally:
        attn.close()
        ffn.close()


def test_local_misuse_is_a_value_error():
    attn, ffn = connect_pair("loopback", num_ubatches=2)
    try:
        with pytest.raises(ValueError, match="send_step"):
            attn.send_hidden(0, 0, torch.zeros(1, HIDDEN))
        with pytest.raises(ValueError, match="attention side's API"):
            ffn.send_step(StepHeader(step_id=0, num_tokens=[1]))
        attn.send_step(StepHeader(step_id=0, num_tokens=[2, 3]))
        with pytest.raises(ValueError, match=r"expected shape \[2, 64\] torch.float32, got "
                           r"\[3, 64\] torch.float32"):
            attn.send_hidden(0, 0, torch.zeros(3, HIDDEN))
        with pytest.raises(ValueError, match="ubatch 2 is not in step 0"):
            attn.send_hidden(0, 2, torch.zeros(3, HIDDEN))
        attn.send_hidden(0, 0, torch.zeros(2, HIDDEN))
        attn.send_hidden(0, 1, torch.zeros(3, HIDDEN))
        with pytest.raises(ValueError, match="the next one is layer 0 ubatch 0"):
            attn.recv_output(0, 1)
        with pytest.raises(ValueError, match="already has hidden states in flight"):
            attn.send_hidden(1, 0, torch.zeros(2, HIDDEN))
        with pytest.raises(ValueError, match="still waits for the output"):
            attn.send_step(StepHeader(step_id=1, num_tokens=[1]))
        ffn.recv_step(0)
        for u in (0, 1):
            with pytest.raises(ValueError, match="without its hidden states"):
                ffn.send_output(0, 0, u, torch.zeros(2 + u, HIDDEN))
            ffn.send_output(0, 0, u, ffn.recv_hidden(0, 0, u))
            attn.recv_output(0, u)
        with pytest.raises(ProtocolError, match="steps only move forward"):
            attn.send_step(StepHeader(step_id=0, num_tokens=[1]))
    finally:
        attn.close()
        ffn.close()


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("kind", KINDS)
def test_routing_round_trip(kind, dtype):
    """gate_on "attention": top-k weights and ids travel with the hidden states
    of MoE layers (odd hidden sizes too: the routing is padded into alignment),
    dense layers send none, and both ends count the same bytes."""
    hidden, num_layers = 63, 2
    attn, ffn = connect_pair(kind, num_ubatches=2, dtype=dtype, hidden_size=hidden,
                             routing_topk=TOPK)
    seen: list = []
    server = Background(ffn_serve, ffn, num_layers, seen)
    g = torch.Generator().manual_seed(1)
    sent = []
    try:
        for step_id, tokens in enumerate([[1, 0], [MAX_TOKENS // 2] * 2, [5, 3]]):
            attn.send_step(StepHeader(step_id=step_id, num_tokens=tokens))
            for layer in range(num_layers):
                hs = [torch.randn(n, hidden, generator=g).to(dtype) for n in tokens]
                rs = [routing_for(n, 10 * step_id + u) if layer % 2 == 0 else None
                      for u, n in enumerate(tokens)]
                for u, (h, r) in enumerate(zip(hs, rs)):
                    attn.send_hidden(layer, u, h, routing=r)
                    sent.append((layer, u, r))
                for u, (h, r) in enumerate(zip(hs, rs)):
                    out = attn.recv_output(layer, u)
                    expected = h * 2 + layer
                    if r is not None:
                        expected = expected + (r.topk_weights * r.topk_ids).sum(
                            1, keepdim=True).to(dtype)
                    assert torch.equal(out, expected)
        attn.send_step(StepHeader(step_id=0, num_tokens=[], flags=wire.SHUTDOWN))
        assert server.join_result() == 3
        assert len(seen) == len(sent)
        for (layer, u, r), (layer2, u2, got) in zip(sent, seen):
            assert (layer, u) == (layer2, u2)
            assert (r is None) == (got is None)
            if r is not None:
                assert torch.equal(got[0], r.topk_weights) and torch.equal(got[1], r.topk_ids)
                assert got[0].dtype == torch.float32 and got[1].dtype == torch.int32
        assert attn.bytes_sent == ffn.bytes_received and attn.bytes_received == ffn.bytes_sent
    finally:
        attn.close()
        ffn.close()


@pytest.mark.parametrize("transfer", ["fp8", {"to_ffn": "fp8"}, {"to_attention": "fp8"}],
                         ids=["fp8", "fp8-to-ffn", "fp8-to-attention"])
@pytest.mark.parametrize("kind", KINDS)
def test_fp8_round_trip(kind, transfer):
    """transfer_dtype fp8: hidden states (and outputs, per direction) travel as
    fp8 e4m3 with a float32 scale per 128 elements, packed by the op library
    (into the shared-memory slot itself for shm); each side gets exactly what
    plain torch's quantize/dequantize of the sent tensor gives, routing stays
    exact, and fp8 frames carry about half the bytes of bf16 ones."""

    def through_fp8(x: torch.Tensor) -> torch.Tensor:
        return reference_dequantize(*reference_quantize(x, 128), 128, x.dtype)

    cfg = AFDConfig(role="attention", transfer_dtype=transfer)
    to_ffn, back = (cfg.transfer_to_ffn == "fp8"), (cfg.transfer_to_attention == "fp8")
    hidden, dtype = 200, torch.bfloat16  # two scale groups, the second partial
    attn, ffn = connect_pair(kind, num_ubatches=2, dtype=dtype, hidden_size=hidden,
                             routing_topk=TOPK, transfer_dtype=transfer)
    seen: list = []
    server = Background(ffn_serve, ffn, 2, seen)
    g = torch.Generator().manual_seed(3)
    try:
        for step_id, tokens in enumerate([[1, 0], [MAX_TOKENS // 2] * 2, [5, 3]]):
            attn.send_step(StepHeader(step_id=step_id, num_tokens=tokens))
            for layer in range(2):
                hs = [(torch.randn(n, hidden, generator=g) * 10).to(dtype) for n in tokens]
                rs = [routing_for(n, u) if layer == 0 else None for u, n in enumerate(tokens)]
                for u, (h, r) in enumerate(zip(hs, rs)):
                    attn.send_hidden(layer, u, h, routing=r)
                for u, (h, r) in enumerate(zip(hs, rs)):
                    out = attn.recv_output(layer, u, out=torch.empty_like(h) if u else None)
                    received = through_fp8(h) if to_ffn else h
                    expected = received * 2 + layer
                    if r is not None:
                        expected = expected + (r.topk_weights * r.topk_ids).sum(
                            1, keepdim=True).to(dtype)
                    if back:
                        expected = through_fp8(expected)
                    assert torch.equal(out, expected), (step_id, layer, u)
                    if to_ffn and h.numel():
                        assert not torch.equal(received, h)  # it really went as fp8
        attn.send_step(StepHeader(step_id=0, num_tokens=[], flags=wire.SHUTDOWN))
        assert server.join_result() == 3
        for layer, u, got in seen:  # routing is never quantized
            assert (got is None) == (layer != 0)
        assert attn.bytes_sent == ffn.bytes_received and attn.bytes_received == ffn.bytes_sent
    finally:
        attn.close()
        ffn.close()


def test_fp8_frames_are_half_the_bytes_of_bf16():
    """Bytes on the wire per token and layer, bf16 against fp8 (hidden 2048,
    no routing): 2 bytes an element against 1 plus a 4-byte scale per 128."""
    totals = {}
    for transfer in ("auto", "fp8"):
        attn, ffn = connect_pair("tcp", dtype=torch.bfloat16, hidden_size=2048,
                                 transfer_dtype=transfer)
        server = Background(ffn_serve, ffn, 1)
        try:
            attn.send_step(StepHeader(step_id=0, num_tokens=[16]))
            before = attn.bytes_sent
            attn.send_hidden(0, 0, torch.randn(16, 2048).to(torch.bfloat16))
            totals[transfer] = attn.bytes_sent - before
            attn.recv_output(0, 0)
            attn.send_step(StepHeader(step_id=0, num_tokens=[], flags=wire.SHUTDOWN))
            server.join_result()
        finally:
            attn.close()
            ffn.close()
    assert totals["auto"] > 16 * 2048 * 2 and totals["fp8"] > 16 * (2048 + 16 * 4)
    assert totals["fp8"] < 0.52 * totals["auto"], totals


@pytest.mark.parametrize("kind", ["tcp", "shm"])
def test_routing_on_a_device_without_pack_kernels(kind, monkeypatch):
    """Where the op library cannot pack (a device other than cpu, cuda and
    PrivateUse1; here the CPU, told so), routed payloads go as their parts
    back to back: the same bytes, the same answers, no op called."""
    from vllm.afd.transport.connectors import codec

    monkeypatch.setattr(codec, "PACK_DEVICE_KINDS", ("cuda",))
    attn, ffn = connect_pair(kind, dtype=torch.bfloat16, hidden_size=63, routing_topk=TOPK)
    assert not attn.codec.packs
    server = Background(ffn_serve, ffn, 1)
    try:
        attn.send_step(StepHeader(step_id=0, num_tokens=[5]))
        h, r = torch.randn(5, 63).to(torch.bfloat16), routing_for(5, 0)
        attn.send_hidden(0, 0, h, routing=r)
        expected = h * 2 + (r.topk_weights * r.topk_ids).sum(1, keepdim=True).to(h.dtype)
        assert torch.equal(attn.recv_output(0, 0), expected)
        attn.send_step(StepHeader(step_id=0, num_tokens=[], flags=wire.SHUTDOWN))
        assert server.join_result() == 1
    finally:
        attn.close()
        ffn.close()


def test_fp8_needs_pack_kernels_for_the_device():
    """fp8 on a device the op library cannot pack on (here the meta device)
    is refused when the connector is built, naming the option."""
    with pytest.raises(ValueError, match=r"AFDConfig.transfer_dtype: 'fp8' needs the afd op "
                                         r"library's pack kernels, which exist for cpu, cuda, "
                                         r"privateuseone, not meta"):
        make("tcp", "attention", free_port(), transfer_dtype="fp8", device="meta")
    make("tcp", "attention", free_port(), device="meta").close()  # auto needs none


@pytest.mark.parametrize("attention, ffn_side, field", [
    ("fp8", "auto", "transfer_to_ffn: expected 'auto', received 'fp8'"),
    ({"to_attention": "fp8"}, "auto", "transfer_to_attention: expected 'auto', received 'fp8'"),
    ("auto", {"to_ffn": "fp8"}, "transfer_to_ffn: expected 'fp8', received 'auto'"),
])
def test_handshake_refuses_transfer_dtype_mismatch(attention, ffn_side, field):
    """Peers configured with different transfer encodings are refused at the
    handshake, naming the field, before any tensor moves."""
    port = free_port()
    ffn = make("shm", "ffn", port, transfer_dtype=ffn_side)
    attn = make("shm", "attention", port, transfer_dtype=attention)
    waiter = Background(ffn.connect)
    try:
        with pytest.raises(ProtocolError, match=field):
            attn.connect()
        assert field.split(":")[0] in ffn.handshake.last_refusal
        ffn.close()
        with pytest.raises(AFDConnectionError, match="was closed while it waited"):
            waiter.join_result()
    finally:
        attn.close()
        ffn.close()


@pytest.mark.parametrize("kind", ["loopback", "shm"])
def test_handshake_refuses_routing_mismatch(kind):
    """One role routing on the attention side, the other not: refused at the
    handshake, naming the field, before any tensor moves."""
    port = free_port()
    ffn = make(kind, "ffn", port, routing_topk=2)
    attn = make(kind, "attention", port)
    waiter = Background(ffn.connect)
    try:
        with pytest.raises(ProtocolError, match="routing_topk: expected 2, received 0"):
            attn.connect()
        assert "routing_topk" in ffn.handshake.last_refusal
        ffn.close()  # interrupts its accept loop
        with pytest.raises(AFDConnectionError, match="was closed while it waited"):
            waiter.join_result()
    finally:
        attn.close()
        ffn.close()


@pytest.mark.parametrize("topk, nbytes, needle", [
    (2, 4 * HIDDEN * 4 + 4 * 2 * 8, "LayerFrame.topk: expected 0 or 3, received 2"),
    (TOPK, 4 * HIDDEN * 4, (f"LayerFrame.nbytes: expected {4 * HIDDEN * 4 + 4 * TOPK * 8} "
                            f"(shape [4, 64] x float32, topk 3), received 1024")),
    (TOPK, 4 * HIDDEN * 4 + 4 * TOPK * 8 + 8, "LayerFrame.nbytes: expected 1120"),
], ids=["wrong-width", "routing-missing", "routing-too-long"])
def test_malformed_routing_is_refused(topk, nbytes, needle):
    attn, ffn = connect_pair("tcp", routing_topk=TOPK)
    try:
        attn.send_step(StepHeader(step_id=0, num_tokens=[4]))
        ffn.recv_step(0)
        bad = LayerFrame(step_id=0, layer_id=0, ubatch_id=0, dtype="float32", shape=[4, HIDDEN],
                         nbytes=nbytes, topk=topk)
        attn._streams[0].sock.sendall(raw_frame(bad, bytes(nbytes)))
        with pytest.raises(ProtocolError) as e:
            ffn.recv_hidden(0, 0, 0)
        assert needle in str(e.value)
    finally:
        attn.close()
        ffn.close()


def test_routed_payload_of_the_wrong_length_is_refused():
    """The codec sizes its views by the frame's layout and refuses raw bytes of
    another length (check_frame's nbytes check comes first on the wire)."""
    conn = make("tcp", "ffn", free_port(), routing_topk=TOPK)
    frame = LayerFrame(step_id=0, layer_id=0, ubatch_id=0, dtype="float32", shape=[4, HIDDEN],
                       nbytes=4 * HIDDEN * 4 + 4 * TOPK * 8, topk=TOPK)
    try:
        with pytest.raises(ProtocolError, match=r"payload length from attention rank 0: "
                                                r"expected 1120, received 1121"):
            conn.codec.decode(0, frame, torch.float32, torch.zeros(1121, dtype=torch.uint8), None)
    finally:
        conn.close()


def test_routing_without_negotiation_is_refused():
    """An FFN that did not negotiate routing refuses a routed frame; an
    attention connector without routing refuses to send one."""
    attn, ffn = connect_pair("tcp")
    try:
        attn.send_step(StepHeader(step_id=0, num_tokens=[2]))
        with pytest.raises(ValueError, match="built without routing"):
            attn.send_hidden(0, 0, torch.zeros(2, HIDDEN), routing=routing_for(2, 0))
        ffn.recv_step(0)
        bad = LayerFrame(step_id=0, layer_id=0, ubatch_id=0, dtype="float32", shape=[2, HIDDEN],
                         nbytes=2 * HIDDEN * 4 + 2 * TOPK * 8, topk=TOPK)
        attn._streams[0].sock.sendall(raw_frame(bad, bytes(bad.nbytes)))
        with pytest.raises(ProtocolError, match="LayerFrame.topk: expected 0, received 3"):
            ffn.recv_hidden(0, 0, 0)
    finally:
        attn.close()
        ffn.close()


def test_routing_local_misuse_is_a_value_error():
    attn, ffn = connect_pair("loopback", routing_topk=TOPK)
    try:
        attn.send_step(StepHeader(step_id=0, num_tokens=[2]))
        good = routing_for(2, 0)
        for bad, needle in [
            (wire.Routing(good.topk_weights[:1], good.topk_ids[:1]), r"\[2, 3\]"),
            (wire.Routing(good.topk_weights.double(), good.topk_ids), "topk_weights"),
            (wire.Routing(good.topk_weights, good.topk_ids.long()), "topk_ids"),
            (wire.Routing(good.topk_weights.t().contiguous().t(), good.topk_ids), "contiguous"),
        ]:
            with pytest.raises(ValueError, match=needle):
                attn.send_hidden(0, 0, torch.zeros(2, HIDDEN), routing=bad)
    finally:
        attn.close()
        ffn.close()


# ------------------------------------------------------ processes and /dev/shm
def _attention_process(port: int) -> None:
    attn = make("shm", "attention", port)
    attn.connect()
    attn.send_step(StepHeader(step_id=0, num_tokens=[2]))
    attn.send_hidden(0, 0, torch.ones(2, HIDDEN))
    attn.recv_output(0, 0)
    attn.send_hidden(1, 0, torch.ones(2, HIDDEN))
    time.sleep(60)  # killed here


def _ffn_process(port: int) -> None:
    ffn = make("shm", "ffn", port)
    ffn.connect()
    ffn.recv_step(0)
    ffn.send_output(0, 0, 0, ffn.recv_hidden(0, 0, 0))
    time.sleep(60)  # killed here


def _start(target, port: int):
    process = multiprocessing.get_context("fork").Process(target=target, args=(port,))
    process.start()
    return process


def test_shm_attention_killed():
    port = free_port()
    ffn = make("shm", "ffn", port)
    child = _start(_attention_process, port)
    try:
        ffn.connect()
        ffn.recv_step(0)
        ffn.send_output(0, 0, 0, ffn.recv_hidden(0, 0, 0))
        ffn.recv_hidden(0, 1, 0)
        assert shm_entries(port) == []  # the attention unlinked them once mapped
        os.kill(child.pid, signal.SIGKILL)
        start = time.monotonic()
        with pytest.raises(AFDConnectionError, match="attention rank 0 .* closed the "
                           "connection .* while AFD ffn rank 0 waited for the next step"):
            ffn.recv_step(0)
        assert time.monotonic() - start < 5
    finally:
        ffn.close()
        child.kill()
        child.join()
    assert shm_entries(ffn.port) == []


def test_shm_ffn_killed():
    port = free_port()
    child = _start(_ffn_process, port)
    attn = make("shm", "attention", port)
    try:
        attn.connect()
        assert shm_entries(port) == []  # unlinked as soon as both sides mapped them
        attn.send_step(StepHeader(step_id=0, num_tokens=[2]))
        attn.send_hidden(0, 0, torch.full((2, HIDDEN), 5.0))
        assert attn.recv_output(0, 0).eq(5.0).all()
        attn.send_hidden(1, 0, torch.ones(2, HIDDEN))
        os.kill(child.pid, signal.SIGKILL)
        with pytest.raises(AFDConnectionError, match="FFN rank 0 .* closed the connection"):
            attn.recv_output(1, 0)
    finally:
        attn.close()
        child.kill()
        child.join()
    assert shm_entries(port) == []


def test_shm_creator_unlinks_when_peer_never_attached():
    # A peer that completes the handshake and dies before mapping anything:
    # the FFN's segments exist until the FFN closes.
    port = free_port()
    ffn = make("shm", "ffn", port, timeout_s=5)
    waiter = Background(ffn.connect)
    attn = make("shm", "attention", port)
    peer = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
    deadline = time.monotonic() + 5
    while True:
        try:
            peer.connect(f"\0vllm-afd-{port}")
            break
        except OSError:
            assert time.monotonic() < deadline
            time.sleep(0.05)
    peer.sendall(raw_frame(attn.handshake.hello()))
    assert read_message(peer).accepted
    peer.sendall(raw_frame(wire.HelloConfirm(accepted=True)))
    waiter.join_result()
    try:
        assert len(shm_entries(port)) == 2
        peer.close()  # dies without attaching
        with pytest.raises(AFDConnectionError, match="closed the connection"):
            ffn.recv_step(0)
    finally:
        ffn.close()
    assert shm_entries(port) == []


def test_shm_notify_over_tcp():
    attn, ffn = connect_pair("shm")
    assert attn.address.startswith("unix:@vllm-afd-")
    attn.close()
    ffn.close()
    port = free_port()
    cfg = {"role": "ffn", "connector": "shm", "port": port, "timeout_s": 5,
           "connector_extra_config": {"notify": "tcp"}}
    ffn = create_connector(AFDConfig(**cfg), hidden_size=HIDDEN, dtype=torch.float32,
                           max_tokens=MAX_TOKENS)
    attn = create_connector(AFDConfig(**{**cfg, "role": "attention"}), hidden_size=HIDDEN,
                            dtype=torch.float32, max_tokens=MAX_TOKENS)
    assert attn.address == f"tcp://127.0.0.1:{port}"
    waiter = Background(ffn.connect)
    try:
        attn.connect()
        waiter.join_result()
        attn.send_step(StepHeader(step_id=0, num_tokens=[1]))
        attn.send_hidden(0, 0, torch.ones(1, HIDDEN))
        ffn.recv_step(0)
        ffn.send_output(0, 0, 0, ffn.recv_hidden(0, 0, 0) + 1)
        assert attn.recv_output(0, 0).eq(2).all()
    finally:
        attn.close()
        ffn.close()


# ------------------------------------------------------------------ registry
def test_registry():
    assert connector_names() == ["ipc", "loopback", "nccl", "shm", "tcp"]
    for kind, cls in [("loopback", LoopbackConnector), ("tcp", TcpConnector),
                      ("shm", ShmConnector), ("nccl", NcclConnector)]:
        conn = make(kind, "attention", 7700)
        assert type(conn) is cls and conn.bytes_sent == conn.bytes_received == 0
    cfg = AFDConfig(connector="tcp")
    with pytest.raises(ValueError, match="unknown AFD connector 'rdma'; valid names: "
                       "ipc, loopback, nccl, shm, tcp"):
        create_connector(cfg, name="rdma", hidden_size=8, dtype=torch.float32, max_tokens=1)
    with pytest.raises(ValueError, match="package.module:ClassName"):
        register_connector("rdma", "not a target")
    with pytest.raises(ValueError, match="already registered"):
        register_connector("tcp", "vllm.afd.transport.connectors.shm:ShmConnector")
    from vllm.afd.transport.connectors.registry import unregister_connector

    register_connector("tcp-again", "vllm.afd.transport.connectors.tcp:TcpConnector")
    try:
        assert type(create_connector(cfg, name="tcp-again", hidden_size=8, dtype=torch.float32,
                                     max_tokens=1)) is TcpConnector
    finally:
        unregister_connector("tcp-again")
    with pytest.raises(ValueError, match="float64 cannot travel"):
        make("tcp", "attention", 7700, dtype=torch.float64)
    with pytest.raises(ValueError, match="attention rank 3 is not in 0-0"):
        make("tcp", "attention", 7700, rank=3)


def test_a_registered_connector_carries_its_own_handshake_data():
    """AFDConfig.connector names any registered connector; its handshake data
    travels in Hello.transport / HelloAck.transport, and its own check of the
    ack refuses (the FFN hears why in the HelloConfirm)."""
    from vllm.afd.transport.connectors.registry import unregister_connector

    register_connector("keyed-tcp", "plugin_connector:KeyedTcpConnector")
    try:
        assert "keyed-tcp" in connector_names()
        port = free_port()
        configs = [AFDConfig(role=role, connector="keyed-tcp", port=port, timeout_s=5,
                             connector_extra_config={"key": 21}) for role in ("ffn", "attention")]
        ffn, attn = (create_connector(c, hidden_size=HIDDEN, dtype=torch.float32,
                                      max_tokens=MAX_TOKENS) for c in configs)
        waiter = Background(ffn.connect)
        attn.connect()
        waiter.join_result()
        assert [(k.side, k.key) for k in ffn.received] == [("attention", 21)]
        assert [(k.side, k.key) for k in attn.received] == [("ffn", 42)]
        attn.close()
        ffn.close()
        # A mismatched key: the attention side refuses the ack and says why.
        port = free_port()
        ffn = create_connector(AFDConfig(role="ffn", connector="keyed-tcp", port=port,
                                         timeout_s=3, connector_extra_config={"key": 1}),
                               hidden_size=HIDDEN, dtype=torch.float32, max_tokens=MAX_TOKENS)
        attn = create_connector(AFDConfig(role="attention", connector="keyed-tcp", port=port,
                                          timeout_s=3, connector_extra_config={"key": 5}),
                                hidden_size=HIDDEN, dtype=torch.float32, max_tokens=MAX_TOKENS)
        waiter = Background(ffn.connect)
        with pytest.raises(ProtocolError, match="key 6, expected 10"):
            attn.connect()
        deadline = time.monotonic() + 5
        while "refused our HelloAck" not in (ffn.handshake.last_refusal or ""):
            assert time.monotonic() < deadline
            time.sleep(0.05)
        assert "key 6, expected 10" in ffn.handshake.last_refusal
        attn.close()
        ffn.close()
        with pytest.raises(ValueError, match=r"unknown key\(s\) \['nope'\] for connector "
                                             r"'keyed-tcp'"):
            create_connector(AFDConfig(connector="keyed-tcp",
                                       connector_extra_config={"nope": 1}),
                             hidden_size=8, dtype=torch.float32, max_tokens=1)
    finally:
        unregister_connector("keyed-tcp")
    assert "keyed-tcp" not in connector_names()
