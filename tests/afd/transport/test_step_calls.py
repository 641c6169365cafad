# SPDX-License-Identifier: Apache-2.0
# SPDX-FileCopyrightText: Copyright contributors to the vllm-afd project
"""A step's layer calls prepared once (step_calls.py, csrc/cpu/step_calls.cpp;
shm_frames.py, tcp_frames.py, more in test_step_calls_tcp.py):
the attention link's steps of one micro-batch and the FFN loop's replies take
them, they count what the general path counts, and every surprise goes the
general way and raises what it always did. Real connectors, a real FFN loop
and attention link in threads of one process; the latency they save is
measured by `make bench` (link/layer), not here."""

import time

import pytest
import torch
from prometheus_client import CollectorRegistry, generate_latest
from prometheus_client.parser import text_string_to_metric_families

from vllm.afd.attention.link import AttentionLink, ForwardPass
from vllm.afd.ffn.loop import FFNLoop
from vllm.afd.observability.metrics import LinkCollector
from vllm.afd.topology import FFNPlacement
from vllm.afd.transport import shm_ring
from vllm.afd.transport.config import LinkConfig
from vllm.afd.transport.connectors import AFDConnectionError
from vllm.afd.transport.wire import StepHeader
from helpers.connectors import HIDDEN, Background, free_port
from helpers.pairs import echo, loop_and_link, pair, prepared_steps, tcp_pair
from helpers.torch_ops import ALLOCATING, AtenOps


PAIRS = {"shm": pair, "tcp": tcp_pair}  # (ffn, attn) with prepared calls


def general_steps(attn, steps: list[int], layers: int) -> None:
    g = torch.Generator().manual_seed(1)
    for i, rows in enumerate(steps):
        attn.send_step(StepHeader(step_id=i + 1, num_tokens=[rows]))
        for layer in range(layers):
            h = torch.randn(rows, HIDDEN, generator=g)
            attn.send_hidden(layer, 0, h)
            assert torch.equal(attn.recv_output(layer, 0), h * 2 + layer)


def test_prepared_calls_carry_every_layer_call_and_count_like_the_general_path(
        patient_waits):
    """Every message end of every layer call goes through a prepared call
    (the lane's own count agrees), outputs are exact, and the byte counters
    are those of the same steps through the general path, but for the
    headers' fixed-width integers."""
    steps, layers = [3, 1, 16, 7], 4
    ffn, attn = pair(spin_us=20_000)
    posted = []
    server = Background(echo, ffn, layers, posted)
    try:
        prepared_steps(attn, steps, layers)
        calls = len(steps) * layers
        assert attn.fast_calls == 2 * calls
        send_ns, wait_ns, c_calls = attn.step_times()
        assert c_calls == layers and send_ns > 0 and wait_ns > 0  # the last step's
    finally:
        attn.close()
        assert server.join_result() == len(steps)
    # Every FFN take and reply too (echo serves as the FFN loop does).
    assert ffn.fast_calls == 2 * calls
    assert posted == [layers] * len(steps)  # a prepared reply for every call
    ffn.close()
    ffn2, attn2 = pair(spin_us=20_000)
    server = Background(echo, ffn2, layers)
    try:
        general_steps(attn2, steps, layers)
    finally:
        attn2.close()
        assert server.join_result() == len(steps)
    ffn2.close()
    # The general path's headers encode step, layer and micro-batch in as few
    # bytes as msgpack allows, the templates in fixed widths: 8 + 4 + 4 more
    # bytes a frame toward the FFN here (whose ids all fit in one byte). The
    # outputs came through the FFN's C posts both times.
    assert attn.bytes_sent == attn2.bytes_sent + 16 * calls
    assert attn.bytes_received == attn2.bytes_received
    assert ffn.bytes_received == attn.bytes_sent and ffn2.bytes_received == attn2.bytes_sent


def test_what_prepared_calls_cannot_carry_is_not_sent():
    """Hidden states of another shape, dtype or layout, or an output already
    in flight: send_call's C post sends nothing (the lane's count stays), and
    the general path then raises its error for the call. An `out` the copy
    cannot fill is refused by recv_call's C take (checked there, while the
    FFN computes, not on the way to it): the general receive takes over."""
    ffn, attn = pair(spin_us=20_000)
    server = Background(echo, ffn, 1)
    try:
        attn.send_step(StepHeader(step_id=1, num_tokens=[4]))
        lane = attn._streams[0]
        sent = lane.counters["sent"]
        good = torch.randn(4, HIDDEN)
        for h, out in ((torch.randn(3, HIDDEN), torch.empty(3, HIDDEN)),
                       (good.double(), torch.empty(4, HIDDEN, dtype=torch.float64)),
                       (torch.randn(HIDDEN, 4).t(), torch.empty(4, HIDDEN))):
            with pytest.raises(ValueError, match="hidden states of layer 0 ubatch 0"):
                attn.send_call(0, 0, h)
        assert lane.counters["sent"] == sent and attn.fast_calls == 0
        attn.send_hidden(0, 0, good)
        sent, calls = lane.counters["sent"], attn.fast_calls
        with pytest.raises(ValueError, match="already has hidden states in flight"):
            attn.send_call(0, 0, good)  # one in flight
        assert lane.counters["sent"] == sent and attn.fast_calls == calls
        assert torch.equal(attn.recv_call(0, 0), good * 2)
        attn.send_step(StepHeader(step_id=2, num_tokens=[4]))
        out = torch.empty(4, HIDDEN + 1)[:, :HIDDEN]
        calls = attn.fast_calls
        attn.send_call(0, 0, good)
        assert attn.fast_calls == calls + 1
        received = lane.counters["received"]
        # The general receive's own error, as the call got before `out` was
        # checked by the C take.
        with pytest.raises(ValueError, match="output buffer of layer 0 ubatch 0 must be "
                                             "contiguous"):
            attn.recv_call(0, 0, out)
        assert lane.counters["received"] == received  # nothing taken
        assert attn.fast_calls == calls + 1
        assert torch.equal(attn.recv_call(0, 0), good * 2)  # the general receive's
    finally:
        attn.close()
        server.join_result()
    ffn.close()


@pytest.mark.parametrize("connector", PAIRS)
def test_an_error_frame_instead_of_the_output_is_raised_by_the_general_receive(connector):
    """The FFN reports an error instead of answering: recv_call's C take
    leaves it to the general receive, which raises the FFN's own text."""
    ffn, attn = PAIRS[connector](spin_us=20_000)

    def fail():
        ffn.recv_step(0)
        ffn.recv_hidden(0, 0, 0)
        ffn.report_error("the mlp of layer 0 failed: out of memory")

    server = Background(fail)
    attn.send_step(StepHeader(step_id=1, num_tokens=[2]))
    h, out = torch.randn(2, HIDDEN), torch.empty(2, HIDDEN)
    attn.send_call(0, 0, h)
    assert attn.fast_calls == 1
    server.join_result()
    with pytest.raises(AFDConnectionError, match="out of memory"):
        attn.recv_call(0, 0, out)
    assert attn.fast_calls == 1  # not taken by the C take
    attn.close()
    ffn.close()


@pytest.mark.parametrize("connector", PAIRS)
def test_a_goodbye_instead_of_the_next_hidden_states_is_raised_by_the_general_receive(
        connector):
    """The attention side leaves mid-step: the FFN's reply goes out, and the
    general receive of the next call raises what it always did."""
    ffn, attn = PAIRS[connector](spin_us=20_000)
    attn.send_step(StepHeader(step_id=1, num_tokens=[2]))
    h = torch.randn(2, HIDDEN)
    attn.send_hidden(0, 0, h)
    ffn.recv_step(0)
    got = ffn.recv_hidden(0, 0, 0)

    def reply_and_take_the_next():
        ffn.reply_call(0, 0, 0, got * 2)
        return ffn.take_call(0, 1, 0)

    replying = Background(reply_and_take_the_next)
    assert torch.equal(attn.recv_output(0, 0), h * 2)
    attn.close()  # says goodbye
    with pytest.raises(AFDConnectionError):
        replying.join_result()
    ffn.close()


@pytest.mark.parametrize("connector", PAIRS)
def test_an_answer_later_than_the_prepared_wait_arrives_through_the_general_path(
        monkeypatch, connector):
    """An FFN slower than the C take's bound (shm_ring.FAST_WAIT_MS): the
    general receive waits on and delivers the output."""
    from vllm.afd.transport import shm_ring

    monkeypatch.setattr(shm_ring, "FAST_WAIT_MS", 20)
    ffn, attn = PAIRS[connector](spin_us=0)

    def slow():
        ffn.recv_step(0)
        h = ffn.recv_hidden(0, 0, 0)
        time.sleep(0.2)
        ffn.send_output(0, 0, 0, h + 1)

    server = Background(slow)
    attn.send_step(StepHeader(step_id=1, num_tokens=[2]))
    h, out = torch.randn(2, HIDDEN), torch.empty(2, HIDDEN)
    attn.send_call(0, 0, h)
    assert attn.fast_calls == 1
    assert attn.recv_call(0, 0, out) is out and torch.equal(out, h + 1)
    # The C take gave up at its bound (it would have counted the output it
    # took): the general receive waited on.
    assert attn.fast_calls == 1
    server.join_result()
    attn.close()
    ffn.close()


def test_the_link_and_the_loop_take_prepared_calls_for_one_micro_batch_steps(patient_waits):
    """A real FFN loop and attention link over shm: steps of one micro-batch
    go through prepared calls on both sides (the FFN's loop posts every reply,
    the step's last included, before its bookkeeping), give the FFN's results,
    and their time is
    split into sending and waiting as the general path's is; each side counts
    its spins' preemptions and backoffs in its link statistics. The FFN's
    waits for the next call's hidden states count as waiting (20 ms of
    attention compute before each call but a step's first)."""
    layers = [0, 1, 2]
    loop, link, weight = loop_and_link("shm", layers)
    try:
        assert loop.ready.wait(10)
        link.start()
        for step, rows in enumerate([1, 5, 32]):
            link.begin_step(ForwardPass(num_tokens=(rows,)))
            h = torch.randn(rows, HIDDEN)
            for layer in layers:
                if layer:
                    time.sleep(0.02)  # this side's compute: the FFN waits for it
                out = torch.empty_like(h)
                assert link.exchange(layer, h, out) is out
                torch.testing.assert_close(out, h @ weight + layer, rtol=0, atol=0)
            link.end_step()
        # The FFN counts a step after its last answer: wait for it to get there.
        deadline = time.monotonic() + 10
        while loop.stats().steps < 3 and time.monotonic() < deadline:
            time.sleep(0.01)
        lead = link.pool.members[0].lead
        assert lead.fast_calls == 2 * 3 * len(layers)
        [session] = list(loop._sessions.values())
        assert session.fast_calls == 2 * 3 * len(layers)
        # The last step's: a reply for every call, the step's last one included.
        assert session.step_times(0)[2] == len(layers)
        stats = link.stats
        assert stats.layer_calls == 3 * len(layers) and stats.steps == 3
        assert 0 < stats.send_s < stats.wait_s
        assert link.round_trip.count == 3 * len(layers)
        ffn_stats = loop.stats()
        assert ffn_stats.layer_calls == 3 * len(layers) and ffn_stats.send_s > 0
        assert ffn_stats.wait_s >= 0.02 * (len(layers) - 1) * 3
        assert loop.compute_hist.count == 3 * len(layers)
        # Spins that lost their core land in each side's link statistics (lane_note_spin
        # notes one as the C wait does; three within a second make a backoff).
        lane_C = shm_ring.lane_module()
        before = (stats.spin_preemptions, stats.spin_backoffs,
                  ffn_stats.spin_preemptions, ffn_stats.spin_backoffs)
        t = time.monotonic_ns()
        for i in range(3):
            lane_C.lane_note_spin(lead._streams[0].lane, t + i)
        lane_C.lane_note_spin(session._streams[0].lane, t)
        link.begin_step(ForwardPass(num_tokens=(4,)))
        h = torch.randn(4, HIDDEN)
        for layer in layers:
            link.exchange(layer, h, torch.empty_like(h))
        link.end_step()
        while loop.stats().steps < 4 and time.monotonic() < deadline:
            time.sleep(0.01)
        ffn_stats = loop.stats()
        after = (stats.spin_preemptions, stats.spin_backoffs,
                 ffn_stats.spin_preemptions, ffn_stats.spin_backoffs)
        # At least: this host's scheduler may preempt a spin of its own meanwhile.
        assert all(a - b >= n for a, b, n in zip(after, before, (3, 1, 1, 0))), (before, after)
        # ... and in /metrics, for both roles.
        registry = CollectorRegistry()
        registry.register(LinkCollector(lambda: [link.document(), loop.document()]))
        spins = {(s.name, s.labels["role"]): s.value
                 for family in text_string_to_metric_families(generate_latest(registry).decode())
                 for s in family.samples if s.name.startswith("vllm_afd_spin_")}
        assert spins == {("vllm_afd_spin_preemptions_total", "attention"): after[0],
                         ("vllm_afd_spin_backoffs_total", "attention"): after[1],
                         ("vllm_afd_spin_preemptions_total", "ffn"): after[2],
                         ("vllm_afd_spin_backoffs_total", "ffn"): after[3]}
        # Two micro-batches, the turns of a real ping-pong (both in flight at
        # once): prepared calls too, on both sides.
        from vllm.afd.attention.pingpong import run_micro_batches

        hidden = [torch.randn(2, HIDDEN), torch.randn(3, HIDDEN)]
        fast_before = (lead.fast_calls, session.fast_calls)
        for _ in range(2):
            link.begin_step(ForwardPass(num_tokens=(2, 3)))
            assert link.step.sender is lead

            def run(u, hidden=hidden):
                h = hidden[u]
                outs = []
                for layer in layers:
                    outs.append(link.exchange(layer, h, torch.empty_like(h)))
                return outs

            for u, outs in enumerate(run_micro_batches([2, 3], run, device=link.device)):
                for layer, out in zip(layers, outs):
                    torch.testing.assert_close(out, hidden[u] @ weight + layer, rtol=0,
                                               atol=0)
            link.end_step()
            assert lead.step_times()[2] == 2 * len(layers)  # every call prepared
        assert lead.fast_calls - fast_before[0] == 2 * 2 * 2 * len(layers)
        while loop.stats().steps < 6 and time.monotonic() < deadline:
            time.sleep(0.01)
        assert session.fast_calls - fast_before[1] >= 2 * 2 * (2 * len(layers) - 1)
        assert link.stats.steps == 6 and link.stats.layer_calls == 4 * 3 + 2 * 2 * 3
        assert link.round_trip.count == link.stats.layer_calls
    finally:
        link.close()
        loop.stop()


@pytest.mark.parametrize("path", ["one micro-batch", "micro-batched"])
def test_an_output_the_caller_does_not_give_is_made_after_the_send(path):
    """exchange without `out` (an eager RemoteFFN's call) allocates the output
    once the hidden states are out (send_call returned), in steps of one
    micro-batch and of several. On a CPU host's cold
    cache an allocation costs ~15 us: made after the send, the FFN computes
    meanwhile; made before, both sides wait for it."""

    port = free_port()
    config = dict(connector="shm", port=port, timeout_s=10, num_ubatches=2)
    loop = FFNLoop(LinkConfig(role="ffn", **config), layers=[0, 1],
                   compute=lambda layer, h, routing: h * 2 + layer, hidden_size=HIDDEN,
                   dtype=torch.float32, max_tokens=32, placement=FFNPlacement(0, [0]),
                   warmup_sizes=[])
    loop.start()
    link = AttentionLink(LinkConfig(**config), hidden_size=HIDDEN, dtype=torch.float32,
                         max_tokens=32)
    for layer in (0, 1):
        link.add_layer(layer)
    try:
        assert loop.ready.wait(10)
        link.start()
        rows = (3,) if path == "one micro-batch" else (2, 3)
        link.begin_step(ForwardPass(num_tokens=rows))
        sender, name = link.step.sender, "send_call"
        for layer in (0, 1):
            for u, n in enumerate(rows):
                h = torch.randn(n, HIDDEN)
                with AtenOps() as ops:
                    send = getattr(sender, name)

                    def sending(*args, send=send, names=ops.names):
                        names.append("<sent>")
                        return send(*args)

                    setattr(sender, name, sending)  # an instance attribute, over the method
                    try:
                        out = link.exchange(layer, h, ubatch=u if len(rows) > 1 else None)
                    finally:
                        delattr(sender, name)
                assert torch.equal(out, h * 2 + layer)
                allocations = [i for i, op in enumerate(ops.names) if op in ALLOCATING]
                assert allocations and ops.names.index("<sent>") < allocations[0], ops.names
        link.end_step()
    finally:
        link.close()
        loop.stop()


@pytest.mark.parametrize("connector", ["shm", "tcp"])
def test_tensors_the_transport_cannot_take_fail_no_link(connector):
    """exchange's tensors are the caller's: a strided `out` gets the output
    copied in; one of another shape or dtype raises ValueError once the output
    is taken; hidden states the step does not send raise ValueError with
    nothing sent. None is a link failure: no failover, the step goes on."""

    port = free_port()
    layers = [0, 1, 2]
    config = dict(connector=connector, port=port, timeout_s=10,
                  connector_extra_config={"spin_us": 20_000} if connector == "shm" else {})
    loop = FFNLoop(LinkConfig(role="ffn", **config), layers=layers,
                   compute=lambda layer, h, routing: h * 2 + layer, hidden_size=HIDDEN,
                   dtype=torch.float32, max_tokens=8, placement=FFNPlacement(rank=0, group=[0]),
                   warmup_sizes=[])
    loop.start()
    link = AttentionLink(LinkConfig(**config), hidden_size=HIDDEN, dtype=torch.float32,
                         max_tokens=8)
    for layer in layers:
        link.add_layer(layer)
    try:
        assert loop.ready.wait(10)
        link.start()
        h = torch.randn(4, HIDDEN)
        link.begin_step(ForwardPass(num_tokens=(4,)))
        strided = torch.full((HIDDEN, 4), float("nan")).t()
        assert link.exchange(0, h, strided) is strided
        assert torch.equal(strided, h * 2)
        with pytest.raises(ValueError, match=r"output buffer of layer 1 micro-batch 0 is "
                                             r"\[4, 64\] torch.float64"):
            link.exchange(1, h, torch.empty(4, HIDDEN, dtype=torch.float64))
        out = torch.empty_like(h)
        link.exchange(2, h, out)  # the link stayed in step
        assert torch.equal(out, h * 2 + 2)
        link.end_step()
        # Hidden states the step does not send (rows, dtype) are refused with
        # nothing sent; the step can go on with the right ones.
        link.begin_step(ForwardPass(num_tokens=(4,)))
        for bad in (torch.randn(3, HIDDEN), h.double()):
            with pytest.raises(ValueError, match="hidden states of layer 0 ubatch 0"):
                link.exchange(0, bad, torch.empty_like(bad))
        for layer in layers:
            assert torch.equal(link.exchange(layer, h, torch.empty_like(h)), h * 2 + layer)
        link.end_step()
        assert link.resume.failovers == 0 and link.pool.members[0].failed_over == 0
        link.begin_step(ForwardPass(num_tokens=(4,)))
        for layer in layers:
            assert torch.equal(link.exchange(layer, h, torch.empty_like(h)), h * 2 + layer)
        link.end_step()
    finally:
        link.close()
        loop.stop()
