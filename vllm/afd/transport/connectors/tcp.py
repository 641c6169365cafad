# SPDX-License-Identifier: Apache-2.0
# SPDX-FileCopyrightText: Copyright contributors to the vllm-afd project
"""TCP connector: messages and tensors over one plain TCP socket per peer.

The FFN rank listens on host:port (+ its rank), attention ranks connect;
either may start first (the attention side retries until timeout_s). Each
accepted connection becomes a session of its own (base.py accept_session), or
one of the peers of a connector that accept()ed them all. Each
message is one frame:

    [prefix: magic b"AFD1", u32 header length, u64 payload length]
    [msgpack header (wire.py)] [payload bytes]

sent with one sendmsg() straight from the tensor's memory (no copy) and
received with recv_into() straight into a per-(peer, micro-batch) tensor
buffer (no copy besides the kernel's). The payload is read only after its
LayerFrame passed wire.check_frame, and the announced length must equal the
frame's nbytes, so no buffer is ever sized by an unchecked header.

Why plain sockets and not pyzmq: zmq's I/O thread adds two thread hand-offs
per message, which dominates small messages (the common decode case) when
cores are scarce; for large payloads every option is bound by copies. Plain
sockets also report a dead peer at once (EOF/ECONNRESET), where zmq silently
reconnects. TCP keepalive catches peers that vanish without a FIN (host down,
partition). (The measurements behind this: benchmarks/notes.md.)

A step's layer calls take prepared calls (step_calls.py, tcp_frames.py):
one C call per message end, the frame's bytes before its payload fixed when
the step begins, so Python runs nothing per message. See shm.py for shared
memory.

Devices: CPU tensors are sent from and received into their own memory. For a
device consumer or sender, payloads stage through page-locked host buffers (one
per peer, direction and micro-batch, ../buffers.py): the device-to-host copy
has landed before the first byte is sent, and a received payload is copied to
the device asynchronously on the consumer's stream; the staging buffer is
reused only after that copy (an event).

connector_extra_config {"spin_us": N} (SocketConnector.extra_config_keys): a
wait for the next frame within a step polls the socket for up to N us before it
sleeps in the kernel, sparing a sleeping receiver's wake-up per message; an
idle wait (no deadline: no step yet) sleeps at once, so an idle link costs no
CPU.

The socket is non-blocking for good (SocketStream): a frame that is there is
read with three recv calls and sent with one sendmsg, poll() only when one
must wait. Python's socket timeouts would poll before each recv and send and
set the descriptor's mode again at each settimeout.

The socket stream (SocketStream) is also the header channel of the shm and nccl
connectors, which move payloads elsewhere and announce payload length 0.
"""

import errno
import logging
import select
import socket
import threading
import time

import torch

from vllm.afd.transport import auth, wire
from vllm.afd.transport.backoff import Backoff
from vllm.afd.transport.buffers import HostSlots
from vllm.afd.transport.connectors.base import (AFDConnectionError, AFDConnector,
                                                WaitCallback, spin_us_setting)
from vllm.afd.transport.connectors.socket_stream import _HANGUP, SocketStream
from vllm.afd.transport.connectors.step_calls import StepCalls
from vllm.afd.transport.connectors.tcp_frames import TcpFrames
from vllm.afd.transport.wire import LayerFrame, ProtocolError

logger = logging.getLogger(__name__)

# A peer that connected must say Hello promptly; a silent client (port scanner)
# must not hold the FFN's accept loop for the whole connect timeout.
HELLO_TIMEOUT_S = 10.0
RETRY_INTERVAL_S = (0.05, 0.5)  # connect retries back off between these (jittered)
LISTEN_POLL_S = 0.1
LISTEN_RETRY_S = 1.0


def configure_socket(sock: socket.socket) -> None:
    """Low latency, and notice peers that vanish without closing."""
    if sock.family in (socket.AF_INET, socket.AF_INET6):
        sock.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
        sock.setsockopt(socket.SOL_SOCKET, socket.SO_KEEPALIVE, 1)
        for option, value in (("TCP_KEEPIDLE", 10), ("TCP_KEEPINTVL", 5), ("TCP_KEEPCNT", 3)):
            if hasattr(socket, option):
                sock.setsockopt(socket.IPPROTO_TCP, getattr(socket, option), value)


class SocketConnector(AFDConnector):
    """Frames over one socket per peer: tcp's connector, and the header channel
    of shm's and nccl's, whose payloads travel elsewhere."""

    name = "tcp"
    authenticates = True  # see ../handshake.py and ../auth.py
    stages_through_host = True
    extra_config_keys = frozenset({"spin_us"})
    """spin_us: microseconds (0-1000000, default 0) a wait for the next frame
    within a step (an answer, the next layer's hidden states) polls the socket
    before it sleeps in the kernel. Spinning spares the sleeping receiver's
    wake-up per message, at the price of a busy core while it waits: set it only
    where each role has cores of its own. A wait with no step in progress never
    spins, so an idle link costs no CPU."""
    # Whether this connector's frames wait on the socket, so that spin_us
    # spins there (shm's wait on their rings and spin there: ../shm_ring.py).
    spins_on_socket = True

    def __init__(self, afd_config, **kwargs) -> None:
        super().__init__(afd_config, **kwargs)
        self._socket_spin_s = (spin_us_setting(self.afd_config, 0) / 1e6
                               if self.spins_on_socket else 0.0)
        self._refuser: threading.Thread | None = None
        self.host = self.afd_config.host_of(self.ffn_rank)
        self.port = self.afd_config.port + self.ffn_rank
        self._listener: socket.socket | None = None
        # Receive buffers, per (peer, ubatch): grown on demand up to max_bytes.
        self._rx_buffers: dict[tuple[int, int], torch.Tensor] = {}
        # Host staging of device payloads, per peer (see ../buffers.py).
        self._tx_staging: dict[int, HostSlots] = {}
        self._rx_staging: dict[int, HostSlots] = {}

    @property
    def address(self) -> str:
        host = f"[{self.host}]" if ":" in self.host else self.host
        return f"tcp://{host}:{self.port}"

    # ------------------------------------------------------------- rendezvous
    def _open(self, deadline: float) -> None:
        if self.is_attention:
            sock = self._dial(deadline)
            self._streams[0] = SocketStream(sock, f"{self.peer_name(0)} at {self.address}",
                                        self.timeout_s, self._socket_spin_s)
            self.handshake.as_attention(deadline)
        else:
            self._listen()
            self._accept_peers(deadline)

    def _dial(self, deadline: float) -> socket.socket:
        on_wait = self._waiter(self.peer_name(0), deadline, connecting=True)
        retry = Backoff(*RETRY_INTERVAL_S)
        last_error = "no attempt yet"
        while True:
            remaining = self._wait_budget(
                deadline, f"{self.peer_name(0)} at {self.address}",
                f"{self.me} gave up waiting for {self.peer_name(0)} at {self.address} "
                f"after {self.timeout_s:g}s ({last_error}); is the FFN server (role "
                f"'ffn', connector '{self.name}') running with the same host and port?")
            try:
                sock = self._make_connection(min(remaining, 2.0))
            except OSError as e:
                last_error = e.strerror or str(e)
                on_wait()
                self._closing.wait(min(retry.next(), max(remaining, 0)))
                continue
            configure_socket(sock)
            return sock

    def _make_connection(self, timeout: float) -> socket.socket:
        return socket.create_connection((self.host, self.port), timeout=timeout)

    def _make_listener(self) -> socket.socket:
        return socket.create_server((self.host, self.port), backlog=64)

    def _listens_on_network(self) -> bool:
        """Whether the FFN's listener is reachable over TCP (shm: unless it uses
        its local abstract unix socket)."""
        return True

    def _listen(self) -> None:
        if self._listens_on_network():
            auth.check_listen_address(self.host, has_secret=self.handshake.has_secret,
                                      allow_insecure=self.afd_config.allow_insecure,
                                      what=f"{self.me} at {self.address}")
        # The previous connector of this FFN rank may still hold the address for
        # up to LISTEN_POLL_S after its close() (a listener stays bound while a
        # thread is blocked in accept on it): a short retry covers that.
        retry_until = time.monotonic() + LISTEN_RETRY_S
        while True:
            try:
                self._listener = self._make_listener()
                return
            except OSError as e:
                if e.errno == errno.EADDRINUSE and time.monotonic() < retry_until:
                    time.sleep(0.02)
                    continue
                raise AFDConnectionError(
                    f"{self.me} cannot listen on {self.address}: {e.strerror or e}; is "
                    f"another FFN server using this port?") from None

    def _next_link(self, timeout: float) -> "tuple[SocketStream, str] | None":
        listener = self._listener  # close() from another thread may reset the attribute
        if listener is None:
            if self._closing.is_set():
                return None
            raise AFDConnectionError(f"{self.me}: not listening on {self.address}")
        end = time.monotonic() + timeout
        while not self._closing.is_set():
            remaining = end - time.monotonic()
            if remaining <= 0:
                return None
            try:
                # Short: close() cannot wake an accept on a unix listener, and the
                # address stays bound until that accept returns.
                listener.settimeout(min(remaining, LISTEN_POLL_S))
                sock, addr = listener.accept()
            except socket.timeout:
                continue
            except OSError as e:  # close() from another thread shut the listener
                if self._closing.is_set():
                    return None
                raise AFDConnectionError(f"{self.me}: accepting on {self.address} failed: "
                                         f"{e.strerror or e}") from None
            configure_socket(sock)
            source = f"{addr[0]}:{addr[1]}" if isinstance(addr, tuple) else "local peer"
            return (SocketStream(sock, f"connection from {source}", self.timeout_s,
                               self._socket_spin_s), source)
        return None

    def _hello_timeout(self) -> float:
        return min(self.timeout_s, HELLO_TIMEOUT_S)

    def _accept_peers(self, deadline: float) -> None:
        self._accept_expected(deadline)
        # All peers are here. Keep the port: whoever knocks during the session is
        # told why it cannot join (its mismatches, or that its rank is taken).
        self._refuse_latecomers()

    def _refuse_latecomers(self) -> None:
        """Answer connections that arrive while this connector serves its peers:
        accept_session() with every peer busy, so each Hello is refused, naming
        each problem, by a separate connector (no state of the running session
        is touched); counters and refusals add up on this connector."""
        busy = frozenset(self.connected_peers)

        def run() -> None:
            while not self._closing.is_set():
                try:
                    stray = self.accept_session(LISTEN_POLL_S, busy)
                except Exception as e:  # noqa: BLE001 - the session must go on
                    if self._closing.is_set():
                        return  # close() shut the listener
                    logger.warning("%s: handshake during a session failed: %s", self.me, e)
                    self._closing.wait(LISTEN_POLL_S)  # e.g. out of file descriptors
                    continue
                if stray is not None:  # cannot happen: every expected rank is busy
                    stray.close()

        self._refuser = threading.Thread(target=run, name=f"afd-refuse-{self.port}",
                                            daemon=True)
        self._refuser.start()

    def peer_closed(self) -> bool:
        """Whether a peer's end of the connection hung up (FIN, reset), even
        with unread bytes (a GOODBYE) still queued: lets an idle side notice a
        peer that went away between steps without reading the stream."""
        poller = select.poll()
        for link in list(self._streams.values()):
            if isinstance(link, SocketStream):
                try:
                    poller.register(link.sock.fileno(), _HANGUP)
                except ValueError:  # closed meanwhile
                    return True
        return any(events & _HANGUP for _, events in poller.poll(0))

    # ---------------------------------------------------------------- frames
    def _transmit(self, peer: int, header: bytes, frame: LayerFrame | None,
                  payload: "torch.Tensor | list[torch.Tensor] | None",
                  deadline: float) -> None:
        parts = [] if payload is None else payload if isinstance(payload, list) else [payload]
        buffer = None
        if any(p.device.type != "cpu" for p in parts):
            # Device payload: one copy into this micro-batch's pinned staging slot.
            staging = self._staging(self._tx_staging, peer)
            nbytes = staging.write(frame.ubatch_id, parts, frame.nbytes)
            buffer = wire.tensor_to_buffer(staging.slot(frame.ubatch_id)[:nbytes])
        elif len(parts) > 1:  # a routed payload: its parts, one sendmsg
            buffer = [wire.tensor_to_buffer(p) for p in parts]
        elif parts:
            buffer = wire.tensor_to_buffer(parts[0])
        self.bytes_sent += self._streams[peer].send(header, buffer, deadline)

    def _staging(self, table: dict[int, HostSlots], peer: int) -> HostSlots:
        slots = table.get(peer)
        if slots is None:
            slot_bytes = -(-self.codec.max_bytes // 64) * 64
            memory = self.ops.host_buffer(slot_bytes * self.num_ubatches)
            slots = table[peer] = HostSlots(memory, slot_bytes, self.num_ubatches, self.ops,
                                            pinned=True)
        return slots

    def _receive(self, peer: int, deadline: float | None,
                 on_wait: WaitCallback) -> tuple[memoryview, int]:
        link = self._streams[peer]
        header, announced = link.recv_message(deadline, on_wait)
        self.bytes_received += link.frame_overhead
        return header, announced

    def _receive_payload(self, peer: int, frame: LayerFrame, dtype: torch.dtype,
                         announced: int, deadline: float,
                         out: torch.Tensor | None) -> torch.Tensor:
        if announced != frame.nbytes:
            raise ProtocolError(f"payload length from {self.peer_name(peer)}: expected "
                                f"{frame.nbytes} (LayerFrame.nbytes), received {announced}")
        target = self.device if out is None else out.device
        if target.type != "cpu":
            # Into pinned staging, then to the device on the consumer's stream.
            staging = self._staging(self._rx_staging, peer)
            u = frame.ubatch_id
            staging.release(u)  # its last copy to the device has read it
            if frame.nbytes:
                self._streams[peer].recv_into(
                    wire.tensor_to_buffer(staging.slot(u)[:frame.nbytes]), deadline)
            self.bytes_received += frame.nbytes
            return staging.read(u, dtype, frame.shape, out)
        if frame.nbytes == 0:
            return out if out is not None else torch.empty(frame.shape, dtype=dtype)
        if out is None:
            key = (peer, frame.ubatch_id)
            out = self._typed_view(key, self._rx_buffer(key, frame.nbytes), dtype, frame.shape)
        self._streams[peer].recv_into(wire.tensor_to_buffer(out), deadline)
        self.bytes_received += frame.nbytes
        return out

    def _rx_buffer(self, key: tuple[int, int], nbytes: int) -> torch.Tensor:
        """The (peer, ubatch) receive buffer, holding at least nbytes; reused so
        a step costs no allocation, grown geometrically (never past max_bytes)."""
        buffer = self._rx_buffers.get(key)
        if buffer is None or buffer.numel() < nbytes:
            size = max(nbytes, min(2 * (0 if buffer is None else buffer.numel()),
                                   self.codec.max_bytes))
            buffer = self._rx_buffers[key] = torch.empty(size, dtype=torch.uint8)
        return buffer

    def _close_transport(self) -> None:
        for link in list(self._streams.values()):
            link.close()
        listener, self._listener = self._listener, None
        if listener is not None:
            try:
                listener.shutdown(socket.SHUT_RDWR)  # wakes a blocked accept()
            except OSError:
                pass
            listener.close()
        refuser = self._refuser
        if refuser is not None and refuser is not threading.current_thread():
            refuser.join(timeout=2 * HELLO_TIMEOUT_S)  # frees the port for the next session
        self._rx_buffers.clear()
        self._views.clear()
        for table in (self._tx_staging, self._rx_staging):
            for slots in table.values():
                slots.close()
            table.clear()


class TcpConnector(StepCalls, SocketConnector):
    """The tcp connector: payloads on the socket, a step's layer calls in one C
    call per message end (step_calls.py, tcp_frames.py)."""

    def __init__(self, afd_config, **kwargs) -> None:
        super().__init__(afd_config, **kwargs)
        self._init_step_calls()
        self.frames = TcpFrames(self)
