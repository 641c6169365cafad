# SPDX-License-Identifier: Apache-2.0
# SPDX-FileCopyrightText: Copyright contributors to the vllm-afd project
"""The shm connector's fast path for layer calls (shm_fast.py, csrc/cpu/lane.cpp):
it is taken where it may be, agrees with the general path to the byte, and
hands every surprise to the general path, which raises what it always did.
Real connectors, two threads of one process; the latency itself is measured
by `make bench-link` and `make bench`, not here."""

import random
import time

import pytest
import torch
from test_connectors import HIDDEN, Background, free_port
from test_doorbell import echo, pair

from vllm.afd.config import AFDConfig
from vllm.afd.transport import doorbell, wire
from vllm.afd.transport.connectors.base import AFDConnectionError, create_connector
from vllm.afd.transport.connectors.shm_fast import frame_template
from vllm.afd.transport.wire import ProtocolError, StepHeader


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16, torch.float16])
def test_frame_templates_decode_to_the_frames_they_stand_for(dtype):
    """A template patched with any step, layer and micro-batch is the encoding
    of exactly the LayerFrame wire.layer_frame describes (msgspec reads the
    fixed-width integers), for small and large shapes."""
    rng = random.Random(5)
    for rows in (1, 2, 127, 128, 255, 256, 65535, 65536, 1 << 20):
        encoded, step_at, layer_at, ubatch_at, nbytes = frame_template(dtype, rows, 7168)
        for _ in range(20):
            step, layer, ubatch = (rng.randrange(1 << rng.choice((7, 16, 40, 63))),
                                   rng.randrange(1 << rng.choice((7, 16, 31))),
                                   rng.randrange(wire.MAX_UBATCHES))
            patched = bytearray(encoded)
            patched[step_at:step_at + 8] = step.to_bytes(8, "big")
            patched[layer_at:layer_at + 4] = layer.to_bytes(4, "big")
            patched[ubatch_at:ubatch_at + 4] = ubatch.to_bytes(4, "big")
            frame = wire.decode(bytes(patched))
            assert frame == wire.layer_frame(torch.empty(rows, 7168, dtype=dtype, device="meta"),
                                             step_id=step, layer_id=layer, ubatch_id=ubatch)
            assert frame.nbytes == nbytes
            wire.check_frame(frame, step_id=step, layer_id=layer, ubatch_id=ubatch,
                             max_bytes=nbytes, expected_shape=[rows, 7168], dtype=dtype)


@pytest.mark.parametrize("spin_us", [0, 20_000])
def test_layer_calls_take_the_fast_path_and_count_what_the_general_path_counts(spin_us):
    """Every layer call's four message ends go through the lane when the
    caller passes `out` (the attention link always does), micro-batches of
    different sizes included; outputs are exact, and the byte counters add up
    as the general path's do (header, length word, payload)."""
    ffn, attn = pair(ffn_ubatches=2, attention_ubatches=2, spin_us=spin_us)
    # Counting, not timing: a receive waits FAST_WAIT_MS before the general path
    # takes over, which a loaded 2-core host running the suite sometimes exceeds
    # (47 of 48 once); the handover itself has its own test below.
    for conn in (ffn, attn):
        conn._links[0].fast_wait_ms = 10_000
    server = Background(echo, ffn, 3)
    g = torch.Generator().manual_seed(0)
    steps = [[3, 5], [15, 1], [1, 1], [7, 9]]
    try:
        for i, tokens in enumerate(steps):
            attn.send_step(StepHeader(step_id=i + 1, num_tokens=tokens))
            for layer in range(3):
                hidden = [torch.randn(n, HIDDEN, generator=g) for n in tokens]
                outs = [torch.empty_like(h) for h in hidden]
                for u, h in enumerate(hidden):
                    attn.send_hidden(layer, u, h)
                for u, h in enumerate(hidden):
                    assert attn.recv_output(layer, u, out=outs[u]) is outs[u]
                    assert torch.equal(outs[u], h * 2 + layer)
        calls = sum(len(t) for t in steps) * 3
        assert attn.fast_calls == 2 * calls  # each call: one send, one receive
        assert ffn.fast_calls == 2 * calls
    finally:
        attn.close()  # its goodbye counts on both sides
        assert server.join_result() == len(steps)
    payload = sum(n * HIDDEN * 4 for t in steps for n in t) * 3
    assert attn.bytes_sent > payload and attn.bytes_received > payload  # headers on top
    assert ffn.bytes_received == attn.bytes_sent and ffn.bytes_sent == attn.bytes_received
    ffn.close()


def test_a_frame_other_than_the_expected_one_raises_what_the_general_path_raises():
    """The attention side sends layer 0's hidden states where the FFN awaits
    layer 1's: the lane leaves the entry, the general path decodes it and
    fails with the field, both values and the peer, and the attention side
    hears why."""
    ffn, attn = pair()
    attn.send_step(StepHeader(step_id=1, num_tokens=[2]))
    assert ffn.recv_step(0).step_id == 1
    attn.send_hidden(0, 0, torch.ones(2, HIDDEN))
    with pytest.raises(ProtocolError, match=r"layer_id.*expected 1.*received 0"):
        ffn.recv_hidden(0, 1, 0)
    with pytest.raises(AFDConnectionError, match=r"layer_id"):
        attn.recv_output(0, 0, out=torch.empty(2, HIDDEN))
    assert ffn.fast_calls == 0 and attn.fast_calls == 1
    attn.close()
    ffn.close()


def test_an_error_frame_instead_of_the_output_reaches_the_caller_through_the_fast_path():
    """The FFN's mlp fails: it reports the error where the output would be; the
    attention side's fast receive finds something else and the general path
    raises the FFN's text."""
    ffn, attn = pair()
    attn.send_step(StepHeader(step_id=1, num_tokens=[1]))
    ffn.recv_step(0)
    attn.send_hidden(0, 0, torch.ones(1, HIDDEN))
    ffn.recv_hidden(0, 0, 0)
    ffn.report_error("the mlp of layer 0 ran out of memory")
    with pytest.raises(AFDConnectionError, match="ran out of memory"):
        attn.recv_output(0, 0, out=torch.empty(1, HIDDEN))
    attn.close()
    ffn.close()


def test_what_the_fast_path_cannot_carry_goes_the_general_way():
    """Routing, fp8, a non-contiguous or wrongly shaped tensor: no lane call;
    the general path sends it, or raises the caller's bug as before."""
    port = free_port()
    cfg = lambda role: AFDConfig(role=role, connector="shm", port=port,  # noqa: E731
                                 timeout_s=10, transfer_dtype="fp8")
    ffn = create_connector(cfg("ffn"), hidden_size=HIDDEN, dtype=torch.float32, max_tokens=8)
    attn = create_connector(cfg("attention"), hidden_size=HIDDEN, dtype=torch.float32,
                            max_tokens=8)
    accepting = Background(ffn.accept)
    attn.connect()
    accepting.join_result()
    server = Background(echo, ffn, 1)
    try:
        attn.send_step(StepHeader(step_id=1, num_tokens=[4]))
        h = torch.randn(4, HIDDEN)
        attn.send_hidden(0, 0, h)
        out = attn.recv_output(0, 0, out=torch.empty(4, HIDDEN))
        torch.testing.assert_close(out, h * 2, rtol=0.07, atol=0.07)  # fp8 both ways
        assert attn.fast_calls == 0
    finally:
        attn.close()
        server.join_result()
        ffn.close()
    ffn, attn = pair()
    try:
        attn.send_step(StepHeader(step_id=1, num_tokens=[4]))
        with pytest.raises(ValueError, match="contiguous"):
            attn.send_hidden(0, 0, torch.randn(HIDDEN, 4).t())
        with pytest.raises(ValueError, match=r"expected shape \[4, "):
            attn.send_hidden(0, 0, torch.randn(3, HIDDEN))
        assert attn.fast_calls == 0
    finally:
        attn.close()
        ffn.close()


def test_spinning_stops_only_when_spins_are_preempted_often():
    """A preempted spin now and then (another thread of the host waking for a
    moment) does not stop spinning: stopping it for a second each time had
    turned spinning off for most waits of a serving process. Three within a
    second (more runnable threads than cores) stop it for a second."""
    C = doorbell.lane_module()
    ring = torch.zeros(doorbell.RING_BYTES, dtype=torch.uint8)
    lane = C.lane_new(ring.data_ptr(), ring.data_ptr(), -1, doorbell.RING_ENTRIES,
                      doorbell.ENTRY_BYTES)
    s = 1_000_000_000
    t = 10 * s
    for _ in range(20):  # once every 0.6 s: keeps spinning
        t += 6 * s // 10
        assert C.lane_preempted(lane, t)
    assert C.lane_counters(lane)[2:] == (20, 0)
    t += 10 * s
    assert C.lane_preempted(lane, t) and C.lane_preempted(lane, t + s // 10)
    assert not C.lane_preempted(lane, t + 2 * s // 10)  # the third within a second
    assert C.lane_counters(lane)[3] == 1
    # Spinning is back a second later.
    assert C.lane_preempted(lane, t + 2 * s // 10 + int(doorbell.SPIN_BACKOFF_S * s) + 1)


def test_an_answer_later_than_the_fast_wait_arrives_through_the_general_path():
    """The FFN answers 0.3 s late: the fast receive gives up after
    FAST_WAIT_MS and the general path waits on (its own timeout_s), receives
    the frame and checks it; and a peer that never answers times out after
    timeout_s plus at most that short wait."""
    ffn, attn = pair(timeout_s=2)
    try:
        attn.send_step(StepHeader(step_id=1, num_tokens=[2]))
        ffn.recv_step(0)
        h = torch.randn(2, HIDDEN)
        attn.send_hidden(0, 0, h)

        def late():
            x = ffn.recv_hidden(0, 0, 0)
            time.sleep(0.3)
            ffn.send_output(0, 0, 0, x * 2)

        server = Background(late)
        out = torch.empty(2, HIDDEN)
        assert attn.recv_output(0, 0, out=out) is out and torch.equal(out, h * 2)
        server.join_result()
        assert attn.fast_calls == 1  # the send; the receive went the general way
        attn.send_hidden(1, 0, h)
        ffn.recv_hidden(0, 1, 0)  # and never answers
        t0 = time.monotonic()
        with pytest.raises(AFDConnectionError, match="timed out after 2s"):
            attn.recv_output(1, 0, out=out)
        assert 2 <= time.monotonic() - t0 < 2 + doorbell.FAST_WAIT_MS / 1000 + 0.5
    finally:
        attn.close()
        ffn.close()
