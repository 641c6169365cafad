# SPDX-License-Identifier: Apache-2.0
# SPDX-FileCopyrightText: Copyright contributors to the vllm-afd project
"""The shm connector's message ring: headers in shared memory, a doorbell to wake.

A frame on a socket per message would cost two system calls and, worse, a
sleeping thread's wake-up per message (tens of microseconds on a VM). Instead
each direction of a connection has a ring of RING_ENTRIES message entries in
its shared-memory segment, before the payload slots:

    offset   0   u32 head      messages published (the sender's; the doorbell)
    offset  64   u32 sleeping  1 while the receiver sleeps on the socket
    offset 128   u32 tail      messages consumed (the receiver's)
    offset 192   feedback      the receiver's time to read the last payload
                               (csrc/cpu/slot_copy.h: the sender's copy policy)
    offset 256   RING_ENTRIES x ENTRY_BYTES: [u32 length][encoded header]

A sender writes the entry (and the payload slot before it), then publishes
head (csrc/cpu/doorbell.cpp: a release store; one wake byte on the socket only
if the receiver sleeps). A receiver waits for head to move: it spins for up to
`spin_us`, then sleeps in poll() on the connection's socket. The socket stays
what it was: the rendezvous, the handshake, and how a dead or closed peer is
noticed (EOF on the descriptor a sleeping receiver polls).

Default: no spinning (DEFAULT_SPIN_US 0). On a host with more runnable
threads than cores (a CI machine running several servers at once) spinning
slows everything, the spinner's own peer included; on cores of their own
(`make bench`, a GPU server's per-worker cores) set connector_extra_config
{"spin_us": N} with N beyond the other side's compute of a layer (`make bench`
uses 50000): a round trip then pays no wake-up (figures: benchmarks/notes.md).

CPU use: a wait inside a step (an answer is due) spins up to spin_us
(connector_extra_config, default DEFAULT_SPIN_US), a wait without deadline (an
FFN server waiting for the next step) at most IDLE_SPIN_US; then the waiter
sleeps. An idle link therefore costs no CPU, and a busy one spends at most
spin_us per wait of a core that would otherwise sit idle for that wait
(attention and FFN on cores of their own).

Preempted spins (the lane's backoff): a spinning waiter that finds a gap of 0.5 ms
between two of its checks lost its core for a time slice. Once in a while that
is another thread of the host waking briefly (the link's own once-a-second
status thread, a server's timer): spinning still pays, and stopping it for a
second on each such gap would turn spinning off almost always inside a serving
process, and a thread spinning nonstop on a small VM loses its core a few times
a second to the host's own threads (benchmarks/notes.md). Often
(BACKOFF_PREEMPTIONS of the last SPIN_HISTORY spins; waits whose answer is
already there do not spin and do not count) means
more runnable threads than cores, which take every spin longer than a time
slice: a preempted spinner waits out another thread's time slice
(milliseconds) where a sleeper is woken at once, so the
waiter stops spinning for a while: SPIN_BACKOFF_MIN_S, doubled for each backoff
that follows the last one within SPIN_BACKOFF_S, up to SPIN_BACKOFF_S. A burst
(a server's threads waking together) costs a tenth of a second of sleeping
waits, not a second (at B = 1 a second is ~20 steps whose every layer call pays
two wake-ups); an oversubscribed machine soon pays a few time slices per second
and link. Only a gap with an involuntary context switch of the spinning thread
counts as preempted: without one the time went to the hypervisor (another guest
on this vCPU) or an interrupt, a VM's everyday noise, where sleeping helps no
one, and the spin goes on. spin_us 0: never spin (every wait sleeps).

The per-message path is C (csrc/cpu/lane.cpp, a `Lane` per connection):
sending copies the payload into its slot, writes the entry and publishes it
in one call; receiving waits, checks and consumes in one. RingStream below is
the general path (any message, its header decoded in Python); the shm
connector's layer calls take its prepared calls (connectors/step_calls.py,
shm_frames.py), which check a layer frame by comparing its bytes with the
header it expects. Why C: on a
VM every page the path touches for the first time after a layer's compute
costs microseconds (lane.cpp has the numbers).

Round trips of one layer call (send_hidden, echo, recv_output; two processes
on two cores; `make bench-link`, benchmarks/results/link_latency.json) are in
benchmarks/README.md.
"""

import logging
import mmap
import select
import time

import torch

from vllm.afd.transport.connectors.socket_stream import _HANGUP as HANGUP
from vllm.afd.transport.connectors.socket_stream import SocketStream
from vllm.afd.transport.errors import LinkClosed, LinkTimeout, WaitCallback
from vllm.afd.transport.wire import ProtocolError

logger = logging.getLogger(__name__)

RING_ENTRIES = 16  # > 1 + 2 x MAX_UBATCHES: a sender never waits in a normal step
ENTRY_BYTES = 20 * 1024  # an ErrorFrame's 4096 characters of UTF-8 and then some
_HEAD, _SLEEPING, _TAIL, _ENTRIES = 0, 64, 128, 256
RING_BYTES = _ENTRIES + RING_ENTRIES * ENTRY_BYTES
# Where a segment's payload slots start: on a page of their own. A device pins
# the slots (cudaHostRegister works on whole pages): they share no page with
# the ring, which the peer writes and spins on meanwhile.
SLOTS_OFFSET = -(-RING_BYTES // mmap.PAGESIZE) * mmap.PAGESIZE
DEFAULT_SPIN_US = 0  # see the module docstring: 5000 on cores of their own
IDLE_SPIN_US = 50
# The backoff of preempted spins (constants of csrc/cpu/lane.cpp, for docs and tests):
SPIN_BACKOFF_MIN_S = 0.1  # no spinning for this long once spins are preempted often,
SPIN_BACKOFF_S = 1.0  # doubled while that repeats, up to this
BACKOFF_PREEMPTIONS = 3  # preempted spins among the last SPIN_HISTORY that mean "often"
SPIN_HISTORY = 8
WAIT_CHUNK_MS = 1000  # how often a sleeping waiter checks its deadline and logs
FAST_WAIT_MS = 50  # a prepared receive's wait (connectors/step_calls.py), or the spin where longer
RING_FULL = 1  # lane_send's answer when the peer has RING_ENTRIES messages unread
# connector_extra_config stream_copies -> the lane's copy policy (csrc/cpu/slot_copy.h):
# how a payload goes into its slot, cached or non-temporal (streamed) stores.
COPY_POLICIES = {"auto": 0, "off": 1, "on": 2}


def lane_module():
    """The lane functions (csrc/cpu/lane.cpp) of the afd op library's module."""
    from vllm.afd.kernels import ops

    return ops.module()


class Ring:
    """One direction's ring, in RING_BYTES of shared memory (a uint8 tensor)."""

    def __init__(self, region: torch.Tensor) -> None:
        if region.numel() < RING_BYTES:
            raise ValueError(f"ring region of {region.numel()} bytes; needs {RING_BYTES}")
        self.region = region  # keeps the mapping's view alive
        self.base = region.data_ptr()

    # No close(): the memory must stay mapped while any thread may still be
    # inside a wait on it (a close() from another thread wakes that thread, but
    # cannot unmap under it). The region goes when the last reference does.


class RingStream(SocketStream):
    """A SocketStream whose messages travel through two rings (send, receive)
    instead of the socket; the socket only wakes sleepers and reports EOF."""

    frame_overhead = 4  # the entry's length word

    def __init__(self, link: SocketStream, send_ring: Ring, recv_ring: Ring,
                 spin_us: float, stream_copies: str = "auto") -> None:
        super().__init__(link.sock, link.name, link.stall_timeout_s)
        # Both rings stay referenced as long as the lane (their addresses) is.
        self.send_ring, self.recv_ring = send_ring, recv_ring
        self.spin_ns = int(spin_us * 1000)
        self.idle_spin_ns = min(self.spin_ns, IDLE_SPIN_US * 1000)
        self._fd = link.sock.fileno()
        self.C = lane_module()
        # Both rings start empty: head == tail == 0 in fresh memory.
        self.lane = self.C.lane_new(send_ring.base, recv_ring.base, self._fd, RING_ENTRIES,
                                    ENTRY_BYTES, COPY_POLICIES[stream_copies])
        self._closed = False
        self._header_address = torch.frombuffer(self._header.obj, dtype=torch.uint8).data_ptr()

    @property
    def copy_stats(self) -> dict[str, float]:
        """How this side's payloads went into their slots (slot_copy.h): bytes
        each way, and the measured cost of each (ns per byte, copy and read)."""
        cached, streamed, cost_cached, cost_streamed, n_cached, n_streamed = (
            self.C.lane_copy_stats(self.lane))
        return {"cached_bytes": cached, "streamed_bytes": streamed,
                "cached_ns_per_byte": cost_cached, "streamed_ns_per_byte": cost_streamed,
                "cached_samples": n_cached, "streamed_samples": n_streamed}

    @property
    def counters(self) -> dict[str, int]:
        sent, received, preemptions, backoffs = self.C.lane_counters(self.lane)
        return {"sent": sent, "received": received, "preempted_spins": preemptions,
                "spin_backoffs": backoffs}

    def send(self, header: bytes, payload, deadline: float) -> int:
        if payload is not None:  # shm payloads travel in their slots
            raise ValueError("RingStream carries headers only")
        n = len(header)
        if n > ENTRY_BYTES - self.frame_overhead:
            raise ProtocolError(f"message of {n} bytes to {self.name}: the shm ring holds at "
                                f"most {ENTRY_BYTES - self.frame_overhead}")
        header = header if type(header) is bytes else bytes(header)
        self.post(lambda: self.C.lane_send(self.lane, header), deadline)
        return self.frame_overhead + n

    def post(self, send, deadline: float) -> None:
        """send() (a lane_send*), waiting while the peer's ring is full (rare: a
        step has at most 1 + MAX_UBATCHES messages in flight)."""
        while True:
            status = send()
            if status == 0:
                return
            if status != RING_FULL:  # -errno: the wake-up could not be sent
                raise LinkClosed(f"wake-up to {self.name} failed (errno {-status})")
            if time.monotonic() >= deadline:
                raise LinkTimeout()
            if self._closed or self._peer_hung_up():
                raise LinkClosed("connection closed")
            time.sleep(50e-6)

    def _peer_hung_up(self) -> bool:
        poller = select.poll()
        poller.register(self._fd, HANGUP)
        return bool(poller.poll(0))

    def wait_budget_ms(self, deadline: float | None) -> int:
        """The next wait's bound: WAIT_CHUNK_MS, or less before deadline
        (LinkTimeout once it has passed)."""
        if deadline is None:
            return WAIT_CHUNK_MS
        remaining = deadline - time.monotonic()
        if remaining <= 0:
            raise LinkTimeout()
        return max(1, min(WAIT_CHUNK_MS, int(remaining * 1000) + 1))

    def recv_message(self, deadline: float | None,
                     on_wait: WaitCallback) -> tuple[memoryview, int]:
        spin = self.spin_ns if deadline is not None else self.idle_spin_ns
        while True:
            status = self.C.lane_wait(self.lane, spin, self.wait_budget_ms(deadline))
            if self._closed or status < 0:
                raise LinkClosed("connection closed")
            if status == 1:
                break
            on_wait()
            spin = 0  # spun once already: the answer is late, sleep
        n = self.C.lane_take(self.lane, self._header_address, len(self._header))
        if n < 0:
            raise ProtocolError(f"shm ring entry from {self.name}: length {-1 - n}, at most "
                                f"{ENTRY_BYTES - self.frame_overhead}")
        return self._header[:n], 0

    def close(self) -> None:
        self._closed = True
        self.C.lane_abort(self.lane)  # ends any wait of another thread
        super().close()  # shutdown() wakes a waiter asleep in poll()

    def recv_into(self, view: memoryview, deadline: float) -> None:
        raise ProtocolError(f"{self.name}: shm payloads travel in shared memory")
