# SPDX-License-Identifier: Apache-2.0
# SPDX-FileCopyrightText: Copyright contributors to the vllm-afd project
"""Shared-memory connector: same-host attention and FFN servers (CPU default).

Tensors and message headers travel through POSIX shared memory; a socket (the
tcp connector's framed link) carries the rendezvous and the handshake, then
only wakes a receiver that went to sleep and reports a peer's death (EOF).

Layout, per attention peer: two segments created by the FFN during the
handshake, one per direction (attention->FFN hidden states, FFN->attention
outputs), each holding the direction's message ring (../shm_ring.py) and then
one slot per micro-batch of slot_bytes (>= max_tokens * hidden_size *
itemsize, rounded to 64 bytes). The sender copies the tensor into the slot of
its micro-batch, writes the LayerFrame into the ring and publishes it with a
release store that the receiver's acquire load pairs with, so the payload is
visible before the header. The receiver spins on the ring for a while, then
sleeps on the socket (the sender writes a wake byte only when it sleeps). A
CPU receiver reads the slot itself (a zero-copy view, or one copy into the
caller's `out`); the protocol's one-in-flight-per-micro-batch rule is what
keeps it valid (see base.py for the exact lifetimes).

Devices (../buffers.py): for a CUDA process the segments are page-locked
(cudaHostRegister), a device payload is copied into its slot and the header
sent once that copy has landed, and a received payload is copied to the device
asynchronously on the consumer's current stream; an event guards the slot,
which the peer may overwrite only after this side's next message, sent once
the copy out of it has finished.

Segment lifetime: names are vllm-afd-<port>-<peer>-<a2f|f2a>-<pid>x<hex>, made
by the connector that accepted the peer (a session of the listening gate, see
base.py), which releases them on close; the gate holds only the listener. The
attention side unlinks both names as soon as it has mapped them (both sides
now hold mappings, the memory lives until the last one goes), so nothing is
left in /dev/shm even if either process is then SIGKILLed. The FFN (creator)
unlinks on close and at interpreter exit too, for a peer that never attached.
The FFN commits the memory when it creates a segment (posix_fallocate), so a
too-small /dev/shm is a clear error at connect time, not a SIGBUS mid-step.
A mapping is never unmapped under a thread still waiting on its ring or
holding a received view: it goes with the last tensor made from it.
Memory: 2 x (shm_ring.SLOTS_OFFSET + num_ubatches x max_tokens x hidden_size x
itemsize) per peer.

The socket is a Linux abstract unix socket named after the port (nothing to
clean up); connector_extra_config {"notify": "tcp"} uses host:port over TCP
instead, for containers that share /dev/shm but not a network namespace.
connector_extra_config {"spin_us": N} sets how long a waiting side spins
before it sleeps (../shm_ring.py: CPU use, and 0 to never spin).
connector_extra_config {"stream_copies": "auto" | "on" | "off"}: how a payload
goes into its slot, with cached or non-temporal stores. "auto" (the default)
measures both per direction, the sender's copy plus the receiver's read, and
uses the cheaper (csrc/cpu/slot_copy.h: which wins depends on where the two
cores sit, and on a VM that changes while it runs).

Round trips (send_hidden, FFN echo, recv_output; two processes on two cores)
by payload, with and without spinning: `make bench-link`, recorded in
benchmarks/results/link_latency.json and benchmarks/README.md.
"""

import logging
import mmap
import os
import socket
import sys
import weakref

import msgspec
import torch

from vllm.afd.transport import shm_ring
from vllm.afd.transport.buffers import HostSlots
from vllm.afd.transport.connectors.base import (AFDConnectionError, LinkClosed,
                                                spin_us_setting)
from vllm.afd.transport.connectors.shm_frames import ShmFrames
from vllm.afd.transport.connectors.step_calls import StepCalls
from vllm.afd.transport.connectors.tcp import SocketConnector
from vllm.afd.transport.leftovers import owned_name
from vllm.afd.transport.wire import LayerFrame, ProtocolError

try:  # the module multiprocessing.shared_memory uses, without its resource tracker
    import _posixshmem
except ImportError:  # pragma: no cover - non-POSIX
    _posixshmem = None

logger = logging.getLogger(__name__)

SLOT_ALIGN = 64  # cache line; also keeps every slot aligned for any dtype view


class ShmHandshake(msgspec.Struct):
    """What the FFN's HelloAck carries for shm (HelloAck.transport): the names of
    the segments made for this peer (attention->FFN, FFN->attention), the
    bytes of one micro-batch slot in each, and the layout of the message ring
    before the slots (../shm_ring.py) and where the slots start, which both
    sides must share."""

    segments: list[str]
    slot_bytes: int
    ring_entries: int
    ring_entry_bytes: int
    slots_offset: int = shm_ring.SLOTS_OFFSET


def _unlink(name: str) -> None:
    try:
        _posixshmem.shm_unlink("/" + name)
    except FileNotFoundError:
        pass  # the peer unlinked it first


def _reserve(fd: int, name: str, size: int) -> None:
    """Commit the segment's memory now: tmpfs allocates pages lazily, and a
    full /dev/shm (Docker's default is 64 MiB) would otherwise kill the
    process with SIGBUS at the first large step instead of failing here."""
    if not hasattr(os, "posix_fallocate"):
        return
    try:
        os.posix_fallocate(fd, 0, size)
    except OSError as e:
        free = os.statvfs("/dev/shm") if os.path.isdir("/dev/shm") else None
        have = f", {free.f_bavail * free.f_frsize >> 20} MiB free" if free else ""
        raise AFDConnectionError(
            f"cannot reserve {size >> 20} MiB of shared memory for {name} ({e.strerror}"
            f"{have}); enlarge /dev/shm (docker --shm-size), lower max_tokens, or use "
            f"connector 'tcp'") from None


class ShmSegment:
    """A named POSIX shared-memory segment mapped into this process."""

    def __init__(self, name: str, size: int, *, create: bool) -> None:
        if _posixshmem is None:
            raise AFDConnectionError("the shm AFD connector needs POSIX shared memory")
        flags = os.O_RDWR | (os.O_CREAT | os.O_EXCL if create else 0)
        fd = _posixshmem.shm_open("/" + name, flags, mode=0o600)
        try:
            if create:
                os.ftruncate(fd, size)
                _reserve(fd, name, size)
            else:
                # A smaller segment than announced would SIGBUS on access.
                actual = os.fstat(fd).st_size
                if actual < size:
                    raise ProtocolError(f"shared memory segment {name}: expected at least "
                                        f"{size} bytes, found {actual}")
            self._mmap = mmap.mmap(fd, size)
        except BaseException:
            if create:
                _unlink(name)
            raise
        finally:
            os.close(fd)
        self.name, self.size = name, size
        self.tensor: torch.Tensor | None = torch.frombuffer(self._mmap, dtype=torch.uint8)
        # The creator unlinks on close(), or at exit if close() never ran.
        self._unlinker = weakref.finalize(self, _unlink, name) if create else None

    def unlink(self) -> None:
        if self._unlinker is not None:
            self._unlinker()
        else:
            _unlink(self.name)

    def close(self) -> None:
        if self._unlinker is not None:
            self._unlinker()
        # Dropped, not mmap.close()d: tensors made from it (received views, the
        # message rings a thread may be waiting on) hold the mmap object, not a
        # buffer export, so an explicit close would unmap memory under them.
        # The mapping goes when the last of them does.
        self.tensor = None
        self._mmap = None


class ShmConnector(StepCalls, SocketConnector):
    name = "shm"
    stages_through_host = True
    extra_config_keys = frozenset({"notify", "spin_us", "stream_copies"})
    """notify: "unix" (default) or "tcp", the socket that carries the rendezvous,
    the handshake and the wake-ups. "unix" is a Linux abstract unix socket named
    after the port (local only, nothing to clean up); "tcp" listens on
    host:port, for containers that share /dev/shm but not a network namespace
    (off loopback it needs a secret, as the tcp connector does).

    spin_us: microseconds (0-1000000, default 0) a waiting side spins on the
    message ring before it sleeps (transport/shm_ring.py). Spinning spares a
    wake-up per message but keeps a core busy while it waits, and slows every
    process on a host with more runnable threads than cores: set it beyond the
    other side's compute of a layer, and only where each role has cores of its
    own.

    stream_copies: "auto" (default), "on" or "off", how a payload goes into its
    slot: cached or non-temporal (streamed) stores. "auto" times both per
    direction (the sender's copy plus the receiver's read) and keeps the
    cheaper, since which one wins depends on where the two cores sit."""
    spins_on_socket = False  # its waits spin on the rings (../shm_ring.py)

    def __init__(self, afd_config, **kwargs) -> None:
        super().__init__(afd_config, **kwargs)
        self.slot_bytes = -(-self.codec.max_bytes // SLOT_ALIGN) * SLOT_ALIGN
        # peer -> (segment this side writes, segment this side reads)
        self._segments: dict[int, tuple[ShmSegment, ShmSegment]] = {}
        # peer -> the slots of those segments, with their copies and events
        self._tx: dict[int, HostSlots] = {}
        self._rx: dict[int, HostSlots] = {}
        notify = self.afd_config.connector_extra_config.get("notify", "unix")
        if notify not in ("unix", "tcp"):
            raise ValueError(f"AFDConfig.connector_extra_config['notify']: invalid value "
                             f"{notify!r}; valid choices: 'unix', 'tcp'")
        self._unix_notify = notify == "unix" and sys.platform.startswith("linux")
        self.spin_us = spin_us_setting(self.afd_config, shm_ring.DEFAULT_SPIN_US)
        stream_copies = self.afd_config.connector_extra_config.get("stream_copies", "auto")
        if stream_copies not in shm_ring.COPY_POLICIES:
            raise ValueError(f"AFDConfig.connector_extra_config['stream_copies']: invalid "
                             f"value {stream_copies!r}; valid choices: "
                             f"{', '.join(map(repr, shm_ring.COPY_POLICIES))}")
        self.stream_copies = stream_copies
        # Layer calls in one C call per message end (step_calls.py, shm_frames.py).
        self._init_step_calls()
        self.frames = ShmFrames(self)

    @property
    def _segment_bytes(self) -> int:
        """The message ring first (the same offset on both sides), then this
        side's payload slots: an FFN sized for more micro-batches than the
        attention peer uses makes more slots, which the peer never maps."""
        return shm_ring.SLOTS_OFFSET + self.slot_bytes * self.num_ubatches

    # ------------------------------------------------------------ rendezvous
    @property
    def address(self) -> str:
        if not self._unix_notify:
            return super().address
        return f"unix:@vllm-afd-{self.port}"

    def _listens_on_network(self) -> bool:
        return not self._unix_notify  # an abstract unix socket is local-only

    def _make_connection(self, timeout: float) -> socket.socket:
        if not self._unix_notify:
            return super()._make_connection(timeout)
        sock = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
        sock.settimeout(timeout)
        try:
            sock.connect(f"\0vllm-afd-{self.port}")
        except BaseException:
            sock.close()
            raise
        return sock

    def _make_listener(self) -> socket.socket:
        if not self._unix_notify:
            return super()._make_listener()
        sock = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
        try:
            sock.bind(f"\0vllm-afd-{self.port}")
            sock.listen(64)
        except BaseException:
            sock.close()
            raise
        return sock

    # --------------------------------------------------------------- handshake
    def _ack_transport(self, peer: int, hello_transport: bytes) -> bytes:
        size = self._segment_bytes
        tag = f"vllm-afd-{self.port}-{peer}"
        suffix = owned_name("")  # the creator's pid: leftovers.remove_dead
        to_ffn = ShmSegment(f"{tag}-a2f-{suffix}", size, create=True)
        try:
            to_attention = ShmSegment(f"{tag}-f2a-{suffix}", size, create=True)
        except BaseException:
            to_ffn.close()
            raise
        self._segments[peer] = (to_attention, to_ffn)
        return msgspec.msgpack.encode(ShmHandshake(
            segments=[to_ffn.name, to_attention.name], slot_bytes=self.slot_bytes,
            ring_entries=shm_ring.RING_ENTRIES, ring_entry_bytes=shm_ring.ENTRY_BYTES))

    def _on_refused(self, peer: int) -> None:
        for segment in self._segments.pop(peer, ()):
            segment.close()

    def _on_confirmed(self, peer: int) -> None:
        writes, reads = self._segments[peer]
        at = shm_ring.SLOTS_OFFSET  # the ring, then the slots on a page of their own
        self._tx[peer] = HostSlots(writes.tensor[at:], self.slot_bytes, self.num_ubatches,
                                   self.ops)
        self._rx[peer] = HostSlots(reads.tensor[at:], self.slot_bytes, self.num_ubatches,
                                   self.ops)
        # From here on messages travel through the rings; the socket only
        # wakes a sleeping receiver and reports a peer's death.
        ring = shm_ring.RING_BYTES
        rings = (shm_ring.Ring(writes.tensor[:ring]), shm_ring.Ring(reads.tensor[:ring]))
        self._streams[peer] = shm_ring.RingStream(self._streams[peer], *rings, spin_us=self.spin_us,
                                              stream_copies=self.stream_copies)

    def _on_ack(self, ack_transport: bytes) -> None:
        try:
            ack = msgspec.msgpack.decode(ack_transport, type=ShmHandshake)
        except msgspec.DecodeError as e:
            raise ProtocolError(f"HelloAck.transport (shm): {e}") from None
        if len(ack.segments) != 2:
            raise ProtocolError(f"HelloAck.transport (shm) segments: expected 2 names, "
                                f"received {ack.segments}")
        if (ack.ring_entries, ack.ring_entry_bytes) != (shm_ring.RING_ENTRIES,
                                                        shm_ring.ENTRY_BYTES):
            raise ProtocolError(f"HelloAck.transport (shm) message ring: expected "
                                f"{shm_ring.RING_ENTRIES} entries of {shm_ring.ENTRY_BYTES} "
                                f"bytes, received {ack.ring_entries} of "
                                f"{ack.ring_entry_bytes}")
        if ack.slots_offset != shm_ring.SLOTS_OFFSET:
            raise ProtocolError(f"HelloAck.transport (shm) slots_offset: expected "
                                f"{shm_ring.SLOTS_OFFSET} (the ring, then whole pages), "
                                f"received {ack.slots_offset}")
        if not self.codec.max_bytes <= ack.slot_bytes <= 2 * self.slot_bytes:
            raise ProtocolError(f"HelloAck.transport (shm) slot_bytes: expected "
                                f"{self.codec.max_bytes} to {2 * self.slot_bytes}, received "
                                f"{ack.slot_bytes}")
        # The names come from the peer, and this side unlinks them once mapped:
        # only ever segments made for this connection, never someone else's.
        prefix = f"vllm-afd-{self.port}-{self.rank}-"
        for name, direction in zip(ack.segments, ("a2f", "f2a")):
            suffix = name[len(prefix):]
            if (not name.startswith(prefix) or not suffix.startswith(direction + "-")
                    or not suffix[4:].isalnum()):
                raise ProtocolError(f"HelloAck.transport (shm) segments: expected names "
                                    f"{prefix}{direction}-<pid>x<hex>, received {name!r}")
        self.slot_bytes = ack.slot_bytes
        size = self._segment_bytes
        segments = []
        try:
            for name in ack.segments:
                segments.append(ShmSegment(name, size, create=False))
        except FileNotFoundError as e:
            for segment in segments:
                segment.close()
            raise AFDConnectionError(
                f"{self.me} cannot open shared memory {e.filename or name} announced by "
                f"{self.peer_name(0)} at {self.address}: the shm connector needs both "
                f"servers on one host (same /dev/shm); use connector 'tcp' across hosts"
            ) from None
        to_ffn, to_attention = segments
        self._segments[0] = (to_ffn, to_attention)
        # Both sides have the memory mapped now; drop the names so nothing can
        # leak from /dev/shm, whichever process dies first.
        for segment in segments:
            segment.unlink()

    # ------------------------------------------------------------------ frames
    def spin_counters(self, peer: int = 0) -> tuple[int, int]:
        link = self._streams.get(peer)
        if type(link) is not shm_ring.RingStream:
            return 0, 0
        counters = link.counters
        return counters["preempted_spins"], counters["spin_backoffs"]

    def _slots(self, table: dict[int, HostSlots], peer: int) -> HostSlots:
        try:
            return table[peer]
        except KeyError:
            raise LinkClosed("shared memory already released") from None

    def _send_slot(self, peer: int, ubatch_id: int, nbytes: int,
                   device: torch.device) -> torch.Tensor | None:
        # A host payload is packed straight into the shared-memory slot (no
        # second copy); a device one on its device first, then copied over.
        if device.type != "cpu":
            return None
        return self._slots(self._tx, peer).slot(ubatch_id)[:nbytes]

    def _transmit(self, peer: int, header: bytes, frame: LayerFrame | None,
                  payload: "torch.Tensor | list[torch.Tensor] | None",
                  deadline: float) -> None:
        if payload is not None and frame.nbytes:
            slots = self._slots(self._tx, peer)
            if not (isinstance(payload, torch.Tensor)
                    and payload.data_ptr() == slots.slot(frame.ubatch_id).data_ptr()):
                parts = payload if isinstance(payload, list) else [payload]
                slots.write(frame.ubatch_id, parts, frame.nbytes)
            self.bytes_sent += frame.nbytes
        super()._transmit(peer, header, frame, None, deadline)

    def _receive_payload(self, peer: int, frame: LayerFrame, dtype: torch.dtype,
                         announced: int, deadline: float,
                         out: torch.Tensor | None) -> torch.Tensor:
        if announced != 0:
            raise ProtocolError(f"payload length from {self.peer_name(peer)}: expected 0 "
                                f"(shm payloads travel in shared memory), received {announced}")
        if frame.nbytes > self.slot_bytes:  # check_frame's max_bytes makes this impossible
            raise ProtocolError(f"LayerFrame.nbytes: expected at most {self.slot_bytes}, "
                                f"received {frame.nbytes}")
        self.bytes_received += frame.nbytes
        return self._slots(self._rx, peer).read(frame.ubatch_id, dtype, frame.shape, out)

    def _release_received(self, peer: int, ubatch_id: int) -> None:
        slots = self._rx.get(peer)
        if slots is not None:
            slots.release(ubatch_id)

    def _close_transport(self) -> None:
        super()._close_transport()
        self.frames.clear()
        for table in (self._tx, self._rx):  # our views and pins first
            for slots in table.values():
                slots.close()
            table.clear()
        for segments in list(self._segments.values()):
            for segment in segments:
                segment.close()
        self._segments.clear()
