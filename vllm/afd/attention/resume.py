# SPDX-License-Identifier: Apache-2.0
# SPDX-FileCopyrightText: Copyright contributors to the vllm-afd project
"""Finishing a step on another pool member when its member is lost mid-step.

Where the step's connector checks its calls once per step (checks_per_step:
a device-resident exchange, whose host never waits on a call), a step with
an answered call is not resumed but aborted (abort): its member is dropped
and StepAborted raised, and AttentionLink.run_step runs it again whole on
another member.

The member that failed is dropped (its supervisor thread reconnects it) and
the next ready one takes the step over where each micro-batch was: a
StepHeader with from_layer, then every layer call in flight sent again, in
the order the FFN serves them. The caller of the link never notices, beyond
the time it took. With no member left the step fails (AFDLinkDown: the vLLM
adapter fails its requests and keeps serving; adapter/attention/failover.py).
"""

import logging
import threading
from collections import deque
from collections.abc import Callable

from vllm.afd.attention.pool import Pool
from vllm.afd.attention.step import Step
from vllm.afd.observability.metrics import LATENCY_BUCKETS_S, Histogram
from vllm.afd.transport.errors import AFDLinkDown, StepAborted
from vllm.afd.transport.wire import StepHeader

logger = logging.getLogger(__name__)

LAST_FAILOVERS_KEPT = 64  # failover times kept for /afd/status


class StepResume:
    """Moves a step to another member, and counts it."""

    def __init__(self, pool: Pool, lock: threading.Lock, layers: list[int], rank: int,
                 unavailable_reason: Callable[[], str], on_lost: Callable[[], None],
                 publish: Callable[[], None]) -> None:
        self.pool = pool
        self.lock = lock  # the link's: members change state under it
        self.layers = layers  # the link's remote layers (a live list)
        self.rank = rank
        self._unavailable_reason = unavailable_reason
        self._on_lost = on_lost  # no member left: the link's thread refreshes its state
        self._publish = publish
        self.failovers = 0  # steps finished on another member
        self.resent_calls = 0  # layer calls sent again to the member that took over
        self.aborted_steps = 0  # steps lost where they could not be resumed (abort)
        self.failover_time = Histogram(LATENCY_BUCKETS_S)  # error -> the output, resent
        self.last_failovers: deque[float] = deque(maxlen=LAST_FAILOVERS_KEPT)

    def observe(self, seconds: float) -> None:
        """A layer call that failed over got its output, seconds after the error."""
        self.failover_time.observe(seconds)
        self.last_failovers.append(round(seconds, 6))

    def take_over(self, step: Step, failed, error: BaseException, where: str) -> None:
        """step lost `failed` at `where`: move it to another ready member
        (step.use), or raise AFDLinkDown when none is left. Several
        micro-batches may see the loss; the first one moves the step."""
        if step.aborted is not None or (any(step.done) and step.lead is not None
                                        and step.lead.checks_per_step):
            # An answered call's output may be one the loss left unwritten.
            self.abort(step, failed, error, where)
        with self.lock:
            if step.member is None:  # lost already (another micro-batch's turn)
                raise AFDLinkDown(self._unavailable_reason()) from error
            if step.member is not failed:  # another micro-batch moved the step already
                return
            failed.failed_over += 1
            failed.fail(error)
        lost = f"{failed.name} at {where} of step {step.id}: {error}"
        while True:
            with self.lock:
                member = self.pool.next_member(exclude=failed)
                step.use(member)
            if member is None:
                logger.error("AFD attention rank %d: lost %s; no other FFN server is up: "
                             "failing the step's requests", self.rank, lost)
                self._on_lost()
                raise AFDLinkDown(f"AFD attention rank {self.rank}: lost the link to "
                                  f"{lost}") from error
            in_flight = sorted(step.in_flight.items(), key=lambda item: (item[1][0], item[0]))
            try:
                member.send_step(StepHeader(step_id=step.id, num_tokens=list(step.num_tokens),
                                            from_layer=step.resume_layers(self.layers)))
                member.steps += 1
                for u, (layer, hidden_states, routing) in in_flight:
                    step.sender.send_call(layer, u, hidden_states, routing)
            except Exception as e:  # noqa: BLE001 - this one is lost too: the next
                with self.lock:
                    member.failed_over += 1
                    member.fail(e)
                continue
            self.failovers += 1
            self.resent_calls += len(in_flight)
            logger.warning("AFD attention rank %d: lost %s; step resumed on %s (%d layer "
                           "call(s) sent again)", self.rank, lost, member.name, len(in_flight))
            self._publish()
            return

    def abort(self, step: Step, failed, error: BaseException, where: str) -> None:
        """step lost `failed` at `where`, on a connector that checks once per
        step: what the step computed since the loss is not the model's, so it
        is not resumed. The member is dropped (its supervisor reconnects it)
        and StepAborted raised, for run_step to run the step again whole; a
        micro-batch that sees the loss later raises the same."""
        if step.aborted is None:
            with self.lock:
                if step.member is failed:
                    failed.failed_over += 1
                    failed.fail(error)
                step.use(None)
            self.aborted_steps += 1
            step.aborted = StepAborted(f"AFD attention rank {self.rank}: lost {failed.name} at "
                                       f"{where} of step {step.id}: {error}")
            logger.warning("%s; the step runs again whole", step.aborted)
            self._publish()
        raise step.aborted from error

    def document(self) -> dict:
        return {"failovers": self.failovers, "resent_layer_calls": self.resent_calls,
                "aborted_steps": self.aborted_steps,
                "failover_seconds": self.failover_time.as_dict(),
                "last_failover_seconds": list(self.last_failovers)}
