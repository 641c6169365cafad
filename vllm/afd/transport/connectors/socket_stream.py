# SPDX-License-Identifier: Apache-2.0
# SPDX-FileCopyrightText: Copyright contributors to the vllm-afd project
"""SocketStream: a framed message stream over one connected stream socket.

tcp's transport, and the header channel of the shm and nccl connectors (which
move payloads elsewhere and announce payload length 0). Its own module so that
tcp.py, which builds connectors on it, and shm_ring.py, which wakes a peer
through it, both import it without importing each other.
"""

import select
import socket
import struct
import time

from vllm.afd.transport.connectors.base import (LOG_INTERVAL_S, LinkClosed, LinkTimeout,
                                                WaitCallback)
from vllm.afd.transport.wire import ProtocolError

MAGIC = b"AFD1"
PREFIX = struct.Struct("<4sIQ")  # magic, header length, payload length
MAX_HEADER_BYTES = 64 * 1024  # a Hello with a large fingerprint fits easily
_HANGUP = getattr(select, "POLLRDHUP", 0x2000) | select.POLLHUP | select.POLLERR


class SocketStream:
    """A framed message stream over one connected stream socket. Raises
    LinkClosed / LinkTimeout / ProtocolError; knows nothing about steps."""

    frame_overhead = PREFIX.size  # bytes per message besides its header

    def __init__(self, sock: socket.socket, name: str, stall_timeout_s: float,
                 spin_s: float = 0.0) -> None:
        self.sock = sock
        self.name = name  # who is on the other end, for messages
        # Once a frame has started, the rest must follow within this time,
        # even when the wait for the frame itself has no deadline.
        self.stall_timeout_s = stall_timeout_s
        # How long a wait for the next frame polls the socket before it sleeps
        # in the kernel (0: never): a sleeping receiver's wake-up costs tens of
        # microseconds per message on a VM, a poll ~1 us. At most spin_s of CPU
        # per wait.
        self.spin_s = spin_s
        self.spin_hits = 0  # frames whose first bytes the spin caught
        self._prefix = memoryview(bytearray(PREFIX.size))
        self._header = memoryview(bytearray(MAX_HEADER_BYTES))
        # Non-blocking for good: a send or receive tries the socket first and
        # waits in poll() (_wait) only when it must (the module docstring).
        sock.settimeout(0.0)

    @staticmethod
    def prefix(header_len: int, payload_len: int) -> bytes:
        """A frame's bytes before its header."""
        return PREFIX.pack(MAGIC, header_len, payload_len)

    def send(self, header: bytes, payload: "memoryview | list[memoryview] | None",
             deadline: float) -> int:
        """Send one frame (payload: one buffer, or several sent back to back as
        one payload); returns the bytes put on the wire."""
        views = [] if payload is None else payload if isinstance(payload, list) else [payload]
        views = [v for v in views if v.nbytes]
        payload_len = sum(v.nbytes for v in views)
        parts = [PREFIX.pack(MAGIC, len(header), payload_len), header, *views]
        total = unsent = PREFIX.size + len(header) + payload_len
        while True:
            try:
                sent = self.sock.sendmsg(parts)
            except BlockingIOError:  # the socket's buffer is full
                sent = 0
            except OSError as e:
                raise LinkClosed(e.strerror or str(e)) from None
            unsent -= sent
            if unsent <= 0:
                return total
            if sent:
                parts = _unsent(parts, sent)
            remaining = deadline - time.monotonic()
            if remaining <= 0:
                raise LinkTimeout()
            self._wait(select.POLLOUT, remaining)

    def recv_message(self, deadline: float | None,
                     on_wait: WaitCallback) -> tuple[memoryview, int]:
        """The next frame's header (a view valid until the next call) and its
        announced payload length; the payload is left for recv_into()."""
        # Only a wait with a deadline (within a step: an answer, the next layer)
        # spins; an idle one (no step yet) sleeps at once.
        got = self._spin(self._prefix) if self.spin_s and deadline is not None else 0
        self._recv_exact(self._prefix, deadline, on_wait, got)
        magic, header_len, payload_len = PREFIX.unpack(self._prefix)
        if magic != MAGIC:
            raise ProtocolError(
                f"bad frame from {self.name}: expected magic {MAGIC!r}, received "
                f"{bytes(magic)!r} (is something other than an AFD peer on this port?)")
        if header_len > MAX_HEADER_BYTES:
            raise ProtocolError(f"frame header length from {self.name}: expected at most "
                                f"{MAX_HEADER_BYTES}, received {header_len}")
        header = self._header[:header_len]
        stall = time.monotonic() + self.stall_timeout_s
        self._recv_exact(header, stall if deadline is None else min(deadline, stall), on_wait)
        return header, payload_len

    def recv_into(self, view: memoryview, deadline: float) -> None:
        self._recv_exact(view, deadline, lambda: None)

    def _wait(self, events: int, timeout: float) -> bool:
        """Sleep in poll() until the socket has events (or hung up: the next
        call reads the EOF or error), at most timeout seconds; False when the
        time ran out."""
        fd = self.sock.fileno()
        if fd < 0:  # close()d by another thread
            raise LinkClosed("connection closed")
        poller = select.poll()
        poller.register(fd, events | _HANGUP)
        return bool(poller.poll(max(timeout, 0.0) * 1000.0))

    def _spin(self, view: memoryview) -> int:
        """Poll for the first bytes of view for up to spin_s; how many came."""
        sock, size = self.sock, view.nbytes
        end = time.perf_counter() + self.spin_s
        while True:
            try:
                n = sock.recv_into(view, size)
            except BlockingIOError:
                if time.perf_counter() < end:
                    continue
                return 0
            except OSError as e:
                raise LinkClosed(e.strerror or str(e)) from None
            if n == 0:
                raise LinkClosed("connection closed")
            self.spin_hits += 1
            return n

    def _recv_exact(self, view: memoryview, deadline: float | None,
                    on_wait: WaitCallback, got: int = 0) -> None:
        size = view.nbytes
        if got and deadline is None:
            deadline = time.monotonic() + self.stall_timeout_s
        sock = self.sock
        while got < size:
            try:
                n = sock.recv_into(view[got:] if got else view)
            except BlockingIOError:  # nothing there yet: sleep until there is
                if deadline is None:
                    wait = LOG_INTERVAL_S
                else:
                    wait = deadline - time.monotonic()
                    if wait <= 0:
                        raise LinkTimeout() from None
                    wait = min(wait, LOG_INTERVAL_S)
                if not self._wait(select.POLLIN, wait):
                    on_wait()
                continue
            except OSError as e:
                raise LinkClosed(e.strerror or str(e)) from None
            if n == 0:
                raise LinkClosed("connection closed" if got == 0 else
                                 f"connection closed after {got} of {size} bytes")
            if got == 0 and deadline is None:
                deadline = time.monotonic() + self.stall_timeout_s
            got += n

    def close(self) -> None:
        try:
            # shutdown() wakes a thread blocked in recv on this socket (close()
            # alone does not); data already queued (a GOODBYE) still goes out.
            self.sock.shutdown(socket.SHUT_RDWR)
        except OSError:
            pass  # not connected (any more)
        self.sock.close()


def _unsent(parts: list, sent: int) -> list:
    """What remains of parts after the first `sent` bytes went out."""
    rest = []
    for part in parts:
        view = memoryview(part).cast("B")
        if sent >= view.nbytes:
            sent -= view.nbytes
            continue
        rest.append(view[sent:])
        sent = 0
    return rest
