# SPDX-License-Identifier: Apache-2.0
# SPDX-FileCopyrightText: Copyright contributors to the vllm-afd project
"""Host staging slots: how payloads cross host memory between two devices.

shm moves payloads through shared-memory segments, tcp through a socket into a
host buffer. Either way a payload sits in a host *slot* (one per peer,
direction and micro-batch) between the sender's device and the receiver's.
`HostSlots` owns the copies in and out of one direction's slots:

    sender    write(u, parts)   parts (any device) -> slot u; returns once the
                                bytes are in host memory, because the peer
                                reads them as soon as the header arrives
    receiver  read(u, ...)      slot u -> the consumer: a view of the slot for
                                a CPU consumer, or an asynchronous copy
                                ordered on the consumer's current stream into
                                the consumer's own tensor (`out`) or into the
                                slot's device buffer; an event marks the copy
              release(u)        blocks until that copy has read the slot; the
                                connector calls it before any message that
                                lets the peer overwrite slot u

On an accelerator the slots are page-locked (pinned), so the copies are
asynchronous DMA; on the CPU the copies are synchronous and the events None.
"""

import ctypes
import logging
from collections.abc import Sequence

import torch

from vllm.afd.transport.device import DeviceOps, PinnedRegion

logger = logging.getLogger(__name__)


class HostSlots:
    def __init__(self, memory: torch.Tensor, slot_bytes: int, count: int,
                 ops: DeviceOps, *, pinned: bool = False) -> None:
        """memory: a flat uint8 host tensor of at least count * slot_bytes
        bytes. pinned: it is page-locked already (else it is registered here
        when ops is a CUDA device)."""
        if memory.numel() < slot_bytes * count:
            raise ValueError(f"HostSlots: {memory.numel()} bytes cannot hold {count} "
                             f"slots of {slot_bytes}")
        self.slot_bytes, self.count, self.ops = slot_bytes, count, ops
        self._memory = memory
        self._region: PinnedRegion | None = None if pinned else ops.pin(memory)
        self._slots = [memory[u * slot_bytes:(u + 1) * slot_bytes] for u in range(count)]
        # Each slot's address, for the prepared calls' C (a data_ptr() is a
        # torch call per message end; on the lent GPU host's sandbox, microseconds each).
        self._addresses = [slot.data_ptr() for slot in self._slots]
        self._events: list = [None] * count  # the last read of each slot
        self._spare_events: list = [None] * count  # released, recorded again next read
        self._own_events: list = [False] * count  # the last read's event is self.ops'
        self._write_events: list = [None] * count  # each slot's device-to-host fence
        self._device_buffers: list[torch.Tensor | None] = [None] * count
        self._views: dict = {}

    def slot(self, u: int) -> torch.Tensor:
        return self._slots[u]

    def address(self, u: int) -> int:
        """Slot u's host address (slot(u).data_ptr(), kept)."""
        return self._addresses[u]

    # ------------------------------------------------------------- sending
    def write(self, u: int, parts: Sequence[torch.Tensor], limit: int) -> int:
        """Copy parts back to back into slot u (at most limit bytes) and wait
        until they are in host memory; returns the bytes written."""
        if len(parts) == 1:
            return self._write_one(u, parts[0], limit)
        return self._write_parts(u, parts, limit)

    def _write_parts(self, u: int, parts: Sequence[torch.Tensor], limit: int) -> int:
        """write() of several parts (routed exact frames of a device the op
        library cannot pack on): each copied, then one fence for all."""
        slot, offset, pending = self._slots[u], 0, False
        for part in parts:
            nbytes = part.numel() * part.element_size()
            if offset + nbytes > limit:  # a bug on this side, never the peer's
                raise ValueError(f"payload parts exceed the frame's {limit} bytes")
            if nbytes == 0:
                continue
            if part.device.type == "cpu":
                # One memmove: for decode-sized payloads torch's copy_ costs
                # more in dispatch than in copying.
                ctypes.memmove(slot.data_ptr() + offset, part.data_ptr(), nbytes)
            else:
                self.ops_for(part).copy(slot[offset:offset + nbytes], _bytes_of(part))
                pending = True
            offset += nbytes
        if pending:
            # The peer reads the slot when the header arrives: the device to
            # host copies must have landed before it is sent.
            ops = self.ops_for(parts[0])
            if ops is self.ops:
                event = self._write_events[u] = ops.record(self._write_events[u])
            else:
                event = ops.record()
            ops.wait_host(event)
        return offset

    def _write_one(self, u: int, part: torch.Tensor, limit: int) -> int:
        """write() of one part (every prepared call's, most messages'): one
        copy into a typed view of the slot (cached: steps repeat their shapes)
        that returns once the bytes have landed (DeviceOps.copy_to_host). On
        an accelerator that is one host call with its wait inside, where
        slicing, byte views, an asynchronous copy, a stream lookup, an event
        and a wait on it would be seven, each costly inside a sandbox
        (benchmarks/notes.md)."""
        nbytes = part.numel() * part.element_size()
        if nbytes > limit:  # a bug on this side, never the peer's
            raise ValueError(f"payload parts exceed the frame's {limit} bytes")
        if nbytes:
            if not part.is_contiguous():
                raise ValueError(f"AFD payloads must be contiguous; got strides "
                                 f"{part.stride()}")
            view = self._typed(("write", u), self._slots[u], part.dtype, part.shape, nbytes,
                               alias=False)
            self.ops_for(part).copy_to_host(view, part)
        return nbytes

    def ops_for(self, tensor: torch.Tensor) -> DeviceOps:
        return self.ops if tensor.device == self.ops.device else DeviceOps(tensor.device)

    # ----------------------------------------------------------- receiving
    def read(self, u: int, dtype: torch.dtype, shape: Sequence[int],
             out: torch.Tensor | None = None) -> torch.Tensor:
        """Slot u's payload as dtype and shape, for the consumer (see the
        module docstring). With out, the payload is copied into it."""
        nbytes = _nbytes(dtype, shape)
        # Handed out only to a host consumer, which reads the slot itself.
        view = self._typed(u, self._slots[u], dtype, shape, nbytes,
                           alias=out is None and self.ops.is_host)
        if out is None:
            if self.ops.is_host:
                return view  # the CPU consumer reads the slot itself
            buffer = self._device_buffers[u]
            if buffer is None:
                buffer = self._device_buffers[u] = self.ops.empty(self.slot_bytes)
            out = self._typed(("device", u), buffer, dtype, shape, nbytes)
        ops = self.ops_for(out)
        ops.copy(out, view)
        if self._events[u] is not None:  # a second read before a release (rare)
            self.release(u)
        if ops is self.ops:  # its events are recorded again, read after read
            spare, self._spare_events[u] = self._spare_events[u], None
            self._events[u] = ops.record(spare)
            self._own_events[u] = True
        else:  # another device's: a new event (never recorded on this one's stream)
            self._events[u] = ops.record()
            self._own_events[u] = False
        return out

    def view(self, u: int, dtype: torch.dtype, shape: Sequence[int]) -> torch.Tensor:
        """Slot u's payload as dtype and shape, in host memory (no copy)."""
        return self._typed(u, self._slots[u], dtype, shape, _nbytes(dtype, shape))

    def release(self, u: int) -> None:
        """Block until the last read of slot u has read it."""
        event, self._events[u] = self._events[u], None
        if event is not None:
            self.ops.wait_host_settled(event)
            if self._own_events[u]:
                self._spare_events[u] = event

    def release_all(self) -> None:
        for u in range(self.count):
            self.release(u)

    def _typed(self, key, buffer: torch.Tensor, dtype: torch.dtype, shape: Sequence[int],
               nbytes: int, alias: bool = True) -> torch.Tensor:
        """buffer's first bytes as dtype and shape; cached per key (steps
        repeat their shapes, and building the view costs more than a small
        message). alias: a fresh alias (detach()) for a caller to keep; else
        the cached view itself, for a copy's source (one torch call fewer)."""
        shape = tuple(shape)
        cached = self._views.get(key)
        if cached is not None and cached[0] == dtype and cached[1] == shape:
            return cached[2].detach() if alias else cached[2]
        view = buffer[:nbytes].view(dtype).view(shape)
        self._views[key] = (dtype, shape, view)
        return view.detach() if alias else view

    def close(self) -> None:
        try:
            self.release_all()
        except Exception as e:  # noqa: BLE001 - closing after a device error
            logger.debug("releasing host slots failed: %s", e)
        self._views.clear()
        self._slots = []
        self._addresses = []
        self._device_buffers = []
        if self._region is not None:
            self._region.release()
            self._region = None
        self._memory = None


def _nbytes(dtype: torch.dtype, shape: Sequence[int]) -> int:
    n = dtype.itemsize
    for d in shape:
        n *= d
    return n


def _bytes_of(tensor: torch.Tensor) -> torch.Tensor:
    if not tensor.is_contiguous():
        raise ValueError(f"AFD payloads must be contiguous; got strides {tensor.stride()}")
    return tensor.detach().reshape(-1).view(torch.uint8)
