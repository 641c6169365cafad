# SPDX-License-Identifier: Apache-2.0
# SPDX-FileCopyrightText: Copyright contributors to the vllm-afd project
"""PayloadCodec: how a LayerFrame's tensor (and routing) becomes bytes and back.

Each direction has its transfer encoding (AFDConfig.transfer_dtype, agreed in
the handshake): "auto" sends the hidden states exactly, "fp8" as float8 e4m3fn
with one float32 scale per wire.FP8_SCALE_GROUP elements of a token. Routing
(gate_on "attention") travels after the hidden states in the same payload.

Sending: an exact payload without routing is the caller's tensor itself (zero
copy). Anything else is packed by the op library (afd::pack) in one pass into
the slot the transport offers (_pack_target): for shm on the CPU that is the
shared-memory slot itself, elsewhere a per-(peer, micro-batch) buffer on the
tensor's device that the transport then sends.

Receiving: the transport hands over the raw bytes (a view of its buffer, on
the consumer's device); routing is viewed in place, fp8 hidden states are
unpacked (afd::unpack) straight into the caller's `out` or into a
per-(peer, micro-batch) buffer, which is what the MoE then reads.

Mixed into AFDConnector (base.py).
"""

import torch

from vllm.afd.transport import wire
from vllm.afd.transport.wire import PayloadLayout, ProtocolError, Routing

# Devices the op library has pack/unpack kernels for (csrc/cpu, csrc/cuda).
FP8_DEVICE_KINDS = ("cpu", "cuda")


class PayloadCodec:
    def _init_codec(self, config) -> None:
        """Scale groups per direction (0: exact), and the largest payload."""
        def group(transfer: str) -> int:
            return wire.FP8_SCALE_GROUP if transfer == wire.TRANSFER_FP8 else 0

        self.send_scale_group = group(config.send_transfer)
        self.receive_scale_group = group(config.receive_transfer)
        groups = {0, self.send_scale_group, self.receive_scale_group}
        if max(groups) and self.device.type not in FP8_DEVICE_KINDS:
            raise ValueError(
                f"AFDConfig.transfer_dtype: 'fp8' needs the afd op library's pack kernels, "
                f"built for {', '.join(FP8_DEVICE_KINDS)}, not {self.device.type}; use 'auto'")
        if max(groups) or self.routing_topk:
            from vllm.afd.kernels import ops

            ops.load()
            self._ops = ops
        shape = [self.max_tokens, self.hidden_size]
        self.max_bytes = max(wire.frame_nbytes(self.dtype, shape, self.routing_topk, g)
                             for g in groups)
        self._pack_buffers: dict[tuple[int, int], torch.Tensor] = {}
        self._unpack_buffers: dict[tuple[int, int], torch.Tensor] = {}

    # ------------------------------------------------------------- sending
    def _encode(self, peer: int, ubatch_id: int, h: torch.Tensor,
                routing: Routing | None) -> torch.Tensor:
        """The payload for h (and routing) in this side's send encoding."""
        group = self.send_scale_group
        if group == 0 and routing is None:
            return h
        rows, hidden = h.shape
        topk = 0 if routing is None else routing.topk_ids.shape[1]
        layout = PayloadLayout.of(rows, hidden, h.dtype, group, topk)
        slot = self._pack_target(peer, ubatch_id, layout.total, h.device)
        self._ops.pack(h, slot, group, None if routing is None else routing.topk_ids,
                       None if routing is None else routing.topk_weights)
        return slot

    def _pack_target(self, peer: int, ubatch_id: int, nbytes: int,
                     device: torch.device) -> torch.Tensor:
        """Where to pack a payload of nbytes: a uint8 tensor of exactly that
        size. Transports with their own send slots override this."""
        key = (peer, ubatch_id)
        buffer = self._pack_buffers.get(key)
        if buffer is None or buffer.device != device or buffer.numel() < nbytes:
            buffer = self._pack_buffers[key] = torch.empty(
                self.max_bytes, dtype=torch.uint8, device=device)
        return buffer[:nbytes]

    # ----------------------------------------------------------- receiving
    def _decode(self, peer: int, frame: wire.LayerFrame, dtype: torch.dtype,
                raw: torch.Tensor, out: torch.Tensor | None
                ) -> tuple[torch.Tensor, Routing | None]:
        """The hidden states and routing of a checked routed or fp8 frame
        whose raw bytes (flat uint8, on self.device) are raw."""
        rows, hidden = frame.shape
        layout = PayloadLayout.of(rows, hidden, dtype, frame.scale_group, frame.topk)
        if raw.numel() != layout.total:  # check_frame makes this impossible
            raise ProtocolError(f"payload length from {self.peer_name(peer)}: expected "
                                f"{layout.total}, received {raw.numel()}")
        routing = wire.routing_views(raw, layout, rows, frame.topk) if frame.topk else None
        if frame.scale_group == 0:
            tensor = raw[:layout.hidden_nbytes].view(dtype).view(rows, hidden)
            if out is not None:
                self.ops.copy(out, tensor)
                tensor = out
            return tensor, routing
        target = out
        if target is None or target.device != raw.device:
            key = (peer, frame.ubatch_id)
            buffer = self._unpack_buffers.get(key)
            if buffer is None:
                buffer = self._unpack_buffers[key] = torch.empty(
                    self.max_tokens * hidden, dtype=dtype, device=raw.device)
            target = buffer[:rows * hidden].view(rows, hidden)
        # The hidden states and their scales (routing, after them, is viewed above).
        self._ops.unpack(raw[:layout.weights_offset], target, frame.scale_group)
        if out is not None and target is not out:
            self.ops.copy(out, target)
            target = out
        return target, routing
