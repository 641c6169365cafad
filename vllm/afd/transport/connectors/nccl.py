# SPDX-License-Identifier: Apache-2.0
# SPDX-FileCopyrightText: Copyright contributors to the vllm-afd project
"""NCCL connector: tensors over CUDA point-to-point, headers over the tcp
connector's socket.

NEVER RUN ON HARDWARE. The protocol around NCCL (handshake, unique-id exchange,
the confirm before init, init and close deadlines, frame checks, buffer reuse,
ordering) is tested on CPU with an in-process fake communicator; the NCCL
calls, the CUDA streams and the performance have not run on a GPU (NCCL needs
two GPUs for two ranks; the GPU machine lent to this project has one).

Design:
  * The data plane does not import vLLM, so the communicators come from a
    factory the caller passes (communicator_factory): the vLLM adapter passes
    one built on vLLM's PyNccl (vllm/afd/adapter/nccl_factory.py), tests a fake.
  * The FFN mints two ncclUniqueIds per attention peer and sends them in its
    HelloAck (NcclHandshake in HelloAck.transport: msgpack bytes, no pickle, no
    TCPStore). Neither side enters NCCL init before the attention side has
    checked the ack and confirmed it (HelloConfirm): an attention side that
    refuses never leaves the FFN blocked in ncclCommInitRank. Both then build
    two 2-rank communicators in the same order (attention is rank 0 in both);
    init has a deadline (timeout_s), after which the connect fails and the
    late communicator, if it ever appears, is destroyed.
  * One communicator per direction (attention->FFN, FFN->attention), each on
    its own CUDA stream. With a single bidirectional communicator on one
    stream, the attention's "send ubatch 1" would queue behind nothing but the
    FFN's "send output 0" queues behind its "recv ubatch 1": with more than one
    micro-batch in flight both sides would wait on each other's sends.
  * Every LayerFrame goes over the socket before its NCCL send is enqueued, so
    the receiver always posts the matching recv (after checking the header)
    and the sender's CPU thread never blocks on an unmatched send.
  * Received tensors land in the caller's `out` (the attention side's layer
    output, memory the model already owns, so the KV-cache sizing counts it)
    or in a per-(peer, micro-batch) device buffer (the FFN side, which has no
    KV cache). The consumer's current stream waits for the recv stream before
    the tensor is returned, and the recv stream waits for the current stream
    before a buffer is overwritten.
  * Exchanges cannot be captured in a CUDA graph (the send and receive streams
    would be forked into the capture): graph_capturable is False, so the
    attention role lowers FULL graph modes to piecewise ones, and a send
    during a capture is refused.
  * close() never blocks forever: destroying communicators with operations
    pending is bounded by FAREWELL_TIMEOUT_S per communicator.
"""

import logging
import threading
from typing import Any, Protocol

import msgspec
import torch

from vllm.afd.transport import wire
from vllm.afd.transport.connectors.tcp import SocketConnector
from vllm.afd.transport.errors import AFDTimeoutError
from vllm.afd.transport.wire import LayerFrame, ProtocolError

logger = logging.getLogger(__name__)

NCCL_UNIQUE_ID_BYTES = 128
ATTENTION_COMM_RANK, FFN_COMM_RANK = 0, 1
CLOSE_TIMEOUT_S = 5.0


class Communicator(Protocol):
    """What the connector needs of a 2-rank point-to-point communicator."""

    def send(self, tensor: torch.Tensor, dst: int, stream: Any = None) -> None: ...

    def recv(self, tensor: torch.Tensor, src: int, stream: Any = None) -> None: ...


class CommunicatorFactory(Protocol):
    # Device types its communicators work on ("cuda" for NCCL).
    device_types: tuple[str, ...]

    def unique_id(self) -> bytes: ...

    def create(self, unique_id: bytes, rank: int, world_size: int,
               device: torch.device) -> Communicator: ...

    def destroy(self, comm: Communicator) -> None: ...


class NcclHandshake(msgspec.Struct):
    """HelloAck.transport for nccl: the unique ids of the attention->FFN and
    FFN->attention communicators."""

    unique_ids: list[bytes]


def _bounded(fn, timeout_s: float, what: str) -> Any:
    """fn() in a helper thread, waited for at most timeout_s: NCCL calls can
    block forever when the peer is gone. On timeout raise AFDTimeoutError; the
    helper thread is left behind (daemon) and its late result handed to
    `late` handling by the caller."""
    result: dict[str, Any] = {}
    done = threading.Event()

    def run() -> None:
        try:
            result["value"] = fn()
        except BaseException as e:  # noqa: BLE001 - re-raised below
            result["error"] = e
        done.set()

    thread = threading.Thread(target=run, name=f"afd-nccl-{what}", daemon=True)
    thread.start()
    if not done.wait(timeout_s):
        raise AFDTimeoutError(f"{what} did not complete within {timeout_s:g}s")
    if "error" in result:
        raise result["error"]
    return result["value"]


class NcclConnector(SocketConnector):
    name = "nccl"
    stages_through_host = False  # payloads stay on the device: both peers on CUDA
    extra_config_keys = frozenset()
    """No options: its header socket never spins, so spin_us is refused."""

    def __init__(self, afd_config, *, communicator_factory: CommunicatorFactory | None = None,
                 **kwargs) -> None:
        super().__init__(afd_config, **kwargs)
        if communicator_factory is None:
            raise ValueError("the nccl AFD connector needs a communicator_factory (the vLLM "
                             "adapter passes one built on PyNccl)")
        if self.device.type not in communicator_factory.device_types:
            raise ValueError(f"the nccl AFD connector needs a device of type "
                             f"{communicator_factory.device_types}, got {self.device} (the "
                             f"worker passes its device)")
        self._factory = communicator_factory
        # Sessions (base.py accept_session) are twins of this connector.
        self._init_kwargs = dict(self._init_kwargs, communicator_factory=communicator_factory)
        self._comm_rank = ATTENTION_COMM_RANK if self.is_attention else FFN_COMM_RANK
        self._other = 1 - self._comm_rank
        self._unique_ids: dict[int, list[bytes]] = {}
        self._comms: dict[int, tuple[Communicator, Communicator]] = {}  # peer -> (send, recv)
        self._device_buffers: dict[tuple[int, int], torch.Tensor] = {}
        self._streams: dict[str, Any] = {}

    # --------------------------------------------------------------- handshake
    def _ack_transport(self, peer: int, hello_transport: bytes) -> bytes:
        ids = [self._factory.unique_id(), self._factory.unique_id()]
        self._unique_ids[peer] = ids
        return msgspec.msgpack.encode(NcclHandshake(unique_ids=ids))

    def _on_refused(self, peer: int) -> None:
        self._unique_ids.pop(peer, None)

    def _on_ack(self, ack_transport: bytes) -> None:
        try:
            ids = msgspec.msgpack.decode(ack_transport, type=NcclHandshake).unique_ids
        except msgspec.DecodeError as e:
            raise ProtocolError(f"HelloAck.transport (nccl): {e}") from None
        if len(ids) != 2 or any(len(i) != NCCL_UNIQUE_ID_BYTES for i in ids):
            raise ProtocolError(f"HelloAck.transport (nccl) unique_ids: expected 2 ids of "
                                f"{NCCL_UNIQUE_ID_BYTES} bytes, received "
                                f"{[len(i) for i in ids]} byte(s)")
        self._unique_ids[0] = list(ids)

    def _on_confirmed(self, peer: int) -> None:
        ids = self._unique_ids.pop(peer)
        abandoned = threading.Event()

        def init() -> tuple:
            # Same order on both sides: each create() waits for the other rank.
            comms = (self._factory.create(ids[0], self._comm_rank, 2, self.device),
                     self._factory.create(ids[1], self._comm_rank, 2, self.device))
            if abandoned.is_set():  # the deadline passed: nobody will use them
                for comm in comms:
                    self._factory.destroy(comm)
            return comms

        try:
            to_ffn, to_attention = _bounded(
                init, self.timeout_s, f"NCCL init with {self.peer_name(peer)}")
        except AFDTimeoutError as e:
            abandoned.set()
            raise AFDTimeoutError(f"{self.me}: {e} (is the peer on a reachable GPU?)") from None
        self._comms[peer] = ((to_ffn, to_attention) if self.is_attention
                             else (to_attention, to_ffn))
        logger.debug("%s: NCCL communicators with %s ready on %s", self.me,
                     self.peer_name(peer), self.device)

    # ------------------------------------------------------------------ frames
    def _stream(self, direction: str):
        if direction not in self._streams:
            self._streams[direction] = torch.cuda.Stream(device=self.device)
        return self._streams[direction]

    def _transmit(self, peer: int, header: bytes, frame: LayerFrame | None,
                  payload: "torch.Tensor | list[torch.Tensor] | None",
                  deadline: float) -> None:
        super()._transmit(peer, header, frame, None, deadline)
        if isinstance(payload, list):
            # A routed payload: one send, matching the receiver's one recv of
            # frame.nbytes (NCCL pairs calls, not bytes).
            payload = torch.cat([wire.tensor_bytes(p.to(self.device)) for p in payload])
        if payload is None or payload.numel() == 0:
            return
        comm = self._comms[peer][0]
        if payload.is_cuda:
            if torch.cuda.is_current_stream_capturing():
                raise RuntimeError("the nccl AFD connector cannot run inside a CUDA graph "
                                   "capture (graph_capturable is False)")
            stream = self._stream("send")
            stream.wait_stream(torch.cuda.current_stream(payload.device))
            comm.send(payload, self._other, stream=stream)
            payload.record_stream(stream)  # keep its memory until the send ran
        else:
            comm.send(payload, self._other)
        self.bytes_sent += frame.nbytes

    def _receive_payload(self, peer: int, frame: LayerFrame, dtype: torch.dtype,
                         announced: int, deadline: float,
                         out: torch.Tensor | None) -> torch.Tensor:
        if announced != 0:
            raise ProtocolError(f"payload length from {self.peer_name(peer)}: expected 0 "
                                f"(nccl payloads travel over NCCL), received {announced}")
        if out is not None and out.device != self.device:
            raise ValueError(f"{self.me}: out is on {out.device}, the nccl connector "
                             f"receives on {self.device}")
        if frame.nbytes == 0:
            return out if out is not None else torch.empty(frame.shape, dtype=dtype,
                                                           device=self.device)
        view = out
        if view is None:
            key = (peer, frame.ubatch_id)
            if key not in self._device_buffers:
                self._device_buffers[key] = torch.empty(self.codec.max_bytes, dtype=torch.uint8,
                                                        device=self.device)
            view = self._typed_view(key, self._device_buffers[key], dtype, frame.shape)
        comm = self._comms[peer][1]
        if view.is_cuda:
            stream = self._stream("recv")
            current = torch.cuda.current_stream(view.device)
            stream.wait_stream(current)  # earlier readers of this buffer are done
            comm.recv(view, self._other, stream=stream)
            current.wait_stream(stream)
        else:
            comm.recv(view, self._other)
        self.bytes_received += frame.nbytes
        return view

    def _close_transport(self) -> None:
        super()._close_transport()
        for comms in self._comms.values():
            for comm in comms:
                try:
                    _bounded(lambda comm=comm: self._factory.destroy(comm), CLOSE_TIMEOUT_S,
                             "NCCL communicator destroy")
                except Exception as e:  # noqa: BLE001 - closing must not raise
                    logger.warning("%s: destroying an NCCL communicator failed: %s", self.me, e)
        self._comms.clear()
        self._device_buffers.clear()
        self._views.clear()
        self._streams.clear()
