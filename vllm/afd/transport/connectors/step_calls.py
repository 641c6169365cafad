# SPDX-License-Identifier: Apache-2.0
# SPDX-FileCopyrightText: Copyright contributors to the vllm-afd project
"""A step's layer calls, prepared once per step: one implementation for the
connectors whose message ends this host posts (shm's lane, tcp's socket).

Through a connector's general path (attention_side.py, ffn_side.py) a layer
call's message end is a dozen Python functions: the checks, a LayerFrame built
and encoded, the slot copy or the sendmsg; on receipt the decode,
wire.check_frame, the slot's view or the receives. After a layer's compute,
with the caches cold, each of those lines costs microseconds on the path both
sides wait on (the figures: benchmarks/notes.md). So what is fixed for a step
is fixed once when it begins (send_step on the attention side, recv_step on the
FFN side): per micro-batch and direction the frame's bytes up to its payload
(prepared.py's templates, patched with step and micro-batch), where the
payload goes and how it is encoded. A layer call is then one C call per
message end (csrc/cpu/step_calls.cpp, one implementation for both transports):

  attention  send_call(layer, u, h), then recv_call(layer, u, out): send h;
             wait for the output and copy it into out (the link makes `out`
             in between, while the FFN computes)
  FFN        take_call(peer, layer, u), then reply_call(peer, layer, u, out):
             wait for a call's hidden states (on shm a view of the slot they
             came in); send its output

What the transport decides is its frames object's (self.frames: step_frames
and the staging calls, below): where a frame's payload goes (shm: the micro-batch's slot,
where the FFN's exact hidden states are taken without a copy; tcp: straight
into the caller's tensor or the connector's receive buffer, after the
connector's frame prefix) and how device tensors are staged through host
memory.

Everything that is not the common case, and every surprise, takes the general
path, unchanged: nothing sent (a full ring or socket buffer) means the general
path sends it all; a receive that does not find the expected frame within its
bound (shm_ring.FAST_WAIT_MS, or the link's spin where longer) leaves the
message where it was (in the ring; peeked, not read, on a socket), and the
general receive reads it and raises the error it always did (an ErrorFrame, a
goodbye, a malformed or mismatched frame), with its own timeout. A socket that
fails mid-frame breaks the stream: the connector fails with the general path's
error for it, and the caller's next call raises it.

fp8 directions (AFDConfig.transfer_dtype) and routed frames (gate_on
"attention") take them too, for host tensors: the C call packs the caller's
tensor (and the routing after it) into the payload, or unpacks the payload's
hidden states into the caller's tensor (on the FFN its unpack buffer; the
routing viewed in place), with afd::pack's row kernels (csrc/cpu/frame_codec.h).
CUDA tensors are staged through the connector's host slots: their fp8 and
routing are packed on the device by the op library (codec.encode) and their
frames prepared raw; the receiver copies the payload to its device and decodes
it there (codec.decode_staged).
"""

import errno
import os

import torch

from vllm.afd.transport import shm_ring, wire
from vllm.afd.transport.connectors.codec import Packed
from vllm.afd.transport.connectors.prepared import Ubatch, routable
from vllm.afd.transport.errors import LinkClosed, LinkTimeout, What

# What frames.step_frames gives: the object the calls keep alive, the transport (a
# lane's capsule or a socket's descriptor), the spin in ns, and per micro-batch
# the frames each way (step_calls_prepare's tuples), the routed ones, the
# Ubatch records.
StepFrames = tuple


class StepCalls:
    """See the module docstring. Mixed into ShmConnector and TcpConnector
    ahead of the protocol classes; keeps a step's prepared calls in its
    PeerStep (peer_step.py: prepared, posted), with the protocol's state
    there, and places them through the transport's self.frames (below)."""

    def _init_step_calls(self) -> None:
        self.fast_calls = 0  # message ends taken by C calls (tests, benchmarks)
        # Host tensors on a host connector: no staging, no slot events to settle.
        self._on_host = self.device.type == "cpu"

    # The transport's part is an object the connector holds, self.frames
    # (shm_frames.py, tcp_frames.py), with four methods:
    #   step_frames(peer, step) -> StepFrames | None: the step's frames with
    #       peer (see StepFrames), or None: this step goes the general way;
    #   staged_source(peer, u, t) -> int: a device tensor's bytes in this
    #       side's host slot u, landed: the address a prepared post sends from;
    #   staged_target(peer, u) -> int: where a device side's prepared receive
    #       puts the payload (0: it stays where the transport left it), once
    #       the last copy out of it is done;
    #   staged_slots(peer) -> HostSlots: the host slots a device side's
    #       received payloads are read from.

    # ------------------------------------------------------------- preparing
    def _prepared_enabled(self) -> bool:
        """Host memory both ends, exact or fp8, with routing or without. CUDA
        tensors are staged; their fp8 and routing are packed on the device by
        the op library (where it packs: csrc/cpu/frame_codec.h packs host
        memory only), their frames then prepared raw."""
        return self.device.type in ("cpu", "cuda") and (self._on_host or self.codec.packs or not (
            self.codec.send_scale_group or self.codec.receive_scale_group or self.routing_topk))

    def _prepare(self, peer: int, step: wire.StepHeader) -> None:
        """Prepare the step's layer calls with peer (see the module docstring)."""
        current = self._steps.get(peer)
        if current is None or current.header is not step:  # a goodbye: no more calls
            if current is not None:
                current.prepared = None
            return
        if not self._prepared_enabled() or self._failure is not None or not self._connected:
            return
        frames = self.frames.step_frames(peer, step)
        if frames is None:
            return
        owner, transport, spin_ns, sends, recvs, routed, ubatches = frames
        C = shm_ring.lane_module()
        attention = self.is_attention
        calls = C.step_calls_prepare(owner, transport, step.step_id, spin_ns,
                                     shm_ring.FAST_WAIT_MS, max(1, int(self.timeout_s * 1000)),
                                     sends, recvs, routed if routed and attention else None,
                                     routed if routed and not attention else None)
        current.prepared = (calls, C, ubatches)

    def step_times(self, peer: int = 0) -> tuple[int, int, int] | None:
        """(ns spent sending, ns spent waiting, calls posted) by the current
        step's prepared calls with peer so far; None: the step goes the
        general way (or none began)."""
        step = self._steps.get(peer)
        if step is None or step.prepared is None:
            return None
        calls, C, _ = step.prepared
        return C.step_calls_times(calls)

    def _prepared_send_s(self, peer: int) -> float:
        """Time the prepared calls spent sending since the last time asked."""
        times = self.step_times(peer)
        if times is None:
            return 0.0
        step = self._steps[peer]
        before, step.reported_send_ns = step.reported_send_ns, times[0]
        return (times[0] - before) * 1e-9

    def _not_sent(self, peer: int, status: int, layer_id: int, u: int, what: str) -> bool:
        """A post's status other than 0 (sent): 1, nothing sent (the general
        path sends it); -errno, a socket's stream broken mid-frame (the
        connector fails with the general path's error, which the general
        path then raises). False either way."""
        if status < 0:
            self._broken(peer, status, What("layer {} ubatch {} " + what, layer_id, u), "send")
        return False

    def _broken(self, peer: int, status: int, what: What, action: str) -> None:
        """A prepared call that left a socket's stream mid-frame: fail the
        connector with the general path's error."""
        error = (LinkTimeout() if status == -errno.ETIMEDOUT
                 else LinkClosed(os.strerror(-status)))
        self._link_error(error, self.peer_name(peer), what, action)

    def _post_packed(self, peer: int, layer_id: int, u: int, t: torch.Tensor, ub: Ubatch,
                     routing: "wire.Routing | None", calls, C) -> bool:
        """A device tensor's fp8 or routed frame (prepared raw): packed on its
        device by the op library (the general path's bytes: codec.encode),
        staged, posted. False: nothing sent."""
        if routing is not None and not (ub.routed and routable(*routing, ub, t.device)):
            return False
        src = self.frames.staged_source(peer, u, self.codec.encode(peer, u, t, routing))
        # Any routing address selects the routed frame; a raw frame's routing
        # is in its payload, at src.
        status = C.step_calls_post(calls, u, layer_id, src, *((src, src) if routing else ()))
        if status:
            return self._not_sent(peer, status, layer_id, u, "hidden states")
        self.bytes_sent += ub.sent if routing is None else ub.routed
        self.fast_calls += 1
        return True

    # ------------------------------------------------------- attention side
    def send_step(self, header: wire.StepHeader) -> None:
        super().send_step(header)
        if self.is_attention:
            self._prepare(0, header)

    # send_call and recv_call hold the C calls' Python inline: a Python call
    # costs microseconds on a cold cache (each tensor attribute 1-3 us after a
    # layer's compute), and these are on the path both sides wait on. What the
    # C calls do not take goes to the general path (send_hidden, recv_output).
    def send_call(self, layer_id: int, ubatch_id: int, h: torch.Tensor,
                  routing: wire.Routing | None = None) -> None:
        step = self._steps.get(0)
        if (step is None or (prepared := step.prepared) is None or step.in_flight
                or self._failure is not None):
            return self.send_hidden(layer_id, ubatch_id, h, routing=routing)
        calls, C, ubatches = prepared
        ub = ubatches[ubatch_id]
        # What the copy needs (host memory, contiguous, the frame's byte count)
        # and the dtype; nbytes, not shape: a tuple compare costs 4x an
        # attribute. `out`'s are recv_call's, made while the FFN computes.
        if not (h.dtype == self.dtype and h.nbytes == ub.nbytes and h.is_contiguous()):
            return self.send_hidden(layer_id, ubatch_id, h, routing=routing)
        if h.is_cpu and self._on_host:
            src = h.data_ptr()
        elif self.codec.send_scale_group or routing is not None:
            # A device connector's frame, prepared raw; a host connector's C
            # packs host memory: a device tensor there goes the general way.
            if self._on_host or not self._post_packed(0, layer_id, ubatch_id, h, ub, routing,
                                                      calls, C):
                return self.send_hidden(layer_id, ubatch_id, h, routing=routing)
            step.posted[ubatch_id] = layer_id
            return
        else:
            src = self.frames.staged_source(0, ubatch_id, h)
        if routing is None:
            status = C.step_calls_post(calls, ubatch_id, layer_id, src)
            sent = ub.sent
        else:
            weights, ids = routing
            if not (ub.routed and routable(weights, ids, ub)):
                # Not prepared, or not as the frame needs it.
                return self.send_hidden(layer_id, ubatch_id, h, routing=routing)
            status = C.step_calls_post(calls, ubatch_id, layer_id, src, weights.data_ptr(),
                                       ids.data_ptr())
            sent = ub.routed
        if status:
            self._not_sent(0, status, layer_id, ubatch_id, "hidden states")
            return self.send_hidden(layer_id, ubatch_id, h, routing=routing)
        self.bytes_sent += sent
        self.fast_calls += 1
        step.posted[ubatch_id] = layer_id

    def recv_call(self, layer_id: int, ubatch_id: int,
                  out: torch.Tensor | None = None) -> torch.Tensor:
        step = self._steps.get(0)
        if step is None or step.posted.pop(ubatch_id, None) != layer_id:  # the general way
            return self.recv_output(layer_id, ubatch_id, out=out)
        calls, C, ubatches = step.prepared
        ub = ubatches[ubatch_id]
        # What the copy into `out` needs (as send_call's checks, made here
        # while the FFN computes); fp8 is unpacked into host memory by the C
        # call, on a device connector on the device (unstage). The general
        # receive takes any other `out` (None: its buffer's).
        if out is not None and (
                out.dtype == self.dtype and out.nbytes == ub.nbytes and out.is_contiguous()
                and ((on_host := out.is_cpu and self._on_host) or not self.codec.receive_scale_group
                     or ub.unstage is not None)):
            # Counted before, so that nothing stands between the output's
            # arrival and the caller; undone when it does not come.
            self.bytes_received += ub.received
            self.fast_calls += 1
            status = C.step_calls_take(calls, ubatch_id, layer_id, out.data_ptr() if on_host
                                       else self.frames.staged_target(0, ubatch_id))
            if status == 1:
                if not on_host:  # staged: from the slot on the caller's stream
                    unstage = ub.unstage
                    if unstage is None:
                        self.frames.staged_slots(0).read(ubatch_id, self.dtype, ub.shape, out)
                    else:
                        self.codec.decode_staged(self.frames.staged_slots(0), 0, ubatch_id,
                                                 unstage[0], out)
                return out
            self.bytes_received -= ub.received
            self.fast_calls -= 1
            if status < 0:
                self._broken(0, status, What("the output of layer {} ubatch {}", layer_id,
                                             ubatch_id), "payload")
        # The general receive takes over (recv_output: its wait, its errors).
        step.in_flight.append((layer_id, ubatch_id, ub.shape))
        return self.recv_output(layer_id, ubatch_id, out=out)

    # ------------------------------------------------------------- FFN side
    def recv_step(self, peer: int = 0, timeout_s: float | None = None) -> wire.StepHeader:
        header = super().recv_step(peer, timeout_s)
        if not self.is_attention:
            self._prepare(peer, header)
        return header

    # take_call and reply_call hold the C calls' Python inline too: between
    # the hidden states' arrival and the mlp, and between the mlp and the
    # attention side, every line counts.
    def take_call(self, peer: int, layer_id: int, ubatch_id: int) -> "torch.Tensor | Packed":
        step = self._steps.get(peer)
        if step is None or (prepared := step.prepared) is None or self._failure is not None:
            return self.recv_hidden(peer, layer_id, ubatch_id, defer=True)
        calls, C, ubatches = prepared
        ub = ubatches[ubatch_id]
        view = ub.view  # a host FFN's: where its hidden states are taken
        target = ub.into if view is not None else self.frames.staged_target(peer, ubatch_id)
        # The receive's bookkeeping as if it will succeed (undone below when it
        # does not): after the receive, only the return stands between it and
        # the next mlp.
        awaiting, routings = step.awaiting, step.routings
        awaiting[ubatch_id] = (layer_id, ub.shape)
        routings[ubatch_id] = None
        self.bytes_received += ub.received
        self.fast_calls += 1
        status = C.step_calls_take(calls, ubatch_id, layer_id, target)
        if status == 1 and view is not None:
            return view  # the common case first: the next mlp waits on this path
        if status > 0:
            if status == 2:  # the routed frame: its routing stays in the payload
                routings[ubatch_id] = ub.routing
                self.bytes_received += ub.routed - ub.received
            unstage = ub.unstage
            if unstage is not None and unstage[status - 1] is not None:
                # A device's fp8 or routed frame: decoded there (the routing
                # viewed in the device's copy of the payload).
                h, routings[ubatch_id] = self.codec.decode_staged(
                    self.frames.staged_slots(peer), peer, ubatch_id, unstage[status - 1])
                return h
            # On a device: copied from the slot on this side's stream.
            return view if view is not None else self.frames.staged_slots(peer).read(
                ubatch_id, self.dtype, ub.shape)
        del awaiting[ubatch_id]
        del routings[ubatch_id]
        self.bytes_received -= ub.received
        self.fast_calls -= 1
        if status < 0:
            self._broken(peer, status, What("the hidden states of layer {} ubatch {}",
                                            layer_id, ubatch_id), "payload")
        # Not the expected frame (or none in time): the general receive.
        return self.recv_hidden(peer, layer_id, ubatch_id, defer=True)

    def reply_call(self, peer: int, layer_id: int, ubatch_id: int, out: torch.Tensor) -> None:
        step = self._steps.get(peer)
        prepared = None if step is None else step.prepared
        awaited = None if prepared is None else step.awaiting.get(ubatch_id)
        if awaited is None or awaited[0] != layer_id or self._failure is not None:
            return super().reply_call(peer, layer_id, ubatch_id, out)
        calls, C, ubatches = prepared
        ub = ubatches[ubatch_id]
        # The checks inline (see send_call): this is the path from the mlp to
        # the attention side.
        if not (out.dtype == self.dtype and out.nbytes == ub.nbytes and out.is_contiguous()):
            return super().reply_call(peer, layer_id, ubatch_id, out)
        if out.is_cpu and self._on_host:
            src = out.data_ptr()
        elif self.codec.send_scale_group:  # fp8: packed on the device, then staged
            if self._on_host:  # a device tensor on a host connector: the general way
                return super().reply_call(peer, layer_id, ubatch_id, out)
            src = self.frames.staged_source(peer, ubatch_id,
                                            self.codec.encode(peer, ubatch_id, out, None))
        else:
            src = self.frames.staged_source(peer, ubatch_id, out)
        status = C.step_calls_post(calls, ubatch_id, layer_id, src)
        if status:
            self._not_sent(peer, status, layer_id, ubatch_id, "output")
            return super().reply_call(peer, layer_id, ubatch_id, out)
        # Sent: the bookkeeping now, while the attention side computes.
        self.bytes_sent += ub.sent
        self.fast_calls += 1
        del step.awaiting[ubatch_id]
        step.routings.pop(ubatch_id, None)

    def take_reply_send_s(self, peer: int) -> float:
        return self._prepared_send_s(peer) + super().take_reply_send_s(peer)
