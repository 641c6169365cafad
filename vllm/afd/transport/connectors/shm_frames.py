# SPDX-License-Identifier: Apache-2.0
# SPDX-FileCopyrightText: Copyright contributors to the vllm-afd project
"""The shm connector's frames: where a step's prepared layer calls put them
on the lane (step_calls.py holds the calls, csrc/cpu/step_calls.cpp their C).

A step's layer calls go through the lane with each payload in its
micro-batch's slot (_step_frames): the FFN's exact hidden states are taken
there without a copy (a view of the slot), fp8 is unpacked from it into the
connector's unpack buffer, a routed frame's routing follows the hidden states
in the same slot and is viewed in place. Device tensors (CUDA) are staged
through the same slots: the sender copies its tensor into its slot and waits
for the copy (the peer reads the slot once the header is out), then posts with
the slot itself as the source (the C call copies nothing then); the receiver
takes the frame leaving the payload in its slot, then copies it to the device
on the consumer's stream, and the slot's event is settled before this side's
next message on that micro-batch (which lets the peer write the slot again).

What the prepared calls do not take goes the general way (attention_side.py,
ffn_side.py: the Python protocol over the ring, shm_ring.py). Why comparing
bytes checks a frame: prepared.py.

An object ShmConnector (shm.py) holds as its frames (step_calls.py names
the four methods StepCalls uses).
"""


import torch

from vllm.afd.transport import shm_ring, wire
from vllm.afd.transport.buffers import HostSlots
from vllm.afd.transport.connectors.prepared import (
    Ubatch, codec_spec, frame_template, received_frame)
from vllm.afd.transport.connectors.step_calls import StepFrames


class ShmFrames:
    """See the module docstring. Reads, from its ShmConnector: _streams
    (RingStreams once connected), _tx/_rx (HostSlots), the codec and the
    connector's sizes."""

    def __init__(self, conn) -> None:
        self.conn = conn
        # Per direction: rows -> template (or None: this shape goes the general way).
        self._send_templates: dict[int, tuple | None] = {}
        self._recv_templates: dict[int, tuple | None] = {}
        # rows -> the template of the frame toward the FFN with routing
        # (gate_on "attention": the hidden states of MoE layers carry it)
        self._routed_templates: dict[int, tuple | None] = {}
        # peer -> slot addresses (send, receive), per micro-batch
        self._slot_addresses: dict[int, tuple[list[int], list[int]]] = {}

    def staged_source(self, peer: int, u: int, t: torch.Tensor) -> int:
        """On a device connector, the address a prepared post sends from: t
        copied into this side's slot u (waited for: the peer reads the slot
        once the header arrives). Before that, the last read of the received
        slot u is settled: once the peer has this message it may write that
        slot again."""
        c = self.conn
        c._rx[peer].release(u)
        tx = c._tx[peer]
        tx.write(u, (t,), t.nbytes)
        return tx.address(u)

    def _template(self, table: dict, rows: int, scale_group: int = 0, topk: int = 0):
        """The frame template of rows (in this direction's encoding: its table's)."""
        c = self.conn
        if rows not in table:
            table[rows] = frame_template(c.dtype, rows, c.hidden_size, scale_group, topk)
        return table[rows]

    def _addresses(self, peer: int) -> tuple[list[int], list[int]] | None:
        c = self.conn
        addresses = self._slot_addresses.get(peer)
        if addresses is None:
            tx, rx = c._tx.get(peer), c._rx.get(peer)
            if tx is None or rx is None:
                return None
            addresses = self._slot_addresses[peer] = (
                [tx.address(u) for u in range(tx.count)],
                [rx.address(u) for u in range(rx.count)])
        return addresses

    def step_frames(self, peer: int, step: wire.StepHeader) -> "StepFrames | None":
        """The step's frames on the lane (step_calls.py): each payload in its
        micro-batch's slot; the FFN's exact hidden states taken there without
        a copy."""
        c = self.conn
        link = c._streams.get(peer)
        addresses = self._addresses(peer) if type(link) is shm_ring.RingStream else None
        if addresses is None:
            return None
        sends, recvs, routed_frames, ubatches = [], [], [], []
        hidden, dtype, topk = c.hidden_size, c.dtype, c.routing_topk
        send_group, receive_group = c.codec.send_scale_group, c.codec.receive_scale_group
        # Frames toward the FFN carry routing on MoE layers (gate_on "attention").
        to_ffn_group = send_group if c.is_attention else receive_group
        overhead = link.frame_overhead
        # A device's fp8 and routing are packed and unpacked on it (around the
        # staging), so its frames go as they are: no codec in the C calls.
        raw = not c._on_host
        for u, rows in enumerate(step.num_tokens):
            out_t = self._template(self._send_templates, rows, send_group)
            in_t = self._template(self._recv_templates, rows, receive_group)
            out_codec = None if raw else codec_spec(dtype, rows, hidden, send_group)
            in_codec = None if raw else codec_spec(dtype, rows, hidden, receive_group)
            if out_t is None or in_t is None or out_codec is False or in_codec is False:
                return None
            sends.append((*out_t[:4], addresses[0][u], out_t[4], out_codec))
            recvs.append((*in_t[:4], addresses[1][u], in_t[4], in_codec))
            shape = [rows, hidden]
            # The FFN's hidden states: a view of the slot (exact; taken without a
            # copy) or the buffer the C call unpacks fp8 into.
            view, into = None, 0
            if not c.is_attention and c._on_host:
                if in_codec is None:
                    view = c._rx[peer].view(u, dtype, shape)
                else:
                    view = c.codec.unpack_buffer(peer, u, dtype, c.device)[
                        :rows * hidden].view(rows, hidden)
                    into = view.data_ptr()
            routed, routing = 0, None
            # Raw received frames that need the device to decode them: fp8.
            unstage = [(received_frame(dtype, rows, hidden, receive_group, 0, u), in_t[4])
                       if raw and receive_group else None, None]
            if topk:  # the same slot, the routing after the hidden states
                routed_t = self._template(self._routed_templates, rows, to_ffn_group, topk)
                routed_codec = (None if raw else
                                codec_spec(dtype, rows, hidden, to_ffn_group, 0, topk))
                if routed_t is None or routed_codec is False:
                    return None
                slot = addresses[0 if c.is_attention else 1][u]
                routed_frames.append((*routed_t[:4], slot, routed_t[4], routed_codec))
                routed = routed_t[4] + overhead + len(routed_t[0])
                if not c.is_attention and raw:  # the routing: views on the device
                    unstage[1] = (received_frame(dtype, rows, hidden, to_ffn_group, topk, u),
                                  routed_t[4])
                elif not c.is_attention:
                    layout = wire.PayloadLayout.of(rows, hidden, dtype, to_ffn_group, topk)
                    routing = wire.routing_views(c._rx[peer].slot(u)[:layout.total],
                                                 layout, rows, topk)
            ubatches.append(Ubatch(rows, hidden, dtype, out_t[4] + overhead + len(out_t[0]),
                                   in_t[4] + overhead + len(in_t[0]), view, into, routed,
                                   routing, topk, tuple(unstage) if any(unstage) else None))
        return link, link.lane, link.spin_ns, sends, recvs, routed_frames, ubatches

    def clear(self) -> None:
        """Forget the slots' addresses (the transport is closing)."""
        self._slot_addresses.clear()

    def staged_target(self, peer: int, u: int) -> int:
        return 0  # a device side's received payload stays in its slot

    def staged_slots(self, peer: int) -> HostSlots:
        c = self.conn
        return c._rx[peer]
