# SPDX-License-Identifier: Apache-2.0
# SPDX-FileCopyrightText: Copyright contributors to the vllm-afd project
"""NCCL connector: tensors over CUDA point-to-point, headers over the tcp
connector's socket.

UNTESTED ON HARDWARE. The protocol around NCCL (handshake, unique-id exchange,
frame checks, buffer reuse, ordering) is unit-tested on CPU with an in-process
fake communicator; the PyNccl calls, the CUDA streams and the performance have
not run on a GPU yet.

Design:
  * The FFN mints two ncclUniqueIds per attention peer and sends them in its
    HelloAck (msgpack bytes: no pickle, no TCPStore); both sides then build
    two 2-rank communicators with PyNcclCommunicator.from_unique_id_bytes, in
    the same order (attention is rank 0 in both).
  * One communicator per direction (attention->FFN, FFN->attention), each on
    its own CUDA stream. With a single bidirectional communicator on one
    stream, the attention's "send ubatch 1" would queue behind nothing but the
    FFN's "send output 0" queues behind its "recv ubatch 1": with more than one
    micro-batch in flight both sides would wait on each other's sends.
  * Every LayerFrame goes over the socket before its NCCL send is enqueued, so
    the receiver always posts the matching recv (after checking the header)
    and the sender's CPU thread never blocks on an unmatched send.
  * Received tensors are views into a per-(peer, micro-batch) device buffer
    of max_bytes, with the usual lifetime (see base.py); the current stream
    waits for the recv stream before they are returned, and the recv stream
    waits for the current stream before a buffer is overwritten.
  * The communicator is injectable (communicator_factory) so tests can run
    the protocol without GPUs.

Known limits: ncclCommInitRank blocks until both sides join (an attention
rank that dies between HelloAck and its init leaves the FFN waiting); a peer
dying with NCCL operations in flight leaves them pending on the GPU until
close() aborts the communicators.
"""

from typing import Any, Protocol

import torch

from vllm.afd import wire
from vllm.afd.connectors.tcp import TcpConnector
from vllm.afd.wire import HelloAck, LayerFrame, ProtocolError
from vllm.logger import init_logger

logger = init_logger(__name__)

NCCL_UNIQUE_ID_BYTES = 128
ATTENTION_COMM_RANK, FFN_COMM_RANK = 0, 1


class Communicator(Protocol):
    """The subset of PyNcclCommunicator the connector uses."""

    def send(self, tensor: torch.Tensor, dst: int, stream: Any = None) -> None: ...

    def recv(self, tensor: torch.Tensor, src: int, stream: Any = None) -> None: ...


class CommunicatorFactory(Protocol):
    def unique_id(self) -> bytes: ...

    def create(self, unique_id: bytes, rank: int, world_size: int,
               device: torch.device) -> Communicator: ...

    def destroy(self, comm: Communicator) -> None: ...


class PyNcclFactory:
    """Communicators from vLLM's PyNccl, rendezvous by pre-shared unique id."""

    def unique_id(self) -> bytes:
        from vllm.distributed.device_communicators.pynccl_wrapper import NCCLLibrary

        return bytes(NCCLLibrary().ncclGetUniqueId().internal)

    def create(self, unique_id: bytes, rank: int, world_size: int,
               device: torch.device) -> Communicator:
        from vllm.distributed.device_communicators.pynccl import PyNcclCommunicator

        comm = PyNcclCommunicator.from_unique_id_bytes(unique_id, rank, world_size, device)
        if comm.disabled:  # e.g. VLLM_DISABLE_PYNCCL: send/recv would silently do nothing
            raise RuntimeError("PyNccl is disabled (VLLM_DISABLE_PYNCCL?); the nccl AFD "
                               "connector needs it")
        return comm

    def destroy(self, comm: Communicator) -> None:
        comm.destroy()


class NcclConnector(TcpConnector):
    name = "nccl"

    def __init__(self, afd_config, *, communicator_factory: CommunicatorFactory | None = None,
                 device: torch.device | str | None = None, **kwargs) -> None:
        super().__init__(afd_config, **kwargs)
        self._factory = communicator_factory or PyNcclFactory()
        device = device or afd_config.connector_extra_config.get("device")
        if device is None:
            device = (f"cuda:{torch.cuda.current_device()}" if torch.cuda.is_available()
                      else "cpu")
        self.device = torch.device(device)
        self._comm_rank = ATTENTION_COMM_RANK if self.is_attention else FFN_COMM_RANK
        self._other = 1 - self._comm_rank
        self._unique_ids: dict[int, list[bytes]] = {}
        self._comms: dict[int, tuple[Communicator, Communicator]] = {}  # peer -> (send, recv)
        self._device_buffers: dict[tuple[int, int], torch.Tensor] = {}
        self._streams: dict[str, Any] = {}

    # --------------------------------------------------------------- handshake
    def _ack_fields(self, peer: int) -> dict:
        ids = [self._factory.unique_id(), self._factory.unique_id()]
        self._unique_ids[peer] = ids
        return {"nccl_unique_ids": ids}

    def _after_ack(self, peer: int) -> None:
        self._init_comms(peer, self._unique_ids.pop(peer))

    def _on_ack(self, ack: HelloAck) -> None:
        ids = ack.nccl_unique_ids
        if len(ids) != 2 or any(len(i) != NCCL_UNIQUE_ID_BYTES for i in ids):
            raise ProtocolError(f"HelloAck.nccl_unique_ids: expected 2 ids of "
                                f"{NCCL_UNIQUE_ID_BYTES} bytes, received "
                                f"{[len(i) for i in ids]} byte(s)")
        self._init_comms(0, list(ids))

    def _init_comms(self, peer: int, ids: list[bytes]) -> None:
        # Same order on both sides: each create() waits for the other rank.
        to_ffn = self._factory.create(ids[0], self._comm_rank, 2, self.device)
        to_attention = self._factory.create(ids[1], self._comm_rank, 2, self.device)
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
            stream = self._stream("send")
            stream.wait_stream(torch.cuda.current_stream(payload.device))
            comm.send(payload, self._other, stream=stream)
            payload.record_stream(stream)  # keep its memory until the send ran
        else:
            comm.send(payload, self._other)
        self.bytes_sent += frame.nbytes

    def _receive_payload(self, peer: int, frame: LayerFrame, dtype: torch.dtype,
                         announced: int, deadline: float) -> torch.Tensor:
        if announced != 0:
            raise ProtocolError(f"payload length from {self.peer_name(peer)}: expected 0 "
                                f"(nccl payloads travel over NCCL), received {announced}")
        if frame.nbytes == 0:
            return torch.empty(frame.shape, dtype=dtype, device=self.device)
        key = (peer, frame.ubatch_id)
        if key not in self._device_buffers:
            self._device_buffers[key] = torch.empty(self.max_bytes, dtype=torch.uint8,
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
                    self._factory.destroy(comm)
                except Exception as e:
                    logger.debug("%s: destroying an NCCL communicator failed: %s", self.me, e)
        self._comms.clear()
        self._device_buffers.clear()
        self._views.clear()
        self._streams.clear()
