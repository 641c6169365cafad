# SPDX-License-Identifier: Apache-2.0
# SPDX-FileCopyrightText: Copyright contributors to the vllm-afd project
"""The overlap of m micro-batches (MegaScale-Infer's ping-pong pipeline).

Per layer, each micro-batch runs attention (Ta, on its attention device), crosses
the link (Tc A->F), runs the FFN (Te, on the FFN devices) and crosses back (Tc
F->A) before its next layer's attention. The attention device takes micro-batches
in turn, so does the FFN. In steady state one layer of all m micro-batches takes

    cycle = max(m Ta, m Te, m Tlink, Ta + Te + Tc_a2f + Tc_f2a)

where Tlink is the time a micro-batch occupies a link direction (bytes / bandwidth;
links are full duplex). With Ta = Te = Tf and one-way Tc this is MegaScale-Infer's
max(m Tf, 2 Tf + 2 Tc): the link is hidden iff m Tf >= 2 (Tf + Tc), i.e.
m >= 2 (1 + Tc / Tf), so two micro-batches never hide it (any Tc > 0 costs).
"""

from __future__ import annotations

import math


def layer_cycle(ta: float, te: float, tc_a2f: float, tc_f2a: float, m: int,
                link_busy: float = 0.0) -> float:
    """Steady-state seconds per layer for m micro-batches (see the module doc)."""
    return max(m * ta, m * te, m * link_busy, ta + te + tc_a2f + tc_f2a)


def step_time(ta: float, te: float, tc_a2f: float, tc_f2a: float, m: int, layers: int,
              link_busy: float = 0.0) -> float:
    """Seconds for all m micro-batches through `layers` identical layers, from the
    first attention to the last output back on the attention side: the steady
    cycles plus filling and draining the pipeline (one chain, and the m - 1
    micro-batches behind the first on the busier device)."""
    cycle = layer_cycle(ta, te, tc_a2f, tc_f2a, m, link_busy)
    chain = ta + te + tc_a2f + tc_f2a
    return (layers - 1) * cycle + chain + (m - 1) * max(ta, te)


def simulate_step(ta: float, te: float, tc_a2f: float, tc_f2a: float, m: int,
                  layers: int) -> float:
    """The same pipeline event by event: the attention device and the FFN each run
    one micro-batch at a time, in turn; a micro-batch's next attention waits for
    its FFN output. Returns when the last output is back."""
    ready = [0.0] * m  # when micro-batch u may start its next attention
    attention_free = ffn_free = 0.0
    for _ in range(layers):
        for u in range(m):
            attention_free = max(attention_free, ready[u]) + ta
            ffn_free = max(ffn_free, attention_free + tc_a2f) + te
            ready[u] = ffn_free + tc_f2a
    return max(ready)


def min_microbatches(tc: float, tf: float) -> int:
    """MegaScale-Infer's rule: the fewest micro-batches that hide a one-way
    transfer time tc behind compute tf per micro-batch: m >= 2 (1 + tc / tf)."""
    if tf <= 0:
        raise ValueError("compute time per micro-batch must be positive")
    return max(2, math.ceil(2.0 * (1.0 + tc / tf) - 1e-12))


def utilization(ta: float, te: float, tc: float, m: int) -> float:
    """Busy fraction of the busier compute device: m max(Ta, Te) / cycle."""
    return m * max(ta, te) / layer_cycle(ta, te, tc, tc, m)


def stage_budget(tpot_s: float, layers: int, m: int) -> float:
    """Seconds per layer stage (one micro-batch's share of a layer) a TPOT allows:
    TPOT / (layers x m), Step-3's budget."""
    return tpot_s / (layers * m)
