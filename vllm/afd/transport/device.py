# SPDX-License-Identifier: Apache-2.0
# SPDX-FileCopyrightText: Copyright contributors to the vllm-afd project
"""Devices and streams in the data plane.

Two rules hold on every device (docs/architecture.md, "Device rules"):

- Work happens on the device and stream of whoever asked for it. A caller
  captures `DeviceContext.current(device)` where it asks (a model runner, an
  FFN worker); every thread the data plane starts for that work enters it
  (`with context.entered():`), so its copies and kernels are ordered with the
  caller's, never on the device's default stream or on device 0.
- A received tensor lands on the consumer's device, in a buffer the consumer
  owns, ordered on the consumer's current stream. `DeviceOps` is how the
  transports copy and fence: asynchronous copies and events on an accelerator,
  plain copies on the CPU (where there is nothing to fence).

Nothing here asks `current_device()` from inside a data-plane thread: the
device always comes from the caller.
"""

import contextlib
import ctypes
import logging
import threading
from collections.abc import Iterator
from typing import Any

import torch

logger = logging.getLogger(__name__)

_tls = threading.local()  # .context: the DeviceContext this thread entered


def device_module(device: torch.device) -> Any | None:
    """torch.cuda, torch.npu, ... for an accelerator device; None for the CPU
    (and meta), which have no streams."""
    if device.type in ("cpu", "meta"):
        return None
    return torch.get_device_module(device)


class DeviceContext:
    """A device and the stream its work is ordered on."""

    __slots__ = ("device", "stream")

    def __init__(self, device: torch.device | str, stream: Any | None = None) -> None:
        device = torch.device(device)
        stream_device = getattr(stream, "device", None)
        if (device.index is None and isinstance(stream_device, torch.device)
                and stream_device.type == device.type):
            # "cuda" with a stream of cuda:0 is cuda:0, the device the tensors
            # name: the GPU check's loopback refused cuda:0 payloads for "cuda".
            device = stream_device
        self.device = device
        self.stream = stream

    @classmethod
    def current(cls, device: torch.device | str) -> "DeviceContext":
        """The calling thread's current stream on device (call it where the
        work is asked for, not inside a data-plane thread)."""
        device = torch.device(device)
        module = device_module(device)
        if module is None:
            return cls(device)
        if device.index is None:
            device = torch.device(device.type, module.current_device())
        return cls(device, module.current_stream(device))

    @contextlib.contextmanager
    def entered(self) -> Iterator["DeviceContext"]:
        """Make this the thread's device and current stream for the block."""
        previous = getattr(_tls, "context", None)
        _tls.context = self
        module = device_module(self.device)
        try:
            if module is None:
                yield self
            else:
                with module.device(self.device):
                    if self.stream is None:
                        yield self
                    else:
                        with module.stream(self.stream):
                            yield self
        finally:
            _tls.context = previous

    def describe(self) -> dict:
        """Device and stream as plain values (tests, logs)."""
        stream = None
        if self.stream is not None:
            stream = getattr(self.stream, "stream_id", None) or id(self.stream)
        return {"device": str(self.device), "stream": stream}

    def __eq__(self, other: object) -> bool:
        return (isinstance(other, DeviceContext) and self.device == other.device
                and self.stream == other.stream)

    def __hash__(self) -> int:
        return hash((self.device, id(self.stream)))

    def __repr__(self) -> str:
        return f"DeviceContext({self.device}, stream={self.describe()['stream']})"


def entered_context() -> DeviceContext | None:
    """The DeviceContext the calling thread entered, if any."""
    return getattr(_tls, "context", None)


class DeviceOps:
    """Copies and fences for one device, as the transports use them.

    On an accelerator: copies are asynchronous on the current stream, events
    mark them, `wait_host` blocks the host on an event (before the peer may
    touch memory a copy still reads or writes) and `wait_stream` makes the
    current stream wait (before the consumer reads what a copy writes). On the
    CPU everything is synchronous and the events are None.
    """

    def __init__(self, device: torch.device | str) -> None:
        self.device = torch.device(device)
        self.module = device_module(self.device)

    @property
    def is_host(self) -> bool:
        return self.module is None

    def copy(self, dst: torch.Tensor, src: torch.Tensor) -> None:
        if (dst.device.type == src.device.type == "cpu" and dst.dtype == src.dtype
                and dst.shape == src.shape and dst.is_contiguous() and src.is_contiguous()):
            # One memmove: for decode-sized payloads torch's copy_ costs more
            # in dispatch than in copying.
            ctypes.memmove(dst.data_ptr(), src.data_ptr(), src.numel() * src.element_size())
            return
        dst.copy_(src, non_blocking=not (dst.device.type == src.device.type == "cpu"))

    def copy_to_host(self, dst: torch.Tensor, src: torch.Tensor) -> None:
        """Copy src into dst, host memory of src's dtype and shape, and return
        once the bytes have landed there (a staged send: the peer reads them
        as soon as the header arrives). On an accelerator torch's blocking
        copy: the copy and a wait for the current stream, both inside one
        call (no event, no stream lookup in Python)."""
        if src.device.type == "cpu":
            self.copy(dst, src)  # synchronous on the host
        else:
            dst.copy_(src)

    def record(self, event: Any | None = None) -> Any | None:
        """An event after the work queued so far on the current stream: event
        recorded again when given (creating one is a driver call, on a GPU
        host as dear as recording it), else a new one."""
        if self.module is None:
            return None
        if event is None:
            event = self.module.Event()
        event.record(self.module.current_stream(self.device))
        return event

    def wait_host(self, event: Any | None) -> None:
        if event is not None:
            event.synchronize()

    def wait_host_settled(self, event: Any | None) -> None:
        """wait_host for work that has most likely finished (a slot's last
        read, fenced since by a later wait on the same stream): asking costs
        a fraction of a wait (benchmarks/notes.md)."""
        if event is not None and not event.query():
            self.wait_host(event)

    def wait_stream(self, event: Any | None) -> None:
        if event is not None:
            self.module.current_stream(self.device).wait_event(event)

    def empty(self, nbytes: int) -> torch.Tensor:
        """A uint8 buffer on this device."""
        return torch.empty(nbytes, dtype=torch.uint8, device=self.device)

    def host_buffer(self, nbytes: int) -> torch.Tensor:
        """A host staging buffer: page-locked when this is an accelerator, so
        copies to and from it are truly asynchronous."""
        pin = self.module is not None and self.device.type == "cuda"
        return torch.empty(nbytes, dtype=torch.uint8, pin_memory=pin)

    def pin(self, host: torch.Tensor) -> "PinnedRegion | None":
        """Page-lock existing host memory (a shared-memory mapping) for this
        device; None where that is not possible or not needed (the CPU)."""
        if self.device.type != "cuda" or host.numel() == 0:
            return None
        return PinnedRegion(host)


class PinnedRegion:
    """Host memory registered with CUDA (cudaHostRegister) while alive."""

    def __init__(self, host: torch.Tensor) -> None:
        self._ptr, self._nbytes = host.data_ptr(), host.numel() * host.element_size()
        error = torch.cuda.cudart().cudaHostRegister(self._ptr, self._nbytes, 0)
        if int(error) != 0:
            raise RuntimeError(f"cudaHostRegister of {self._nbytes} bytes failed "
                               f"(cudaError {int(error)})")

    def release(self) -> None:
        if self._ptr:
            torch.cuda.cudart().cudaHostUnregister(self._ptr)
            self._ptr = 0
