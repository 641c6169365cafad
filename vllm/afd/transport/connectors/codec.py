# SPDX-License-Identifier: Apache-2.0
# SPDX-FileCopyrightText: Copyright contributors to the vllm-afd project
"""PayloadCodec: how a LayerFrame's tensor (and routing) becomes bytes and back.

Each direction has its transfer encoding (AFDConfig.transfer_dtype, agreed in
the handshake): "auto" sends the hidden states exactly, "fp8" as float8 e4m3fn
with one float32 scale per wire.FP8_SCALE_GROUP elements of a token. Routing
(gate_on "attention") travels after the hidden states in the same payload.

Sending: an exact payload without routing is the caller's tensor itself (zero
copy). Anything else is packed by the op library (afd::pack) in one pass into
the slot the transport offers (its _send_slot hook): for shm on the CPU that is
the shared-memory slot itself, elsewhere a per-(peer, micro-batch) buffer on
the tensor's device that the transport then sends.

Receiving: the transport hands over the raw bytes (a view of its buffer, on
the consumer's device); routing is viewed in place, fp8 hidden states are
unpacked (afd::unpack) straight into the caller's `out` or into a
per-(peer, micro-batch) buffer, which is what the MoE then reads.

An object each connector holds (AFDConnector.codec), built from the link's
configuration and the connector's sizes; it keeps the buffers and views it
made, which clear() drops before the transport frees its memory.
"""

from collections.abc import Callable

import torch

from vllm.afd.transport import wire
from vllm.afd.transport.wire import PayloadLayout, ProtocolError, Routing

# Devices the op library packs on: kernels for cpu and cuda (csrc/), torch-op
# implementations for PrivateUse1, the Ascend NPU (kernels/composite.py).
PACK_DEVICE_KINDS = ("cpu", "cuda", torch._C._get_privateuse1_backend_name())


# A transport's own memory to pack a payload into (peer, micro-batch, bytes,
# the tensor's device), or None: the codec's buffer.
SendSlot = Callable[[int, int, int, torch.device], "torch.Tensor | None"]


class PayloadCodec:
    def __init__(self, config, *, dtype: torch.dtype, hidden_size: int, max_tokens: int,
                 routing_topk: int, device: torch.device, ops,
                 peer_name: Callable[[int], str], send_slot: SendSlot | None = None) -> None:
        """config: the LinkConfig (send_transfer, receive_transfer); ops: the
        device's copies (../device.py); peer_name names a peer in errors."""
        self.dtype, self.hidden_size, self.max_tokens = dtype, hidden_size, max_tokens
        self.routing_topk, self.device, self.ops = routing_topk, device, ops
        self._peer_name, self._send_slot = peer_name, send_slot

        # Scale groups per direction (0: exact), and the largest payload.
        def group(transfer: str) -> int:
            return wire.FP8_SCALE_GROUP if transfer == wire.TRANSFER_FP8 else 0

        self.send_scale_group = group(config.send_transfer)
        self.receive_scale_group = group(config.receive_transfer)
        groups = {0, self.send_scale_group, self.receive_scale_group}
        if max(groups) and self.device.type not in PACK_DEVICE_KINDS:
            raise ValueError(
                f"AFDConfig.transfer_dtype: 'fp8' needs the afd op library's pack kernels, "
                f"which exist for {', '.join(PACK_DEVICE_KINDS)}, not {self.device.type}; use "
                f"'auto'")
        # Routed exact payloads on a device the library cannot pack on go as
        # their parts, back to back (wire.routed_parts).
        self.packs = self.device.type in PACK_DEVICE_KINDS
        if max(groups) or (self.routing_topk and self.packs):
            from vllm.afd.kernels import ops

            ops.load()  # torch.ops.afd.pack / unpack
        shape = [self.max_tokens, self.hidden_size]
        self.max_bytes = max(wire.frame_nbytes(self.dtype, shape, self.routing_topk, g)
                             for g in groups)
        self._pack_buffers: dict[tuple[int, int], torch.Tensor] = {}
        self._unpack_buffers: dict[tuple[int, int], torch.Tensor] = {}
        # Per (peer, micro-batch): the last payload's shape and the views it
        # needed. Steps repeat their shapes, and building a layout and its
        # views costs several times the pack itself for decode-sized payloads.
        self._encoded: dict[tuple[int, int], tuple] = {}
        self._decoded: dict[tuple[int, int, int], tuple] = {}

    # ------------------------------------------------------------- sending
    def encode(self, peer: int, ubatch_id: int, h: torch.Tensor,
                routing: Routing | None) -> "torch.Tensor | list[torch.Tensor]":
        """The payload for h (and routing) in this side's send encoding."""
        group = self.send_scale_group
        if group == 0 and routing is None:
            return h
        if group == 0 and not self.packs:
            return wire.routed_parts(h, routing)
        key = (peer, ubatch_id)
        ids = None if routing is None else routing.topk_ids
        weights = None if routing is None else routing.topk_weights
        signature = (h.shape, h.dtype, h.device, None if ids is None else ids.shape[1])
        cached = self._encoded.get(key)
        if cached is None or cached[0] != signature:
            rows, hidden = h.shape
            nbytes = PayloadLayout.of(rows, hidden, h.dtype, group, signature[3] or 0).total
            cached = self._encoded[key] = (signature, self.pack_target(
                peer, ubatch_id, nbytes, h.device))
        slot = cached[1]
        torch.ops.afd.pack(h, ids, weights, group, slot)
        return slot

    def pack_target(self, peer: int, ubatch_id: int, nbytes: int,
                    device: torch.device) -> torch.Tensor:
        """Where to pack a payload of nbytes: a uint8 tensor of exactly that
        size, the same memory for every call of (peer, ubatch_id): the
        transport's send slot if it offers one, else the codec's buffer."""
        if self._send_slot is not None:
            slot = self._send_slot(peer, ubatch_id, nbytes, device)
            if slot is not None:
                return slot
        key = (peer, ubatch_id)
        buffer = self._pack_buffers.get(key)
        if buffer is None or buffer.device != device:
            buffer = self._pack_buffers[key] = torch.empty(
                self.max_bytes, dtype=torch.uint8, device=device)
        return buffer[:nbytes]

    def clear(self) -> None:
        """Drop every view of transport memory (before the transport frees it)."""
        self._encoded.clear()
        self._decoded.clear()
        self._pack_buffers.clear()
        self._unpack_buffers.clear()

    # ----------------------------------------------------------- receiving
    def decode(self, peer: int, frame: wire.LayerFrame, dtype: torch.dtype,
                raw: torch.Tensor, out: torch.Tensor | None, defer: bool = False
                ) -> "tuple[torch.Tensor | Packed, Routing | None]":
        """The hidden states and routing of a checked routed or fp8 frame
        whose raw bytes (flat uint8, on self.device) are raw. defer: fp8
        hidden states come back still packed (Packed), for the caller to
        unpack where it wants them."""
        # Routed and plain frames apart: a step alternates them on one
        # micro-batch (dense and MoE layers), which would rebuild the views.
        key = (peer, frame.ubatch_id, frame.topk)
        signature = (frame.shape, dtype, frame.scale_group, frame.topk, raw.data_ptr(),
                     raw.numel())
        cached = self._decoded.get(key)
        if cached is None or cached[0] != signature:
            cached = self._decoded[key] = (signature, *self._views(peer, frame, dtype, raw))
        _, tensor, packed, weights, ids = cached
        routing = None if weights is None else Routing(weights.detach(), ids.detach())
        if packed is None:  # exact: the hidden states are a view of the payload
            if out is not None:
                self.ops.copy(out, tensor)
                return out, routing
            return tensor.detach(), routing
        if defer and out is None:
            return Packed(packed, frame.scale_group, tensor), routing
        target = tensor if out is None or out.device != raw.device else out
        # The hidden states and their scales (the routing after them is viewed).
        torch.ops.afd.unpack(packed, frame.scale_group, target, None, None)
        if out is not None and target is not out:
            self.ops.copy(out, target)
            target = out
        return target if target is out else target.detach(), routing

    def decode_staged(self, slots, peer: int, u: int, decoded: tuple,
                      out: torch.Tensor | None = None
                      ) -> "tuple[torch.Tensor, Routing | None]":
        """A device connector's raw fp8 or routed frame left in host slot u
        of slots (buffers.HostSlots) by a prepared receive: its payload copied
        to the device (on the consumer's stream, the slot's event set) and
        decoded there (decode). decoded: the (LayerFrame, payload bytes) the
        step prepared (prepared.Ubatch.unstage)."""
        frame, nbytes = decoded
        return self.decode(peer, frame, self.dtype, slots.read(u, torch.uint8, (nbytes,)), out)

    def _views(self, peer: int, frame: wire.LayerFrame, dtype: torch.dtype,
               raw: torch.Tensor) -> tuple:
        """(hidden states: a view of raw (exact) or the unpack buffer (fp8),
        the packed bytes to unpack (fp8) or None, routing weights, ids or None)."""
        rows, hidden = frame.shape
        layout = PayloadLayout.of(rows, hidden, dtype, frame.scale_group, frame.topk)
        if raw.numel() != layout.total:  # check_frame makes this impossible
            raise ProtocolError(f"payload length from {self._peer_name(peer)}: expected "
                                f"{layout.total}, received {raw.numel()}")
        weights = ids = None
        if frame.topk:
            weights, ids = wire.routing_views(raw, layout, rows, frame.topk)
        if frame.scale_group == 0:
            return raw[:layout.hidden_nbytes].view(dtype).view(rows, hidden), None, weights, ids
        buffer = self.unpack_buffer(peer, frame.ubatch_id, dtype, raw.device)
        return (buffer[:rows * hidden].view(rows, hidden), raw[:layout.weights_offset],
                weights, ids)

    def unpack_buffer(self, peer: int, ubatch_id: int, dtype: torch.dtype,
                      device: torch.device) -> torch.Tensor:
        """Where fp8 hidden states of (peer, micro-batch) are unpacked: flat,
        room for max_tokens rows, the same memory for every call."""
        key = (peer, ubatch_id)
        buffer = self._unpack_buffers.get(key)
        if buffer is None or buffer.device != device or buffer.dtype != dtype:
            buffer = self._unpack_buffers[key] = torch.empty(
                self.max_tokens * self.hidden_size, dtype=dtype, device=device)
        return buffer


class Packed:
    """fp8 hidden states received but not unpacked yet. The FFN's batcher
    unpacks them straight into its MoE input (into(), a row range of the
    joined batch); tensor() unpacks them into the connector's buffer for them.
    Valid as long as the received payload is: until send_output on the same
    (peer, micro-batch)."""

    __slots__ = ("shape", "dtype", "device", "_packed", "_group", "_buffer")

    def __init__(self, packed: torch.Tensor, group: int, buffer: torch.Tensor) -> None:
        self.shape, self.dtype, self.device = buffer.shape, buffer.dtype, buffer.device
        self._packed, self._group, self._buffer = packed, group, buffer

    def into(self, target: torch.Tensor) -> torch.Tensor:
        """Unpack into target (this shape and dtype, contiguous, this device)."""
        torch.ops.afd.unpack(self._packed, self._group, target, None, None)
        return target

    def tensor(self) -> torch.Tensor:
        return self.into(self._buffer.detach())
