# SPDX-License-Identifier: Apache-2.0
# SPDX-FileCopyrightText: Copyright contributors to the vllm-afd project
"""Prometheus metrics of the attention<->FFN link, on both roles.

The counters live where the link runs (the attention link, the FFN loops in
the FFN workers) as plain numbers and fixed-bucket histograms; a collector in
the HTTP process turns them into metric families at scrape time, next to
vLLM's own metrics on the same /metrics:

  vllm_afd_peer_up{role,rank,peer}                 1 while the link is up
  vllm_afd_link_state{role,rank,state}             1 for the current state
  vllm_afd_bytes_sent_total / _received_total      payload and header bytes
  vllm_afd_layer_round_trip_seconds (histogram)    attention: send -> output
  vllm_afd_ffn_layer_compute_seconds (histogram)   FFN: one mlp call
  vllm_afd_ffn_tokens_per_layer_call (histogram)   FFN: tokens in one mlp call
  vllm_afd_steps_total, vllm_afd_layer_calls_total, vllm_afd_tokens_total
  vllm_afd_connector_errors_total{role,rank,kind}  lost peers, timeouts, bad frames
  vllm_afd_reconnects_total                        connections after the first
  vllm_afd_auth_failures_total, vllm_afd_handshake_failures_total (FFN)
  vllm_afd_failovers_total, vllm_afd_resent_layer_calls_total   attention: FFN pool
  vllm_afd_aborted_steps_total                     attention: steps run again whole
  vllm_afd_failover_seconds (histogram)            attention: error -> resent output
  vllm_afd_pool_member_up{...,endpoint}            attention: 1 per ready member
  vllm_afd_pool_member_layer_calls_total{...,endpoint}
  vllm_afd_ubatch_steps_total{...,ubatches}        attention: steps run with m micro-batches
  vllm_afd_ubatch_chosen{...,tokens}               attention: m the rule runs for a step size

Recording costs a bisect and two additions (the histograms are not locked:
each has one writer thread, and a scrape reading a half-updated bucket is off
by one observation at most).
"""

import bisect
from collections.abc import Callable, Iterable

LATENCY_BUCKETS_S = (0.0001, 0.00025, 0.0005, 0.001, 0.0025, 0.005, 0.01, 0.025, 0.05,
                     0.1, 0.25, 0.5, 1.0, 2.5, 5.0)
TOKEN_BUCKETS = (1, 2, 4, 8, 16, 32, 64, 128, 256, 512, 1024, 2048, 4096, 8192)


class Histogram:
    """Cumulative fixed-bucket histogram; as_dict() travels as JSON."""

    def __init__(self, bounds: Iterable[float]) -> None:
        self.bounds = tuple(bounds)
        self.counts = [0] * (len(self.bounds) + 1)  # the last bucket is +Inf
        self.sum = 0.0

    def observe(self, value: float) -> None:
        self.counts[bisect.bisect_left(self.bounds, value)] += 1
        self.sum += value

    @property
    def count(self) -> int:
        return sum(self.counts)

    def as_dict(self) -> dict:
        return {"bounds": list(self.bounds), "counts": list(self.counts), "sum": self.sum}

    @staticmethod
    def merge(documents: list[dict]) -> dict | None:
        """Several workers' histograms of the same bounds as one."""
        documents = [d for d in documents if d]
        if not documents:
            return None
        merged = {"bounds": documents[0]["bounds"],
                  "counts": [0] * len(documents[0]["counts"]), "sum": 0.0}
        for d in documents:
            merged["counts"] = [a + b for a, b in zip(merged["counts"], d["counts"])]
            merged["sum"] += d["sum"]
        return merged


def _buckets(document: dict) -> list[tuple[str, float]]:
    """Prometheus' cumulative (le, count) pairs."""
    out, running = [], 0
    for bound, count in zip([*document["bounds"], float("inf")], document["counts"]):
        running += count
        out.append(("+Inf" if bound == float("inf") else repr(float(bound)), running))
    return out


class LinkCollector:
    """A prometheus_client collector over `source()`: a list of link metric
    documents, each with role, rank, peer, state and the counters above."""

    def __init__(self, source: Callable[[], list[dict]]) -> None:
        self.source = source

    def describe(self):  # unchecked registration: no scrape at register time
        return []

    def collect(self):
        from prometheus_client.core import (CounterMetricFamily, GaugeMetricFamily,
                                            HistogramMetricFamily)

        try:
            documents = self.source()
        except Exception:  # a scrape must not fail because a worker is gone
            documents = []
        labels = ["role", "rank", "peer"]
        up = GaugeMetricFamily("vllm_afd_peer_up", "1 while the AFD link to this peer is up",
                               labels=labels)
        state = GaugeMetricFamily("vllm_afd_link_state",
                                  "1 for the AFD link's current state", labels=[*labels, "state"])
        counters = {
            key: CounterMetricFamily(f"vllm_afd_{key}", text, labels=labels)
            for key, text in (
                ("bytes_sent", "Bytes the AFD link sent (headers and payloads)"),
                ("bytes_received", "Bytes the AFD link received"),
                ("steps", "Model steps through the AFD link"),
                ("layer_calls", "Layer calls (layer x micro-batch) through the AFD link"),
                ("tokens", "Tokens through the remote mlp layers, summed over layer calls"),
                ("reconnects", "AFD link connections made after the first"),
                ("auth_failures", "Peers refused because they failed authentication"),
                ("handshake_failures", "Peers refused because their handshake did not match"),
                ("failovers", "Steps finished on another FFN pool member after one failed"),
                ("resent_layer_calls", "Layer calls sent again to the member taking over"),
                ("aborted_steps", "Steps that lost their FFN pool member on a connector "
                 "checking once per step (ipc), run again whole"),
                ("spin_preemptions", "Waits on the link whose spin lost its core (shm): the "
                 "scheduler ran something else on it"),
                ("spin_backoffs", "Times repeated preemptions turned the link's spinning off "
                 "for a while, so its waits slept (shm)"),
            )}
        member_up = GaugeMetricFamily("vllm_afd_pool_member_up",
                                      "1 while this FFN pool member's link is up",
                                      labels=[*labels, "endpoint"])
        member_calls = CounterMetricFamily("vllm_afd_pool_member_layer_calls",
                                           "Layer calls answered by this FFN pool member",
                                           labels=[*labels, "endpoint"])
        ubatch_steps = CounterMetricFamily("vllm_afd_ubatch_steps",
                                           "Steps run with this many micro-batches",
                                           labels=[*labels, "ubatches"])
        ubatch_chosen = GaugeMetricFamily("vllm_afd_ubatch_chosen",
                                          "Micro-batches the rule runs for steps of these "
                                          "token counts (absent while it probes)",
                                          labels=[*labels, "tokens"])
        errors = CounterMetricFamily("vllm_afd_connector_errors",
                                     "AFD link failures by kind", labels=[*labels, "kind"])
        histograms = {
            key: HistogramMetricFamily(f"vllm_afd_{key}", text, labels=labels)
            for key, text in (
                ("layer_round_trip_seconds",
                 "Attention side: from sending a layer's hidden states to its FFN output"),
                ("ffn_layer_compute_seconds", "FFN side: one mlp call"),
                ("ffn_tokens_per_layer_call", "FFN side: tokens in one mlp call"),
                ("failover_seconds",
                 "Attention side: from losing a pool member mid-step to the resent call's output"),
            )}
        for d in documents:
            values = [str(d.get("role", "")), str(d.get("rank", "")), str(d.get("peer", ""))]
            up.add_metric(values, 1.0 if d.get("state") == "ready" else 0.0)
            state.add_metric([*values, str(d.get("state", ""))], 1.0)
            for key, family in counters.items():
                if key in d:
                    family.add_metric(values, float(d[key]))
            for m in d.get("pool", []):
                member = [*values, str(m.get("endpoint") or m.get("peer", ""))]
                member_up.add_metric(member, 1.0 if m.get("state") == "ready" else 0.0)
                member_calls.add_metric(member, float(m.get("layer_calls", 0)))
            rule = d.get("ubatches") or {}
            for m, count in rule.get("steps", {}).items():
                ubatch_steps.add_metric([*values, m], float(count))
            for bucket, b in rule.get("buckets", {}).items():
                if b.get("chosen") is not None and not b.get("probing"):
                    ubatch_chosen.add_metric([*values, bucket], float(b["chosen"]))
            for kind, count in sorted(d.get("errors", {}).items()):
                errors.add_metric([*values, kind], float(count))
            for key, family in histograms.items():
                h = d.get(key)
                if h:
                    family.add_metric(values, _buckets(h), sum_value=h["sum"])
        yield up
        yield state
        yield from counters.values()
        yield errors
        yield from histograms.values()
        yield member_up
        yield member_calls
        yield ubatch_steps
        yield ubatch_chosen


_registered: set[str] = set()


def register(name: str, source: Callable[[], list[dict]]) -> None:
    """Register a LinkCollector with prometheus_client's default registry
    (the one vLLM's /metrics serves), once per process and name."""
    from prometheus_client import REGISTRY

    if name in _registered:
        return
    REGISTRY.register(LinkCollector(source))
    _registered.add(name)
