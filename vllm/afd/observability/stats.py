# SPDX-License-Identifier: Apache-2.0
# SPDX-FileCopyrightText: Copyright contributors to the vllm-afd project
"""Where a step's time goes, on each side of the link.

Cumulative counters (seconds, counts) that the attention link and the FFN loop
update at a few points per layer call; cheap enough to stay on (time.perf_counter
costs ~50 ns). The benchmark reads them before and after a run and reports the
difference per step:

  attention side: step wall time (first send to last receive), time blocked in
  the link (sending and waiting for outputs), and so attention compute = wall -
  blocked.
  FFN side: mlp compute, time waiting for hidden states (idle + transfer), time
  sending outputs.
"""

import time
from dataclasses import asdict, dataclass

now = time.perf_counter


@dataclass
class LinkStats:
    steps: int = 0
    layer_calls: int = 0  # one per (layer, micro-batch)
    routed_calls: int = 0  # layer calls whose MoE routing came from the attention side
    tokens: int = 0  # tokens through the mlp layers, summed over layer calls
    step_wall_s: float = 0.0
    compute_s: float = 0.0  # FFN: mlp compute
    wait_s: float = 0.0  # attention: waiting for outputs; FFN: for hidden states
    send_s: float = 0.0
    # This side's waits on the link: spins that lost their core (the scheduler
    # ran something else) and the times that turned spinning off for a while,
    # so the waits slept (shm; a step's link time jumps then).
    spin_preemptions: int = 0
    spin_backoffs: int = 0

    def add_spin(self, seen: list[int], counters: tuple[int, int]) -> None:
        """Count a connector's cumulative spin counters since seen (updated in
        place; [0, 0] for a new connector)."""
        self.spin_preemptions += counters[0] - seen[0]
        self.spin_backoffs += counters[1] - seen[1]
        seen[:] = counters

    def as_dict(self) -> dict:
        return asdict(self)

    @staticmethod
    def delta(after: dict, before: dict) -> dict:
        return {k: after[k] - before.get(k, 0) for k in after}
