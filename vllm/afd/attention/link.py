# SPDX-License-Identifier: Apache-2.0
# SPDX-FileCopyrightText: Copyright contributors to the vllm-afd project
"""The attention role's end of the link. Data plane: imports nothing from vLLM.

The runner drives it through an explicit step API:

    link.begin_step(ForwardPass(num_tokens=[n0, n1], kind="real", device=ctx))
    link.exchange(layer, hidden_states, out)      # per layer and micro-batch
    link.end_step()

or, for a real step, `link.run_step(forward, run)` around the model's forward
(which may run it again). `begin_step` names the run: "real" steps talk to
the FFN; "profile", "warmup" and "capture" runs never touch the link and never
wait for an FFN (their exchanges write zeros into `out`). Nothing is guessed
from other state. A real step announces itself (StepHeader) to the FFN rank
and its tensor/expert parallel group; each exchange sends the hidden states and receives the FFN's
output into the caller's `out`, ordered on the caller's stream. Inside a
micro-batch ping-pong (pingpong.py) the exchange passes the turn between its
send and its receive, so another micro-batch's attention overlaps the FFN.

The FFN side is a pool of FFN deployments (pool.py; one member without
AFDConfig.ffn_pool), each kept connected by its own supervisor thread (which
enters the device the link was built for): it dials, retries with backoff
while the FFN is not there or refuses us, and reconnects after a loss. A real
step goes to the next ready member (round robin). When that member fails
mid-step, the step is resumed on another ready one (resume.py: a StepHeader
with from_layer, then the layer calls in flight sent again), and the caller
never notices; on a connector that checks its calls once per step (a
device-resident exchange) the step is instead run again whole (run_step:
what it computed after the loss is not the model's). A step never waits
for a connection once the link was up: with no member ready, at the start
or after a failure, it raises AFDLinkDown at once (the vLLM adapter fails the
step's requests and keeps serving). The state and counters are published
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
from vllm.afd.attention.pool import Pool
from vllm.afd.attention.resume import StepResume
from vllm.afd.attention.step import Step
from vllm.afd.attention.ubatch_rule import UbatchRule
from vllm.afd.observability.metrics import LATENCY_BUCKETS_S, Histogram
from vllm.afd.observability.stats import LinkStats, now
from vllm.afd.transport import leftovers
from vllm.afd.transport.config import LinkConfig
from vllm.afd.transport.device import DeviceContext
from vllm.afd.transport.errors import AFDLinkDown, StepAborted
from vllm.afd.transport.wire import ProtocolError, Routing, StepHeader

logger = logging.getLogger(__name__)

PUBLISH_INTERVAL_S = 1.0
# How often run_step runs a step its connector aborted (each run loses a
# member; with none left begin_step raises AFDLinkDown first).
MAX_STEP_RUNS = 4

# What a step is, as the runner names it.
REAL, PROFILE, WARMUP, CAPTURE = "real", "profile", "warmup", "capture"
STEP_KINDS = (REAL, PROFILE, WARMUP, CAPTURE)


@dataclass(frozen=True)
class ForwardPass:
    """One forward pass, as the runner describes it to the link."""

    num_tokens: tuple[int, ...] = ()  # per micro-batch (real steps)
    kind: str = REAL
    device: DeviceContext | None = field(default=None, compare=False)

    def __post_init__(self) -> None:
        if self.kind not in STEP_KINDS:
            raise ValueError(f"ForwardPass.kind: {self.kind!r} is not one of {STEP_KINDS}")
        if self.kind == REAL and not self.num_tokens:
            raise ValueError("ForwardPass: a real step needs its tokens per micro-batch")

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
        self.forward_pass: ForwardPass | None = None  # the run in progress, any kind
        self.step: Step | None = None  # the real step in progress
        self.dummy_runs: dict[str, int] = {}  # runs per kind that never touched the link
        self.stats = LinkStats()
        self._spin_link, self._spin_seen = None, [0, 0]  # see end_step
        self.round_trip = Histogram(LATENCY_BUCKETS_S)
        self.state = link_status.STARTING
        self.since = time.time()
        self.last_error: str | None = None
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
                         in_step=lambda m: self.step is not None and self.step.member is m,
                         on_thread=on_thread)
        # Failovers: a member lost mid-step, the step finished on another one.
        self.resume = StepResume(self.pool, self._lock, self.layers, rank,
                                 self.unavailable_reason, on_lost=self._wake.set,
                                 publish=self._publish)
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
            leftovers.remove_dead()  # shared memory of AFD processes killed before
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
    def begin_step(self, forward: ForwardPass) -> None:
        """Start a forward pass. A real step is announced to a ready pool member
        (raises AFDLinkDown when none is reachable); other kinds never touch it."""
        if self.forward_pass is not None:
            raise RuntimeError(f"AFD attention rank {self.rank}: begin_step({forward.kind}) "
                               f"while a {self.forward_pass.kind} step is in progress")
        if not forward.is_real:
            self.forward_pass = forward
            self.dummy_runs[forward.kind] = self.dummy_runs.get(forward.kind, 0) + 1
            return
        if len(forward.num_tokens) > self.config.num_ubatches:
            raise ValueError(f"AFD: a step of {len(forward.num_tokens)} micro-batches, but "
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
        step = Step(self.step_id, forward.num_tokens, member, len(self.layers), now())
        self.forward_pass, self.step = forward, step
        try:
            member.send_step(StepHeader(step_id=step.id, num_tokens=list(forward.num_tokens)))
            member.steps += 1
        except Exception as e:
            try:
                self.resume.take_over(step, member, e, "the step header")
            except AFDLinkDown:
                self.forward_pass = self.step = None
                raise
        self.stats.tokens += sum(forward.num_tokens) * len(self.layers)

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
        (0 outside one).

        One path for every connector: the step's sender sends (send_call), the
        turn passes to another micro-batch, the lead receives (recv_call); how
        is the connector's (a prepared C call, the general protocol, a device
        exchange). Anything else is an exception, handled out of line
        (_recover): a failover, or an `out` the connector cannot fill."""
        step = self.step
        if step is None:
            return self._outside_a_real_step(layer_idx, hidden_states, out)
        pp, u = None, 0
        if step.ubatched:
            turn = pingpong.current_turn()
            if turn is not None:
                pp, u = turn
        if ubatch is not None:
            u = ubatch
        hidden_states = hidden_states.contiguous()  # sends read its bytes as they lie
        step.in_flight[u] = (layer_idx, hidden_states, routing)
        failed_at = None
        t0 = now()
        try:
            step.sender.send_call(layer_idx, u, hidden_states, routing)
        except Exception as e:
            failed_at = self._send_failed(step, layer_idx, u, hidden_states, e)
        t1 = now()
        if out is None:  # made after the send (see the docstring)
            out = _output_like(hidden_states)
        if pp is not None:
            pp.yield_turn(u)
            t2 = now()  # the turn's time is neither sending nor waiting
        else:
            t2 = t1
        staged = None  # the output, where `out` could not take it from the transport
        try:
            step.lead.recv_call(layer_idx, u, out)  # a failover meanwhile moved it
        except Exception as e:
            failed_at, staged = self._recover(step, layer_idx, u, hidden_states, out, e,
                                              failed_at)
        t3 = now()
        # The call's counters, once.
        step.answered(u)
        step.member.layer_calls += 1
        step.round_trips.append(t3 - t0)
        stats = self.stats
        stats.send_s += t1 - t0
        stats.wait_s += t3 - t2
        stats.layer_calls += 1
        stats.routed_calls += routing is not None
        if failed_at is not None:
            self.resume.observe(t3 - failed_at)
        if staged is not None:
            self._copy_staged(layer_idx, u, staged, out)
        return out

    def _outside_a_real_step(self, layer_idx: int, hidden_states: torch.Tensor,
                             out: torch.Tensor | None) -> torch.Tensor:
        """Profile, warm-up and capture runs: shapes only, zeros; outside any
        step, the runner's error."""
        if self.forward_pass is None:
            raise RuntimeError(f"AFD attention rank {self.rank}: remote FFN layer "
                               f"{layer_idx} called outside a step; the model runner names "
                               f"every forward pass (begin_step)")
        if out is None:
            return torch.zeros_like(hidden_states, memory_format=torch.contiguous_format)
        return out.zero_()

    def _send_failed(self, step: Step, layer_idx: int, u: int, hidden_states: torch.Tensor,
                     error: Exception) -> float:
        """A send that raised: the caller's hidden states refused before
        anything was sent are the caller's error (re-raised: every member would
        refuse them alike, and all would be dropped); anything else moves the
        step to another member, which was sent this call too. When it failed."""
        if (isinstance(error, ValueError) and not isinstance(error, ProtocolError)
                and not self._sendable(hidden_states, step.num_tokens[u])):
            del step.in_flight[u]
            raise error
        failed_at = now()
        self.resume.take_over(step, step.member, error, f"layer {layer_idx} micro-batch {u}")
        return failed_at

    def _recover(self, step: Step, layer_idx: int, u: int, hidden_states: torch.Tensor,
                 out: torch.Tensor, error: Exception, failed_at: float | None
                 ) -> tuple[float | None, torch.Tensor | None]:
        """recv_call raised: receive (layer_idx, u)'s output anyway, failing
        over as often as members are lost (AFDLinkDown when none is left).
        The connector refuses an `out` it cannot fill (strided, another shape
        or dtype) before it receives anything: the caller's buffer, not the
        link, so no failover; the output then comes in the transport's
        buffer, for the caller to copy into out. When the first failure was
        (None: no failover), and that output (None: it is in out)."""
        where = f"layer {layer_idx} micro-batch {u}"
        staged = False  # receiving into the transport's buffer instead of out
        while True:
            if (not staged and isinstance(error, ValueError)
                    and not self._fits(out, hidden_states)):
                staged = True
            else:
                failed_at = failed_at or now()
                self.resume.take_over(step, step.member, error, where)
            try:
                if not staged:
                    step.lead.recv_call(layer_idx, u, out)
                    return failed_at, None
                return failed_at, step.lead.recv_call(layer_idx, u)
            except Exception as e:  # noqa: BLE001 - the next member's turn
                error = e

    def _copy_staged(self, layer_idx: int, u: int, output: torch.Tensor,
                     out: torch.Tensor) -> None:
        """An output received in the transport's buffer, into the caller's
        `out` (the call is counted: the link stays in step either way)."""
        if out.shape != output.shape or out.dtype != output.dtype:
            raise ValueError(
                f"AFD attention rank {self.rank}: the output buffer of layer {layer_idx} "
                f"micro-batch {u} is {list(out.shape)} {out.dtype}, the output "
                f"{list(output.shape)} {output.dtype} (the link stays in step)")
        out.copy_(output)  # a strided `out`: the values land where it says

    def _sendable(self, hidden_states: torch.Tensor, num_tokens: int) -> bool:
        """Whether hidden_states are what a micro-batch of num_tokens sends."""
        return (hidden_states.dtype == self.dtype
                and list(hidden_states.shape) == [num_tokens, self.hidden_size])

    def _fits(self, out: torch.Tensor, hidden_states: torch.Tensor) -> bool:
        """Whether the transport can write layer outputs straight into `out`."""
        return (out.shape == hidden_states.shape and out.dtype == self.dtype
                and out.is_contiguous())

    def end_step(self, failed: bool = False) -> None:
        """End the forward pass begun by begin_step. A real step that did not
        finish every exchange (the model failed in between) leaves the FFN
        mid-step: that member's connection is dropped (the FFN is told) and
        re-made. A step whose connector checks once per step is checked here:
        StepAborted when it lost its member (run_step runs it again)."""
        try:
            self._end_step(failed)
        finally:
            if self._publish_due:  # the periodic publish fell inside the step (_publish_tick)
                self._publish_due = False
                self._publish()

    def run_step(self, forward: ForwardPass, run: Callable[[], Any]) -> Any:
        """run() as one forward pass of the link (begin_step, run(), end_step),
        its result returned. A step aborted on a connector that checks once
        per step (StepAborted: its outputs since the loss are not the model's)
        runs again whole on another member, as long as one is left: run()
        must be repeatable, as a model's forward is (the same tokens write the
        same KV entries)."""
        for run_number in range(1, MAX_STEP_RUNS + 1):
            self.begin_step(forward)
            ran, aborted = False, None
            try:
                result = run()
                ran = True
            except StepAborted as e:
                aborted = e
            finally:
                try:
                    self.end_step(failed=not ran)
                except StepAborted as e:
                    aborted = e
            if aborted is None or run_number == MAX_STEP_RUNS:
                break
        if aborted is not None:
            raise aborted
        return result

    def _end_step(self, failed: bool) -> None:
        step, self.step, self.forward_pass = self.step, None, None
        if step is None:
            return  # dummy runs never time a micro-batch choice
        for elapsed in step.round_trips:
            self.round_trip.observe(elapsed)
        member, lead = step.member, step.lead
        if lead is not None:  # the spin counters of the lead's link (a new one from 0)
            if self._spin_link is not lead:
                self._spin_link, self._spin_seen = lead, [0, 0]
            self.stats.add_spin(self._spin_seen, lead.spin_counters())
        ok = step.finished and not failed
        lost = None  # a call's failure that its connector shows only now
        if ok and lead.checks_per_step:
            try:
                lead.check_step()
            except Exception as e:  # noqa: BLE001 - aborted below, after the bookkeeping
                ok, lost = False, e
        if self.ubatch_rule is not None:
            self.ubatch_rule.finish_step(ok=ok)
        if ok:
            self.stats.steps += 1
            self.stats.step_wall_s += now() - step.started
            return
        if lost is not None:
            self.resume.abort(step, member, lost, "the end")  # raises StepAborted
        if not step.finished and member is not None and member.ready:
            reason = (f"the attention side abandoned step {step.id} with "
                      f"{step.calls_left} layer call(s) left")
            logger.warning("AFD attention rank %d: %s; reconnecting", self.rank, reason)
            with self._lock:
                member.fail(None, report=reason)

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
                "pool": members, **self.resume.document(),
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
        if self.forward_pass is not None:
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
