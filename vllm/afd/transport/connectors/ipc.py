# SPDX-License-Identifier: Apache-2.0
# SPDX-FileCopyrightText: Copyright contributors to the vllm-afd project
"""The device-resident connector: layer calls through each other's device
memory (../ipc/), step headers and the handshake through shm's ring.

Per attention peer, each side owns one region on its device (../ipc/memory.py:
CUDA memory handed over as a CUDA IPC handle, or on the CPU a shared-memory
file) and maps the other's: a layer call is the exchange's post (into the
peer's slot, record and flag) and take (a wait on this side's own flag), with
no message and no host on the way on CUDA (NEVER RUN ON A GPU YET: the
kernels are compiled, tools/testing/gpu_check's `ipc` check is their first
run). What the FFN host must know travels once per step: the StepHeader on
shm's ring, which also begins the step on both sides' exchanges (its step id
is then checked against every call's record on the device).

The handshake: the attention side's Hello carries its region's handle and
layout (IpcHello), the FFN maps it while it checks the Hello (a refusal names
why: another device kind, a region it cannot map) and answers with its own
(IpcAck); the attention side maps that or refuses the ack. Each side unlinks
its region's name once the other has mapped it.

A dead peer never holds a take: a watcher thread per connector sees the shm
socket hang up and releases the exchange (the take returns, the rest of the
step does nothing); a take also ends at timeout_s. An aborted take is the
link's error as on every connector (a closed peer, a timeout, a record of
another step), so the attention link's failover serves the step elsewhere.

Payloads are the codec's (codec.py): exact hidden states copied into the
peer's slot, fp8 and routing packed straight into it (the pack kernel writes
the peer's memory; the post then only publishes); each call's record carries
the routing width, since dense and MoE layers alternate.

The attention side's host never waits on a call's outcome (checks_per_step):
its takes enqueue and return, an aborted one leaving its output unwritten
and the rest of the step doing nothing; check_step reads the step's abort
word once, after its last call (on CUDA the step's one synchronization),
and raises the link error the call met. The link then runs the step again
whole on another member (AttentionLink.run_step): outputs computed after
an abort are not the model's, so a step is never resumed mid-way. The FFN
side checks each take (its host reads the call's routing width anyway).

Not yet: FFN groups (expect_output False), the stream-wait variant,
per-step accounting for FULL CUDA graphs (graph_capturable is False: the
attention role lowers FULL to piecewise, as with shm), the FFN's graphs.
"""

import logging
import threading
import time

import msgspec
import torch

from vllm.afd.transport import wire
from vllm.afd.transport.connectors.codec import Packed
from vllm.afd.transport.connectors.shm import ShmConnector
from vllm.afd.transport.errors import AFDConnectionError, LinkClosed, LinkTimeout, What
from vllm.afd.transport.ipc.calls import Exchange
from vllm.afd.transport.ipc.layout import (ABORT_REASONS, ABORT_RELEASED, ABORT_TIMEOUT,
                                           NOT_ABORTED, Layout, Region)
from vllm.afd.transport.ipc.memory import Control, OwnRegion, open_peer
from vllm.afd.transport.ipc.op_stream import OpStream
from vllm.afd.transport.wire import ErrorFrame, ProtocolError, StepHeader

logger = logging.getLogger(__name__)

WATCH_INTERVAL_S = 0.05  # how often the watcher looks for a hung-up peer
ERROR_TEXT_WAIT_S = 1.0  # after a failure record, for the error's text on the ring


class IpcHello(msgspec.Struct):
    """Hello.transport for ipc: the attention side's region."""

    device: str
    num_ubatches: int
    slot_bytes: int
    handle: bytes


class IpcAck(msgspec.Struct):
    """HelloAck.transport for ipc: shm's ring segments and the FFN's region."""

    shm: bytes
    handle: bytes


class IpcConnector(ShmConnector):
    name = "ipc"
    stages_through_host = False  # payloads stay on the device: both peers on one kind
    checks_per_step = True  # the attention side's takes never make its host wait
    device_types = ("cpu", "cuda")  # the CPU as the device too (../ipc/memory.py)
    extra_config_keys = frozenset({"notify", "spin_us"})
    """notify: "unix" (default) or "tcp", as for shm: the socket of the
    rendezvous, the handshake and the step headers' wake-ups.

    spin_us: as for shm, how long a side waiting for a step header spins on
    the ring before it sleeps (layer calls always poll the exchange's flag,
    then yield the core)."""

    def __init__(self, afd_config, **kwargs) -> None:
        super().__init__(afd_config, **kwargs)
        if self.device.type not in ("cpu", "cuda"):
            raise ValueError(f"the ipc AFD connector runs on cpu or cuda, not {self.device}")
        # Per peer: the region this side owns, the peer's as mapped here, their
        # layout (the attention side's choice), then the exchange over them.
        self._own: dict[int, OwnRegion] = {}
        self._mapped: dict[int, torch.Tensor] = {}
        self._layouts: dict[int, Layout] = {}
        self.exchanges: dict[int, Exchange] = {}
        self._watcher: threading.Thread | None = None
        self._watch_stop = threading.Event()

    def _prepared_enabled(self) -> bool:
        return False  # layer calls go through the exchange, never the ring

    # --------------------------------------------------------------- handshake
    def _hello_transport(self) -> bytes:
        if not self.is_attention:  # the FFN builds a Hello only to compare with one
            return b""
        layout = self._layouts[0] = Layout(self.num_ubatches, self.codec.max_bytes)
        self._drop_regions(0)  # a retried handshake
        own = self._own[0] = OwnRegion(self.device, layout.total)
        return msgspec.msgpack.encode(IpcHello(
            device=self.device.type, num_ubatches=layout.num_ubatches,
            slot_bytes=layout.slot_bytes, handle=own.handle))

    def _transport_problems(self, peer: int, hello_transport: bytes) -> list[str]:
        try:
            hello = msgspec.msgpack.decode(hello_transport, type=IpcHello)
        except msgspec.DecodeError as e:
            return [f"Hello.transport (ipc): {e}"]
        if hello.device != self.device.type:
            return [f"ipc: the attention server's region is {hello.device} memory, this FFN "
                    f"server runs on {self.device.type}: use connector 'shm' or 'tcp'"]
        limit = self.codec.max_bytes
        if not (1 <= hello.num_ubatches <= self.num_ubatches and 0 < hello.slot_bytes <= limit):
            return [f"ipc layout: expected at most {self.num_ubatches} micro-batches of at most "
                    f"{limit} bytes, received {hello.num_ubatches} of {hello.slot_bytes}"]
        layout = Layout(hello.num_ubatches, hello.slot_bytes)
        try:
            mapped = open_peer(self.device, hello.handle, layout.total)
        except ValueError as e:
            return [f"ipc: this FFN server cannot map the attention server's memory ({e}); "
                    f"use connector 'shm' or 'tcp'"]
        self._layouts[peer], self._mapped[peer] = layout, mapped
        return []

    def _ack_transport(self, peer: int, hello_transport: bytes) -> bytes:
        shm = super()._ack_transport(peer, b"")
        own = self._own[peer] = OwnRegion(self.device, self._layouts[peer].total)
        return msgspec.msgpack.encode(IpcAck(shm=shm, handle=own.handle))

    def _on_refused(self, peer: int) -> None:
        super()._on_refused(peer)
        self._drop_regions(peer)

    def _on_ack(self, ack_transport: bytes) -> None:
        try:
            ack = msgspec.msgpack.decode(ack_transport, type=IpcAck)
        except msgspec.DecodeError as e:
            raise ProtocolError(f"HelloAck.transport (ipc): {e}") from None
        super()._on_ack(ack.shm)
        try:
            self._mapped[0] = open_peer(self.device, ack.handle, self._layouts[0].total)
        except ValueError as e:
            raise ProtocolError(f"ipc: {self.me} cannot map the FFN server's memory ({e}); use "
                                f"connector 'shm' or 'tcp'") from None

    def _on_confirmed(self, peer: int) -> None:
        super()._on_confirmed(peer)
        own, layout = self._own[peer], self._layouts[peer]
        own.unlink()  # the peer has mapped it: nothing left to leak
        exchange = Exchange(self.role, OpStream(self.device), Control.on(self.device),
                            Region(own.memory, layout), Region(self._mapped[peer], layout),
                            self.timeout_s)
        exchange.set_mode(True)
        self.exchanges[peer] = exchange
        if self._watcher is None:
            self._watcher = threading.Thread(target=self._watch, name="afd-ipc-watch",
                                             daemon=True)
            self._watcher.start()

    def _watch(self) -> None:
        """Release the exchanges once a peer hangs up (or this side closes):
        a connector that lost a peer fails as a whole (an FFN server gives each
        peer a session of its own)."""
        while not self._watch_stop.wait(WATCH_INTERVAL_S):
            if self.peer_closed():
                break
        for exchange in list(self.exchanges.values()):
            exchange.release()

    def report_error(self, text: str) -> None:
        """The error's text on the ring, then a failure record for every call
        the FFN owes an answer: the attention side's take ends at once and
        reads the text (not at its deadline)."""
        super().report_error(text)
        if not self.is_attention:
            for exchange in list(self.exchanges.values()):
                exchange.fail()

    # ------------------------------------------------------------ the steps
    def send_step(self, header: StepHeader) -> None:
        super().send_step(header)
        if not (header.is_goodbye or header.is_shutdown):
            self._live_exchange(0).begin_step(header.step_id)

    def recv_step(self, peer: int = 0, timeout_s: float | None = None) -> StepHeader:
        header = super().recv_step(peer, timeout_s)
        if not (header.is_goodbye or header.is_shutdown):
            self._live_exchange(peer).begin_step(header.step_id)
        return header

    # ------------------------------------------------------- the layer calls
    # The protocol's four calls, through the exchange; the step channel's
    # (send_call, recv_call, take_call, reply_call) come here too, prepared
    # calls being off. Payloads in the codec's format (codec.py): exact hidden
    # states as they are, fp8 and routing packed straight into the peer's slot
    # (_send_slot); the record says how many experts' routing came with a call.
    def send_hidden(self, layer_id: int, ubatch_id: int, h: torch.Tensor,
                    expect_output: bool = True, routing=None) -> None:
        self._require("attention")
        if not expect_output:
            raise ValueError(f"{self.me}: the ipc connector answers every call (FFN groups "
                             f"need connector 'shm' or 'tcp')")
        step = self._checked_step(0, ubatch_id)
        rows = step.header.num_tokens[ubatch_id]
        what = What("hidden states of layer {} ubatch {}", layer_id, ubatch_id)
        self._check_here(h, [rows, self.hidden_size], what)
        topk = 0
        if routing is not None:
            self._check_routing(routing, rows, What("routing of layer {} ubatch {}", layer_id,
                                                    ubatch_id))
            topk = self.routing_topk
        self._post(0, layer_id, ubatch_id, h, routing, rows, topk)

    def recv_output(self, layer_id: int, ubatch_id: int,
                    out: torch.Tensor | None = None) -> torch.Tensor:
        self._require("attention")
        step = self._checked_step(0, ubatch_id)
        what = What("the output of layer {} ubatch {} of step {}", layer_id, ubatch_id,
                    step.header.step_id)
        rows = step.header.num_tokens[ubatch_id]
        if out is not None:
            self._check_here(out, [rows, self.hidden_size], what)
        result, _ = self._take(0, step, layer_id, ubatch_id, what, out)
        return result

    def check_step(self) -> None:
        self._require("attention")
        step = self._steps.get(0)
        if step is not None:
            self._check_outcome(0, What("step {}", step.header.step_id))

    def recv_hidden(self, peer: int, layer_id: int, ubatch_id: int, *,
                    defer: bool = False) -> "torch.Tensor | Packed":
        self._require("ffn", peer)
        step = self._checked_step(peer, ubatch_id)
        what = What("the hidden states of layer {} ubatch {} of step {}", layer_id, ubatch_id,
                    step.header.step_id)
        h, routing = self._take(peer, step, layer_id, ubatch_id, what, None, defer)
        step.awaiting[ubatch_id] = (layer_id, [step.header.num_tokens[ubatch_id],
                                               self.hidden_size])
        step.routings[ubatch_id] = routing
        return h

    def send_output(self, peer: int, layer_id: int, ubatch_id: int, out: torch.Tensor) -> None:
        self._require("ffn", peer)
        step = self._checked_step(peer, ubatch_id)
        awaited = step.awaiting.get(ubatch_id)
        if awaited is None or awaited[0] != layer_id:
            raise ValueError(f"{self.me}: send_output(layer {layer_id}, ubatch {ubatch_id}) "
                             f"to {self.peer_name(peer)} without its hidden states")
        self._check_here(out, awaited[1], What("output of layer {} ubatch {}", layer_id,
                                                ubatch_id))
        self._post(peer, layer_id, ubatch_id, out, None, awaited[1][0], 0)
        del step.awaiting[ubatch_id]
        step.routings.pop(ubatch_id, None)

    def _send_slot(self, peer: int, ubatch_id: int, nbytes: int,
                   device: torch.device) -> torch.Tensor | None:
        return self._live_exchange(peer).peer_slot(ubatch_id, nbytes)

    def _post(self, peer: int, layer_id: int, ubatch_id: int, t: torch.Tensor, routing,
              rows: int, topk: int) -> None:
        exchange = self._live_exchange(peer)
        exchange.check_post(ubatch_id, layer_id)  # before anything is packed into its slot
        payload = self.codec.encode(peer, ubatch_id, t, routing)
        exchange.post(ubatch_id, layer_id, payload, rows=rows, topk=topk)
        self.bytes_sent += payload.nbytes

    def _take(self, peer: int, step, layer_id: int, ubatch_id: int, what: What,
              out: torch.Tensor | None, defer: bool = False):
        """The call's payload, decoded (codec.py) from this side's slot: into
        out, or a view of the slot (fp8 hidden states unpacked, or still packed
        with defer). The FFN side checks the take's outcome and reads the
        routing width it carries; the attention side's replies carry none, and
        its outcome waits for check_step."""
        exchange = self._live_exchange(peer)
        rows = step.header.num_tokens[ubatch_id]
        exchange.take(ubatch_id, layer_id, torch.uint8, (0,), rows=rows)
        topk = 0
        if not self.is_attention:
            self._check_outcome(peer, what)
            topk = exchange.taken_topk(ubatch_id) if self.routing_topk else 0
        if topk not in (0, self.routing_topk):
            raise self._fail(ProtocolError(f"from {self.peer_name(peer)}, {what}: routing of "
                                           f"{topk} experts, expected 0 or "
                                           f"{self.routing_topk}"))
        frame = wire.frame_of(self.dtype, [rows, self.hidden_size], step_id=step.header.step_id,
                              layer_id=layer_id, ubatch_id=ubatch_id, topk=topk,
                              scale_group=self.codec.receive_scale_group)
        raw = exchange.local.payload(ubatch_id, torch.uint8, (frame.nbytes,))
        self.bytes_received += frame.nbytes
        return self.codec.decode(peer, frame, self.dtype, raw, out, defer)

    # ------------------------------------------------------------- internals
    def _live_exchange(self, peer: int) -> Exchange:
        exchange = self.exchanges.get(peer)
        if exchange is None or self._failure is not None:
            self._require(self.role)  # raises why: an earlier error, not connected
            raise AFDConnectionError(f"{self.me}: the exchange is closed")
        return exchange

    def _check_here(self, t: torch.Tensor, shape: list[int], what: What) -> None:
        """Our caller's tensor: the shape and dtype, and on this connector's
        device (the exchange's kernels read it there)."""
        self._check_local(t, shape, what)
        if t.device != self.device:
            raise ValueError(f"{self.me}: {what} is on {t.device}; the ipc connector moves "
                             f"tensors of {self.device}")

    def _checked_step(self, peer: int, ubatch_id: int):
        step = self._steps.get(peer)
        if step is None:
            raise ValueError(f"{self.me}: a layer call before the step's header")
        if not 0 <= ubatch_id < len(step.header.num_tokens):
            raise ValueError(f"{self.me}: ubatch {ubatch_id} is not in step "
                             f"{step.header.step_id} ({len(step.header.num_tokens)} ubatches)")
        return step

    def _check_outcome(self, peer: int, what: What) -> None:
        """The exchange's outcome so far (the FFN side: after each take; the
        attention side: once per step, check_step): on the CPU the takes have
        run (host memory, no cost); on CUDA abort_code() synchronizes the
        stream first."""
        code = self.exchanges[peer].abort_code()
        if code == NOT_ABORTED:
            return
        outcome = ABORT_REASONS.get(code, f"abort code {code}")
        if code == ABORT_RELEASED:
            error = LinkClosed("released: the peer hung up" if not self._closed else "closing")
            raise self._link_error(error, self.peer_name(peer), what, "receive") from None
        if code == ABORT_TIMEOUT:
            raise self._link_error(LinkTimeout(outcome), self.peer_name(peer), what,
                                   "receive") from None
        # A record of another step or layer: the peer's failure record after
        # its error's text (report_error), or a protocol error.
        label = self.peer_name(peer)
        try:
            data, _ = self._receive(peer, time.monotonic() + ERROR_TEXT_WAIT_S, lambda: None)
            message = wire.decode(data, source=label)
        except (LinkTimeout, LinkClosed, ProtocolError):
            message = None  # no text came: the mismatch is the error
        if isinstance(message, ErrorFrame):
            raise self._peer_failed(label, what, message)
        raise self._fail(ProtocolError(f"from {label}, {what}: {outcome}"))

    def _drop_regions(self, peer: int) -> None:
        own = self._own.pop(peer, None)
        if own is not None:
            own.unlink()
        self._mapped.pop(peer, None)

    def _close_transport(self) -> None:
        self._watch_stop.set()
        for exchange in list(self.exchanges.values()):
            exchange.release()  # a take still waiting returns
        watcher = self._watcher
        if watcher is not None and watcher is not threading.current_thread():
            watcher.join(timeout=1.0)
        super()._close_transport()
        for peer in list(self._own) + list(self._mapped):
            self._drop_regions(peer)
        self.exchanges.clear()

