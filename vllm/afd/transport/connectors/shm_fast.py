# SPDX-License-Identifier: Apache-2.0
# SPDX-FileCopyrightText: Copyright contributors to the vllm-afd project
"""The shm connector's fast path for layer calls: one C call per message end.

The protocol API (send_hidden, recv_output on the attention side; recv_hidden,
send_output on the FFN side) goes through many small Python functions: checks,
a LayerFrame built and encoded, the slot copy, the ring entry, the doorbell;
and on receipt the decode, wire.check_frame, the slot's view. After a
layer's compute, on a VM where every page touched first costs microseconds,
each of those lines is a string of cache misses on the path both sides wait
on (the figures: benchmarks/notes.md). Here the
attention side's send_hidden and recv_output (a step's calls that the prepared
calls below did not carry) take one call into csrc/cpu/lane.cpp in the common
case (the FFN's recv_hidden and send_output take the prepared calls):

  sending    the tensor's bytes into the micro-batch's slot, the frame's header
             (a template per shape, patched with step, layer and micro-batch)
             into the ring, published: lane_send_frame
  receiving  wait, compare the entry with the header expected next, consume it,
             copy the payload into the caller's `out`: lane_recv_frame

Which case is common: CPU tensors (host memory on both ends), exact transfer
(no fp8: the prepared calls below carry it), no routing, the caller's own
checks passing. Everything else, and
every surprise, takes the general path of attention_side.py / ffn_side.py,
unchanged: a message that is not the expected frame (an ErrorFrame, a goodbye,
a malformed or mismatched frame) is left in the ring for it, so it decodes it
and raises the error it always did; a wait that ends without the frame (after
doorbell.FAST_WAIT_MS, or the link's spin where longer, or closed) continues
there too, with its own timeout_s, logging and error messages: a late answer
waits at most that much longer in all (an answer later than that pays the
general path's cost, small next to such a wait).

Why comparing bytes checks the frame: prepared.py (the templates, shared
with tcp_fast.py).

Prepared layer calls (csrc/cpu/lane_calls.cpp): even one C call per message
end left a stack of Python helpers around each layer call (the checks above,
the template and slot lookups, the protocol state), costly after a layer's
compute for the same reason. What is fixed for a step (per micro-batch: the
headers with step and micro-batch patched in, the slots, the sizes) is
prepared once when the step begins (send_step on the attention side, recv_step
on the FFN side), and a layer call is one C call with four numbers:

  attention  prepared_send(layer, u, h, out), then prepared_recv(layer, u, out):
             send h; wait and copy the output into out (link.py uses them for
             steps of one micro-batch, and counts the call in between)
  FFN        reply_prepared(peer, layer, u, out), then recv_prepared(peer,
             next_layer, next_u): send this call's output; wait for the next
             call's hidden states (reply_and_recv does both; recv_hidden and
             send_output, a step's first receive and last send, too)

Both fall back as the calls above do: nothing sent (a full ring) means the
general path does it all; sent but no expected answer in time means the
general receive takes over, with its own timeout and errors.

fp8 directions (AFDConfig.transfer_dtype) and routing (gate_on "attention")
take them too, for host tensors: the frame's template says fp8 or carries the
routing's width, and the C call packs the caller's tensor (and the routing
after it) into the slot (sending) or unpacks the slot's hidden states into the
caller's tensor, on the FFN into the connector's unpack buffer (receiving; the
routing is viewed in the slot), with afd::pack's row kernels
(csrc/cpu/frame_codec.h): the general path's bytes, one C call instead of a
dispatcher round trip and a dozen Python helpers per message end. A micro-batch has a plain
and a routed frame prepared; the FFN's receive takes either (a step mixes
dense and MoE layers). CUDA tensors with fp8 or routing are packed on the
device (the op library's kernels, codec._encode) and staged; their frames are
prepared raw (no codec in the C call), and the receiver copies the payload to
its device and decodes it there (codec._decode_staged): _post_packed.

Device tensors (CUDA) take the prepared calls too, staged through the same
slots: the sender copies its tensor into its slot and waits for the copy (the
peer reads the slot once the header is out), then posts with the slot itself
as the source (lane_post_call copies nothing then); the receiver takes the
frame leaving the payload in its slot, then copies it to the device on the
consumer's stream, and the slot's event is settled before this side's next
message on that micro-batch (which lets the peer write the slot again): the
general path's Python and its event per copy are gone, two copies and one
wait per side remain.

Mixed into ShmConnector (shm.py) ahead of the protocol classes.
"""

import time

import torch

from vllm.afd.transport import doorbell, wire
from vllm.afd.transport.connectors.codec import Packed
from vllm.afd.transport.connectors.prepared import (
    Ubatch, codec_spec, frame_template, received_frame, routable)
from vllm.afd.transport.errors import LinkClosed, LinkTimeout

class FastFrames:
    """See the module docstring. Needs, from ShmConnector: _links (RingLinks
    once connected), _tx/_rx (HostSlots), and the protocol state of
    attention_side.py and ffn_side.py."""

    def _init_fast(self) -> None:
        # Per direction: rows -> template (or None: this shape goes the general way).
        self._send_templates: dict[int, tuple | None] = {}
        self._recv_templates: dict[int, tuple | None] = {}
        # rows -> the template of the frame toward the FFN with routing
        # (gate_on "attention": the hidden states of MoE layers carry it)
        self._routed_templates: dict[int, tuple | None] = {}
        # peer -> slot addresses (send, receive), per micro-batch
        self._slot_addresses: dict[int, tuple[list[int], list[int]]] = {}
        self.fast_calls = 0  # layer-call message ends taken by the fast path (tests)
        # peer -> the step's prepared calls: (lane_calls capsule, its module,
        # per micro-batch (rows, bytes sent, bytes received, [rows, hidden],
        # the received slot's tensor on the FFN side, payload bytes sent)), or None
        self._prepared: dict[int, tuple | None] = {}
        self._prepared_send_ns: dict[int, int] = {}  # send time already reported
        # Host tensors on a host connector: no staging, no slot events to settle.
        self._on_host = self.device.type == "cpu"

    def _prepared_enabled(self) -> bool:
        """The prepared calls: host memory both ends, exact or fp8, with
        routing or without. CUDA tensors are staged through it; their fp8 and
        routing are packed on the device by the op library (where it packs:
        csrc/cpu/frame_codec.h packs host memory only), their frames then
        prepared raw."""
        return self.device.type in ("cpu", "cuda") and (self._on_host or self._packs or not (
            self.send_scale_group or self.receive_scale_group or self.routing_topk))

    def _fast_enabled(self) -> bool:
        """Host memory both ends (CUDA tensors staged through it), exact
        transfer both ways, no routing."""
        return (self.device.type in ("cpu", "cuda") and not self.send_scale_group
                and not self.receive_scale_group and not self.routing_topk)

    def _staged_source(self, peer: int, u: int, t: torch.Tensor) -> int:
        """On a device connector, the address a prepared post sends from: t
        copied into this side's slot u (waited for: the peer reads the slot
        once the header arrives). Before that, the last read of the received
        slot u is settled: once the peer has this message it may write that
        slot again."""
        self._rx[peer].release(u)
        tx = self._tx[peer]
        tx.write(u, (t,), t.nbytes)
        return tx.address(u)

    def _post_packed(self, peer: int, layer_id: int, u: int, t: torch.Tensor, ub: Ubatch,
                     routing: "wire.Routing | None", calls, C) -> bool:
        """A device tensor's fp8 or routed frame (prepared raw): packed on its
        device by the op library (the general path's bytes: codec._encode),
        staged into the slot, posted. False: nothing sent."""
        if routing is not None and not (ub.routed and routable(*routing, ub, t.device)):
            return False
        src = self._staged_source(peer, u, self._encode(peer, u, t, routing))
        # Any routing address selects the routed frame; a raw frame's routing
        # is in its payload, at src.
        if C.lane_post_call(calls, u, layer_id, src, *((src, src) if routing else ())) == 1:
            return False
        self.bytes_sent += ub.sent if routing is None else ub.routed
        self.fast_calls += 1
        return True

    def _template(self, table: dict, rows: int, scale_group: int = 0, topk: int = 0):
        """The frame template of rows (in this direction's encoding: its table's)."""
        if rows not in table:
            table[rows] = frame_template(self.dtype, rows, self.hidden_size, scale_group, topk)
        return table[rows]

    def _addresses(self, peer: int) -> tuple[list[int], list[int]] | None:
        addresses = self._slot_addresses.get(peer)
        if addresses is None:
            tx, rx = self._tx.get(peer), self._rx.get(peer)
            if tx is None or rx is None:
                return None
            addresses = self._slot_addresses[peer] = (
                [tx.address(u) for u in range(tx.count)],
                [rx.address(u) for u in range(rx.count)])
        return addresses

    def _usable(self, peer: int, t: torch.Tensor, rows: int):
        """The peer's RingLink when the fast path may carry t ([rows, hidden],
        this dtype, contiguous host memory) over a healthy link; else None."""
        if self._failure is not None or not self._connected:
            return None
        link = self._links.get(peer)
        if (type(link) is not doorbell.RingLink or t.dtype != self.dtype or not t.is_cpu
                or not self._on_host or t.shape != (rows, self.hidden_size)
                or not t.is_contiguous()):
            return None
        return link

    def _post_frame(self, peer: int, link, template, step_id: int, layer_id: int, u: int,
                    src: int, dst: int) -> None:
        """Send the frame (and copy the payload src -> dst), waiting for room in
        the ring in the rare case there is none."""
        encoded, step_at, layer_at, ubatch_at, nbytes = template
        status = link.C.lane_send_frame(link.lane, encoded, step_at, layer_at, ubatch_at,
                                        step_id, layer_id, u, src, dst, nbytes)
        if status:
            what = f"layer {layer_id} ubatch {u} of step {step_id}"
            try:
                link.post(lambda: link.C.lane_send_frame(
                    link.lane, encoded, step_at, layer_at, ubatch_at, step_id, layer_id, u,
                    src, dst, nbytes), time.monotonic() + self.timeout_s)
            except (LinkTimeout, LinkClosed) as e:
                raise self._link_error(e, self.peer_name(peer), what, "send") from None
        self.bytes_sent += nbytes + link.frame_overhead + len(encoded)
        self.fast_calls += 1

    def _recv_frame(self, link, template, step_id: int, layer_id: int, u: int, src: int,
                    dst: int) -> bool:
        """Wait for the frame and take it (payload src -> dst unless dst is 0);
        False: it did not come as expected, the general path takes over."""
        encoded, step_at, layer_at, ubatch_at, nbytes = template
        status = link.C.lane_recv_frame(link.lane, link.spin_ns, link.fast_wait_ms,
                                        encoded, step_at, layer_at, ubatch_at, step_id,
                                        layer_id, u, src, dst, nbytes)
        if status != 1:
            return False
        self.bytes_received += nbytes + link.frame_overhead + len(encoded)
        self.fast_calls += 1
        return True

    def _prepare(self, peer: int, step: wire.StepHeader) -> None:
        """Prepare the step's layer calls with peer (see the module docstring)."""
        self._prepared[peer] = None
        self._prepared_send_ns.pop(peer, None)
        link = self._links.get(peer)
        if (step.is_goodbye or step.is_shutdown or not self._prepared_enabled()
                or type(link) is not doorbell.RingLink or self._failure is not None
                or not self._connected):
            return
        addresses = self._addresses(peer)
        if addresses is None:
            return
        sends, recvs, routed_frames, ubatches = [], [], [], []
        hidden, dtype, topk = self.hidden_size, self.dtype, self.routing_topk
        send_group, receive_group = self.send_scale_group, self.receive_scale_group
        # Frames toward the FFN carry routing on MoE layers (gate_on "attention").
        to_ffn_group = send_group if self.is_attention else receive_group
        overhead = link.frame_overhead
        # A device's fp8 and routing are packed and unpacked on it (around the
        # staging), so its frames go as they are: no codec in the C calls.
        raw = not self._on_host
        for u, rows in enumerate(step.num_tokens):
            out_t = self._template(self._send_templates, rows, send_group)
            in_t = self._template(self._recv_templates, rows, receive_group)
            out_codec = None if raw else codec_spec(dtype, rows, hidden, send_group)
            in_codec = None if raw else codec_spec(dtype, rows, hidden, receive_group)
            if out_t is None or in_t is None or out_codec is False or in_codec is False:
                return
            sends.append((*out_t[:4], addresses[0][u], out_t[4], out_codec))
            recvs.append((*in_t[:4], addresses[1][u], in_t[4], in_codec))
            shape = [rows, hidden]
            # The FFN's hidden states: a view of the slot (exact; taken without a
            # copy) or the buffer the C call unpacks fp8 into.
            view, into = None, 0
            if not self.is_attention and self._on_host:
                if in_codec is None:
                    view = self._rx[peer].view(u, dtype, shape)
                else:
                    view = self._unpack_buffer(peer, u, dtype, self.device)[
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
                    return
                slot = addresses[0 if self.is_attention else 1][u]
                routed_frames.append((*routed_t[:4], slot, routed_t[4], routed_codec))
                routed = routed_t[4] + overhead + len(routed_t[0])
                if not self.is_attention and raw:  # the routing: views on the device
                    unstage[1] = (received_frame(dtype, rows, hidden, to_ffn_group, topk, u),
                                  routed_t[4])
                elif not self.is_attention:
                    layout = wire.PayloadLayout.of(rows, hidden, dtype, to_ffn_group, topk)
                    routing = wire.routing_views(self._rx[peer].slot(u)[:layout.total],
                                                 layout, rows, topk)
            ubatches.append(Ubatch(rows, hidden, dtype, out_t[4] + overhead + len(out_t[0]),
                                   in_t[4] + overhead + len(in_t[0]), view, into, routed,
                                   routing, topk, tuple(unstage) if any(unstage) else None))
        calls = link.C.lane_prepare(link, link.lane, step.step_id, link.spin_ns,
                                    link.fast_wait_ms, sends, recvs,
                                    routed_frames if topk and self.is_attention else None,
                                    routed_frames if topk and not self.is_attention else None)
        self._prepared[peer] = (calls, link.C, ubatches)

    def _prepared_send_s(self, peer: int) -> float:
        """Time the prepared calls spent sending since the last time asked."""
        prepared = self._prepared.get(peer)
        if prepared is None:
            return 0.0
        send_ns = prepared[1].lane_call_times(prepared[0])[0]
        before = self._prepared_send_ns.get(peer, 0)
        self._prepared_send_ns[peer] = send_ns
        return (send_ns - before) * 1e-9

    # ------------------------------------------------------- attention side
    def send_step(self, header: wire.StepHeader) -> None:
        super().send_step(header)
        if self.is_attention:
            self._prepare(0, header)

    def exchange_prepared(self) -> bool:
        return self._prepared.get(0) is not None

    def prepared_send(self, layer_id: int, ubatch_id: int, h: torch.Tensor,
                      out: torch.Tensor | None, routing: wire.Routing | None = None) -> bool:
        prepared = self._prepared.get(0)
        if prepared is None or self._in_flight or self._failure is not None:
            return False
        calls, C, ubatches = prepared
        ub = ubatches[ubatch_id]
        # Inline checks: a Python call costs microseconds on a cold cache (each
        # tensor attribute 1-3 us after a layer's compute). What the copy needs
        # (host memory, contiguous, the slot's byte count) and the dtype;
        # nbytes, not shape: a tuple compare costs 4x an attribute. `out`'s are
        # prepared_recv's, made while the FFN computes.
        if not (h.dtype == self.dtype and h.nbytes == ub.nbytes and h.is_contiguous()):
            return False
        if h.is_cpu and self._on_host:
            src = h.data_ptr()
        elif self.send_scale_group or routing is not None:
            # A device connector's frame, prepared raw; a host connector's C
            # packs host memory: a device tensor there goes the general way.
            return not self._on_host and self._post_packed(0, layer_id, ubatch_id, h, ub,
                                                           routing, calls, C)
        else:
            src = self._staged_source(0, ubatch_id, h)
        if routing is None:
            if C.lane_post_call(calls, ubatch_id, layer_id, src) == 1:
                return False  # a full ring: nothing sent
            self.bytes_sent += ub.sent
        else:
            weights, ids = routing
            if not (ub.routed and routable(weights, ids, ub)
                    and C.lane_post_call(calls, ubatch_id, layer_id, src, weights.data_ptr(),
                                         ids.data_ptr()) != 1):
                return False  # not prepared, not as the frame needs it, or a full ring
            self.bytes_sent += ub.routed
        self.fast_calls += 1
        return True

    def prepared_recv(self, layer_id: int, ubatch_id: int, out: torch.Tensor) -> bool:
        calls, C, ubatches = self._prepared[0]
        ub = ubatches[ubatch_id]
        dtype = self.dtype
        # What the copy into `out` needs (as prepared_send's checks, made here
        # while the FFN computes); the general receive takes any other `out`.
        if out.dtype == dtype and out.nbytes == ub.nbytes and out.is_contiguous():
            # Counted before, so that nothing stands between the output's arrival
            # and the caller; undone when it does not come.
            on_host, unstage = out.is_cpu and self._on_host, ub.unstage
            # fp8 is unpacked into host memory by the C call, on a device
            # connector on the device (unstage).
            if on_host or not self.receive_scale_group or unstage is not None:
                self.bytes_received += ub.received
                self.fast_calls += 1
                if C.lane_take_call(calls, ubatch_id, layer_id,
                                    out.data_ptr() if on_host else 0):
                    if not on_host:  # staged: from the slot on the caller's stream
                        if unstage is None:
                            self._rx[0].read(ubatch_id, dtype, ub.shape, out)
                        else:
                            self._decode_staged(self._rx[0], 0, ubatch_id, unstage[0], out)
                    return True
                self.bytes_received -= ub.received
                self.fast_calls -= 1
        # The general receive takes over (recv_output: its wait, its errors).
        self._in_flight.append((layer_id, ubatch_id, ub.shape))
        return False

    def take_exchange_send_s(self) -> float:
        return self._prepared_send_s(0)

    def send_hidden(self, layer_id: int, ubatch_id: int, h: torch.Tensor,
                    expect_output: bool = True, routing: wire.Routing | None = None) -> None:
        step = self._step
        if (routing is None and expect_output and self.is_attention and step is not None
                and self._fast_enabled() and 0 <= ubatch_id < len(step.num_tokens)
                and all(u != ubatch_id for _, u, _ in self._in_flight)):
            rows = step.num_tokens[ubatch_id]
            link = self._usable(0, h, rows)
            template = self._template(self._send_templates, rows) if link else None
            addresses = self._addresses(0) if template else None
            if addresses is not None:
                self._post_frame(0, link, template, step.step_id, layer_id, ubatch_id,
                                 h.data_ptr(), addresses[0][ubatch_id])
                self._in_flight.append((layer_id, ubatch_id, [rows, self.hidden_size]))
                return
        super().send_hidden(layer_id, ubatch_id, h, expect_output, routing)

    def recv_output(self, layer_id: int, ubatch_id: int,
                    out: torch.Tensor | None = None) -> torch.Tensor:
        step, in_flight = self._step, self._in_flight
        if (out is not None and in_flight and self.is_attention and step is not None
                and in_flight[0][0] == layer_id and in_flight[0][1] == ubatch_id
                and self._fast_enabled()):
            rows = in_flight[0][2][0]
            link = self._usable(0, out, rows)
            template = self._template(self._recv_templates, rows) if link else None
            addresses = self._addresses(0) if template else None
            if addresses is not None and self._recv_frame(
                    link, template, step.step_id, layer_id, ubatch_id,
                    addresses[1][ubatch_id], out.data_ptr()):
                in_flight.popleft()
                return out
        return super().recv_output(layer_id, ubatch_id, out)

    # ------------------------------------------------------------- FFN side
    def recv_step(self, peer: int = 0, timeout_s: float | None = None) -> wire.StepHeader:
        header = super().recv_step(peer, timeout_s)
        if not self.is_attention:
            self._prepare(peer, header)
        return header

    def reply_and_recv(self, peer: int, layer_id: int, ubatch_id: int, out: torch.Tensor,
                       next_layer: int, next_ubatch: int) -> "torch.Tensor":
        if self.reply_prepared(peer, layer_id, ubatch_id, out):
            return self.recv_prepared(peer, next_layer, next_ubatch)
        return super().reply_and_recv(peer, layer_id, ubatch_id, out, next_layer, next_ubatch)

    def reply_prepared(self, peer: int, layer_id: int, ubatch_id: int,
                       out: torch.Tensor) -> bool:
        prepared = self._prepared.get(peer)
        awaiting, key = self._awaiting, (peer, ubatch_id)
        awaited = awaiting.get(key)
        if (prepared is None or awaited is None or awaited[0] != layer_id
                or self._failure is not None):
            return False
        calls, C, ubatches = prepared
        ub = ubatches[ubatch_id]
        # Inline checks (see prepared_send): a Python call costs microseconds on
        # a cold cache, and this is the path from the mlp to the attention side.
        if not (out.dtype == self.dtype and out.nbytes == ub.nbytes and out.is_contiguous()):
            return False
        if out.is_cpu and self._on_host:
            src = out.data_ptr()
        elif self.send_scale_group:  # fp8: packed on the device, then staged
            if self._on_host:
                return False  # a device tensor on a host connector: the general way
            src = self._staged_source(peer, ubatch_id, self._encode(peer, ubatch_id, out, None))
        else:
            src = self._staged_source(peer, ubatch_id, out)
        if C.lane_post_call(calls, ubatch_id, layer_id, src) == 1:
            return False
        # Sent: the bookkeeping now, while the attention side computes.
        self.bytes_sent += ub.sent
        self.fast_calls += 1
        del awaiting[key]
        self._routings.pop(key, None)
        return True

    def _take_prepared(self, peer: int, layer_id: int, ubatch_id: int) -> "torch.Tensor | None":
        """The FFN's prepared receive (the step's calls are prepared): the
        hidden states, or None when they did not come as expected."""
        calls, C, ubatches = self._prepared[peer]
        ub = ubatches[ubatch_id]
        # The receive's bookkeeping as if it will succeed (undone below when it
        # does not): after the receive, only the return stands between it and
        # the next mlp.
        key = (peer, ubatch_id)
        self._awaiting[key] = (layer_id, ub.shape)
        self._routings[key] = None
        self.bytes_received += ub.received
        self.fast_calls += 1
        view = ub.view  # a host FFN's: exact frames' slot or fp8's unpack buffer
        taken = C.lane_take_call(calls, ubatch_id, layer_id, ub.into)
        if taken == 1 and view is not None:
            return view  # the common case first: the next mlp waits on this path
        if taken:
            if taken == 2:  # the routed frame: its routing stays in the slot
                self._routings[key] = ub.routing
                self.bytes_received += ub.routed - ub.received
            unstage = ub.unstage
            if unstage is not None and unstage[taken - 1] is not None:
                # A device's fp8 or routed frame: decoded there (the routing
                # viewed in the device's copy of the payload).
                h, self._routings[key] = self._decode_staged(self._rx[peer], peer, ubatch_id,
                                                             unstage[taken - 1])
                return h
            # On a device: copied from the slot on this side's stream.
            return view if view is not None else self._rx[peer].read(ubatch_id, self.dtype,
                                                                     ub.shape)
        del self._awaiting[key]
        del self._routings[key]
        self.bytes_received -= ub.received
        self.fast_calls -= 1
        return None

    def take_reply_send_s(self, peer: int) -> float:
        return self._prepared_send_s(peer) + super().take_reply_send_s(peer)

    def recv_prepared(self, peer: int, layer_id: int, ubatch_id: int) -> "torch.Tensor | Packed":
        # recv_hidden's, one Python frame fewer between the frame and the mlp.
        h = self._take_prepared(peer, layer_id, ubatch_id) if self._prepared.get(peer) else None
        return h if h is not None else super().recv_hidden(peer, layer_id, ubatch_id, defer=True)

    def recv_hidden(self, peer: int, layer_id: int, ubatch_id: int, *,
                    defer: bool = False) -> "torch.Tensor | Packed":
        # The FFN's receives (a step's first; the rest through recv_prepared,
        # above): the prepared call where the step has them, else (or
        # when the frame is not the expected one) the general receive.
        h = (self._take_prepared(peer, layer_id, ubatch_id)
             if not self.is_attention and self._prepared.get(peer) is not None else None)
        return h if h is not None else super().recv_hidden(peer, layer_id, ubatch_id,
                                                           defer=defer)

    def send_output(self, peer: int, layer_id: int, ubatch_id: int, out: torch.Tensor) -> None:
        if not self.reply_prepared(peer, layer_id, ubatch_id, out):  # a step's last call
            super().send_output(peer, layer_id, ubatch_id, out)
