# SPDX-License-Identifier: Apache-2.0
# SPDX-FileCopyrightText: Copyright contributors to the vllm-afd project
"""The device-resident exchange's rules (vllm/afd/transport/ipc/), on a fake
device: two streams of this process (tests/helpers/fake_stream.py), each side's
region host memory. What only a GPU can show (IPC across processes, a captured
CUDA graph, the timings) has not run anywhere yet (issue 53)."""

import threading
import time

import pytest
import torch

from vllm.afd.transport.ipc.calls import Exchange
from vllm.afd.transport.ipc.layout import ABORT, CONTROL_WORDS, NOT_ABORTED, Layout, Region
from vllm.afd.transport.ipc.memory import Control
from helpers.fake_stream import FakeStream, kernel

HIDDEN, ROWS, LAYERS = 16, 3, 4
DTYPE = torch.float32


def cuda_like_control() -> Control:
    """Control as on CUDA: the abort word's mirror a word of its own (there
    pinned host memory), apart from the control's abort word."""
    mirror = torch.zeros(1, dtype=torch.int32)
    return Control(torch.zeros(CONTROL_WORDS, dtype=torch.int32), mirror, mirror)


def pair(num_ubatches=2, timeout_s=10.0, deferred_s=0.0, fenced_stores=True,
         apart_mirror=False):
    layout = Layout(num_ubatches, ROWS * HIDDEN * DTYPE.itemsize)
    attn_region = Region(torch.zeros(layout.total, dtype=torch.uint8), layout)
    ffn_region = Region(torch.zeros(layout.total, dtype=torch.uint8), layout)
    controls = [cuda_like_control() if apart_mirror else Control.on(torch.device("cpu"))
                for _ in range(2)]
    streams = [FakeStream(c.device, deferred_s, fenced_stores) for c in controls]
    attn = Exchange("attention", streams[0], controls[0], attn_region, ffn_region, timeout_s)
    ffn = Exchange("ffn", streams[1], controls[1], ffn_region, attn_region, timeout_s)
    for side in (attn, ffn):
        side.set_mode(True)
        side.stream.synchronize()
    return attn, ffn


def mlp(h: torch.Tensor, layer: int) -> torch.Tensor:
    return h * 2 + layer


def enqueue_ffn_step(ffn, step_id, num_ubatches, layers=LAYERS):
    """The FFN host launches a whole step ahead (one header per step)."""
    ffn.begin_step(step_id)
    outs = [torch.empty(ROWS, HIDDEN) for _ in range(num_ubatches)]
    for layer in range(layers):
        for u in range(num_ubatches):
            h = ffn.take(u, layer, DTYPE, (ROWS, HIDDEN))
            kernel(ffn.stream, lambda h=h, o=outs[u], layer=layer: o.copy_(mlp(h, layer)))
            ffn.post(u, layer, outs[u])


def enqueue_attention_step(attn, step_id, hidden, layers=LAYERS):
    """The attention side: per layer, each micro-batch's call, then its
    output (into hidden, as the next layer's input). step_id None: the step
    was begun already (a graph being captured cannot begin it)."""
    if step_id is not None:
        attn.begin_step(step_id)
    out = [torch.empty_like(h) for h in hidden]
    for layer in range(layers):
        for u, h in enumerate(hidden):
            attn.post(u, layer, h)
        for u, h in enumerate(hidden):
            attn.take_into(u, layer, out[u])
            kernel(attn.stream, lambda h=h, o=out[u]: h.copy_(o + 1))


def expected(hidden, layers=LAYERS):
    result = [h.clone() for h in hidden]
    for layer in range(layers):
        result = [mlp(h, layer) + 1 for h in result]
    return result


def finish(attn, ffn, hidden, want):
    """Both streams idle, the step ran through, the model's answers came back."""
    attn.stream.synchronize()
    ffn.stream.synchronize()
    assert attn.outcome() is None and ffn.outcome() is None
    for got, w in zip(hidden, want):
        torch.testing.assert_close(got, w, rtol=0, atol=0)


def inputs(num_ubatches, seed=0):
    g = torch.Generator().manual_seed(seed)
    return [torch.randn(ROWS, HIDDEN, generator=g) for _ in range(num_ubatches)]


@pytest.mark.parametrize("num_ubatches", [1, 2, 3, 4])
def test_layer_calls_give_the_model_s_answers(num_ubatches):
    attn, ffn = pair(num_ubatches)
    for step in range(3):
        hidden = inputs(num_ubatches, step)
        want = expected(hidden)
        enqueue_ffn_step(ffn, step, num_ubatches)
        enqueue_attention_step(attn, step, hidden)
        finish(attn, ffn, hidden, want)


def test_step_ids_wrap_at_32_bits():
    attn, ffn = pair(1)
    for step in (2**32 - 1, 2**32, 2**32 + 1):
        hidden = inputs(1, step % 7)
        want = expected(hidden, layers=2)
        enqueue_ffn_step(ffn, step, 1, layers=2)
        enqueue_attention_step(attn, step, hidden, layers=2)
        finish(attn, ffn, hidden, want)


@pytest.mark.parametrize("fenced", [True, False])
def test_a_flag_is_set_after_its_payload_and_record_landed(fenced):
    """Writes that land late (deferred_s) are still seen in full: the flag's
    store is a release after the slot and the record. Negative control: a
    device whose stores do not wait (fenced_stores=False) lets the consumer
    read a stale record (the step aborts) or a stale payload."""
    attn, ffn = pair(2, timeout_s=2.0, deferred_s=0.02, fenced_stores=fenced)
    hidden = inputs(2)
    want = expected(hidden, layers=2)
    enqueue_ffn_step(ffn, 7, 2, layers=2)
    enqueue_attention_step(attn, 7, hidden, layers=2)
    attn.stream.synchronize()
    ffn.stream.synchronize()
    correct = (attn.outcome() is None and ffn.outcome() is None
               and all(torch.equal(h, w) for h, w in zip(hidden, want)))
    assert correct is fenced


def test_a_record_of_another_step_aborts_the_step():
    """The consumer checks the record against its own step word: an FFN that
    took the header of another step does not compute on these hidden states
    (it aborts, its later operations do nothing), and the attention side's
    wait ends at its deadline instead of reading a wrong answer."""
    attn, ffn = pair(1, timeout_s=0.3)
    ffn.timeout_s = 30.0  # its wait ends by the call, not by a deadline
    enqueue_ffn_step(ffn, 5, 1, layers=1)
    hidden = inputs(1)
    before = hidden[0].clone()
    enqueue_attention_step(attn, 6, hidden, layers=1)
    ffn.stream.synchronize()
    attn.stream.synchronize()
    assert "another step" in ffn.outcome()
    assert "deadline" in attn.outcome()
    assert torch.equal(hidden[0], before)  # nothing came back into the model


def test_idle_mode_waits_never_block_and_touch_nothing():
    """Warm-up, profile and capture runs (and a replay without a peer): with
    the mode IDLE every operation is a no-op, a wait on a flag nobody will
    set returns at once, the peer's memory is not written."""
    attn, ffn = pair(2, timeout_s=30.0)
    attn.set_mode(False)
    peer_memory = ffn.local.memory.clone()
    t0 = time.monotonic()
    enqueue_attention_step(attn, 1, inputs(2))
    attn.stream.synchronize()
    assert time.monotonic() - t0 < 5.0
    assert attn.stream.executed == 0
    assert torch.equal(ffn.local.memory, peer_memory)


def test_release_frees_a_wait_for_a_dead_peer():
    """The link's supervisor sees the FFN die and releases the step: the
    blocked wait returns long before its deadline, nothing after it runs (the
    output buffer keeps what it had), and the outcome says why."""
    attn, _ffn = pair(1, timeout_s=60.0)
    hidden = inputs(1)
    before = hidden[0].clone()
    enqueue_attention_step(attn, 1, hidden, layers=2)
    timer = threading.Timer(0.2, attn.release)
    t0 = time.monotonic()
    timer.start()
    attn.stream.synchronize(timeout=10.0)
    assert time.monotonic() - t0 < 5.0
    assert "released" in attn.outcome()
    assert torch.equal(hidden[0], before)
    # The next step starts clean.
    attn.begin_step(2)
    assert attn.outcome() is None


def test_a_wait_ends_at_its_deadline():
    attn, _ffn = pair(1, timeout_s=0.3)
    t0 = time.monotonic()
    enqueue_attention_step(attn, 1, inputs(1), layers=3)
    attn.stream.synchronize()
    assert 0.3 <= time.monotonic() - t0 < 3.0  # one deadline, not one per layer
    assert "deadline" in attn.outcome()


def test_a_captured_step_replays_with_new_inputs_and_new_step_ids():
    """The attention side's step captured once, replayed for three steps:
    the step id is data (begin_step between replays), the inputs are new,
    the answers equal the eager ones; the host calls a graph cannot hold
    (begin_step, outcome) are refused during the capture."""
    attn, ffn = pair(2)
    hidden = inputs(2)
    with attn.stream.capture() as graph:
        with pytest.raises(RuntimeError, match="during a capture"):
            attn.begin_step(0)
        with pytest.raises(RuntimeError, match="during a capture"):
            attn.outcome()
        enqueue_attention_step(attn, None, hidden)
    assert attn.stream.executed == 0  # captured, not run
    for step in (10, 11, 12):
        fresh = inputs(2, step)
        want = expected(fresh)
        for h, f in zip(hidden, fresh):
            h.copy_(f)
        enqueue_ffn_step(ffn, step, 2)
        attn.begin_step(step)
        graph.replay()
        finish(attn, ffn, hidden, want)


def test_post_and_take_alternate_per_micro_batch():
    attn, ffn = pair(2)
    attn.post(0, 0, inputs(1)[0])
    with pytest.raises(ValueError, match="out of turn"):
        attn.post(0, 1, inputs(1)[0])  # the slot's answer has not come back
    with pytest.raises(ValueError, match="out of turn"):
        attn.take(1, 0, DTYPE, (ROWS, HIDDEN))  # nothing posted on 1
    with pytest.raises(ValueError, match="out of turn"):
        ffn.post(0, 0, inputs(1)[0])  # the FFN answers a call it took


def test_regions_must_fit_and_agree():
    layout = Layout(2, 1024)
    with pytest.raises(ValueError, match="needs"):
        Region(torch.zeros(layout.total - 1, dtype=torch.uint8), layout)
    other = Layout(2, 2048)
    a = Region(torch.zeros(layout.total, dtype=torch.uint8), layout)
    b = Region(torch.zeros(other.total, dtype=torch.uint8), other)
    control = Control.on(torch.device("cpu"))
    with pytest.raises(ValueError, match="layouts differ"):
        Exchange("attention", FakeStream(control.device), control, a, b, 1.0)
    short = Control(control.device[:2], control.mirror, control.host)
    with pytest.raises(ValueError, match="3 int32 words"):
        Exchange("attention", FakeStream(control.device), short, a, a, 1.0)
    with pytest.raises(ValueError, match="does not fit"):
        a.payload(0, torch.float32, (1024,))


def test_aborts_reach_the_host_through_the_mirror():
    """As on CUDA, the host never reads the control (device memory): the
    release lands in the mirror while a take waits, a take's own abort (its
    deadline) is written to the mirror too, begin_step clears both."""
    attn, _ffn = pair(1, timeout_s=60.0, apart_mirror=True)
    enqueue_attention_step(attn, 1, inputs(1), layers=2)
    threading.Timer(0.2, attn.release).start()
    attn.stream.synchronize(timeout=10.0)
    assert "released" in attn.outcome()
    assert int(attn.control.device[ABORT]) != NOT_ABORTED  # later operations skip
    attn.begin_step(2)
    attn.stream.synchronize()
    assert attn.outcome() is None and int(attn.control.device[ABORT]) == NOT_ABORTED
    attn.timeout_s = 0.3
    enqueue_attention_step(attn, None, inputs(1), layers=1)
    attn.stream.synchronize()
    assert "deadline" in attn.outcome()
