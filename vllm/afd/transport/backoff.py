# SPDX-License-Identifier: Apache-2.0
# SPDX-FileCopyrightText: Copyright contributors to the vllm-afd project
"""Delays between reconnect attempts: doubling, capped, jittered.

Many attention servers lose a restarted FFN server at the same moment; with
plain doubling they would redial it in lockstep, every attempt a burst. Each
delay is drawn uniformly from [d/2, d] ("equal jitter": never less than half
the backoff, so a down server is not hammered either), d doubling from
`first` to `cap`. Used by the pool members' supervisors (one per FFN server,
also for a single link) and by the tcp/shm dial loop.
"""

import random


class Backoff:
    def __init__(self, first: float, cap: float, rng: random.Random | None = None) -> None:
        if not 0 < first <= cap:
            raise ValueError(f"backoff: expected 0 < first <= cap, got {first}, {cap}")
        self.first, self.cap = first, cap
        self._rng = rng or random.Random()
        self._delay = first

    def next(self) -> float:
        """The delay before the next attempt (and the backoff doubled)."""
        delay = self._delay
        self._delay = min(delay * 2, self.cap)
        return self._rng.uniform(delay / 2, delay)

    def reset(self) -> None:
        """After a success: the next failure waits about `first` again."""
        self._delay = self.first
