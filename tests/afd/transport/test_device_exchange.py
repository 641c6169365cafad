# SPDX-License-Identifier: Apache-2.0
# SPDX-FileCopyrightText: Copyright contributors to the vllm-afd project
"""A transport added without touching the link: the fake device-resident
exchange of tests/helpers/device_exchange.py (its message ends posted as a
device would post them; no GPU here, so the device is this host) implements
only the step channel (send_call/recv_call, take_call/reply_call) on top of the
loopback reference, is registered by name, and the attention link, its pool
failover and the FFN loop serve it as they serve shm and tcp: exact outputs,
micro-batches, a member lost mid-step. Its layer calls have graph-capturable
semantics: only copies between buffers fixed for the connection, no
allocation and no host read of a value, and step and layer checked on every
message."""

import time

import pytest
import torch

from vllm.afd.attention.link import AttentionLink, ForwardPass
from vllm.afd.attention.pingpong import run_micro_batches
from vllm.afd.ffn.loop import FFNLoop
from vllm.afd.topology import FFNPlacement
from vllm.afd.transport.config import LinkConfig
from vllm.afd.transport.wire import ProtocolError, StepHeader
from helpers import device_exchange
from helpers.connectors import HIDDEN, connect_pair, free_port
from helpers.torch_ops import ALLOCATING, AtenOps

LAYERS = [0, 1, 2]
WEIGHT = torch.randn(HIDDEN, HIDDEN, generator=torch.Generator().manual_seed(3)) / HIDDEN


def mlp(layer, h, routing):
    return h @ WEIGHT + layer


def reference(layer, h):
    return h @ WEIGHT + layer


@pytest.fixture(autouse=True)
def registered():
    device_exchange.register()
    yield
    device_exchange.unregister()


def start_loop(port: int, compute=mlp) -> FFNLoop:
    loop = FFNLoop(LinkConfig(role="ffn", connector=device_exchange.NAME, port=port,
                              timeout_s=10, num_ubatches=2),
                   layers=LAYERS, compute=compute, hidden_size=HIDDEN, dtype=torch.float32,
                   max_tokens=16, placement=FFNPlacement(rank=0, group=[0]), warmup_sizes=[])
    loop.start()
    assert loop.ready.wait(10)
    return loop


def make_link(port: int, **config) -> AttentionLink:
    link = AttentionLink(LinkConfig(connector=device_exchange.NAME, port=port, timeout_s=10,
                                    num_ubatches=2, **config),
                         hidden_size=HIDDEN, dtype=torch.float32, max_tokens=16)
    for layer in LAYERS:
        link.add_layer(layer)
    link.start()
    return link


def test_the_link_and_the_loop_serve_a_transport_that_implements_only_the_channel():
    """Steps of one micro-batch and of two (a real ping-pong), a strided `out`
    (the link's own fallback through the transport's buffer): outputs exact,
    counted once each, on both sides."""
    port = free_port()
    loop = start_loop(port)
    link = make_link(port)
    try:
        for rows in (1, 5, 16):
            link.begin_step(ForwardPass(num_tokens=(rows,)))
            h = torch.randn(rows, HIDDEN)
            for layer in LAYERS:
                assert torch.equal(link.exchange(layer, h, torch.empty_like(h)),
                                   reference(layer, h))
            link.end_step()
        hidden = [torch.randn(2, HIDDEN), torch.randn(3, HIDDEN)]
        link.begin_step(ForwardPass(num_tokens=(2, 3)))

        def run(u):
            return [link.exchange(layer, hidden[u], torch.empty_like(hidden[u]))
                    for layer in LAYERS]

        for u, outs in enumerate(run_micro_batches([2, 3], run, device=link.device)):
            for layer, out in zip(LAYERS, outs):
                assert torch.equal(out, reference(layer, hidden[u])), (u, layer)
        link.end_step()
        link.begin_step(ForwardPass(num_tokens=(4,)))
        h = torch.randn(4, HIDDEN)
        strided = torch.full((HIDDEN, 4), float("nan")).t()
        assert link.exchange(0, h, strided) is strided
        assert torch.equal(strided, reference(0, h))
        for layer in LAYERS[1:]:
            link.exchange(layer, h)
        link.end_step()
        assert link.stats.steps == 5 and link.stats.layer_calls == (3 + 2 + 1) * len(LAYERS)
        assert link.round_trip.count == link.stats.layer_calls
        deadline = time.monotonic() + 10  # the FFN counts a step after its last answer
        while loop.stats().steps < 5 and time.monotonic() < deadline:
            time.sleep(0.01)
        assert loop.stats().layer_calls == link.stats.layer_calls
    finally:
        link.close()
        loop.stop()


def test_its_layer_calls_are_graph_capturable():
    """What a FULL CUDA graph needs of an exchange: a layer call dispatches
    copies only (no allocation, no `.item()`-like host read), between buffers
    whose addresses stay the same at every step; and the adapter keeps FULL
    graph modes for a transport that says so (graph_capturable), not for shm."""
    port = free_port()
    seen = []  # the FFN's received hidden states: their addresses

    def recording(layer, h, routing):
        seen.append(h.data_ptr())
        return mlp(layer, h, routing)

    loop = start_loop(port, recording)
    link = make_link(port)
    try:
        for step in range(2):
            link.begin_step(ForwardPass(num_tokens=(4,)))
            h, out = torch.randn(4, HIDDEN), torch.empty(4, HIDDEN)
            for layer in LAYERS:
                with AtenOps() as ops:
                    link.exchange(layer, h, out)
                assert torch.equal(out, reference(layer, h))
                assert ops.names.count("copy_") == 2, ops.names  # in, and out
                assert not set(ops.names) & (ALLOCATING | {"_local_scalar_dense", "item"})
            link.end_step()
        assert len(seen) == 2 * len(LAYERS) and len(set(seen)) == 1  # one buffer
    finally:
        link.close()
        loop.stop()
    from vllm.afd.transport.connectors.registry import connector_class

    assert connector_class(device_exchange.NAME).graph_capturable
    assert not connector_class("shm").graph_capturable


def test_every_message_is_checked_against_the_step_and_layer_it_answers():
    """A message of another layer than the receiver awaits is a ProtocolError
    naming both (the flag a device would write), not wrong hidden states."""
    attn, ffn = connect_pair(device_exchange.NAME, timeout_s=5)
    try:
        attn.send_step(StepHeader(step_id=1, num_tokens=[2]))
        ffn.recv_step(0)
        attn.send_call(1, 0, torch.randn(2, HIDDEN))
        with pytest.raises(ProtocolError, match="expected the hidden states of step 1 layer 0 "
                                                "ubatch 0, the flag says step 1 layer 1"):
            ffn.take_call(0, 0, 0)
    finally:
        attn.close()
        ffn.close()


def test_a_member_lost_mid_step_is_resumed_on_another_without_the_link_knowing_the_transport():
    """A pool of two FFN loops over the fake device exchange: the member
    serving a step stops at its 5th mlp call; the step finishes on the other
    member with exact outputs (the link's failover sends the calls in flight
    again through the same channel)."""
    ports = [free_port(), free_port()]
    calls = []
    loops = []

    def dying(layer, h, routing):
        calls.append(layer)
        if len(calls) == 5:
            raise RuntimeError("injected: the member is lost")
        return mlp(layer, h, routing)

    loops.append(start_loop(ports[0], dying))
    loops.append(start_loop(ports[1]))
    link = make_link(ports[0], ffn_pool=[f"127.0.0.1:{port}" for port in ports])
    try:
        deadline = time.monotonic() + 10
        while len(link.pool.ready_members()) < 2 and time.monotonic() < deadline:
            time.sleep(0.05)
        assert len(link.pool.ready_members()) == 2
        for step in range(4):
            link.begin_step(ForwardPass(num_tokens=(3,)))
            h = torch.randn(3, HIDDEN)
            for layer in LAYERS:
                assert torch.equal(link.exchange(layer, h, torch.empty_like(h)),
                                   reference(layer, h)), (step, layer)
            link.end_step()
        doc = link.document()
        assert doc["failovers"] == 1 and doc["resent_layer_calls"] == 1, doc
        assert doc["steps"] == 4
    finally:
        link.close()
        for loop in loops:
            loop.stop()
