# SPDX-License-Identifier: Apache-2.0
# SPDX-FileCopyrightText: Copyright contributors to the vllm-afd project
"""The shm connector's message ring: headers in shared memory, a doorbell to wake.

Before this, every shm message was a frame on a unix socket: two system calls
and, worse, a sleeping thread's wake-up per message (tens of microseconds on a
VM, the whole round trip ~110 us with an idle core). Now each direction of a
connection has a ring of RING_ENTRIES message entries in its shared-memory
segment, after the payload slots:

    offset   0   u32 head      messages published (the sender's; the doorbell)
    offset  64   u32 sleeping  1 while the receiver sleeps on the socket
    offset 128   u32 tail      messages consumed (the receiver's)
    offset 256   RING_ENTRIES x ENTRY_BYTES: [u32 length][encoded header]

A sender writes the entry (and the payload slot before it), then publishes
head (csrc/cpu/doorbell.cpp: a release store; one wake byte on the socket only
if the receiver sleeps). A receiver waits for head to move: it spins for up to
`spin_us`, then sleeps in poll() on the connection's socket. The socket stays
what it was: the rendezvous, the handshake, and how a dead or closed peer is
noticed (EOF on the descriptor a sleeping receiver polls).

Default: no spinning (DEFAULT_SPIN_US 0). On a host with more runnable
threads than cores (this project's 2-core CI, which runs several servers at
once) spinning slowed the suite's multi-server tests (3A:2F 94 s -> 166 s);
on cores of their own (`make bench`, a GPU server's per-worker cores) set
connector_extra_config {"spin_us": 5000}: 35 us round trips instead of ~160.

CPU use: a wait inside a step (an answer is due) spins up to spin_us
(connector_extra_config, default DEFAULT_SPIN_US), a wait without deadline (an
FFN server waiting for the next step) at most IDLE_SPIN_US; then the waiter
sleeps. An idle link therefore costs no CPU, and a busy one spends at most
spin_us per wait of a core that would otherwise sit idle for that wait
(attention and FFN on cores of their own). A spinning waiter that finds itself
preempted (a gap of 0.5 ms between its checks: it lost its core for a time
slice, so there are more runnable threads than cores) stops spinning, sleeps, and does not spin again for SPIN_BACKOFF_S: a
preempted spinner waits out another thread's time slice (milliseconds) where
a sleeper is woken at once, so on a shared core sleeping is faster. An
oversubscribed machine pays one time slice per second and link. spin_us 0: never spin (every wait
sleeps; the old latency).

Round trips of one layer call (send_hidden, echo, recv_output; two processes
on two cores; `make bench-link`, benchmarks/results/link_latency.json) are in
benchmarks/README.md.
"""

import ctypes
import logging
import select
import struct
import time

import torch

from vllm.afd.transport.connectors.tcp import _HANGUP as HANGUP
from vllm.afd.transport.connectors.tcp import SocketLink
from vllm.afd.transport.errors import LinkClosed, LinkTimeout, WaitCallback
from vllm.afd.transport.wire import ProtocolError

logger = logging.getLogger(__name__)

RING_ENTRIES = 16  # > 1 + 2 x MAX_UBATCHES: a sender never waits in a normal step
ENTRY_BYTES = 20 * 1024  # an ErrorFrame's 4096 characters of UTF-8 and then some
_HEAD, _SLEEPING, _TAIL, _ENTRIES = 0, 64, 128, 256
RING_BYTES = _ENTRIES + RING_ENTRIES * ENTRY_BYTES
DEFAULT_SPIN_US = 0  # see the module docstring: 5000 on cores of their own
IDLE_SPIN_US = 50
SPIN_BACKOFF_S = 1.0  # no spinning for this long after a spin was preempted
WAIT_CHUNK_MS = 1000  # how often a sleeping waiter checks its deadline and logs
_LENGTH = struct.Struct("<I")
_MASK = 0xFFFFFFFF

_lib = None


def _library() -> ctypes.CDLL:
    """The doorbell functions of the afd op library (csrc/cpu/doorbell.cpp)."""
    global _lib
    if _lib is None:
        from vllm.afd.kernels import ops

        lib = ctypes.CDLL(ops.library_path())
        lib.afd_doorbell_wait.argtypes = [ctypes.c_void_p, ctypes.c_void_p, ctypes.c_uint32,
                                          ctypes.c_int, ctypes.c_int64, ctypes.c_int,
                                          ctypes.c_void_p]
        lib.afd_doorbell_wait.restype = ctypes.c_int
        lib.afd_doorbell_ring.argtypes = [ctypes.c_void_p, ctypes.c_void_p, ctypes.c_uint32,
                                          ctypes.c_int]
        lib.afd_doorbell_ring.restype = ctypes.c_int
        lib.afd_doorbell_store.argtypes = [ctypes.c_void_p, ctypes.c_uint32]
        lib.afd_doorbell_store.restype = None
        lib.afd_doorbell_load.argtypes = [ctypes.c_void_p]
        lib.afd_doorbell_load.restype = ctypes.c_uint32
        _lib = lib
    return _lib


class Ring:
    """One direction's ring, in RING_BYTES of shared memory (a uint8 tensor)."""

    def __init__(self, region: torch.Tensor) -> None:
        if region.numel() < RING_BYTES:
            raise ValueError(f"ring region of {region.numel()} bytes; needs {RING_BYTES}")
        self.region = region  # keeps the mapping's view alive
        self.view = memoryview(region.numpy())
        base = region.data_ptr()
        self.head, self.sleeping, self.tail = base + _HEAD, base + _SLEEPING, base + _TAIL

    @staticmethod
    def entry(seq: int) -> int:
        return _ENTRIES + (seq % RING_ENTRIES) * ENTRY_BYTES

    # No close(): the memory must stay mapped while any thread may still be
    # inside a wait on it (a close() from another thread wakes that thread, but
    # cannot unmap under it). The region goes when the last reference does.


class RingLink(SocketLink):
    """A SocketLink whose messages travel through two rings (send, receive)
    instead of the socket; the socket only wakes sleepers and reports EOF."""

    frame_overhead = _LENGTH.size

    def __init__(self, link: SocketLink, send_ring: Ring, recv_ring: Ring,
                 spin_us: float) -> None:
        super().__init__(link.sock, link.name, link.stall_timeout_s)
        self.send_ring, self.recv_ring = send_ring, recv_ring
        self.spin_ns = int(spin_us * 1000)
        self.idle_spin_ns = min(self.spin_ns, IDLE_SPIN_US * 1000)
        self._fd = link.sock.fileno()
        self._lib = _library()
        # Set by close(): ends any wait of another thread, spinning or asleep.
        self._abort = ctypes.c_uint32(0)
        self._abort_address = ctypes.addressof(self._abort)
        # Both rings start empty: head == tail == 0 in fresh memory.
        self._sent = 0
        self._received = 0
        self._spin_from = 0.0  # no spinning before this time (after a preemption)
        self._peer_tail = 0

    def send(self, header: bytes, payload, deadline: float) -> int:
        if payload is not None:  # shm payloads travel in their slots
            raise ValueError("RingLink carries headers only")
        n = len(header)
        if n > ENTRY_BYTES - _LENGTH.size:
            raise ProtocolError(f"message of {n} bytes to {self.name}: the shm ring holds at "
                                f"most {ENTRY_BYTES - _LENGTH.size}")
        seq = self._sent
        if (seq - self._peer_tail) & _MASK >= RING_ENTRIES:
            self._wait_for_space(seq, deadline)
        ring = self.send_ring
        offset = ring.entry(seq)
        _LENGTH.pack_into(ring.view, offset, n)
        ring.view[offset + _LENGTH.size:offset + _LENGTH.size + n] = header
        seq = (seq + 1) & _MASK
        status = self._lib.afd_doorbell_ring(ring.head, ring.sleeping, seq, self._fd)
        if status < 0:
            raise LinkClosed(f"wake-up to {self.name} failed (errno {-status})")
        self._sent = seq
        return _LENGTH.size + n

    def _wait_for_space(self, seq: int, deadline: float) -> None:
        """The peer has RING_ENTRIES messages unread: wait until it reads one
        (rare: a step has at most 1 + MAX_UBATCHES messages in flight)."""
        while True:
            self._peer_tail = self._lib.afd_doorbell_load(self.send_ring.tail)
            if (seq - self._peer_tail) & _MASK < RING_ENTRIES:
                return
            if time.monotonic() >= deadline:
                raise LinkTimeout()
            if self._abort.value or self._peer_hung_up():
                raise LinkClosed("connection closed")
            time.sleep(50e-6)

    def _peer_hung_up(self) -> bool:
        poller = select.poll()
        poller.register(self._fd, HANGUP)
        return bool(poller.poll(0))

    def recv_message(self, deadline: float | None,
                     on_wait: WaitCallback) -> tuple[memoryview, int]:
        seq = self._received
        ring = self.recv_ring
        spin = self.spin_ns if deadline is not None else self.idle_spin_ns
        if spin and self._spin_from and time.monotonic() < self._spin_from:
            spin = 0
        while True:
            if deadline is None:
                wait_ms = WAIT_CHUNK_MS
            else:
                remaining = deadline - time.monotonic()
                if remaining <= 0:
                    raise LinkTimeout()
                wait_ms = max(1, min(WAIT_CHUNK_MS, int(remaining * 1000) + 1))
            status = self._lib.afd_doorbell_wait(ring.head, ring.sleeping, seq, self._fd,
                                                 spin, wait_ms, self._abort_address)
            if self._abort.value:  # this side closed the link meanwhile
                raise LinkClosed("connection closed")
            if status == 2:  # preempted while spinning: the core is shared, sleep a while
                self._spin_from = time.monotonic() + SPIN_BACKOFF_S
                break
            if status == 1:
                break
            if status < 0:
                raise LinkClosed("connection closed")
            on_wait()
            spin = 0  # spun once already: the answer is late, sleep
        offset = ring.entry(seq)
        (n,) = _LENGTH.unpack_from(ring.view, offset)
        if n > ENTRY_BYTES - _LENGTH.size:
            raise ProtocolError(f"shm ring entry from {self.name}: length {n}, at most "
                                f"{ENTRY_BYTES - _LENGTH.size}")
        header = self._header[:n]
        header[:] = ring.view[offset + _LENGTH.size:offset + _LENGTH.size + n]
        self._received = (seq + 1) & _MASK
        self._lib.afd_doorbell_store(ring.tail, self._received)
        return header, 0

    def close(self) -> None:
        self._abort.value = 1
        super().close()  # shutdown() wakes a waiter asleep in poll()

    def recv_into(self, view: memoryview, deadline: float) -> None:
        raise ProtocolError(f"{self.name}: shm payloads travel in shared memory")
