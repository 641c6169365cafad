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

The FFN side is a pool of FFN deployments (pool.py; one member without
AFDConfig.ffn_pool), each kept connected by its own supervisor thread (which
enters the device the link was built for): it dials, retries with backoff
while the FFN is not there or refuses us, and reconnects after a loss. A real
step goes to the next ready member (round robin). When that member fails
mid-step, the step is resumed on another ready one (`_fail_over`: a StepHeader
with from_layer, then the layer calls in flight sent again), and the caller
never notices. A step never waits for a connection once the link was up: with
no member ready, at the start or after a failure, it raises AFDLinkDown at
once (the vLLM adapter fails the step's requests and keeps serving). The state
and counters are published (status.py) for the API server's /health and
/metrics.
"""

import logging
import os
import threading
import time
from collections import deque
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

import torch

from vllm.afd.attention import pingpong
from vllm.afd.attention import status as link_status
from vllm.afd.attention.pool import Pool
from vllm.afd.attention.ubatch_rule import UbatchRule
from vllm.afd.observability.metrics import LATENCY_BUCKETS_S, Histogram
from vllm.afd.observability.stats import LinkStats, now
from vllm.afd.transport.config import LinkConfig
from vllm.afd.transport.device import DeviceContext
from vllm.afd.transport.errors import AFDLinkDown
from vllm.afd.transport.wire import ProtocolError, Routing, StepHeader

logger = logging.getLogger(__name__)

PUBLISH_INTERVAL_S = 1.0
LAST_FAILOVERS_KEPT = 64  # failover times kept for /afd/status

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


def _output_like(hidden_states: torch.Tensor) -> torch.Tensor:
    """The output exchange makes when the caller gives none: contiguous, like
    hidden_states (the link writes rows of bytes)."""
    return torch.empty_like(hidden_states, memory_format=torch.contiguous_format)


class AttentionLink:
    def __init__(self, config: LinkConfig, *, hidden_size: int, dtype: torch.dtype,
                 max_tokens: int, rank: int = 0, fingerprint: dict[str, str] | None = None,
                 device: DeviceContext | None = None,
                 connector_kwargs: dict[str, Any] | None = None,
                 on_thread: Callable[[str, DeviceContext], None] | None = None,
                 ubatch_rule: UbatchRule | None = None):
        self.config = LinkConfig.of(config)
        self.hidden_size = hidden_size
        self.dtype = dtype
        self.max_tokens = max_tokens
        self.rank = rank
        self.fingerprint = dict(fingerprint or {})
        # Where the supervisors connect (nccl sets up on this device).
        self.device = device or DeviceContext("cpu")
        self.connector_kwargs = dict(connector_kwargs or {})
        self._on_thread = on_thread  # tests: which context each thread entered
        # Chooses each real step's micro-batch count (the runner asks it); its
        # steps end in end_step. None: the runner's split as configured.
        self.ubatch_rule = ubatch_rule
        self.layers: list[int] = []
        self.routing_topk = 0  # experts per token of the routed layers (0: none)
        self.step_id = 0
        self.plan: StepPlan | None = None  # the step in progress
        self.dummy_runs: dict[str, int] = {}  # runs per kind that never touched the link
        self.stats = LinkStats()
        self._spin_link, self._spin_seen = None, [0, 0]  # see end_step
        self.round_trip = Histogram(LATENCY_BUCKETS_S)
        # Failovers: a member lost mid-step, the step finished on another one.
        self.failovers = 0
        self.resent_calls = 0  # layer calls sent again to the member that took over
        self.failover_time = Histogram(LATENCY_BUCKETS_S)  # error -> the output, resent
        self.last_failovers: deque[float] = deque(maxlen=LAST_FAILOVERS_KEPT)
        self.state = link_status.STARTING
        self.since = time.time()
        self.last_error: str | None = None
        self._member = None  # the pool member of the step in progress
        self._pending: dict[int, tuple] = {}  # ubatch -> (layer, hidden, routing) in flight
        self._done: list[int] = []  # per ubatch: layer calls finished this step
        self._step_start = 0.0
        self._step_calls_left = 0
        # The lead connector whose prepared calls (connectors/step_calls.py) carry
        # this step, armed by begin_step where they apply: a lone lead, shm.
        # _fast: a step of one micro-batch; _fast_ubatches: of more (ping-pong).
        # _fast_lead: either, until end_step reads its times.
        self._fast = self._fast_ubatches = self._fast_lead = None
        self._round_trips: list[float] = []  # into self.round_trip at end_step
        self._lock = threading.Lock()
        self._state_changed = threading.Condition(self._lock)
        self._publish_lock = threading.Lock()
        self._publish_due = False  # a periodic publish left to end_step
        self._wake = threading.Event()
        self._closed = threading.Event()
        self._thread: threading.Thread | None = None
        self.pool = Pool(self.config, rank=rank, device=self.device,
                         connector_kwargs=self._connector_kwargs, lock=self._lock,
                         on_state=self._refresh_state, publish=self._publish,
                         in_step=lambda m: self.plan is not None and self._member is m,
                         on_thread=on_thread)
        ffn_rank = rank % self.config.num_ffn_ranks
        members = self.pool.members
        self.peer = members[0].name if len(members) == 1 and not self.config.ffn_pool_file \
            else f"FFN rank {ffn_rank} (pool: {', '.join(m.endpoint for m in members)})"

    def add_layer(self, layer_idx: int, routing_topk: int = 0) -> None:
        """Register a remote layer; routing_topk > 0: it sends routing that wide."""
        if layer_idx not in self.layers:
            self.layers.append(layer_idx)
            self.layers.sort()
        self.routing_topk = max(self.routing_topk, routing_topk)

    def _connector_kwargs(self) -> dict[str, Any]:
        kwargs = dict(hidden_size=self.hidden_size, dtype=self.dtype,
                      max_tokens=self.max_tokens, routing_topk=self.routing_topk,
                      device=self.device.device, **self.connector_kwargs)
        if self.fingerprint:
            kwargs["fingerprint"] = self.fingerprint
        return kwargs

    @property
    def connector(self):
        """The answering connector of the first ready member (None: none is up)."""
        ready = self.pool.ready_members()
        return ready[0].lead if ready else None

    @property
    def connects(self) -> int:
        return sum(m.connects for m in self.pool.members)

    @property
    def errors(self) -> dict[str, int]:
        merged: dict[str, int] = {}
        for m in self.pool.members:
            for kind, count in m.errors.items():
                merged[kind] = merged.get(kind, 0) + count
        return merged

    # ----------------------------------------------------------- supervision
    def start(self) -> None:
        """Start keeping the connections (after the model registered its layers)."""
        with self._lock:
            if self._thread is not None or self._closed.is_set():
                return
            self._thread = threading.Thread(target=self._supervise, name="afd-link",
                                            daemon=True)
            self._thread.start()
        self.pool.start()

    def _supervise(self) -> None:
        """Publish the state every second and follow ffn_pool_file (each member
        keeps its own connection: pool.py)."""
        with self.device.entered() as context:
            if self._on_thread is not None:
                self._on_thread("afd-link", context)
            while not self._closed.is_set():
                if self.config.ffn_pool_file:
                    self.pool.sync()
                self._publish_tick()
                self._wake.wait(PUBLISH_INTERVAL_S)
                self._wake.clear()
        self._publish()

    def _refresh_state(self) -> None:
        """The link's state from its members' (under self._lock): ready while
        any member is; otherwise the most hopeful of theirs."""
        if not hasattr(self, "pool"):  # the pool's first sync, in __init__
            return
        members = [m for m in self.pool.members if not m.removed]
        states = {m.state for m in members}
        if self._closed.is_set():
            state = link_status.CLOSED
        elif link_status.READY in states:
            state = link_status.READY
        elif link_status.DOWN in states or any(m.connects for m in members):
            state = link_status.DOWN
        elif states and states <= {link_status.REFUSED}:
            state = link_status.REFUSED
        elif link_status.CONNECTING in states:
            state = link_status.CONNECTING
        else:
            state = self.state if self.state != link_status.READY else link_status.DOWN
        errors = [(m.since, m.last_error) for m in members if m.last_error]
        if errors:
            self.last_error = max(errors, key=lambda e: e[0])[1]
        if state != self.state:
            self.state, self.since = state, time.time()
        self._state_changed.notify_all()

    def _await_first_connection(self) -> None:
        """Before the link was ever up (offline use, a request racing the
        start), wait for it as a connect would, up to timeout_s; a link that
        was up and is lost, or a refused one, fails at once."""
        deadline = time.monotonic() + self.config.timeout_s
        with self._lock:
            while (not self.pool.ready_members() and self.connects == 0
                   and self.state in (link_status.STARTING, link_status.CONNECTING)
                   and not self._closed.is_set()):
                remaining = deadline - time.monotonic()
                if remaining <= 0:
                    break
                self._state_changed.wait(remaining)

    def unavailable_reason(self) -> str:
        reason = f"AFD attention rank {self.rank}: the link to {self.peer} is {self.state}"
        if self.last_error:
            reason += f" (last error: {self.last_error})"
        return reason

    # -------------------------------------------------------------- the step
    def begin_step(self, plan: StepPlan) -> None:
        """Start a forward pass. A real step is announced to a ready pool member
        (raises AFDLinkDown when none is reachable); other kinds never touch it."""
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
        with self._lock:
            member = self.pool.next_member()
        if member is None:
            self.start()
            self._await_first_connection()
            with self._lock:
                member = self.pool.next_member()
            if member is None:
                raise AFDLinkDown(self.unavailable_reason())
        self.step_id += 1
        self.plan, self._member = plan, member
        self._pending = {}
        self._done = [0] * len(plan.num_tokens)
        self._step_calls_left = len(self.layers) * len(plan.num_tokens)
        try:
            member.send_step(StepHeader(step_id=self.step_id, num_tokens=list(plan.num_tokens)))
            member.steps += 1
        except Exception as e:
            try:
                self._fail_over(member, e, "the step header")
            except AFDLinkDown:
                self.plan, self._member = None, None
                raise
        self._step_start = now()
        self.stats.tokens += sum(plan.num_tokens) * len(self.layers)
        self._arm_fast(member, plan)

    def _arm_fast(self, member, plan: StepPlan) -> None:
        """A step with a lone lead takes its connector's prepared calls when it
        has them: exchange()'s general path costs more than the link itself on
        a cold cache (benchmarks/notes.md)."""
        self._fast = self._fast_ubatches = self._fast_lead = None
        lead = member.lead if self._member is member else None
        if lead is not None and not member.followers and lead.exchange_prepared():
            if len(plan.num_tokens) == 1:
                self._fast = lead
            else:
                self._fast_ubatches = lead
            self._fast_lead = lead

    def exchange(self, layer_idx: int, hidden_states: torch.Tensor,
                 out: torch.Tensor | None = None, routing: Routing | None = None,
                 ubatch: int | None = None) -> torch.Tensor:
        """Layer layer_idx's mlp of hidden_states, computed by the FFN server,
        written into out (caller-owned, same shape and dtype) and returned.
        out None: a new contiguous tensor like hidden_states, allocated after
        the send, while the FFN computes (on a CPU host's cold cache an
        allocation costs microseconds, on the path both sides wait on when made
        before the call). routing: the MoE routing (gate_on "attention").
        ubatch: the micro-batch; by default the ping-pong turn of this thread
        (0 outside one)."""
        fast = self._fast  # set only inside a real step: the checks below hold
        if fast is not None and not ubatch:
            t0 = now()
            if fast.prepared_send(layer_idx, 0, hidden_states, out, routing):
                # Counted while the FFN computes, undone if the output does not come.
                member = self._member
                self._done[0] += 1
                member.layer_calls += 1
                stats = self.stats
                stats.layer_calls += 1
                stats.routed_calls += routing is not None
                self._step_calls_left -= 1
                if out is None:
                    out = _output_like(hidden_states)
                if fast.prepared_recv(layer_idx, 0, out):
                    elapsed = now() - t0
                    stats.wait_s += elapsed  # end_step moves the send's part to send_s
                    self._round_trips.append(elapsed)
                    return out
                self._done[0] -= 1
                member.layer_calls -= 1
                stats.layer_calls -= 1
                stats.routed_calls -= routing is not None
                self._step_calls_left += 1
                self._fast = None  # the rest of the step takes the general path
                stats.wait_s += now() - t0
                return self._finish_exchange(layer_idx, 0, hidden_states, out, routing, member,
                                             t0, t0, None)
            self._fast = None
        plan = self.plan
        if plan is None:
            raise RuntimeError(f"AFD attention rank {self.rank}: remote FFN layer "
                               f"{layer_idx} called outside a step; the model runner names "
                               f"every forward pass (begin_step)")
        if not plan.is_real:  # profile, warm-up and capture runs: shapes only
            if out is None:
                return torch.zeros_like(hidden_states, memory_format=torch.contiguous_format)
            return out.zero_()
        hidden_states = hidden_states.contiguous()  # sends read its bytes as they lie
        turn = pingpong.current_turn()
        pp, u = turn if turn is not None else (None, 0)
        if ubatch is not None:
            u = ubatch
        member = self._member
        if member is None:  # lost earlier in this step (another micro-batch)
            raise AFDLinkDown(self.unavailable_reason())
        fast = self._fast_ubatches
        if fast is not None:
            done = self._exchange_prepared(fast, member, pp, u, layer_idx, hidden_states, out,
                                           routing)
            if done is not None:
                return done
        where = f"layer {layer_idx} micro-batch {u}"
        # Kept until its output arrives: a failover sends it again (the caller
        # leaves the tensors unchanged until then, as zero-copy sends need).
        self._pending[u] = (layer_idx, hidden_states, routing)
        failed_at = None
        t0 = now()
        try:
            member.send_hidden(layer_idx, u, hidden_states, routing)
        except Exception as e:
            if (isinstance(e, ValueError) and not isinstance(e, ProtocolError)
                    and not self._sendable(hidden_states, u)):
                # The caller's hidden states, refused before anything was sent:
                # not the link's fault, so no failover (each member would
                # refuse them alike, and all would be dropped).
                del self._pending[u]
                raise
            failed_at = now()
            self._fail_over(member, e, where)
        t1 = now()
        if out is None:  # made after the send (see the docstring)
            out = _output_like(hidden_states)
        if pp is not None:
            pp.yield_turn(u)
        return self._finish_exchange(layer_idx, u, hidden_states, out, routing, member, t0,
                                     t1, failed_at)

    def _exchange_prepared(self, fast, member, pp, u: int, layer_idx: int,
                           hidden_states: torch.Tensor, out: torch.Tensor | None,
                           routing: Routing | None):
        """A micro-batched step's layer call through the lead's prepared calls:
        send, pass the turn, receive (into out, made once the turn is back when
        None). None: nothing was sent (the general path sends it). The call
        stays in _pending until its output is in, so a failover while the other
        micro-batches hold the turn sends it again. The send is counted as
        waiting, as the one micro-batch path's: end_step moves the prepared
        sends' own time (take_exchange_send_s) to send_s."""
        self._pending[u] = (layer_idx, hidden_states, routing)
        t0 = now()
        if not fast.prepared_send(layer_idx, u, hidden_states, out, routing):
            self._fast_ubatches = None  # the rest of the step takes the general path
            return None
        stats = self.stats
        stats.wait_s += now() - t0
        if pp is not None:
            pp.yield_turn(u)
        if out is None:
            # Here, not before the send: where the FFN bounds the step it
            # computes this micro-batch meanwhile; elsewhere the attention core
            # pays for it wherever it is made.
            out = _output_like(hidden_states)
        t2 = now()
        if self._member is member:
            if fast.prepared_recv(layer_idx, u, out):
                t3 = now()
                del self._pending[u]
                self._done[u] += 1
                member.layer_calls += 1
                stats.wait_s += t3 - t2
                stats.layer_calls += 1
                stats.routed_calls += routing is not None
                self._round_trips.append(t3 - t0)
                self._step_calls_left -= 1
                return out
            # Queued for the general receive (its waits, errors, failover); the
            # calls sent after it follow it there.
            self._fast_ubatches = None
            stats.wait_s += now() - t2
        # else another micro-batch failed over meanwhile and sent this call
        # again to the new member: the general receive takes it there.
        return self._finish_exchange(layer_idx, u, hidden_states, out, routing, member, t0,
                                     t0, None)

    def _finish_exchange(self, layer_idx: int, u: int, hidden_states: torch.Tensor,
                         out: torch.Tensor, routing: Routing | None, member, t0: float,
                         t1: float, failed_at: float | None) -> torch.Tensor:
        """Wait for (layer, u)'s output, sent at t0 (done sending at t1),
        failing over as needed; then the step's and the link's counters."""
        where = f"layer {layer_idx} micro-batch {u}"
        self._pending[u] = (layer_idx, hidden_states, routing)
        staged = None  # the output, where `out` cannot take it from the transport
        t2 = now()
        while True:
            member = self._member  # a failover while others held the turn moves it
            if member is None:
                raise AFDLinkDown(self.unavailable_reason())
            try:
                lead = member.lead
                if lead is None:
                    raise AFDLinkDown(f"{member.name} was closed")
                if staged is None:
                    lead.recv_output(layer_idx, u, out=out)
                else:
                    staged = lead.recv_output(layer_idx, u)
                break
            except ValueError as e:
                # The connector refuses an `out` it cannot fill (strided, another
                # shape or dtype) before it receives anything: the caller's
                # buffer, not the link, so no failover; the output comes
                # through the transport's buffer instead (below).
                if staged is None and not self._fits(out, hidden_states):
                    staged = False
                    continue
                failed_at = failed_at or now()
                self._fail_over(member, e, where)
            except Exception as e:
                failed_at = failed_at or now()
                self._fail_over(member, e, where)
        t3 = now()
        del self._pending[u]
        self._done[u] += 1
        member.layer_calls += 1
        if failed_at is not None:
            self.failover_time.observe(t3 - failed_at)
            self.last_failovers.append(round(t3 - failed_at, 6))
        stats = self.stats
        stats.send_s += t1 - t0
        stats.wait_s += t3 - t2
        stats.layer_calls += 1
        stats.routed_calls += routing is not None
        self.round_trip.observe(t3 - t0)
        self._step_calls_left -= 1
        if staged is not None:
            if out.shape != staged.shape or out.dtype != staged.dtype:
                raise ValueError(
                    f"AFD attention rank {self.rank}: the output buffer of layer {layer_idx} "
                    f"micro-batch {u} is {list(out.shape)} {out.dtype}, the output "
                    f"{list(staged.shape)} {staged.dtype} (the link stays in step)")
            out.copy_(staged)  # a strided `out`: the values land where it says
        return out

    def _sendable(self, hidden_states: torch.Tensor, u: int) -> bool:
        """Whether hidden_states are what the step's micro-batch u sends."""
        return (hidden_states.dtype == self.dtype and list(hidden_states.shape)
                == [self.plan.num_tokens[u], self.hidden_size])

    def _fits(self, out: torch.Tensor, hidden_states: torch.Tensor) -> bool:
        """Whether the transport can write layer outputs straight into `out`."""
        return (out.shape == hidden_states.shape and out.dtype == self.dtype
                and out.is_contiguous())

    def _fail_over(self, failed, error: BaseException, where: str):
        """A step lost `failed` at `where`: drop it (its thread reconnects) and
        finish the step on another ready member, resuming each micro-batch where
        it was: a StepHeader with from_layer, then every layer call in flight
        sent again, in the order the FFN serves them. The new member, or
        AFDLinkDown when no member is left (the step's requests fail)."""
        with self._lock:
            if self._member is not failed:  # another micro-batch moved the step already
                if self._member is None:
                    raise AFDLinkDown(self.unavailable_reason()) from error
                return self._member
            failed.failed_over += 1
            failed.fail(error)
        lost = f"{failed.name} at {where} of step {self.step_id}: {error}"
        while True:
            with self._lock:
                member = self.pool.next_member(exclude=failed)
                self._member = member
            if member is None:
                logger.error("AFD attention rank %d: lost %s; no other FFN server is up: "
                             "failing the step's requests", self.rank, lost)
                self._wake.set()
                raise AFDLinkDown(f"AFD attention rank {self.rank}: lost the link to "
                                  f"{lost}") from error
            pending = sorted(self._pending.items(), key=lambda item: (item[1][0], item[0]))
            try:
                member.send_step(StepHeader(step_id=self.step_id,
                                            num_tokens=list(self.plan.num_tokens),
                                            from_layer=self._resume_layers()))
                member.steps += 1
                for u, (layer, hidden_states, routing) in pending:
                    member.send_hidden(layer, u, hidden_states, routing)
            except Exception as e:  # noqa: BLE001 - this one is lost too: the next
                with self._lock:
                    member.failed_over += 1
                    member.fail(e)
                continue
            self.failovers += 1
            self.resent_calls += len(pending)
            logger.warning("AFD attention rank %d: lost %s; step resumed on %s (%d layer "
                           "call(s) sent again)", self.rank, lost, member.name, len(pending))
            self._publish()
            return member

    def _resume_layers(self) -> list[int]:
        """Per micro-batch, the first layer the member taking over serves: the
        one in flight, else the next one it will send (past the last: done)."""
        layers = []
        for u, done in enumerate(self._done):
            if u in self._pending:
                layers.append(self._pending[u][0])
            else:
                layers.append(self.layers[done] if done < len(self.layers)
                              else self.layers[-1] + 1)
        return layers

    def end_step(self, failed: bool = False) -> None:
        """End the forward pass begun by begin_step. A real step that did not
        finish every exchange (the model failed in between) leaves the FFN
        mid-step: that member's connection is dropped (the FFN is told) and
        re-made."""
        self._end_step(failed)
        if self._publish_due:  # the periodic publish fell inside the step (_publish_tick)
            self._publish_due = False
            self._publish()

    def _end_step(self, failed: bool) -> None:
        plan, self.plan = self.plan, None
        member, self._member = self._member, None
        self._pending = {}
        if self._fast_lead is not None:
            # The prepared calls' time was counted as waiting: their sends' part.
            sent = self._fast_lead.take_exchange_send_s()
            self.stats.send_s += sent
            self.stats.wait_s -= sent
        self._fast = self._fast_ubatches = self._fast_lead = None
        for elapsed in self._round_trips:
            self.round_trip.observe(elapsed)
        self._round_trips.clear()
        if plan is None or not plan.is_real:
            return  # dummy runs never time a micro-batch choice
        lead = member.lead if member is not None else None
        if lead is not None:  # the spin counters of the lead's link (a new one from 0)
            if self._spin_link is not lead:
                self._spin_link, self._spin_seen = lead, [0, 0]
            self.stats.add_spin(self._spin_seen, lead.spin_counters())
        if self.ubatch_rule is not None:
            self.ubatch_rule.finish_step(ok=self._step_calls_left == 0 and not failed)
        if self._step_calls_left == 0 and not failed:
            self.stats.steps += 1
            self.stats.step_wall_s += now() - self._step_start
            return
        if self._step_calls_left and member is not None and member.ready:
            reason = (f"the attention side abandoned step {self.step_id} with "
                      f"{self._step_calls_left} layer call(s) left")
            logger.warning("AFD attention rank %d: %s; reconnecting", self.rank, reason)
            with self._lock:
                member.fail(None, report=reason)
        self._step_calls_left = 0

    # ------------------------------------------------------------- reporting
    def document(self) -> dict:
        """State and counters, as status.py and metrics read them."""
        members = [m.document() for m in self.pool.members]
        stats = self.stats
        return {"role": "attention", "rank": self.rank, "peer": self.peer,
                "state": self.state, "since": self.since, "last_error": self.last_error,
                "pid": os.getpid(), "connects": self.connects,
                "reconnects": sum(max(0, m["connects"] - 1) for m in members),
                "errors": self.errors,
                "bytes_sent": sum(m["bytes_sent"] for m in members),
                "bytes_received": sum(m["bytes_received"] for m in members),
                "steps": stats.steps, "layer_calls": stats.layer_calls, "tokens": stats.tokens,
                "spin_preemptions": stats.spin_preemptions,
                "spin_backoffs": stats.spin_backoffs,
                "dummy_runs": dict(self.dummy_runs),
                "layer_round_trip_seconds": self.round_trip.as_dict(),
                "pool": members, "failovers": self.failovers,
                "resent_layer_calls": self.resent_calls,
                "failover_seconds": self.failover_time.as_dict(),
                "last_failover_seconds": list(self.last_failovers),
                "ubatches": self.ubatch_rule.document() if self.ubatch_rule else None}

    def _publish(self) -> None:
        if link_status.status_dir() is None:
            return  # nobody reads it (no API server process): not even built
        # Serialized, so an older document never replaces a newer one.
        with self._publish_lock:
            link_status.publish(f"link-a{self.rank}", self.document())

    def _publish_tick(self) -> None:
        """The periodic publish (the link's thread, every PUBLISH_INTERVAL_S).
        Inside a step it waits for end_step: on the attention's core it would
        preempt the model thread's spin for the FFN's answer and hold the GIL
        it needs back (the document, its JSON and the file: ~0.1-1 ms)."""
        if self.plan is not None:
            self._publish_due = True
        else:
            self._publish()

    def close(self) -> None:
        """Say goodbye to the FFN servers (they then wait for the next attention
        server)."""
        self._closed.set()
        self._wake.set()
        self.pool.close()
        with self._lock:
            self._refresh_state()
        if self._thread is not None and self._thread is not threading.current_thread():
            self._thread.join(timeout=5)
        self._publish()
