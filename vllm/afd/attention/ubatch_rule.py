# SPDX-License-Identifier: Apache-2.0
# SPDX-FileCopyrightText: Copyright contributors to the vllm-afd project
"""How many micro-batches a step runs (AFDConfig.ubatch_policy). Data plane.

Splitting a step into m micro-batches lets the attention of one overlap the
FFN of another, but every micro-batch pays again what a forward pass costs
whatever its size: each weight matrix is read once per micro-batch (on both
roles: the half-batch GEMMs of the attention projections and of the experts
are weight-read bound), per-layer Python and dispatch, one more link round
trip per layer, thread hand-overs. Whether the overlap gains more than that
depends on the batch, the model, the hardware and the load, so the rule
measures instead of modelling:

- Steps are grouped by their token count into buckets (edges 1, 2, 3, 4, 6, 8,
  12, 16, 24, ...: within a bucket token counts differ by at most 1.5x). A
  bucket's candidates are m = 1 .. num_ubatches, at most its smallest token
  count.
- Probing: the candidates take turns (1, 2, ..., 1, 2, ...) until each has
  PROBES timed steps. The first step of each candidate in a bucket is not
  counted (a shape's first run pays for allocations and kernel set-up).
- A candidate that measures more than ELIMINATE slower than the best one
  measured so far in the round stops probing there: with one core per role a
  step at a clearly losing m costs a third more (m = 1 at B = 8 on the 2-core
  VM), and three of them per round were most of what "auto" lost to the best
  fixed m in `make bench`.
- Then the bucket runs its best candidate: the estimate of a candidate is the
  median of its last WINDOW step times per token, and a larger m is taken only
  when it is at least MARGIN faster than the best smaller one, so a tie keeps
  the fewer micro-batches (less FFN work, fewer threads).
- Every REPROBE_EVERY steps of a bucket the candidates are probed again
  (PROBES fresh steps each): load and batch mix change. The chosen one's
  window is refreshed by every step it runs; when, over WINDOW steps, it has
  become slower than another candidate was when last measured, by MARGIN plus
  NOISE_K times its own window's spread (the median absolute deviation over
  the median: step times on a shared host scatter by 5-12 %, and a bare MARGIN
  started a round every few windows there), the round starts at once.

A step's time is taken by the caller from the choice (before vLLM builds the
per-micro-batch attention metadata) to the end of the model forward, and
given to `finish_step` only for real steps that completed; profile, warm-up
and capture runs never reach the rule (they never choose). Given the same
sequence of (tokens, seconds) the rule makes the same choices: no randomness.

"fixed" always splits into min(num_ubatches, tokens), as before the rule.
"""

import logging
import statistics
import time
from collections import deque
from collections.abc import Callable
from dataclasses import dataclass, field

logger = logging.getLogger(__name__)

AUTO, FIXED = "auto", "fixed"
POLICIES = (AUTO, FIXED)

PROBES = 3  # counted steps per candidate in a probe round
WARMUP_STEPS = 1  # first steps of a candidate in a bucket, not counted
WINDOW = 5  # latest step times kept per candidate (the estimate is their median)
REPROBE_EVERY = 200  # steps of a bucket between probe rounds
MARGIN = 0.03  # a larger m must be this much faster (per token) to be chosen
ELIMINATE = 0.25  # a candidate this much slower than the round's best stops probing
NOISE_K = 2.0  # the chosen m's spreads beyond MARGIN before it counts as fallen behind


def bucket_edges(limit: int) -> list[int]:
    """Upper edges of the token-count buckets up to limit: 1, 2, 3, 4, 6, 8, 12,
    ... (powers of two and 1.5x them)."""
    edges, power = [1, 2], 2
    while edges[-1] < limit:
        edges += [power * 3 // 2, power * 2]
        power *= 2
    return edges


@dataclass
class _Candidate:
    m: int
    seen: int = 0  # steps observed in this bucket, counted or not
    probed: int = 0  # counted steps in the current probe round
    steps: int = 0  # steps run with this m (all of them: probes and chosen)
    window: deque = field(default_factory=lambda: deque(maxlen=WINDOW))

    def estimate(self) -> float | None:
        return statistics.median(self.window) if self.window else None

    def spread(self) -> float:
        """The window's median absolute deviation over its median (0 for fewer
        than three steps)."""
        if len(self.window) < 3:
            return 0.0
        mid = statistics.median(self.window)
        return statistics.median(abs(x - mid) for x in self.window) / mid if mid else 0.0


class _Bucket:
    def __init__(self, low: int, high: int, max_ubatches: int) -> None:
        self.low, self.high = low, high
        self.candidates = [_Candidate(m) for m in range(1, min(max_ubatches, low) + 1)]
        self.chosen: int | None = None if len(self.candidates) > 1 else 1
        self.probing = len(self.candidates) > 1
        self.since_probe = 0  # steps since the last probe round ended
        self.turn = 0  # next candidate to probe (round robin)
        self.decisions = 0

    @property
    def name(self) -> str:
        return f"{self.low}-{self.high}"

    def next_m(self) -> int:
        if not self.probing:
            return self.chosen
        # Round robin over the candidates that still need steps in this round.
        n = len(self.candidates)
        for k in range(n):
            c = self.candidates[(self.turn + k) % n]
            if c.probed < PROBES:
                self.turn = (self.turn + k + 1) % n
                return c.m
        return self.chosen or 1  # unreachable: a finished round ends probing

    def observe(self, m: int, seconds: float, tokens: int) -> None:
        c = self.candidates[m - 1]
        c.seen += 1
        c.steps += 1
        if c.seen <= WARMUP_STEPS:
            return
        c.window.append(seconds / tokens)
        if self.probing:
            c.probed += 1
            self._eliminate()
            if all(x.probed >= PROBES for x in self.candidates):
                self._decide()
        else:
            self.since_probe += 1
            if self.since_probe >= REPROBE_EVERY or self._chosen_fell_behind():
                self.probing, self.turn = True, 0
                for x in self.candidates:
                    x.probed = 0

    def _eliminate(self) -> None:
        """Candidates of this round measured ELIMINATE slower than its best so
        far are done probing (their estimate stands for the decision)."""
        measured = [x for x in self.candidates if x.probed]
        best = min(x.estimate() for x in measured)
        for x in measured:
            if x.probed < PROBES and x.estimate() > best * (1 + ELIMINATE):
                x.probed = PROBES

    def _chosen_fell_behind(self) -> bool:
        """The chosen count, over WINDOW steps run since the decision, is now
        slower than another candidate was when last measured, by more than its
        own steps scatter: measure again now rather than at the next regular
        round."""
        if self.since_probe < WINDOW:
            return False
        chosen = self.candidates[self.chosen - 1]
        mine = chosen.estimate()
        margin = MARGIN + NOISE_K * chosen.spread()
        return any(c.estimate() * (1 + margin) < mine
                   for c in self.candidates if c.m != self.chosen and c.window)

    def _decide(self) -> None:
        best = self.candidates[0]
        for c in self.candidates[1:]:
            if c.estimate() < best.estimate() * (1 - MARGIN):
                best = c
        if best.m != self.chosen:
            logger.info("AFD micro-batches: steps of %s tokens run %d micro-batch(es) "
                        "(per token: %s)", self.name, best.m,
                        ", ".join(f"m={c.m} {c.estimate() * 1e6:.1f} us"
                                  for c in self.candidates))
        self.chosen, self.probing, self.since_probe = best.m, False, 0
        self.decisions += 1

    def document(self) -> dict:
        return {"chosen": self.chosen, "probing": self.probing, "decisions": self.decisions,
                "steps": {str(c.m): c.steps for c in self.candidates},
                "us_per_token": {str(c.m): round(c.estimate() * 1e6, 3)
                                 for c in self.candidates if c.window}}


class UbatchRule:
    """Chooses the micro-batch count of each real step (one per attention link)."""

    def __init__(self, max_ubatches: int, policy: str = AUTO,
                 clock: Callable[[], float] = time.perf_counter) -> None:
        if policy not in POLICIES:
            raise ValueError(f"ubatch_policy: {policy!r} is not one of {POLICIES}")
        self.max_ubatches = max_ubatches
        self.policy = policy
        self.clock = clock
        self._edges: list[int] = []
        self._buckets: dict[int, _Bucket] = {}  # by upper edge
        self._pending: tuple[_Bucket | None, int, int, float] | None = None
        self.steps_by_m: dict[int, int] = {}

    def _bucket(self, num_tokens: int) -> _Bucket:
        if not self._edges or self._edges[-1] < num_tokens:
            self._edges = bucket_edges(num_tokens)
        i = next(i for i, edge in enumerate(self._edges) if edge >= num_tokens)
        high = self._edges[i]
        if high not in self._buckets:
            low = self._edges[i - 1] + 1 if i else 1
            self._buckets[high] = _Bucket(low, high, self.max_ubatches)
        return self._buckets[high]

    def choose(self, num_tokens: int) -> int:
        """The micro-batch count for a real step of num_tokens tokens, about to
        run; its time starts now (finish_step ends it)."""
        if self.policy == FIXED or self.max_ubatches < 2:
            bucket, m = None, min(self.max_ubatches, max(num_tokens, 1))
        else:
            bucket = self._bucket(max(num_tokens, 1))
            m = bucket.next_m()
        self._pending = (bucket, m, num_tokens, self.clock())
        return m

    def finish_step(self, ok: bool = True) -> None:
        """The step chosen last ended (ok: it completed; a failed or abandoned
        step is not counted)."""
        pending, self._pending = self._pending, None
        if pending is None:
            return
        bucket, m, tokens, start = pending
        self.steps_by_m[m] = self.steps_by_m.get(m, 0) + 1
        if ok and bucket is not None:
            bucket.observe(m, self.clock() - start, tokens)

    def observe(self, num_tokens: int, m: int, seconds: float) -> None:
        """A step of num_tokens tokens ran with m micro-batches in seconds (for
        callers that time steps themselves)."""
        self._bucket(num_tokens).observe(m, seconds, num_tokens)
        self.steps_by_m[m] = self.steps_by_m.get(m, 0) + 1

    def chosen(self, num_tokens: int) -> int | None:
        """The current choice for steps of num_tokens tokens (None: probing)."""
        bucket = self._bucket(num_tokens)
        return None if bucket.probing else bucket.chosen

    def document(self) -> dict:
        """For /afd/status: the policy and, per bucket, the choice and its counts."""
        # Read by the link's publishing thread while the runner's thread
        # counts: copy each dict in one call before walking it.
        steps, buckets = dict(self.steps_by_m), dict(self._buckets)
        return {"policy": self.policy, "max": self.max_ubatches,
                "steps": {str(m): n for m, n in sorted(steps.items())},
                "buckets": {b.name: b.document() for _, b in sorted(buckets.items())}}
