# SPDX-License-Identifier: Apache-2.0
# SPDX-FileCopyrightText: Copyright contributors to the vllm-afd project
"""The tcp connector's frames for a step's prepared layer calls
(step_calls.py, csrc/cpu/step_calls.cpp): what shm_frames.py is for the lane.

Per micro-batch and direction a frame's bytes up to its payload are the
connector's prefix (magic, header length, payload length: socket_stream.PREFIX)
and prepared.frame_template's LayerFrame template; the C call sends prefix,
header and payload in one sendmsg, and on receipt peeks the expected bytes,
compares them, consumes them and receives the payload straight into the
caller's tensor (the attention side's output) or the (peer, micro-batch)
receive buffer (the FFN's hidden states, viewed there without a copy).

fp8 and routed frames of host tensors are packed into the (peer, micro-batch)
pack buffer and sent from it, or received into the receive buffer and
unpacked from it into the caller's tensor (on the FFN its unpack buffer; the
routing viewed in the receive buffer). Device tensors (CUDA) are staged
through the connector's pinned host slots (tcp.py's _staging, ../buffers.py),
as the general path stages them: the sender copies its tensor into its slot
and waits for the copy (the frame goes out from the slot), the receiver
settles the last copy out of its slot (HostSlots.release), receives into it,
and copies it to the device on the consumer's stream.

An object TcpConnector (tcp.py) holds as its frames (step_calls.py names the
four methods StepCalls uses); the shm and nccl connectors, whose payloads do
not travel on the socket, derive from SocketConnector without it.
"""

import torch

from vllm.afd.transport import wire
from vllm.afd.transport.buffers import HostSlots
from vllm.afd.transport.connectors.prepared import (
    MAX_TEMPLATE_BYTES, Ubatch, codec_spec, frame_template, received_frame)
from vllm.afd.transport.connectors.step_calls import StepFrames


def socket_frame_template(dtype: torch.dtype, rows: int, hidden: int, scale_group: int,
                          prefix, topk: int = 0) -> "tuple[bytes, int, int, int, int] | None":
    """frame_template's, with the connector's prefix (socket_stream.PREFIX:
    magic, header length, payload length) in front and the offsets moved past it."""
    template = frame_template(dtype, rows, hidden, scale_group, topk)
    if template is None:
        return None
    encoded, step_at, layer_at, ubatch_at, nbytes = template
    head = prefix(len(encoded), nbytes)
    if len(head) + len(encoded) > MAX_TEMPLATE_BYTES:
        return None
    shift = len(head)
    return (head + encoded, step_at + shift, layer_at + shift, ubatch_at + shift, nbytes)


class TcpFrames:
    """See the module docstring. Reads, from its TcpConnector: _streams
    (SocketStreams once connected: their socket, spin and frame prefix),
    _rx_buffer, _typed_view, _staging, the codec and the connector's sizes."""

    def __init__(self, conn) -> None:
        self.conn = conn
        # (rows, scale group, topk) -> template, or None: the general way
        self._socket_templates: dict[tuple[int, int, int], tuple | None] = {}

    def _socket_template(self, rows: int, scale_group: int, prefix, topk: int = 0):
        c = self.conn
        key = (rows, scale_group, topk)
        if key not in self._socket_templates:
            self._socket_templates[key] = socket_frame_template(
                c.dtype, rows, c.hidden_size, scale_group, prefix, topk)
        return self._socket_templates[key]

    def step_frames(self, peer: int, step: wire.StepHeader) -> "StepFrames | None":
        """The step's frames on the socket (see the module docstring)."""
        c = self.conn
        link = c._streams.get(peer)
        if getattr(link, "sock", None) is None:
            return None
        sends, recvs, routed_frames, ubatches = [], [], [], []
        hidden, dtype, host = c.hidden_size, c.dtype, torch.device("cpu")
        topk, attention = c.routing_topk, c.is_attention
        send_group, receive_group = c.codec.send_scale_group, c.codec.receive_scale_group
        # Frames toward the FFN carry routing on MoE layers (gate_on "attention").
        to_ffn_group = send_group if attention else receive_group
        # A device's fp8 and routing are packed and unpacked on it (around the
        # staging), so its frames go as they are: no codec, no buffers here.
        raw = not c._on_host
        for u, rows in enumerate(step.num_tokens):
            out_t = self._socket_template(rows, send_group, link.prefix)
            in_t = self._socket_template(rows, receive_group, link.prefix)
            routed_t = (self._socket_template(rows, to_ffn_group, link.prefix, topk) if topk
                        else None)
            if out_t is None or in_t is None or (topk and routed_t is None):
                return None
            key = (peer, u)
            # fp8 and routed frames: packed into the (peer, micro-batch) pack
            # buffer and sent from it; received into the receive buffer (one
            # for both frames, sized for the larger: its address must hold)
            # and unpacked from it. The FFN's exact hidden states are received
            # straight into that buffer. Each allocated only where a frame
            # needs it (a pack buffer is max_bytes).
            pack = (c.codec.pack_target(peer, u, max(out_t[4], routed_t[4] if topk else 0),
                                      host).data_ptr()
                    if not raw and (send_group or (topk and attention)) else 0)
            rx = (c._rx_buffer(key, max(in_t[4], routed_t[4] if topk else 0))
                  if not raw and (receive_group or not attention) else None)
            received_at = 0 if rx is None else rx.data_ptr()
            out_codec = None if raw else codec_spec(dtype, rows, hidden, send_group, pack)
            in_codec = None if raw else codec_spec(dtype, rows, hidden, receive_group,
                                                   received_at)
            routed_codec = (codec_spec(dtype, rows, hidden, to_ffn_group,
                                       pack if attention else received_at, topk)
                            if topk and not raw else None)
            if out_codec is False or in_codec is False or routed_codec is False:
                return None
            sends.append((*out_t[:4], 0, out_t[4], out_codec))
            recvs.append((*in_t[:4], 0, in_t[4], in_codec))
            shape = [rows, hidden]
            # The FFN's hidden states: received into its receive buffer (exact)
            # or unpacked from there into its unpack buffer (fp8).
            view, routing, routed = None, None, 0
            if not attention and c._on_host:
                view = (c._typed_view(key, rx, dtype, shape)
                        if in_codec is None else c.codec.unpack_buffer(
                            peer, u, dtype, host)[:rows * hidden].view(rows, hidden))
            # Raw received frames that need the device to decode them: fp8.
            unstage = [(received_frame(dtype, rows, hidden, receive_group, 0, u), in_t[4])
                       if raw and receive_group else None, None]
            if topk:
                routed_frames.append((*routed_t[:4], 0, routed_t[4], routed_codec))
                routed = routed_t[4] + len(routed_t[0])
                if not attention and raw:  # the routing: views on the device
                    unstage[1] = (received_frame(dtype, rows, hidden, to_ffn_group, topk, u),
                                  routed_t[4])
                elif not attention:  # views of the received payload
                    layout = wire.PayloadLayout.of(rows, hidden, dtype, to_ffn_group, topk)
                    routing = wire.routing_views(rx[:layout.total], layout, rows, topk)
            # The prefix is part of the template. A host FFN's receive writes
            # its view (the receive buffer, or fp8's unpack buffer).
            into = 0 if view is None else view.data_ptr()
            ubatches.append(Ubatch(rows, hidden, dtype, out_t[4] + len(out_t[0]),
                                   in_t[4] + len(in_t[0]), view, into, routed, routing, topk,
                                   tuple(unstage) if any(unstage) else None))
        sock = link.sock
        fd = sock.fileno()
        if fd < 0:  # closed by another thread: the general path says so
            return None
        return sock, fd, int(link.spin_s * 1e9), sends, recvs, routed_frames, ubatches

    def staged_source(self, peer: int, u: int, t: torch.Tensor) -> int:
        """A device tensor's bytes in this side's pinned slot u, landed: the
        address a prepared post sends from."""
        c = self.conn
        staging = c._staging(c._tx_staging, peer)
        staging.write(u, (t,), t.nbytes)
        return staging.address(u)

    def staged_target(self, peer: int, u: int) -> int:
        """The address a staged receive writes, once the last copy out of
        that slot has read it."""
        c = self.conn
        staging = c._staging(c._rx_staging, peer)
        staging.release(u)
        return staging.address(u)


    def staged_slots(self, peer: int) -> HostSlots:
        c = self.conn
        return c._rx_staging[peer]
