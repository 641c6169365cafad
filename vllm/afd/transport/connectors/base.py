# SPDX-License-Identifier: Apache-2.0
# SPDX-FileCopyrightText: Copyright contributors to the vllm-afd project
"""AFDConnector: how an attention rank and its FFN server exchange hidden states.

One connector object per rank and role:

- the per-role protocol, its methods: attention_side.py (send_step,
  send_hidden, recv_output, the step channel's send_call/recv_call) and
  ffn_side.py (recv_step, recv_hidden, routing, send_output, take_call/
  reply_call);
- the transport hooks a concrete connector implements (hooks.py): shm, tcp,
  loopback, nccl, or any registered one;
- objects it holds: self.handshake (../handshake.py: the handshake and
  authentication, their counters), self.codec (codec.py: how payloads become
  bytes) and self._steps (peer_step.py: each peer's current step).

This file holds what they share: construction, lifecycle, and the message
helpers every check goes through.

Routing (AFDConfig.gate_on == "attention"): a connector built with
routing_topk=k > 0 lets the attention side pass the MoE router's decision with
the hidden states, send_hidden(layer, u, h, routing=wire.Routing(weights, ids))
(float32 and int32, [tokens, k]; dense layers pass none), in the same payload.
The FFN side still gets h from recv_hidden; routing(peer, u) then returns what
came with it. Both sides must agree on k (Hello.routing_topk).

Devices: a connector is built with the device of its consumer (the attention
rank's hidden states, the FFN worker's weights), never guessed inside a thread.
Received tensors land on that device, or in the caller's `out`, ordered on the
current stream (see ../device.py and ../buffers.py).

Contract shared by every transport (the checks live here, once):
  * Outputs come back in the order hidden states were sent, one in flight per
    micro-batch; each received frame is checked against the expected step,
    layer, micro-batch, dtype and shape before its payload is touched.
  * Received tensors may be transport buffers. Attention side: recv_output's
    tensor (without out) is valid until the next send_hidden on the same
    micro-batch. FFN side: recv_hidden's tensor is valid until send_output on
    the same (peer, micro-batch). Treat them as read-only; copy to keep.
  * Sent tensors may be read after send_* returns (zero-copy sends): do not
    modify them in place before the peer's answer for that micro-batch arrives.
  * Every wait is bounded by timeout_s, except recv_step, which waits for the
    next step as long as the peer is connected (an idle server is not an
    error). A peer that closes, dies or sends garbage raises
    AFDConnectionError / ProtocolError naming the peer and what was awaited;
    a peer's ErrorFrame raises AFDConnectionError with the peer's text.
  * After any error the connector is unusable (the stream may be out of
    sync); the peer is told with an ErrorFrame when possible so it fails
    fast too. close() is idempotent and releases everything.
  * One thread drives a connector, except on the FFN side after connect():
    one thread per peer may then call recv_step / recv_hidden / send_output
    for its own peer (per-peer state is keyed by peer). close() may come from
    any thread to interrupt a blocked connect or receive; the blocked call then
    raises AFDConnectionError ("... was closed ...").

Two ways to be the FFN side:
  * accept() (connect()): wait until every expected attention peer has
    connected, and serve them all through this one connector; a failure of
    one makes it unusable for all. Later knocks are refused (tcp: a
    thread of its own refuses them) while it is connected.
  * Per-peer sessions (what the FFN server's loop uses): listen() once, then
    accept_session() repeatedly on this connector, the listener. Each accepted
    peer gets a fresh connector of the same class and configuration holding
    only that peer's link: its session, driven by its own thread, closed
    alone when that peer leaves or fails. Peers come and go at any time; a
    rank with a live session is refused ("already connected") until it ends.
    The handshake counters and refusals of every session add up on the
    gate's (gate.handshake: failures, auth_failures, refusals, last_refusal).
"""

import logging
import threading
import time
from collections.abc import Collection
from typing import Any

import msgspec
import torch

from vllm.afd.transport import auth, leftovers, wire
from vllm.afd.transport.config import LinkConfig
from vllm.afd.transport.connectors.attention_side import AttentionSide
from vllm.afd.transport.connectors.codec import Packed, PayloadCodec
from vllm.afd.transport.connectors.ffn_side import FFNSide
from vllm.afd.transport.connectors.hooks import TransportHooks
from vllm.afd.transport.connectors.peer_step import PeerStep
from vllm.afd.transport.device import DeviceOps
from vllm.afd.transport.errors import (AFDConnectionError, AFDTimeoutError, LinkClosed,
                                       LinkTimeout, WaitCallback, What)
from vllm.afd.transport.gate import Gate
from vllm.afd.transport.handshake import Handshake
from vllm.afd.transport.wire import ErrorFrame, LayerFrame, ProtocolError, StepHeader

logger = logging.getLogger(__name__)

# Seconds between "still waiting" log lines.
LOG_INTERVAL_S = 5.0
# Best-effort messages on the way out (GOODBYE, ErrorFrame) wait at most this.
FAREWELL_TIMEOUT_S = 1.0


def spin_us_setting(config, default: float) -> float:
    """connector_extra_config["spin_us"]: how long a waiting side spins before
    it sleeps (shm: on the ring, ../shm_ring.py; tcp: on the socket), checked."""
    spin_us = config.connector_extra_config.get("spin_us", default)
    if (isinstance(spin_us, bool) or not isinstance(spin_us, (int, float))
            or not 0 <= spin_us <= 1_000_000):
        raise ValueError(f"AFDConfig.connector_extra_config['spin_us']: invalid value "
                         f"{spin_us!r}; expected microseconds in 0-1000000 (0: never "
                         f"spin, sleep until woken)")
    return spin_us


class AFDConnector(AttentionSide, FFNSide, TransportHooks):
    def __init__(self, config: Any, *, hidden_size: int, dtype: torch.dtype,
                 max_tokens: int, rank: int = 0,
                 fingerprint: dict[str, str] | None = None, ffn_rank: int | None = None,
                 ffn_group: list[int] | None = None, routing_topk: int = 0,
                 device: torch.device | str = "cpu") -> None:
        """config: a LinkConfig (or an AFDConfig, read field by field).
        device: where received tensors go (the consumer's device)."""
        config = LinkConfig.of(config)
        # What a session (accept_session) is built with: this connector's twin.
        self._init_kwargs: dict[str, Any] = dict(
            hidden_size=hidden_size, dtype=dtype, max_tokens=max_tokens, rank=rank,
            fingerprint=fingerprint, ffn_rank=ffn_rank, ffn_group=ffn_group,
            routing_topk=routing_topk, device=device)
        if hidden_size < 1 or max_tokens < 1:
            raise ValueError(f"AFD connector: hidden_size ({hidden_size}) and max_tokens "
                             f"({max_tokens}) must be >= 1")
        if not 0 <= routing_topk <= wire.MAX_TOPK:
            raise ValueError(f"AFD connector: routing_topk ({routing_topk}) is not in 0-"
                             f"{wire.MAX_TOPK}")
        unknown = sorted(set(config.connector_extra_config) - self.extra_config_keys)
        if unknown:
            raise ValueError(f"AFDConfig.connector_extra_config: unknown key(s) {unknown} for "
                             f"connector {self.name!r}; valid keys: "
                             f"{sorted(self.extra_config_keys)}")
        wire.dtype_name(dtype)  # ValueError for dtypes that cannot travel
        ranks = config.num_attention_ranks if config.is_attention else config.num_ffn_ranks
        if not 0 <= rank < ranks:
            raise ValueError(f"AFD connector: {config.role} rank {rank} is not in 0-"
                             f"{ranks - 1}")
        self.afd_config = config  # the LinkConfig (name kept for transports)
        self.role = config.role
        self.rank = rank
        self.hidden_size = hidden_size
        self.dtype = dtype
        self.max_tokens = max_tokens
        self.routing_topk = routing_topk
        self.device = torch.device(device)
        self.ops = DeviceOps(self.device)
        # How payloads become bytes and back (codec.py): the transfer encodings
        # per direction, max_bytes (the largest payload, a full micro-batch
        # with its routing if any, in either), pack and unpack buffers.
        self.codec = PayloadCodec(config, dtype=dtype, hidden_size=hidden_size,
                                  max_tokens=max_tokens, routing_topk=routing_topk,
                                  device=self.device, ops=self.ops, peer_name=self.peer_name,
                                  send_slot=self._send_slot)
        self.timeout_s = config.timeout_s
        self.num_ubatches = config.num_ubatches
        self.fingerprint = dict(fingerprint or {})
        # FFN rank f listens on port + f. Attention rank a talks to FFN rank
        # a % num_ffn_ranks and, when that rank is one of a tensor/expert
        # parallel group (HelloAck.group), to every member of the group
        # (ffn_rank names the member; vllm/afd/topology.py has the rules).
        if self.is_attention:
            self.ffn_rank = rank % config.num_ffn_ranks if ffn_rank is None else ffn_rank
        else:
            self.ffn_rank = rank
        if not 0 <= self.ffn_rank < config.num_ffn_ranks:
            raise ValueError(f"AFD connector: FFN rank {self.ffn_rank} is not in 0-"
                             f"{config.num_ffn_ranks - 1}")
        # FFN side: the ranks of this rank's group, lead first ([rank]: no group).
        # Attention side: filled from the FFN's HelloAck.
        self.ffn_group = list(ffn_group) if ffn_group else [self.ffn_rank]
        self.bytes_sent = 0
        self.bytes_received = 0
        self.me = f"AFD {self.role} rank {rank}"
        self._streams: dict[int, Any] = {}  # peer -> transport link
        self._connected = False
        self._closed = False
        self._failure: str | None = None
        self._closing = threading.Event()  # lets close() interrupt connect()'s waits
        self._gate: Gate | None = None  # FFN side: admits sessions (accept_session)
        self._announced: dict[int, int] = {}  # peer -> payload length of its last message
        self._views: dict[Any, tuple] = {}  # see _typed_view
        # peer -> its current step (peer_step.py; the attention side's peer is 0)
        self._steps: dict[int, PeerStep] = {}
        # The handshake, its shared secret and its counters (../handshake.py):
        # transports whose peers live in other processes prove the secret
        # (authenticates), in-process loopback has nothing to prove.
        self.handshake = Handshake(self, auth.load_secret(config.token_file)
                                   if self.authenticates else None)

    # ----------------------------------------------------------------- identity
    @property
    def is_attention(self) -> bool:
        return self.role == "attention"

    def peer_name(self, peer: int) -> str:
        return f"FFN rank {self.ffn_rank}" if self.is_attention else f"attention rank {peer}"

    def expected_peers(self) -> list[int]:
        """Attention ranks served by this FFN rank (the FFN's `peer` values)."""
        cfg = self.afd_config
        return [a for a in range(cfg.num_attention_ranks)
                if a % cfg.num_ffn_ranks in self.ffn_group]

    @property
    def connected_peers(self) -> list[int]:
        return sorted(p for p in self._streams if p >= 0) if self._connected else []

    # --------------------------------------------------------------- lifecycle
    def connect(self) -> None:
        """Block until the peer(s) are there and the handshake passed; raise
        AFDTimeoutError after timeout_s."""
        if self._closed:
            raise AFDConnectionError(f"{self.me}: connect() after close()")
        if self._connected:
            return
        try:
            self._open(time.monotonic() + self.timeout_s)
        except BaseException:
            self.codec.clear()
            self._close_transport()
            self._streams.clear()
            raise
        self._connected = True
        logger.info("%s connected via %s at %s (peers: %s)", self.me, self.name, self.address,
                    ", ".join(self.peer_name(p) for p in self.connected_peers))

    def accept(self) -> None:
        """The FFN side's connect(): wait for its attention ranks."""
        self.connect()

    # ------------------------------------------- FFN side: per-peer sessions
    def listen(self) -> None:
        """FFN side: start listening for attention peers (once), to take them
        one by one with accept_session(). This connector, the gate, serves no
        peer itself; close() stops listening."""
        if self.is_attention:
            raise ValueError(f"{self.me}: listen() is the FFN side's API")
        if self._closed:
            raise AFDConnectionError(f"{self.me}: listen() after close()")
        leftovers.remove_dead()  # shared memory of AFD processes killed before
        self._listen()
        logger.info("%s listening via %s at %s", self.me, self.name, self.address)

    def accept_session(self, timeout: float,
                       busy: Collection[int] = ()) -> "AFDConnector | None":
        """FFN side, after listen(): wait up to timeout seconds for one
        attention peer admitted by this connector's gate (../gate.py: each
        incoming connection handshaken on a fresh connector of this class and
        configuration, concurrently, each with its own deadline) and return
        that connector, connected to this one peer (its session). None when
        nobody was admitted meanwhile; whoever was refused or dropped was told
        why, logged, and counted here (handshake.failures, .auth_failures,
        .refusals).

        busy: attention ranks with a live session, refused as already
        connected. It is consulted when a Hello arrives: pass a live view
        (a dict's keys()) so a session that ended meanwhile frees its rank."""
        if self._closed:
            raise AFDConnectionError(f"{self.me} was closed while it waited for "
                                     f"attention peers at {self.address}")
        if self._gate is None:
            self._gate = Gate(self)
        session = self._gate.next_session(timeout, busy)
        if session is None and self._closed:
            raise AFDConnectionError(f"{self.me} was closed while it waited for "
                                     f"attention peers at {self.address}")
        return session

    def _accept_expected(self, deadline: float) -> None:
        """accept()'s rendezvous, after _listen(): handshake incoming peers on
        this connector until every expected attention rank is here."""
        expected = self.expected_peers()
        missing = lambda: [p for p in expected if p not in self._streams]  # noqa: E731
        on_wait = self._waiter(f"attention rank(s) {missing()} to connect", deadline,
                               connecting=True)
        while missing():
            remaining = self._wait_budget(
                deadline, f"attention rank(s) {missing()} on {self.address}",
                f"{self.me} waited {self.timeout_s:g}s on {self.address} for attention "
                f"rank(s) {missing()} to connect; is the attention server running with "
                f"the same host, port and connector '{self.name}'?"
                f"{self.handshake.refusal_note()}")
            incoming = self._next_link(min(remaining, LOG_INTERVAL_S))
            if incoming is None:
                on_wait()
                continue
            link, source = incoming
            hello_deadline = min(deadline, time.monotonic() + self._hello_timeout())
            if self.handshake.as_ffn(link, source, hello_deadline) is None:
                link.close()

    def close(self) -> None:
        """Say goodbye to the peers (best effort) and release sockets, buffers
        and shared memory. Idempotent. A gate's sessions are not closed with
        it (each has its own close)."""
        if self._closed:
            return
        self._closed = True
        self._closing.set()
        gate = self._gate
        if gate is not None:
            gate.close()  # interrupts the handshakes in progress
        self.handshake.release_claim()  # a gate's session: its rank may come again
        if self._connected and self._failure is None:
            goodbye = StepHeader(step_id=0, num_tokens=[], flags=wire.GOODBYE)
            self._farewell(goodbye)
        try:
            self.codec.clear()
            self._close_transport()
        finally:
            # self._streams stays: another thread blocked in this connector may
            # still look its link up, and must get a clean error, not a KeyError.
            self._connected = False
            logger.debug("%s closed (sent %d bytes, received %d bytes)", self.me,
                         self.bytes_sent, self.bytes_received)

    def spin_counters(self, peer: int = 0) -> tuple[int, int]:
        """(preempted spins, spin backoffs) of the link to peer so far: waits
        whose spin lost its core, and the times that turned spinning off for a
        while (shm_ring.py). 0, 0 for connectors that do not spin."""
        return 0, 0

    def report_error(self, text: str) -> None:
        """Tell every peer this side hit a fatal error; the connector is then
        unusable. Use it when the model fails mid-step so the peer fails fast,
        with this text."""
        if self._connected and self._failure is None:
            self._farewell(ErrorFrame(text=f"{self.me}: {text}"[:wire.MAX_TEXT]))
        self._failure = self._failure or f"reported error: {text}"

    def __enter__(self) -> "AFDConnector":
        return self

    def __exit__(self, *exc) -> None:
        self.close()

    # ------------------------------------------------------------- internals
    def _require(self, role: str, peer: int | None = None) -> None:
        if self.role != role:
            raise ValueError(f"{self.me}: this is the {role} side's API")
        if self._failure is not None:
            raise AFDConnectionError(f"{self.me} is unusable after an earlier error: "
                                     f"{self._failure}")
        if not self._connected:
            raise AFDConnectionError(f"{self.me}: not connected (call connect() first"
                                     f"{'; it was closed' if self._closed else ''})")
        if peer is not None and peer not in self._streams:
            raise ValueError(f"{self.me}: {self.peer_name(peer)} is not connected "
                             f"(connected: {self.connected_peers})")

    def _check_local(self, t: torch.Tensor, shape: list[int], what: What) -> None:
        """Our own caller's tensors: a mismatch is a bug on this side."""
        if list(t.shape) != shape or t.dtype != self.dtype:
            raise ValueError(f"{self.me}: {what}: expected shape {shape} {self.dtype}, got "
                             f"{list(t.shape)} {t.dtype}")
        if not t.is_contiguous():
            raise ValueError(f"{self.me}: {what} must be contiguous")

    def _wait_budget(self, deadline: float, waited_for: str, timeout_message: str) -> float:
        """Seconds left before deadline in a connect wait; raise if close() was
        called meanwhile or no time is left."""
        remaining = deadline - time.monotonic()
        if self._closing.is_set():
            raise AFDConnectionError(f"{self.me} was closed while it waited for {waited_for}")
        if remaining <= 0:
            raise AFDTimeoutError(timeout_message)
        return remaining

    def _lazy_waiter(self, what: "str | What", label: str,
                     deadline: float | None) -> WaitCallback:
        """_waiter(what from label), built when a transport first calls it."""
        start = time.monotonic()
        built: list[WaitCallback] = []

        def on_wait() -> None:
            if not built:
                built.append(self._waiter(What("{} from {}", what, label), deadline,
                                          start=start))
            built[0]()

        return on_wait

    def _waiter(self, what: "str | What", deadline: float | None,
                connecting: bool = False, start: float | None = None) -> WaitCallback:
        """A callback transports call while blocked, logging every few seconds
        what this side waits for: info while connecting, a warning for a late
        answer, debug for an idle wait without deadline."""
        start = time.monotonic() if start is None else start
        limit = None if deadline is None else deadline - start
        next_log = [LOG_INTERVAL_S]

        def on_wait() -> None:
            waited = time.monotonic() - start
            if waited < next_log[0]:
                return
            next_log[0] = waited + LOG_INTERVAL_S
            budget = f"{waited:.0f}s/{limit:.0f}s" if limit is not None else f"{waited:.0f}s"
            log = (logger.info if connecting else
                   logger.debug if limit is None else logger.warning)
            log("%s waiting for %s at %s (%s)", self.me, what, self.address, budget)

        return on_wait

    def _send_message(self, peer: int, message: wire.Message,
                      payload: torch.Tensor | None = None, *, what: "str | What",
                      deadline: float | None = None) -> None:
        if deadline is None:
            deadline = time.monotonic() + self.timeout_s
        header = wire.encode(message)
        frame = message if isinstance(message, LayerFrame) else None
        try:
            self._transmit(peer, header, frame, payload, deadline)
        except (LinkTimeout, LinkClosed) as e:
            raise self._link_error(e, self.peer_name(peer), what, "send") from None

    def _recv_checked(self, peer: int, kind: type, what: "str | What",
                      deadline: float | None,
                      on_wait: WaitCallback | None = None, peer_label: str | None = None):
        """The next message from peer, which must be of kind (not a payload frame
        unless kind is LayerFrame); its announced payload length is kept in
        self._announced[peer] for _recv_tensor."""
        label = peer_label or self.peer_name(peer)
        if on_wait is None:  # built on the first call only: most messages are waited briefly
            on_wait = self._lazy_waiter(what, label, deadline)
        try:
            data, announced = self._receive(peer, deadline, on_wait)
            self.bytes_received += len(data)
            message = wire.decode(data, source=label)
            if isinstance(message, ErrorFrame):
                raise self._peer_failed(label, what, message)
            if isinstance(message, StepHeader) and message.is_goodbye and kind is not StepHeader:
                raise self._fail(AFDConnectionError(
                    f"{label} closed the connection (goodbye) while {self.me} waited for "
                    f"{what}"), notify=False)
            wire.expect(message, kind, source=label, waiting_for=what)
            if kind is not LayerFrame and announced:
                raise ProtocolError(f"{type(message).__name__} from {label} announced a "
                                    f"payload of {announced} bytes; only LayerFrames carry one")
        except (LinkTimeout, LinkClosed) as e:
            raise self._link_error(e, label, what, "receive") from None
        except ProtocolError as e:
            raise self._fail(e) from None
        self._announced[peer] = announced
        return message

    def _recv_tensor(self, peer: int, what: What, *, step_id: int, layer_id: int,
                     ubatch_id: int, shape: list[int], routing_topk: int = 0,
                     out: torch.Tensor | None = None, defer: bool = False
                     ) -> "tuple[torch.Tensor | Packed, wire.Routing | None]":
        """The checked tensor of the next frame (written into out, if given),
        and the routing it carries (frames may carry routing of width
        routing_topk; 0: none allowed). defer: fp8 hidden states stay packed
        (codec.Packed) for the caller to unpack."""
        deadline = time.monotonic() + self.timeout_s
        frame = self._recv_checked(peer, LayerFrame, what, deadline)
        routing = None
        group = self.codec.receive_scale_group
        try:
            dtype = wire.check_frame(frame, step_id=step_id, layer_id=layer_id,
                                     ubatch_id=ubatch_id, max_bytes=self.codec.max_bytes,
                                     expected_shape=shape, dtype=self.dtype,
                                     routing_topk=routing_topk,
                                     encoding=wire.FP8_E4M3 if group else wire.EXACT,
                                     scale_group=group,
                                     context=What("from {}, {}", self.peer_name(peer), what))
            announced = self._announced.get(peer, 0)
            if frame.topk or frame.scale_group:
                # The transports move bytes; the payload layout is ours (codec.py).
                raw_frame = msgspec.structs.replace(frame, dtype="uint8", shape=[frame.nbytes])
                raw = self._receive_payload(peer, raw_frame, torch.uint8, announced, deadline,
                                            None)
                tensor, routing = self.codec.decode(peer, frame, dtype, raw, out, defer)
            else:
                tensor = self._receive_payload(peer, frame, dtype, announced, deadline, out)
        except ProtocolError as e:
            raise self._fail(e) from None
        except (LinkTimeout, LinkClosed) as e:
            raise self._link_error(e, self.peer_name(peer), what, "payload") from None
        return tensor, routing

    def _peer_failed(self, label: str, what: "str | What", message: ErrorFrame) -> Exception:
        """The connector's exception for the peer's ErrorFrame (it is gone:
        not told back)."""
        return self._fail(AFDConnectionError(
            f"{label} reported a fatal error while {self.me} waited for {what}: "
            f"{message.text}"), notify=False)

    _LINK_ERROR_WORDS = {  # action: (timed out ..., while me ...)
        "send": ("sending {what} to", "was sending {what}"),
        "receive": ("waiting for {what} from", "waited for {what}"),
        "payload": ("receiving the payload of {what} from", "received the payload of {what}"),
    }

    def _link_error(self, error: Exception, label: str, what: "str | What",
                    action: str) -> Exception:
        """The connector's exception for a transport's LinkTimeout/LinkClosed."""
        timed_out, doing = (w.format(what=what) for w in self._LINK_ERROR_WORDS[action])
        if self._closed:  # close() from another thread interrupted the wait
            return AFDConnectionError(f"{self.me} was closed while it {doing}")
        if isinstance(error, LinkTimeout):
            hint = " (peer not reading?)" if action == "send" else ""
            return self._fail(AFDTimeoutError(
                f"{self.me} timed out after {self.timeout_s:g}s {timed_out} {label} at "
                f"{self.address}{hint}"))
        return self._fail(AFDConnectionError(
            f"{label} at {self.address} closed the connection ({error}) while {self.me} "
            f"{doing}"), notify=False)

    def _typed_view(self, key: Any, buffer: torch.Tensor, dtype: torch.dtype,
                    shape: list[int]) -> torch.Tensor:
        """The first bytes of a uint8 transport buffer as a tensor of dtype and
        shape. Cached per key: steps repeat their shapes, and building the view
        costs more than everything else a small message needs. Each call returns
        a fresh alias (detach), so a caller's in-place metadata change (squeeze_,
        resize_) cannot corrupt the cached view."""
        shape = tuple(shape)
        cached = self._views.get(key)
        if (cached is not None and cached[0] is buffer and cached[1] == dtype
                and cached[2] == shape):
            return cached[3].detach()
        nbytes = wire.payload_nbytes(dtype, shape)
        view = buffer[:nbytes].view(dtype).view(shape)
        self._views[key] = (buffer, dtype, shape, view)
        return view.detach()

    def _fail(self, error: Exception, notify: bool = True) -> Exception:
        """Mark the connector unusable and, unless the peer is gone, tell it."""
        if self._failure is None:
            self._failure = f"{type(error).__name__}: {error}"
            if notify and self._connected:
                self._farewell(ErrorFrame(text=f"{self.me}: {self._failure}"[:wire.MAX_TEXT]))
        return error

    def _farewell(self, message: wire.Message) -> None:
        """Best-effort last message to every peer; errors are ignored."""
        header = wire.encode(message)
        for peer in list(self._streams):
            if peer < 0:
                continue
            try:
                self._transmit(peer, header, None, None, time.monotonic() + FAREWELL_TIMEOUT_S)
            except Exception as e:  # the peer may be gone already
                logger.debug("%s: could not send %s to %s: %s", self.me,
                             type(message).__name__, self.peer_name(peer), e)


__all__ = ["AFDConnectionError", "AFDConnector", "AFDTimeoutError", "LinkClosed",
           "LinkTimeout", "What", "WaitCallback", "LOG_INTERVAL_S"]
