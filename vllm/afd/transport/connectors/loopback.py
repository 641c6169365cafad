# SPDX-License-Identifier: Apache-2.0
# SPDX-FileCopyrightText: Copyright contributors to the vllm-afd project
"""Loopback connector: attention and FFN connectors in one process (tests).

Connectors with the same host:port key find each other through a process-wide
table, like sockets through an address: the FFN "listens" on
loopback://host:port, attention ranks "dial" it; either may come first. Each
connection is a pair of thread-safe queues carrying encoded headers and
payload bytes, so the handshake, the header encoding and every protocol check
of the real transports run here too; only the bytes never leave the process.

Payloads are copied at send, on the sender's device and current stream (the
sender may reuse its tensor at once), with an event after the copy; the
receiver's stream waits for that event and gets the copy, which it owns (or it
is copied into the receiver's `out`). Data never leaves the device, so both
ends must be on the same device kind.
"""

import logging
import queue
import threading
import time

import torch

from vllm.afd.transport import wire
from vllm.afd.transport.connectors.base import (LOG_INTERVAL_S, AFDConnectionError,
                                                AFDConnector, LinkClosed, LinkTimeout,
                                                WaitCallback)
from vllm.afd.transport.wire import LayerFrame, ProtocolError

logger = logging.getLogger(__name__)

_CLOSED = object()  # put in the peer's inbox when a side closes

# key -> queue of incoming links of the FFN connector listening on that key.
_listeners: dict[str, queue.Queue] = {}
_listeners_changed = threading.Condition()


class QueueStream:
    """One side of an in-process connection."""

    def __init__(self, inbox: queue.Queue, outbox: queue.Queue, closed: list[bool],
                 side: int, name: str) -> None:
        self.inbox, self.outbox = inbox, outbox
        self._closed = closed  # shared by both sides: [side 0 closed, side 1 closed]
        self._side = side
        self.name = name

    @classmethod
    def pair(cls, name_a: str, name_b: str) -> tuple["QueueStream", "QueueStream"]:
        """Two connected ends; name_x is how end x refers to the other end."""
        a_to_b, b_to_a, closed = queue.Queue(), queue.Queue(), [False, False]
        return (cls(b_to_a, a_to_b, closed, 0, name_a), cls(a_to_b, b_to_a, closed, 1, name_b))

    def send(self, header: bytes, payload: torch.Tensor | None) -> None:
        if self._closed[1 - self._side]:
            raise LinkClosed("peer closed its end")
        self.outbox.put((header, payload))

    def recv(self, deadline: float | None,
             on_wait: WaitCallback) -> tuple[bytes, torch.Tensor | None]:
        while True:
            wait = LOG_INTERVAL_S
            if deadline is not None:
                wait = min(wait, deadline - time.monotonic())
                if wait <= 0:
                    raise LinkTimeout()
            try:
                item = self.inbox.get(timeout=wait)
            except queue.Empty:
                on_wait()
                continue
            if item is _CLOSED:
                self.inbox.put(_CLOSED)  # later receives fail the same way
                raise LinkClosed("peer closed its end" if self._closed[1 - self._side]
                                 else "closed")
            return item

    def close(self) -> None:
        if not self._closed[self._side]:
            self._closed[self._side] = True
            self.outbox.put(_CLOSED)
            self.inbox.put(_CLOSED)  # wakes a thread of ours blocked in recv()


class LoopbackConnector(AFDConnector):
    name = "loopback"

    def __init__(self, afd_config, **kwargs) -> None:
        super().__init__(afd_config, **kwargs)
        config = self.afd_config
        self.key = f"{config.host_of(self.ffn_rank)}:{config.port + self.ffn_rank}"
        self._incoming: queue.Queue | None = None  # FFN side, while listening
        self._payloads: dict[int, torch.Tensor | None] = {}  # last received, per peer

    @property
    def address(self) -> str:
        return f"loopback://{self.key}"

    def _open(self, deadline: float) -> None:
        if self.is_attention:
            self._dial(deadline)
            self.handshake.as_attention(deadline)
        else:
            self._accept_peers(deadline)

    def _dial(self, deadline: float) -> None:
        on_wait = self._waiter(self.peer_name(0), deadline, connecting=True)
        with _listeners_changed:
            while self.key not in _listeners:
                remaining = self._wait_budget(
                    deadline, f"{self.peer_name(0)} at {self.address}",
                    f"{self.me} gave up waiting for {self.peer_name(0)} at {self.address} "
                    f"after {self.timeout_s:g}s; no FFN connector listens there")
                _listeners_changed.wait(min(remaining, 0.5))
                on_wait()
            mine, theirs = QueueStream.pair(f"{self.peer_name(0)} at {self.address}",
                                          f"attention rank {self.rank}")
            _listeners[self.key].put(theirs)
        self._streams[0] = mine

    def _listen(self) -> None:
        with _listeners_changed:
            if self.key in _listeners:
                raise AFDConnectionError(f"{self.me} cannot listen on {self.address}: "
                                         f"another FFN connector listens there")
            self._incoming = _listeners[self.key] = queue.Queue()
            _listeners_changed.notify_all()

    def _next_link(self, timeout: float) -> "tuple[QueueStream, str] | None":
        incoming = self._incoming
        if incoming is None:
            if self._closing.is_set():
                return None
            raise AFDConnectionError(f"{self.me}: not listening on {self.address}")
        try:
            link = incoming.get(timeout=max(timeout, 0.0))
        except queue.Empty:
            return None
        if link is None:  # close() from another thread
            return None
        return link, link.name

    def _accept_peers(self, deadline: float) -> None:
        self._listen()
        self._accept_expected(deadline)
        self._stop_listening()

    def _stop_listening(self) -> None:
        with _listeners_changed:
            if self._incoming is not None:
                if _listeners.get(self.key) is self._incoming:
                    del _listeners[self.key]
                self._incoming.put(None)  # wakes _next_link if another thread closes us
            self._incoming = None

    def _transmit(self, peer: int, header: bytes, frame: LayerFrame | None,
                  payload: "torch.Tensor | list[torch.Tensor] | None",
                  deadline: float) -> None:
        data = None
        if isinstance(payload, list):  # a routed payload: its parts, joined (a copy)
            data = torch.cat([wire.tensor_bytes(p) for p in payload])
        elif payload is not None:
            data = wire.tensor_bytes(payload).clone()
        event = self.ops.record() if data is not None else None
        self._streams[peer].send(header, None if data is None else (data, event))
        self.bytes_sent += len(header) + (0 if data is None else data.numel())

    def _receive(self, peer: int, deadline: float | None,
                 on_wait: WaitCallback) -> tuple[bytes, int]:
        header, payload = self._streams[peer].recv(deadline, on_wait)
        if not isinstance(header, (bytes, bytearray, memoryview)):
            raise ProtocolError(f"loopback item from {self._streams[peer].name} is "
                                f"{type(header).__name__}, not encoded bytes")
        self._payloads[peer] = payload
        return header, 0 if payload is None else payload[0].numel()

    def _receive_payload(self, peer: int, frame: LayerFrame, dtype: torch.dtype,
                         announced: int, deadline: float,
                         out: torch.Tensor | None) -> torch.Tensor:
        payload = self._payloads.pop(peer, None)
        if payload is None or announced != frame.nbytes:
            raise ProtocolError(f"payload length from {self.peer_name(peer)}: expected "
                                f"{frame.nbytes} (LayerFrame.nbytes), received {announced}")
        data, event = payload
        if data.device != self.device:
            raise ProtocolError(f"loopback payload from {self.peer_name(peer)} is on "
                                f"{data.device}, this side consumes on {self.device}")
        self.bytes_received += announced
        self.ops.wait_stream(event)  # the sender's copy is done before we read
        tensor = data.view(dtype).view(frame.shape)
        if out is None:
            return tensor
        self.ops.copy(out, tensor)
        return out

    def _close_transport(self) -> None:
        self._stop_listening()
        for link in list(self._streams.values()):
            link.close()
        self._payloads.clear()
