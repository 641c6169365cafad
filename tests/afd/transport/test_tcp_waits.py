# SPDX-License-Identifier: Apache-2.0
# SPDX-FileCopyrightText: Copyright contributors to the vllm-afd project
"""The tcp connector's spin (connector_extra_config {"spin_us": N}): a wait
within a step polls its socket for up to N us before it sleeps in the kernel,
which spares a sleeping receiver's wake-up per message. Each rule here has a
case that fails without it; the latency gain is measured by `make bench-link`
(benchmarks/link_latency.py --connectors tcp), not here. Real connectors and
sockets, two threads of one process."""

import socket
import threading
import time

import pytest
import torch

from vllm.afd.adapter.config import AFDConfig
from vllm.afd.transport.connectors import AFDConnectionError, create_connector
from vllm.afd.transport.connectors.socket_stream import MAGIC, PREFIX, SocketStream
from vllm.afd.transport.wire import StepHeader
from helpers.connectors import HIDDEN, Background, free_port
from helpers.pairs import echo, run_steps, wait_cpu_times


def tcp(role: str, port: int, *, num_ubatches: int = 1, spin_us=None):
    extra = {} if spin_us is None else {"spin_us": spin_us}
    cfg = AFDConfig(role=role, connector="tcp", port=port, timeout_s=10,
                    num_ubatches=num_ubatches, connector_extra_config=extra)
    return create_connector(cfg, hidden_size=HIDDEN, dtype=torch.float32, max_tokens=16)


def pair(*, num_ubatches: int = 1, spin_us=None):
    port = free_port()
    ffn = tcp("ffn", port, num_ubatches=num_ubatches, spin_us=spin_us)
    attn = tcp("attention", port, num_ubatches=num_ubatches, spin_us=spin_us)
    accepting = Background(ffn.accept)
    attn.connect()
    accepting.join_result()
    return ffn, attn


@pytest.mark.parametrize("spin_us", [0, 200_000])
def test_spinning_waits_catch_the_answers_and_keep_them_exact(spin_us):
    """With a spin, answers that come within it are read by the spin (both
    sides count them), whole and in order, micro-batches and layers mixed;
    without one, none is."""
    ffn, attn = pair(num_ubatches=2, spin_us=spin_us)
    serving = Background(echo, ffn, 3)
    run_steps(attn, [[3, 2], [1, 4], [5]], layers=3)
    attn.close()
    assert serving.join_result() == 3
    caught = attn._streams[0].spin_hits, ffn._streams[0].spin_hits
    ffn.close()
    if spin_us:
        # 15 answers and 15 hidden frames within steps, each sent right away
        assert caught[0] >= 7 and caught[1] >= 7, caught
    else:
        assert caught == (0, 0)


def test_idle_waits_do_not_spin_and_late_answers_spin_only_spin_us():
    """CPU use stays bounded: a wait for the next step (no deadline) sleeps at
    once; a wait for an answer spins at most spin_us, then sleeps. Process CPU
    time over each wait shows it (bounds with room for the test's threads)."""
    ffn, attn = pair(spin_us=50_000)  # 50 ms
    caught = attn._streams[0].spin_hits
    idle_cpu, waited_cpu = wait_cpu_times(ffn, attn)  # the answer 0.5 s late
    attn.close()
    ffn.close()
    assert idle_cpu < 0.05, f"an idle tcp link burnt {idle_cpu:.3f}s of CPU in 1 s"
    assert waited_cpu < 0.05 + 0.1, f"a 0.5 s wait burnt {waited_cpu:.3f}s of CPU"
    # and the late answer came after the spin: the sleep got it
    assert attn._streams[0].spin_hits == caught


@pytest.mark.parametrize("pause_s", [0.01, 0.3])
def test_a_frame_whose_start_the_spin_caught_is_read_on_from_there(pause_s):
    """The spin may catch only the first bytes of a frame's prefix; the rest
    (within the spin's time or after it) is read after them, not over them."""
    a, b = socket.socketpair()
    link = SocketStream(b, "test peer", stall_timeout_s=5, spin_s=0.1)
    header = b"header bytes of a frame"
    frame = PREFIX.pack(MAGIC, len(header), 0) + header

    def send_in_two():
        a.sendall(frame[:3])
        time.sleep(pause_s)
        a.sendall(frame[3:])

    sender = threading.Thread(target=send_in_two)
    sender.start()
    got, payload_len = link.recv_message(time.monotonic() + 5, lambda: None)
    sender.join()
    assert (bytes(got), payload_len) == (header, 0)
    assert link.spin_hits == 1
    a.close()
    link.close()


def test_a_peer_gone_during_the_spin_is_noticed_at_once():
    """A peer that closes while the other side spins for its answer is an
    error right away, not at the end of the spin (1 s here)."""
    ffn, attn = pair(spin_us=1_000_000)
    attn.send_step(StepHeader(step_id=1, num_tokens=[1]))
    ffn.recv_step(0)
    attn.send_hidden(0, 0, torch.ones(1, HIDDEN))
    ffn.recv_hidden(0, 0, 0)
    closing = threading.Timer(0.1, ffn._streams[0].sock.close)
    t0 = time.monotonic()
    closing.start()
    with pytest.raises(AFDConnectionError):
        attn.recv_output(0, 0)
    assert time.monotonic() - t0 < 0.6
    closing.join()
    attn.close()
    ffn.close()
