# SPDX-License-Identifier: Apache-2.0
# SPDX-FileCopyrightText: Copyright contributors to the vllm-afd project
"""The tcp connector's prepared layer calls: one C call per message end.

What shm_fast.py does for the shm lane, for frames on a socket. Through the
general path (attention_side.py, ffn_side.py, tcp.py's SocketLink) a layer
call's message end is a dozen Python functions: the checks, a LayerFrame
built and encoded, a sendmsg; on receipt three receives, the decode and
wire.check_frame: several times what the same frames cost through a bare loop
of sendmsg and spinning receives (benchmarks/notes.md).

So, as on shm, a step's layer calls are prepared when the step begins
(send_step on the attention side, recv_step on the FFN side): per micro-batch
and direction the frame's bytes up to its payload, the connector's prefix and
the LayerFrame template of shm_fast.frame_template, patched with step and
micro-batch; csrc/cpu/sock_calls.cpp patches the layer in per call.

  attention  prepared_send(layer, u, h, out): prefix, header and h's bytes in
             one sendmsg; prepared_recv(layer, u, out): wait until the
             expected prefix and header can be read, compare them (peeked),
             consume them and receive the payload straight into out
  FFN        reply_prepared / send_output: the output, as prepared_send;
             recv_prepared / recv_hidden: the hidden states, as prepared_recv,
             into the (peer, micro-batch) receive buffer

Why comparing bytes checks the frame: prepared.py. Both ends write and expect
the same templates; the general path's frames (minimal integers) compare
unequal and are read by the general receive, as is anything else that is not
the expected frame (an ErrorFrame, a goodbye, a malformed frame): the peek
leaves the socket as it was. So does a wait past its bound (the link's spin,
or doorbell.FAST_WAIT_MS where longer): the general receive waits on, with
its timeout, logging and errors. A failure once the header is consumed (the
peer gone or stalled mid-payload), or after part of a frame went out, breaks
the stream: the connector fails with the general path's error for it, and the
caller's next call raises it.

Device tensors (CUDA) take the prepared calls too, staged through the
connector's pinned host slots (tcp.py's _staging, ../buffers.py), as the
general path stages them: the sender copies its tensor into its slot and
waits for the copy (the frame goes out from the slot), the receiver settles
the last copy out of its slot (HostSlots.release), receives into it, and
copies it to the device on the consumer's stream.

fp8 directions and routed frames take them for host tensors, as on shm
(shm_fast.py): the C call packs the tensor (and the routing) into the (peer,
micro-batch) pack buffer and sends it from there, or receives the payload
into the receive buffer and unpacks it into the caller's tensor (on the FFN
the unpack buffer; the routing viewed there). CUDA tensors' fp8 and routing
are packed on the device by the op library and staged, their frames prepared
raw; the receiver copies the payload to its device and decodes it there
(_socket_post_packed, codec._decode_staged), as on shm.

Mixed into TcpConnector (tcp.py) ahead of SocketConnector; the shm and nccl
connectors, whose payloads do not travel on the socket, derive from
SocketConnector without it.
"""

import errno
import os

import torch

from vllm.afd.transport import wire
from vllm.afd.transport.connectors.codec import Packed
from vllm.afd.transport.connectors.prepared import (
    Ubatch, codec_spec, frame_template, received_frame, routable)
from vllm.afd.transport.errors import LinkClosed, LinkTimeout, What

MAX_PREFIXED_HEADER = 512  # csrc/cpu/sock_calls.cpp's kMaxHeader


def socket_frame_template(dtype: torch.dtype, rows: int, hidden: int, scale_group: int,
                          prefix, topk: int = 0) -> "tuple[bytes, int, int, int, int] | None":
    """frame_template's, with the connector's prefix (tcp.PREFIX: magic,
    header length, payload length) in front and the offsets moved past it."""
    template = frame_template(dtype, rows, hidden, scale_group, topk)
    if template is None:
        return None
    encoded, step_at, layer_at, ubatch_at, nbytes = template
    head = prefix(len(encoded), nbytes)
    if len(head) + len(encoded) > MAX_PREFIXED_HEADER:
        return None
    shift = len(head)
    return (head + encoded, step_at + shift, layer_at + shift, ubatch_at + shift, nbytes)


class SocketCalls:
    """See the module docstring. Needs, from SocketConnector: _links (SocketLinks
    once connected: their socket, spin and frame prefix), _rx_buffer,
    _typed_view, and the protocol state of attention_side.py and ffn_side.py."""

    def _init_socket_calls(self) -> None:
        # (rows, scale group, topk) -> template, or None: the general way
        self._socket_templates: dict[tuple[int, int, int], tuple | None] = {}
        # peer -> the step's prepared calls: (capsule, C module, per micro-batch
        # a shm_fast.Ubatch), or None
        self._socket_prepared: dict[int, tuple | None] = {}
        self._socket_send_ns: dict[int, int] = {}  # send time already reported
        self.socket_calls = 0  # message ends taken by prepared calls (tests, benchmarks)
        # Host tensors on a host connector: no staging, no slot events to settle.
        self._socket_on_host = self.device.type == "cpu"

    def _socket_calls_usable(self) -> bool:
        """Host memory both ends, exact or fp8, with routing or without. CUDA
        tensors are staged through it; their fp8 and routing are packed on the
        device by the op library (where it packs: csrc/cpu/frame_codec.h packs
        host memory only), their frames then prepared raw."""
        return self.device.type in ("cpu", "cuda") and (self._socket_on_host or self._packs or not (
            self.send_scale_group or self.receive_scale_group or self.routing_topk))

    def _socket_template(self, rows: int, scale_group: int, prefix, topk: int = 0):
        key = (rows, scale_group, topk)
        if key not in self._socket_templates:
            self._socket_templates[key] = socket_frame_template(
                self.dtype, rows, self.hidden_size, scale_group, prefix, topk)
        return self._socket_templates[key]

    def _prepare_socket_calls(self, peer: int, step: wire.StepHeader) -> None:
        self._socket_prepared[peer] = None
        self._socket_send_ns.pop(peer, None)
        link = self._links.get(peer)
        if (step.is_goodbye or step.is_shutdown or not self._socket_calls_usable()
                or self._failure is not None or not self._connected
                or getattr(link, "sock", None) is None):
            return
        from vllm.afd.transport import doorbell

        C = doorbell.lane_module()
        if not hasattr(C, "sock_prepare"):  # an op library built before them
            return
        sends, recvs, routed_frames, ubatches = [], [], [], []
        hidden, dtype, host = self.hidden_size, self.dtype, torch.device("cpu")
        topk, attention = self.routing_topk, self.is_attention
        send_group, receive_group = self.send_scale_group, self.receive_scale_group
        # Frames toward the FFN carry routing on MoE layers (gate_on "attention").
        to_ffn_group = send_group if attention else receive_group
        # A device's fp8 and routing are packed and unpacked on it (around the
        # staging), so its frames go as they are: no codec, no buffers here.
        raw = not self._socket_on_host
        for u, rows in enumerate(step.num_tokens):
            out_t = self._socket_template(rows, send_group, link.prefix)
            in_t = self._socket_template(rows, receive_group, link.prefix)
            routed_t = (self._socket_template(rows, to_ffn_group, link.prefix, topk) if topk
                        else None)
            if out_t is None or in_t is None or (topk and routed_t is None):
                return
            key = (peer, u)
            # fp8 and routed frames: packed into the (peer, micro-batch) pack
            # buffer and sent from it; received into the receive buffer (one
            # for both frames, sized for the larger: its address must hold)
            # and unpacked from it. The FFN's exact hidden states are received
            # straight into that buffer. Each allocated only where a frame
            # needs it (a pack buffer is max_bytes).
            pack = (self._pack_target(peer, u, max(out_t[4], routed_t[4] if topk else 0),
                                      host).data_ptr()
                    if not raw and (send_group or (topk and attention)) else 0)
            rx = (self._rx_buffer(key, max(in_t[4], routed_t[4] if topk else 0))
                  if not raw and (receive_group or not attention) else None)
            received_at = 0 if rx is None else rx.data_ptr()
            out_codec = None if raw else codec_spec(dtype, rows, hidden, send_group, pack)
            in_codec = None if raw else codec_spec(dtype, rows, hidden, receive_group,
                                                   received_at)
            routed_codec = (codec_spec(dtype, rows, hidden, to_ffn_group,
                                       pack if attention else received_at, topk)
                            if topk and not raw else None)
            if out_codec is False or in_codec is False or routed_codec is False:
                return
            sends.append((*out_t, out_codec))
            recvs.append((*in_t, in_codec))
            shape = [rows, hidden]
            # The FFN's hidden states: received into its receive buffer (exact)
            # or unpacked from there into its unpack buffer (fp8).
            view, routing, routed = None, None, 0
            if not attention and self._socket_on_host:
                view = (self._typed_view(key, rx, dtype, shape)
                        if in_codec is None else self._unpack_buffer(
                            peer, u, dtype, host)[:rows * hidden].view(rows, hidden))
            # Raw received frames that need the device to decode them: fp8.
            unstage = [(received_frame(dtype, rows, hidden, receive_group, 0, u), in_t[4])
                       if raw and receive_group else None, None]
            if topk:
                routed_frames.append((*routed_t, routed_codec))
                routed = routed_t[4] + len(routed_t[0])
                if not attention and raw:  # the routing: views on the device
                    unstage[1] = (received_frame(dtype, rows, hidden, to_ffn_group, topk, u),
                                  routed_t[4])
                elif not attention:  # views of the received payload
                    layout = wire.PayloadLayout.of(rows, hidden, dtype, to_ffn_group, topk)
                    routing = wire.routing_views(rx[:layout.total], layout, rows, topk)
            # The prefix is part of the template.
            ubatches.append(Ubatch(rows, hidden, dtype, out_t[4] + len(out_t[0]),
                                   in_t[4] + len(in_t[0]), view, 0, routed, routing, topk,
                                   tuple(unstage) if any(unstage) else None))
        sock = link.sock
        fd = sock.fileno()
        if fd < 0:  # closed by another thread: the general path says so
            return
        calls = C.sock_prepare(sock, fd, step.step_id, int(link.spin_s * 1e9),
                               doorbell.FAST_WAIT_MS, max(1, int(self.timeout_s * 1000)),
                               sends, recvs, routed_frames if topk and attention else None,
                               routed_frames if topk and not attention else None)
        self._socket_prepared[peer] = (calls, C, ubatches)

    def _socket_send_s(self, peer: int) -> float:
        prepared = self._socket_prepared.get(peer)
        if prepared is None:
            return 0.0
        send_ns = prepared[1].sock_call_times(prepared[0])[0]
        before = self._socket_send_ns.get(peer, 0)
        self._socket_send_ns[peer] = send_ns
        return (send_ns - before) * 1e-9

    def _socket_staged_source(self, peer: int, u: int, t: torch.Tensor) -> int:
        """A device tensor's bytes in this side's pinned slot u, landed: the
        address a prepared post sends from."""
        staging = self._staging(self._tx_staging, peer)
        staging.write(u, (t,), t.nbytes)
        return staging.address(u)

    def _socket_post_packed(self, peer: int, layer_id: int, u: int, t: torch.Tensor,
                            ub: Ubatch, routing: "wire.Routing | None", calls, C) -> bool:
        """A device tensor's fp8 or routed frame (prepared raw): packed on its
        device by the op library (the general path's bytes: codec._encode),
        staged into the slot, sent from there. False: nothing sent."""
        if routing is not None and not (ub.routed and routable(*routing, ub, t.device)):
            return False
        src = self._socket_staged_source(peer, u, self._encode(peer, u, t, routing))
        # Any routing address selects the routed frame; a raw frame's routing
        # is in its payload, at src.
        status = C.sock_post_call(calls, u, layer_id, src, *((src, src) if routing else ()))
        if status == 1:
            return False  # nothing sent: the general path sends, or says why not
        if status < 0:
            self._broken(peer, status, What("layer {} ubatch {} hidden states", layer_id, u),
                         "send")
            return False
        self.bytes_sent += ub.sent if routing is None else ub.routed
        self.socket_calls += 1
        return True

    def _socket_staged_target(self, peer: int, u: int) -> int:
        """The address a staged receive writes, once the last copy out of
        that slot has read it."""
        staging = self._staging(self._rx_staging, peer)
        staging.release(u)
        return staging.address(u)

    def _broken(self, peer: int, status: int, what: What, action: str) -> None:
        """A prepared call that left the stream mid-frame: fail the connector
        with the general path's error (raised by the caller's next call)."""
        error = (LinkTimeout() if status == -errno.ETIMEDOUT
                 else LinkClosed(os.strerror(-status)))
        self._link_error(error, self.peer_name(peer), what, action)

    # ------------------------------------------------------- attention side
    def send_step(self, header: wire.StepHeader) -> None:
        super().send_step(header)
        if self.is_attention:
            self._prepare_socket_calls(0, header)

    def exchange_prepared(self) -> bool:
        return self._socket_prepared.get(0) is not None

    def prepared_send(self, layer_id: int, ubatch_id: int, h: torch.Tensor,
                      out: torch.Tensor | None, routing: wire.Routing | None = None) -> bool:
        prepared = self._socket_prepared.get(0)
        if prepared is None or self._in_flight or self._failure is not None:
            return False
        calls, C, ubatches = prepared
        ub = ubatches[ubatch_id]
        # Inline checks, as shm_fast.prepared_send's (each Python call costs
        # microseconds on a cold cache).
        if not (h.dtype == self.dtype and h.nbytes == ub.nbytes and h.is_contiguous()):
            return False
        if h.is_cpu and self._socket_on_host:
            src = h.data_ptr()
        elif self.send_scale_group or routing is not None:
            # A device connector's frame, prepared raw; a host connector's C
            # packs host memory: a device tensor there goes the general way.
            return not self._socket_on_host and self._socket_post_packed(
                0, layer_id, ubatch_id, h, ub, routing, calls, C)
        else:
            src = self._socket_staged_source(0, ubatch_id, h)
        if routing is None:
            status = C.sock_post_call(calls, ubatch_id, layer_id, src)
        else:
            weights, ids = routing
            if not (ub.routed and routable(weights, ids, ub)):
                return False  # not prepared, or not as the frame needs it
            status = C.sock_post_call(calls, ubatch_id, layer_id, src, weights.data_ptr(),
                                      ids.data_ptr())
        if status == 1:
            return False  # nothing sent: the general path sends, or says why not
        if status < 0:
            self._broken(0, status, What("layer {} ubatch {} hidden states", layer_id,
                                         ubatch_id), "send")
            return False
        self.bytes_sent += ub.sent if routing is None else ub.routed
        self.socket_calls += 1
        return True

    def prepared_recv(self, layer_id: int, ubatch_id: int, out: torch.Tensor) -> bool:
        prepared = self._socket_prepared.get(0)
        if prepared is None:
            raise ValueError(f"{self.me}: prepared_recv without prepared_send")
        calls, C, ubatches = prepared
        ub = ubatches[ubatch_id]
        on_host, unstage = out.is_cpu and self._socket_on_host, ub.unstage
        # fp8 is unpacked into host memory by the C call, on a device
        # connector on the device (unstage).
        if (out.dtype == self.dtype and out.nbytes == ub.nbytes and out.is_contiguous()
                and (on_host or not self.receive_scale_group or unstage is not None)):
            status = C.sock_take_call(calls, ubatch_id, layer_id, out.data_ptr() if on_host
                                      else self._socket_staged_target(0, ubatch_id))
            if status == 1:
                if not on_host:  # staged: from the slot on the caller's stream
                    if unstage is None:
                        self._rx_staging[0].read(ubatch_id, self.dtype, ub.shape, out)
                    else:
                        self._decode_staged(self._rx_staging[0], 0, ubatch_id, unstage[0], out)
                self.bytes_received += ub.received
                self.socket_calls += 1
                return True
            if status < 0:
                self._broken(0, status, What("the output of layer {} ubatch {}", layer_id,
                                             ubatch_id), "payload")
        # The general receive takes over (recv_output: its wait, its errors).
        self._in_flight.append((layer_id, ubatch_id, ub.shape))
        return False

    def take_exchange_send_s(self) -> float:
        return self._socket_send_s(0)

    # ------------------------------------------------------------- FFN side
    def recv_step(self, peer: int = 0, timeout_s: float | None = None) -> wire.StepHeader:
        header = super().recv_step(peer, timeout_s)
        if not self.is_attention:
            self._prepare_socket_calls(peer, header)
        return header

    def reply_and_recv(self, peer: int, layer_id: int, ubatch_id: int, out: torch.Tensor,
                       next_layer: int, next_ubatch: int) -> "torch.Tensor":
        if self.reply_prepared(peer, layer_id, ubatch_id, out):
            return self.recv_prepared(peer, next_layer, next_ubatch)
        return super().reply_and_recv(peer, layer_id, ubatch_id, out, next_layer, next_ubatch)

    def reply_prepared(self, peer: int, layer_id: int, ubatch_id: int,
                       out: torch.Tensor) -> bool:
        prepared = self._socket_prepared.get(peer)
        awaiting, key = self._awaiting, (peer, ubatch_id)
        awaited = awaiting.get(key)
        if (prepared is None or awaited is None or awaited[0] != layer_id
                or self._failure is not None):
            return False
        calls, C, ubatches = prepared
        ub = ubatches[ubatch_id]
        if not (out.dtype == self.dtype and out.nbytes == ub.nbytes and out.is_contiguous()):
            return False
        if out.is_cpu and self._socket_on_host:
            src = out.data_ptr()
        elif self.send_scale_group:  # fp8: packed on the device, then staged
            if self._socket_on_host:
                return False  # a device tensor on a host connector: the general way
            src = self._socket_staged_source(peer, ubatch_id,
                                             self._encode(peer, ubatch_id, out, None))
        else:
            src = self._socket_staged_source(peer, ubatch_id, out)
        status = C.sock_post_call(calls, ubatch_id, layer_id, src)
        if status == 1:
            return False
        if status < 0:
            self._broken(peer, status, What("layer {} ubatch {} output", layer_id, ubatch_id),
                         "send")
            return False
        # Sent: the bookkeeping now, while the attention side computes.
        self.bytes_sent += ub.sent
        self.socket_calls += 1
        del awaiting[key]
        self._routings.pop(key, None)
        return True

    def recv_prepared(self, peer: int, layer_id: int, ubatch_id: int) -> "torch.Tensor | Packed":
        # recv_hidden's, one Python frame fewer between the frame and the mlp.
        h = self._socket_recv(peer, layer_id, ubatch_id)
        return h if h is not None else super().recv_hidden(peer, layer_id, ubatch_id, defer=True)

    def recv_hidden(self, peer: int, layer_id: int, ubatch_id: int, *,
                    defer: bool = False) -> "torch.Tensor | Packed":
        # The FFN's receives (a step's first; the rest through recv_prepared,
        # above): the prepared receive where it can take it, else the
        # general receive (its wait, its errors).
        h = self._socket_recv(peer, layer_id, ubatch_id) if not self.is_attention else None
        return h if h is not None else super().recv_hidden(peer, layer_id, ubatch_id,
                                                           defer=defer)

    def _socket_recv(self, peer: int, layer_id: int, ubatch_id: int) -> "torch.Tensor | None":
        """The FFN's prepared receive: the hidden states, or None (not taken)."""
        prepared = self._socket_prepared.get(peer)
        if prepared is None or self._failure is not None:
            return None
        calls, C, ubatches = prepared
        ub = ubatches[ubatch_id]
        view = ub.view
        target = (view.data_ptr() if view is not None
                  else self._socket_staged_target(peer, ubatch_id))
        # The receive's bookkeeping as if it will succeed (undone below when it
        # does not): after the receive, only the return stands between it and
        # the next mlp.
        key = (peer, ubatch_id)
        self._awaiting[key] = (layer_id, ub.shape)
        self._routings[key] = None
        self.bytes_received += ub.received
        self.socket_calls += 1
        status = C.sock_take_call(calls, ubatch_id, layer_id, target)
        if status == 1 and view is not None:
            return view  # the common case first: the next mlp waits on this path
        if status > 0:
            if status == 2:  # the routed frame, its routing in the receive buffer
                self._routings[key] = ub.routing
                self.bytes_received += ub.routed - ub.received
            unstage = ub.unstage
            if unstage is not None and unstage[status - 1] is not None:
                # A device's fp8 or routed frame: decoded there (the routing
                # viewed in the device's copy of the payload).
                h, self._routings[key] = self._decode_staged(
                    self._rx_staging[peer], peer, ubatch_id, unstage[status - 1])
                return h
            # On a device: copied from the slot on this side's stream.
            return view if view is not None else self._rx_staging[peer].read(
                ubatch_id, self.dtype, ub.shape)
        del self._awaiting[key]
        del self._routings[key]
        self.bytes_received -= ub.received
        self.socket_calls -= 1
        if status < 0:
            self._broken(peer, status, What("the hidden states of layer {} ubatch {}",
                                            layer_id, ubatch_id), "payload")
        return None

    def send_output(self, peer: int, layer_id: int, ubatch_id: int, out: torch.Tensor) -> None:
        if not self.reply_prepared(peer, layer_id, ubatch_id, out):
            super().send_output(peer, layer_id, ubatch_id, out)

    def take_reply_send_s(self, peer: int) -> float:
        return super().take_reply_send_s(peer) + self._socket_send_s(peer)
