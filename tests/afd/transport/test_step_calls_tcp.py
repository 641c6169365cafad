# SPDX-License-Identifier: Apache-2.0
# SPDX-FileCopyrightText: Copyright contributors to the vllm-afd project
"""The tcp connector's prepared layer calls (step_calls.py, tcp_frames.py, csrc/cpu/step_calls.cpp):
a step's layer calls take them on both ends, outputs are exact, and every
surprise (an error frame, a goodbye, a late answer, a frame the general path
wrote) is read by the general receive and raises what it always did (the
error frame, goodbye and late answer cases are test_step_calls.py's, for
shm and tcp); a peer that stops mid-payload fails the connector with the
payload's error. Real
connectors over loopback TCP, in threads of one process; the latency they save
is measured by `make bench-link` (round trip by payload), not here."""

import socket
import time

import pytest
import torch

from vllm.afd.attention.link import ForwardPass
from vllm.afd.transport.connectors.base import AFDConnectionError
from vllm.afd.transport.connectors.socket_stream import SocketStream
from vllm.afd.transport.connectors.shm_frames import ShmFrames
from vllm.afd.transport.connectors.tcp_frames import TcpFrames, socket_frame_template
from vllm.afd.transport.wire import StepHeader
from helpers.connectors import HIDDEN, Background
from helpers.pairs import echo, loop_and_link, pair, prepared_steps, tcp_pair


# Every test here counts prepared calls: none may fall back for a busy host.
pytestmark = pytest.mark.usefixtures("patient_waits")


def test_layer_calls_go_through_prepared_calls_on_both_ends():
    """Steps of several sizes: every message end of every layer call is a
    prepared call (the C side's count agrees), outputs are exact, and the
    byte counters say what went over the socket."""
    steps, layers = [3, 1, 16, 7], 4
    ffn, attn = tcp_pair()
    server = Background(echo, ffn, layers, None)
    try:
        prepared_steps(attn, steps, layers)
        calls = len(steps) * layers
        assert attn.fast_calls == 2 * calls
        send_ns, wait_ns, sent = attn.step_times()
        assert sent == layers and send_ns > 0 and wait_ns > 0  # the last step's
    finally:
        attn.close()
        assert server.join_result() == len(steps)
    # The FFN's first receive of a step (recv_hidden) and last send
    # (send_output) are prepared calls too.
    assert ffn.fast_calls == 2 * calls
    payload = sum(steps) * layers * HIDDEN * 4
    header = sum(len(socket_frame_template(torch.float32, rows, HIDDEN, 0,
                                           SocketStream.prefix)[0]) for rows in steps) * layers
    assert ffn.bytes_received - attn.bytes_sent == 0
    assert attn.bytes_received == ffn.bytes_sent
    assert ffn.bytes_sent >= payload + header  # and the goodbye's, the step headers'
    # Exact frames need no pack buffer (max_bytes each) on either end, and the
    # attention side receives straight into its `out`: no receive buffer.
    assert not attn.codec._pack_buffers and not ffn.codec._pack_buffers and not attn._rx_buffers
    ffn.close()


def test_the_general_paths_frames_are_read_by_the_general_receive():
    """The attention side sends through the general path (its frames encode
    small integers minimally, not as the template): the FFN's prepared
    receive finds them unequal, leaves them, and the general receive reads
    them; the replies, prepared, are read by the general receive alike."""
    ffn, attn = tcp_pair()
    server = Background(echo, ffn, 3, None)
    try:
        attn.send_step(StepHeader(step_id=1, num_tokens=[5]))
        for layer in range(3):
            h = torch.randn(5, HIDDEN)
            attn.send_hidden(layer, 0, h)
            assert torch.equal(attn.recv_output(layer, 0), h * 2 + layer)
        assert attn.fast_calls == 0
    finally:
        attn.close()
        assert server.join_result() == 1
    # Three hidden states received generally; three outputs sent prepared.
    assert ffn.fast_calls == 3
    ffn.close()


def expected_frame(step: int, layer: int, ubatch: int, rows: int) -> tuple[bytes, int]:
    """The prepared frame's bytes up to its payload, and the payload's size."""
    encoded, step_at, layer_at, ubatch_at, nbytes = socket_frame_template(
        torch.float32, rows, HIDDEN, 0, SocketStream.prefix)
    frame = bytearray(encoded)
    for at, value, width in ((step_at, step, 8), (layer_at, layer, 4), (ubatch_at, ubatch, 4)):
        frame[at:at + width] = value.to_bytes(width, "big")
    return bytes(frame), nbytes


def half_an_answer(ffn, attn) -> torch.Tensor:
    """A prepared layer call whose answer is the expected frame's header and
    half its payload, written to the FFN's socket by hand; the caller's output."""
    attn.send_step(StepHeader(step_id=1, num_tokens=[2]))
    h, out = torch.randn(2, HIDDEN), torch.empty(2, HIDDEN)
    attn.send_call(0, 0, h)
    assert attn.fast_calls == 1
    ffn.recv_step(0)
    ffn.recv_hidden(0, 0, 0)
    frame, nbytes = expected_frame(1, 0, 0, 2)
    ffn._streams[0].sock.setblocking(True)
    ffn._streams[0].sock.sendall(frame + bytes(nbytes // 2))
    return out


def test_a_peer_that_stops_mid_payload_fails_the_connector_with_the_payloads_error():
    """The FFN's header arrives (the expected one), half its payload, then
    nothing: the prepared receive, past the header, cannot give the frame
    back; the connector fails with the general path's error for a payload
    that did not come, and the caller's general receive raises it."""
    ffn, attn = tcp_pair(timeout_s=0.5)
    out = half_an_answer(ffn, attn)
    t0 = time.monotonic()
    with pytest.raises(AFDConnectionError, match="receiving the payload of the output of "
                                                 "layer 0 ubatch 0"):
        attn.recv_call(0, 0, out)
    assert 0.4 < time.monotonic() - t0 < 5
    assert attn.fast_calls == 1  # the take gave nothing
    attn.close()
    ffn.close()


def test_a_peer_gone_mid_payload_fails_the_connector_at_once():
    ffn, attn = tcp_pair()
    out = half_an_answer(ffn, attn)
    ffn._streams[0].sock.shutdown(socket.SHUT_RDWR)
    with pytest.raises(AFDConnectionError, match="closed the connection .* received the "
                                                 "payload of the output of layer 0"):
        attn.recv_call(0, 0, out)
    assert attn.fast_calls == 1  # the take gave nothing
    attn.close()
    ffn.close()


def test_shm_keeps_its_payloads_off_the_socket():
    """The shm connector (a SocketConnector for its header socket, like tcp)
    has no socket calls: its layer calls go through the lane."""

    ffn, attn = pair(spin_us=20_000)
    server = Background(echo, ffn, 2, None)
    try:
        prepared_steps(attn, [3], 2)
        assert attn.fast_calls == 4
    finally:
        attn.close()
        server.join_result()
    assert ffn.fast_calls == 4
    for side in (attn, ffn):
        assert isinstance(side.frames, ShmFrames) and not isinstance(side.frames, TcpFrames)
    ffn.close()


def test_the_link_and_the_loop_take_prepared_calls():
    """A real FFN loop and attention link over tcp: steps of one micro-batch
    and ping-pong steps of two go through prepared calls on both sides and
    give the FFN's results."""
    from vllm.afd.attention.pingpong import run_micro_batches

    layers = [0, 1, 2]
    loop, link, weight = loop_and_link("tcp", layers)
    try:
        assert loop.ready.wait(10)
        link.start()
        for rows in [1, 5, 32]:
            link.begin_step(ForwardPass(num_tokens=(rows,)))
            h = torch.randn(rows, HIDDEN)
            for layer in layers:
                out = link.exchange(layer, h)
                torch.testing.assert_close(out, h @ weight + layer, rtol=0, atol=0)
            link.end_step()
        hidden = [torch.randn(2, HIDDEN), torch.randn(3, HIDDEN)]
        link.begin_step(ForwardPass(num_tokens=(2, 3)))

        def run(u):
            return [link.exchange(layer, hidden[u]) for layer in layers]

        for u, outs in enumerate(run_micro_batches([2, 3], run, device=link.device)):
            for layer, out in zip(layers, outs):
                torch.testing.assert_close(out, hidden[u] @ weight + layer, rtol=0, atol=0)
        link.end_step()
        deadline = time.monotonic() + 10
        while loop.stats().steps < 4 and time.monotonic() < deadline:
            time.sleep(0.01)
        lead = link.pool.members[0].lead
        assert lead.fast_calls == 2 * (3 + 2) * len(layers)
        [session] = list(loop._sessions.values())
        assert session.fast_calls == 2 * (3 + 2) * len(layers)
        stats = link.stats
        assert stats.layer_calls == 5 * len(layers) and 0 < stats.send_s < stats.wait_s
        assert loop.stats().layer_calls == 5 * len(layers)
    finally:
        link.close()
        loop.stop()
