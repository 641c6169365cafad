# SPDX-License-Identifier: Apache-2.0
# SPDX-FileCopyrightText: Copyright contributors to the vllm-afd project
"""Reconnect delays (vllm/afd/transport/backoff.py): doubling to a cap, each
jittered, so servers that lost one FFN at once do not redial it in lockstep."""

import random

import pytest

from vllm.afd.attention.pool import RECONNECT_BACKOFF_S
from vllm.afd.transport.backoff import Backoff


def test_delays_double_to_the_cap_each_within_its_half():
    backoff = Backoff(0.5, 5.0, random.Random(1))
    delays = [backoff.next() for _ in range(8)]
    for delay, bound in zip(delays, [0.5, 1, 2, 4, 5, 5, 5, 5]):
        assert bound / 2 <= delay <= bound
    backoff.reset()
    assert 0.25 <= backoff.next() <= 0.5


def test_servers_that_lost_one_ffn_together_redial_apart():
    """100 supervisors' first three retries: spread over each interval, not
    one instant (plain doubling would put all 100 on 0.5, 1.5 and 3.5 s)."""
    for attempt in range(3):
        times = []
        for seed in range(100):
            backoff = Backoff(*RECONNECT_BACKOFF_S, random.Random(seed))
            times.append(sum(backoff.next() for _ in range(attempt + 1)))
        assert max(times) - min(times) > 0.4 * RECONNECT_BACKOFF_S[0] * 2 ** attempt


def test_bad_bounds_are_refused():
    with pytest.raises(ValueError, match="0 < first <= cap"):
        Backoff(2.0, 1.0)
