# SPDX-License-Identifier: Apache-2.0
# SPDX-FileCopyrightText: Copyright contributors to the vllm-afd project
"""The shm connector's message ring and doorbell (vllm/afd/transport/shm_ring.py,
csrc/cpu/doorbell.cpp): every rule it relies on, each with a case that fails
without it. Real connectors, two threads of one process; the latency itself
is measured by `make bench-link`, not here."""

import time

import pytest
import torch

from vllm.afd.adapter.config import AFDConfig
from vllm.afd.transport import shm_ring
from vllm.afd.transport.connectors import AFDConnectionError, create_connector
from vllm.afd.transport.wire import StepHeader
from helpers.connectors import HIDDEN, Background, free_port
from helpers.pairs import echo, pair, run_steps, wait_cpu_times


def test_the_ring_sits_where_both_sides_look_whatever_their_micro_batches():
    """An FFN server sized for 3 micro-batches serves an attention server that
    uses 1: their slot counts differ, the ring's place must not (the ring once
    sat after the slots, and the FFN never saw a message)."""
    ffn, attn = pair(ffn_ubatches=3, attention_ubatches=1)
    server = Background(echo, ffn, 2)
    try:
        run_steps(attn, [[3], [1], [16]], layers=2)
    finally:
        attn.close()
        assert server.join_result() == 3
        ffn.close()


@pytest.mark.parametrize("spin_us", [0, 20])
def test_sleeping_receivers_are_always_woken(spin_us):
    """With no spinning every wait sleeps on the socket and is woken by the
    sender's byte: a lost wake-up (the Dekker pair in doorbell.cpp) leaves the
    waiter asleep until its wait chunk ends (WAIT_CHUNK_MS, 1 s), when it finds
    the message. Uneven micro-batches, several in flight. Each step is timed:
    one lost wake-up makes its step last a chunk, where a step's 9 round trips
    take milliseconds even on a loaded host (the total time of the 200 steps,
    checked before 2026-12-04, depends on the load and missed a single one)."""
    ffn, attn = pair(ffn_ubatches=3, attention_ubatches=3, spin_us=spin_us, timeout_s=5)
    server = Background(echo, ffn, 3)
    step_seconds: list[float] = []
    try:
        run_steps(attn, [[1, 2, 3], [5, 0, 1]] * 100, layers=3, step_seconds=step_seconds)
    finally:
        attn.close()
        assert server.join_result() == 200
        ffn.close()
    chunk_s = shm_ring.WAIT_CHUNK_MS / 1000
    assert len(step_seconds) == 200
    slow = [round(t, 3) for t in step_seconds if t >= 0.9 * chunk_s]
    assert not slow, f"steps that waited out a wait chunk (a lost wake-up): {slow}"


def test_close_ends_a_wait_of_another_thread_spinning_or_asleep():
    """close() from another thread ends a wait inside the C doorbell at once,
    spinning (spin_us far longer than the test) or asleep. The ring memory
    stays mapped while a thread is still in it (unmapping it under the thread
    crashed the process)."""
    ffn, attn = pair(spin_us=1_000_000)  # 1 s of spinning allowed
    attn.send_step(StepHeader(step_id=1, num_tokens=[2]))
    assert ffn.recv_step(0).step_id == 1
    attn.send_hidden(0, 0, torch.ones(2, HIDDEN))
    ffn.recv_hidden(0, 0, 0)
    spinning = Background(attn.recv_output, 0, 0)  # the answer never comes
    time.sleep(0.1)
    t0 = time.monotonic()
    attn.close()
    with pytest.raises(AFDConnectionError, match="was closed"):
        spinning.join_result(timeout=5)
    # Without the abort word a spinner on a core of its own would go on until
    # its spin_us ran out.
    assert time.monotonic() - t0 < 0.5
    assert ffn.recv_step(0).is_goodbye  # what the closing side said last
    ffn.close()

    ffn, attn = pair(spin_us=1_000_000)
    asleep = Background(ffn.recv_step, 0)  # no deadline: a short spin, then poll()
    time.sleep(0.1)
    t0 = time.monotonic()
    ffn.close()
    with pytest.raises(AFDConnectionError, match="was closed"):
        asleep.join_result(timeout=5)
    assert time.monotonic() - t0 < 0.5
    attn.close()


def test_a_peer_gone_mid_wait_is_noticed_after_the_spin():
    """A spinning receiver cannot see the socket; once its spin ends it sleeps
    on it and finds the hang-up at once (not at timeout_s)."""
    ffn, attn = pair(spin_us=200_000, timeout_s=30)  # spin 0.2 s
    attn.send_step(StepHeader(step_id=1, num_tokens=[2]))
    ffn.recv_step(0)
    attn.send_hidden(0, 0, torch.ones(2, HIDDEN))
    waiting = Background(attn.recv_output, 0, 0)
    time.sleep(0.05)
    t0 = time.monotonic()
    ffn._streams[0].sock.shutdown(2)  # the FFN's end vanishes without a goodbye
    with pytest.raises(AFDConnectionError, match="closed the connection"):
        waiting.join_result(timeout=10)
    assert time.monotonic() - t0 < 3
    attn.close()
    ffn.close()


def test_cpu_use_while_waiting_is_bounded():
    """An idle wait (no deadline) spins at most IDLE_SPIN_US, then sleeps; a
    wait for an answer spins at most spin_us. Process CPU time over the wait
    shows it (bounds with room for the test's own threads)."""
    ffn, attn = pair(spin_us=50_000)  # 50 ms
    idle_cpu, waited_cpu = wait_cpu_times(ffn, attn)  # the answer 0.5 s late
    attn.close()
    ffn.close()
    assert idle_cpu < 0.05, f"an idle link burnt {idle_cpu:.3f}s of CPU in 1 s"
    assert waited_cpu < 0.05 + 0.1, f"a 0.5 s wait burnt {waited_cpu:.3f}s of CPU"


@pytest.mark.parametrize("connector", ["shm", "tcp"])  # tcp: test_tcp_waits.py
@pytest.mark.parametrize("bad", [-1, 2_000_000, "5", True, None])
def test_spin_us_must_be_microseconds(bad, connector):
    with pytest.raises(ValueError, match=r"connector_extra_config\['spin_us'\]: invalid "
                       r"value .*expected microseconds in 0-1000000"):
        cfg = AFDConfig(role="ffn", connector=connector, port=free_port(),
                        connector_extra_config={"spin_us": bad})
        create_connector(cfg, hidden_size=HIDDEN, dtype=torch.float32, max_tokens=16)


def test_oversized_messages_are_refused_before_they_touch_the_ring():
    ffn, attn = pair()
    link = attn._streams[0]
    assert isinstance(link, shm_ring.RingStream)
    from vllm.afd.transport.wire import ProtocolError
    with pytest.raises(ProtocolError, match="the shm ring holds at most"):
        link.send(b"x" * shm_ring.ENTRY_BYTES, None, time.monotonic() + 1)
    attn.close()
    ffn.close()
