# SPDX-License-Identifier: Apache-2.0
# SPDX-FileCopyrightText: Copyright contributors to the vllm-afd project
"""The attention role's end of the link. Data plane: imports nothing from vLLM.

The runner drives it through an explicit step API:

    link.begin_step(StepPlan(num_tokens=[n0, n1], kind="real", device=ctx))
    link.exchange(layer, hidden_states, out)      # per layer and micro-batch
    link.end_step()

`begin_step` names the run: "real" steps talk to the FFN; "profile", "warmup"
and "capture" runs never touch the link and never wait for an FFN (their
exchanges write zeros into `out`). Nothing is guessed from other state. A real
step announces itself (StepHeader) to the FFN rank and its tensor/expert
parallel group; each exchange sends the hidden states and receives the FFN's
output into the caller's `out`, ordered on the caller's stream. Inside a
micro-batch ping-pong (pingpong.py) the exchange passes the turn between its
send and its receive, so another micro-batch's attention overlaps the FFN.

The connection is kept by a supervisor thread (which enters the device the
link was built for): it dials the FFN rank, retries with backoff while the FFN
is not there or refuses us, and reconnects when a step loses it. A step never
waits for a connection once the link was up: while the link is not up, or when
it breaks mid-step, the step raises AFDLinkDown at once (the vLLM adapter fails
the step's requests and keeps serving). The state and counters are published
(status.py) for the API server's /health and /metrics.
"""

import logging
import os
import threading
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

import torch

from vllm.afd.attention import pingpong
from vllm.afd.attention import status as link_status
from vllm.afd.observability.metrics import LATENCY_BUCKETS_S, Histogram
from vllm.afd.observability.stats import LinkStats, now
from vllm.afd.transport.config import LinkConfig
from vllm.afd.transport.connectors.registry import create_connector
from vllm.afd.transport.device import DeviceContext
from vllm.afd.transport.errors import AFDLinkDown, error_kind
from vllm.afd.transport.wire import ProtocolError, Routing, StepHeader

logger = logging.getLogger(__name__)

# Between connection attempts after a failure (an attempt itself dials for up
# to timeout_s, retrying every 0.05-0.5 s).
RECONNECT_BACKOFF_S = (0.5, 5.0)
PUBLISH_INTERVAL_S = 1.0

# What a step is, as the runner names it.
REAL, PROFILE, WARMUP, CAPTURE = "real", "profile", "warmup", "capture"
STEP_KINDS = (REAL, PROFILE, WARMUP, CAPTURE)


@dataclass(frozen=True)
class StepPlan:
    """One forward pass, as the runner describes it to the link."""

    num_tokens: tuple[int, ...] = ()  # per micro-batch (real steps)
    kind: str = REAL
    device: DeviceContext | None = field(default=None, compare=False)

    def __post_init__(self) -> None:
        if self.kind not in STEP_KINDS:
            raise ValueError(f"StepPlan.kind: {self.kind!r} is not one of {STEP_KINDS}")
        if self.kind == REAL and not self.num_tokens:
            raise ValueError("StepPlan: a real step needs its tokens per micro-batch")

    @property
    def is_real(self) -> bool:
        return self.kind == REAL


class AttentionLink:
    def __init__(self, config: LinkConfig, *, hidden_size: int, dtype: torch.dtype,
                 max_tokens: int, rank: int = 0, fingerprint: dict[str, str] | None = None,
                 device: DeviceContext | None = None,
                 connector_kwargs: dict[str, Any] | None = None,
                 on_thread: Callable[[str, DeviceContext], None] | None = None):
        self.config = LinkConfig.of(config)
        self.hidden_size = hidden_size
        self.dtype = dtype
        self.max_tokens = max_tokens
        self.rank = rank
        self.fingerprint = dict(fingerprint or {})
        # Where the supervisor connects (nccl sets up on this device).
        self.device = device or DeviceContext("cpu")
        self.connector_kwargs = dict(connector_kwargs or {})
        self._on_thread = on_thread  # tests: which context each thread entered
        self.layers: list[int] = []
        self.routing_topk = 0  # experts per token of the routed layers (0: none)
        self.step_id = 0
        self.plan: StepPlan | None = None  # the step in progress
        self.dummy_runs: dict[str, int] = {}  # runs per kind that never touched the link
        self.connector = None  # the FFN rank that answers (its group's lead)
        self.followers: list = []  # the other ranks of its group: they only listen
        self.stats = LinkStats()
        self.round_trip = Histogram(LATENCY_BUCKETS_S)
        ffn_rank = rank % self.config.num_ffn_ranks
        self.peer = (f"FFN rank {ffn_rank} ({self.config.connector} "
                     f"{self.config.host_of(ffn_rank)}:{self.config.port + ffn_rank})")
        self.state = link_status.STARTING
        self.since = time.time()
        self.last_error: str | None = None
        self.errors: dict[str, int] = {}
        self.connects = 0
        self._bytes_closed = [0, 0]  # sent, received by connectors already closed
        self._step_start = 0.0
        self._step_calls_left = 0
        self._lock = threading.Lock()
        self._state_changed = threading.Condition(self._lock)
        self._publish_lock = threading.Lock()
        self._wake = threading.Event()
        self._closed = threading.Event()
        self._connecting: list = []  # connectors being connected: close() interrupts them
        self._thread: threading.Thread | None = None
        self._last_logged = ""

    def add_layer(self, layer_idx: int, routing_topk: int = 0) -> None:
        """Register a remote layer; routing_topk > 0: it sends routing that wide."""
        if layer_idx not in self.layers:
            self.layers.append(layer_idx)
            self.layers.sort()
        self.routing_topk = max(self.routing_topk, routing_topk)

    # ----------------------------------------------------------- supervision
    def start(self) -> None:
        """Start keeping the connection (after the model registered its layers)."""
        with self._lock:
            if self._thread is not None or self._closed.is_set():
                return
            self._thread = threading.Thread(target=self._supervise, name="afd-link",
                                            daemon=True)
            self._thread.start()

    def _supervise(self) -> None:
        with self.device.entered() as context:
            if self._on_thread is not None:
                self._on_thread("afd-link", context)
            self._supervise_loop()

    def _supervise_loop(self) -> None:
        backoff = RECONNECT_BACKOFF_S[0]
        while not self._closed.is_set():
            if self.connector is None:
                with self._lock:
                    if self.state == link_status.STARTING:
                        self._set_state(link_status.CONNECTING)
                self._publish()
                try:
                    lead, followers = self._connect()
                except Exception as e:  # noqa: BLE001 - kept as the link's state
                    if self._closed.is_set():
                        break
                    refused = isinstance(e, ProtocolError)
                    with self._lock:
                        self._count_error(e)
                        self._set_state(
                            link_status.REFUSED if refused else
                            link_status.DOWN if self.connects else link_status.CONNECTING,
                            error=f"{type(e).__name__}: {e}")
                    # The same failure again (an FFN still down or still
                    # mismatched) is logged once, then at debug level.
                    repeated = str(e) == self._last_logged
                    self._last_logged = str(e)
                    (logger.debug if repeated else logger.error if refused else logger.warning)(
                        "AFD attention rank %d: no link to %s: %s; retrying every %.0f-%.0fs",
                        self.rank, self.peer, e, *RECONNECT_BACKOFF_S)
                    self._publish()
                    self._wake.wait(backoff)
                    self._wake.clear()
                    backoff = min(backoff * 2, RECONNECT_BACKOFF_S[1])
                    continue
                with self._lock:
                    if self._closed.is_set():
                        for c in [lead, *followers]:
                            c.close()
                        break
                    self.connector, self.followers = lead, followers
                    self.connects += 1
                    self._set_state(link_status.READY)
                backoff = RECONNECT_BACKOFF_S[0]
                logger.info("AFD attention rank %d: link to %s is up%s", self.rank, self.peer,
                            f" (reconnect {self.connects - 1})" if self.connects > 1 else "")
            else:
                self._check_idle_peer()
            self._publish()
            self._wake.wait(PUBLISH_INTERVAL_S)
            self._wake.clear()
        self._publish()

    def _check_idle_peer(self) -> None:
        """Between steps nobody reads the link: notice an FFN that went away
        (said goodbye on SIGTERM, or died) so /health says so before the next
        request fails on it."""
        with self._lock:
            if self.plan is not None:
                return  # a step reads the link now and notices by itself
            connectors = ([self.connector] if self.connector is not None else []) \
                + self.followers
            gone = [c for c in connectors if c.peer_closed()]
            if not gone:
                return
            error = f"{gone[0].peer_name(0)} at {gone[0].address} closed the connection"
            self.errors["connection"] = self.errors.get("connection", 0) + 1
            self._set_state(link_status.DOWN, error=error)
            self._drop_connectors()
        logger.warning("AFD attention rank %d: %s; reconnecting", self.rank, error)

    def _connect(self):
        """Connect to the FFN rank and, for a tensor/expert-parallel FFN server,
        every rank of its group (each gets every token; the lead answers)."""
        kwargs = dict(hidden_size=self.hidden_size, dtype=self.dtype,
                      max_tokens=self.max_tokens, rank=self.rank,
                      routing_topk=self.routing_topk, device=self.device.device,
                      **self.connector_kwargs)
        if self.fingerprint:
            kwargs["fingerprint"] = self.fingerprint
        first = create_connector(self.config, **kwargs)
        connectors = {first.ffn_rank: first}
        self._connecting = [first]
        try:
            first.connect()
            for rank in first.ffn_group:
                if rank not in connectors:
                    connectors[rank] = create_connector(self.config, ffn_rank=rank, **kwargs)
                    self._connecting.append(connectors[rank])
                    connectors[rank].connect()
        except BaseException:
            for c in connectors.values():
                c.close()
            raise
        finally:
            self._connecting = []
        lead = connectors.pop(first.ffn_group[0])
        return lead, list(connectors.values())

    def _set_state(self, state: str, error: str | None = None) -> None:
        """Under self._lock."""
        if state != self.state:
            self.state, self.since = state, time.time()
            self._state_changed.notify_all()
        if error is not None:
            self.last_error = error

    def _await_first_connection(self) -> None:
        """Before the link was ever up (offline use, a request racing the
        start), wait for it as a connect would, up to timeout_s; a link that
        was up and is lost, or a refused one, fails at once."""
        deadline = time.monotonic() + self.config.timeout_s
        with self._lock:
            while (self.connector is None and self.connects == 0
                   and self.state in (link_status.STARTING, link_status.CONNECTING)
                   and not self._closed.is_set()):
                remaining = deadline - time.monotonic()
                if remaining <= 0:
                    break
                self._state_changed.wait(remaining)

    def _count_error(self, error: BaseException) -> None:
        kind = error_kind(error)
        self.errors[kind] = self.errors.get(kind, 0) + 1

    def unavailable_reason(self) -> str:
        reason = f"AFD attention rank {self.rank}: the link to {self.peer} is {self.state}"
        if self.last_error:
            reason += f" (last error: {self.last_error})"
        return reason

    # -------------------------------------------------------------- the step
    def begin_step(self, plan: StepPlan) -> None:
        """Start a forward pass. A real step is announced to the FFN (raises
        AFDLinkDown when it is not reachable); other kinds never touch it."""
        if self.plan is not None:
            raise RuntimeError(f"AFD attention rank {self.rank}: begin_step({plan.kind}) "
                               f"while a {self.plan.kind} step is in progress")
        if not plan.is_real:
            self.plan = plan
            self.dummy_runs[plan.kind] = self.dummy_runs.get(plan.kind, 0) + 1
            return
        if len(plan.num_tokens) > self.config.num_ubatches:
            raise ValueError(f"AFD: a step of {len(plan.num_tokens)} micro-batches, but "
                             f"num_ubatches is {self.config.num_ubatches}")
        connector = self.connector
        if connector is None:
            self.start()
            self._await_first_connection()
            connector = self.connector
            if connector is None:
                raise AFDLinkDown(self.unavailable_reason())
        self.step_id += 1
        header = StepHeader(step_id=self.step_id, num_tokens=list(plan.num_tokens))
        try:
            for follower in self.followers:
                follower.send_step(header)
            connector.send_step(header)
        except Exception as e:
            self._lost(e, "the step header", connector)
        self.plan = plan
        self._step_start = now()
        self._step_calls_left = len(self.layers) * len(plan.num_tokens)
        self.stats.tokens += sum(plan.num_tokens) * len(self.layers)

    def exchange(self, layer_idx: int, hidden_states: torch.Tensor, out: torch.Tensor,
                 routing: Routing | None = None, ubatch: int | None = None) -> torch.Tensor:
        """Layer layer_idx's mlp of hidden_states, computed by the FFN server,
        written into out (caller-owned, same shape and dtype). routing: the
        MoE routing (gate_on "attention"). ubatch: the micro-batch; by default
        the ping-pong turn of this thread (0 outside one)."""
        plan = self.plan
        if plan is None:
            raise RuntimeError(f"AFD attention rank {self.rank}: remote FFN layer "
                               f"{layer_idx} called outside a step; the model runner names "
                               f"every forward pass (begin_step)")
        if not plan.is_real:
            out.zero_()  # profile, warm-up and capture runs: shapes only
            return out
        turn = pingpong.current_turn()
        pp, u = turn if turn is not None else (None, 0)
        if ubatch is not None:
            u = ubatch
        connector = self.connector
        if connector is None:  # lost earlier in this step (another micro-batch)
            raise AFDLinkDown(self.unavailable_reason())
        try:
            t0 = now()
            # Every member of an expert-parallel FFN group gets the routing.
            for follower in self.followers:
                follower.send_hidden(layer_idx, u, hidden_states, expect_output=False,
                                     routing=routing)
            connector.send_hidden(layer_idx, u, hidden_states, routing=routing)
            t1 = now()
            if pp is not None:
                pp.yield_turn(u)
            t2 = now()
            connector.recv_output(layer_idx, u, out=out)
            t3 = now()
        except Exception as e:
            if self.connector is not connector:  # another micro-batch already failed
                raise AFDLinkDown(self.unavailable_reason()) from e
            self._lost(e, f"layer {layer_idx} micro-batch {u}", connector)
        stats = self.stats
        stats.send_s += t1 - t0
        stats.wait_s += t3 - t2
        stats.layer_calls += 1
        stats.routed_calls += routing is not None
        self.round_trip.observe(t3 - t0)
        self._step_calls_left -= 1
        return out

    def end_step(self, failed: bool = False) -> None:
        """End the forward pass begun by begin_step. A real step that did not
        finish every exchange (the model failed in between) leaves the FFN
        mid-step: the connection is dropped (the FFN is told) and re-made."""
        plan, self.plan = self.plan, None
        if plan is None or not plan.is_real:
            return
        if self._step_calls_left == 0 and not failed:
            self.stats.steps += 1
            self.stats.step_wall_s += now() - self._step_start
            return
        if self._step_calls_left and self.connector is not None:
            reason = (f"the attention side abandoned step {self.step_id} with "
                      f"{self._step_calls_left} layer call(s) left")
            logger.warning("AFD attention rank %d: %s; reconnecting", self.rank, reason)
            with self._lock:
                for c in [self.connector, *self.followers]:
                    c.report_error(reason)
                self._set_state(link_status.DOWN, error=reason)
                self._drop_connectors()
            self._wake.set()

    def _lost(self, error: BaseException, where: str, connector) -> None:
        """A step lost the FFN: drop the connection, let the supervisor
        reconnect, and fail the step."""
        with self._lock:
            self._count_error(error)
            self._set_state(link_status.DOWN, error=f"{type(error).__name__}: {error}")
            if self.connector is connector:
                self._drop_connectors()
        logger.error("AFD attention rank %d: lost %s at %s of step %d: %s; failing the "
                     "step's requests and reconnecting", self.rank, self.peer, where,
                     self.step_id, error)
        self._wake.set()
        raise AFDLinkDown(f"AFD attention rank {self.rank}: lost the link to {self.peer} at "
                          f"{where} of step {self.step_id}: {error}") from error

    def _drop_connectors(self) -> None:
        connectors = ([self.connector] if self.connector is not None else []) + self.followers
        self.connector, self.followers = None, []
        self._step_calls_left = 0
        for c in connectors:
            self._bytes_closed[0] += c.bytes_sent
            self._bytes_closed[1] += c.bytes_received
            c.close()

    # ------------------------------------------------------------- reporting
    def document(self) -> dict:
        """State and counters, as status.py and metrics read them."""
        connectors = ([self.connector] if self.connector is not None else []) + self.followers
        sent = self._bytes_closed[0] + sum(c.bytes_sent for c in connectors)
        received = self._bytes_closed[1] + sum(c.bytes_received for c in connectors)
        stats = self.stats
        return {"role": "attention", "rank": self.rank, "peer": self.peer,
                "state": self.state, "since": self.since, "last_error": self.last_error,
                "pid": os.getpid(), "connects": self.connects,
                "reconnects": max(0, self.connects - 1), "errors": dict(self.errors),
                "bytes_sent": sent, "bytes_received": received, "steps": stats.steps,
                "layer_calls": stats.layer_calls, "tokens": stats.tokens,
                "dummy_runs": dict(self.dummy_runs),
                "layer_round_trip_seconds": self.round_trip.as_dict()}

    def _publish(self) -> None:
        # Serialized, so an older document never replaces a newer one.
        with self._publish_lock:
            link_status.publish(f"link-a{self.rank}", self.document())

    def close(self) -> None:
        """Say goodbye to the FFN (it then waits for the next attention server)."""
        self._closed.set()
        self._wake.set()
        for c in list(self._connecting):
            c.close()  # interrupts a connect in progress
        with self._lock:
            self._drop_connectors()
            self._set_state(link_status.CLOSED)
        if self._thread is not None and self._thread is not threading.current_thread():
            self._thread.join(timeout=5)
        self._publish()
