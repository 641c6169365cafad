# SPDX-License-Identifier: Apache-2.0
# SPDX-FileCopyrightText: Copyright contributors to the vllm-afd project
"""The FFN role's loop: receive a step, run each layer's mlp, send back. Data plane.

It imports nothing from vLLM: the caller (the vLLM worker adapter, or the
torch-only harness) hands it the layers to serve and a `compute(layer, h,
routing)` that runs one layer's mlp. It runs in a thread that enters the
device and stream of whoever started it, and:

1. warms up: every layer once per token bucket it will see (so compilation,
   JIT and autotuning happen before a peer waits on them), and only then
2. listens. With one attention peer it serves it directly; with several
   (A > F), one thread per peer receives and answers, and a LayerBatcher joins
   their same-layer calls into mlp calls of at most max_tokens tokens. In a
   tensor/expert-parallel FFN server every worker computes every token; only
   the group's lead answers.

A failing mlp call is reported to the attention side with its text (an
ErrorFrame), so the attention server's error names it. A lost or misbehaving
peer ends its session and the loop listens again; a configuration error
stops the loop and is reported through status().
"""

import logging
import os
import threading
import time
from collections.abc import Callable
from typing import Any

import torch

from vllm.afd.ffn.batcher import LayerBatcher
from vllm.afd.observability.metrics import LATENCY_BUCKETS_S, TOKEN_BUCKETS, Histogram
from vllm.afd.observability.stats import LinkStats, now
from vllm.afd.topology import FFNPlacement
from vllm.afd.transport.auth import AuthConfigError
from vllm.afd.transport.config import LinkConfig
from vllm.afd.transport.connectors.base import AFDConnector, AFDTimeoutError
from vllm.afd.transport.connectors.registry import create_connector
from vllm.afd.transport.device import DeviceContext
from vllm.afd.transport.errors import error_kind
from vllm.afd.transport.wire import ProtocolError, Routing

logger = logging.getLogger(__name__)

# compute(layer, hidden_states, routing or None) -> the layer's mlp output
Compute = Callable[[int, torch.Tensor, "Routing | None"], torch.Tensor]

MAX_WARMUP_BUCKETS = 16


class FFNComputeError(RuntimeError):
    """An mlp call failed on the FFN side (reported to the attention side)."""


def warmup_buckets(max_tokens: int) -> list[int]:
    """Token counts the FFN warms up with: powers of two up to max_tokens, and
    max_tokens itself (the shapes a batch is padded or split to)."""
    sizes, n = set(), 1
    while n < max_tokens:
        sizes.add(n)
        n *= 2
    sizes.add(max_tokens)
    sizes = sorted(sizes)
    if len(sizes) > MAX_WARMUP_BUCKETS:
        sizes = sizes[-MAX_WARMUP_BUCKETS:]
    return sizes


class FFNLoop:
    def __init__(self, config: LinkConfig, *, layers: list[int], compute: Compute,
                 hidden_size: int, dtype: torch.dtype, max_tokens: int,
                 placement: FFNPlacement, routed_layers: dict[int, int] | None = None,
                 fingerprint: dict[str, str] | None = None,
                 connector_kwargs: dict[str, Any] | None = None,
                 warmup_sizes: list[int] | None = None,
                 on_thread: Callable[[str, DeviceContext], None] | None = None):
        """layers: the decoder layers to serve. routed_layers: MoE layer ->
        experts per token, when gate_on is "attention" (their routing comes
        with the hidden states). warmup_sizes: token counts to warm up with
        (default warmup_buckets(max_tokens); [] for none)."""
        self.config = LinkConfig.of(config)
        self.placement = placement
        self.layers = sorted(layers)
        if not self.layers:
            raise RuntimeError("AFD FFN role: the model has no mlp layers to serve")
        self.compute_fn = compute
        self.routed_layers = dict(routed_layers or {})
        self.routing_topk = max(self.routed_layers.values(), default=0)
        self.hidden_size = hidden_size
        self.dtype = dtype
        self.max_tokens = max_tokens
        self.fingerprint = dict(fingerprint or {})
        self.connector_kwargs = dict(connector_kwargs or {})
        self.warmup_sizes = (warmup_buckets(max_tokens) if warmup_sizes is None
                             else list(warmup_sizes))
        self._on_thread = on_thread
        self.device: DeviceContext | None = None  # set by start()
        self.connector: AFDConnector | None = None
        self.stop_event = threading.Event()
        self.thread: threading.Thread | None = None
        self.error: str | None = None  # fatal: the loop stopped
        self.last_error: str | None = None  # the last peer's failure
        self.peer_stats: dict[int, LinkStats] = {}
        self.compute = LinkStats()  # mlp time, shared by all peers' calls
        self.ready = threading.Event()  # warmed up; listening from now on
        self.warmup: dict[str, Any] = {}
        # For /metrics: totals over every session so far.
        self.compute_hist = Histogram(LATENCY_BUCKETS_S)
        self.tokens_hist = Histogram(TOKEN_BUCKETS)
        self.sessions = 0  # times this rank started serving its attention peers
        self.errors: dict[str, int] = {}
        self._bytes_closed = [0, 0]  # sent, received by connectors already closed
        self._refusals_closed = [0, 0]  # auth, handshake failures of closed connectors
        self.serving: list[int] = []  # the attention ranks being served now
        self.last_refusal: str | None = None  # the last peer refused at the handshake
        self.since = time.time()

    # --- lifecycle -------------------------------------------------------
    def start(self, device: DeviceContext | None = None) -> None:
        """Start serving in a thread that enters device (default: the calling
        thread's current stream on the CPU)."""
        self.device = device or DeviceContext("cpu")
        self.thread = threading.Thread(target=self._run, name="afd-ffn-loop", daemon=True)
        self.thread.start()

    def stop(self, timeout: float = 10.0) -> None:
        self.stop_event.set()
        if self.connector is not None:
            self.connector.close()  # unblocks a pending receive
        if self.thread is not None:
            self.thread.join(timeout)

    def stats(self) -> LinkStats:
        total = LinkStats()
        for s in list(self.peer_stats.values()):
            for k, v in s.as_dict().items():
                setattr(total, k, getattr(total, k) + v)
        total.compute_s = self.compute.compute_s
        return total

    def status(self) -> dict:
        stats = self.stats()
        return {"running": self.thread is not None and self.thread.is_alive(),
                "ready": self.ready.is_set(), "error": self.error,
                "steps": stats.steps, "stats": stats.as_dict(),
                "rank": self.placement.rank, "group": self.placement.group,
                "serving": list(self.serving), "last_peer_error": self.last_error,
                "last_refusal": self._last_refusal(), "warmup": dict(self.warmup),
                "layers": list(self.layers), "link": self.document()}

    def _last_refusal(self) -> str | None:
        conn = self.connector
        return (getattr(conn, "last_refusal", None) if conn is not None else None) \
            or self.last_refusal

    def document(self) -> dict:
        """State and counters of this FFN rank's link, for /metrics."""
        conn = self.connector
        sent, received = self._bytes_closed
        auth, handshake = self._refusals_closed
        if conn is not None:
            sent, received = sent + conn.bytes_sent, received + conn.bytes_received
            auth += conn.auth_failures
            handshake += conn.handshake_failures
        stats = self.stats()
        return {"role": "ffn", "rank": self.placement.rank,
                "peer": ",".join(f"attention rank {p}" for p in self.serving) or "-",
                "state": "ready" if self.serving else "waiting", "since": self.since,
                "last_error": self.last_error, "pid": os.getpid(),
                "reconnects": max(0, self.sessions - 1), "errors": dict(self.errors),
                "auth_failures": auth, "handshake_failures": handshake,
                "bytes_sent": sent, "bytes_received": received, "steps": stats.steps,
                "layer_calls": stats.layer_calls, "tokens": stats.tokens,
                "ffn_layer_compute_seconds": self.compute_hist.as_dict(),
                "ffn_tokens_per_layer_call": self.tokens_hist.as_dict()}

    # --- the loop --------------------------------------------------------
    def _run(self) -> None:
        with self.device.entered() as context, torch.inference_mode():
            if self._on_thread is not None:
                self._on_thread("afd-ffn-loop", context)
            try:
                self._warm_up()
            except Exception as e:  # noqa: BLE001 - reported through status()
                self.error = f"warm-up failed: {type(e).__name__}: {e}"
                logger.exception("AFD FFN rank %d: %s", self.placement.rank, self.error)
                return
            self.ready.set()
            self._listen_loop()

    def _warm_up(self) -> None:
        """Every layer at every warm-up size, before any peer is accepted."""
        t0 = time.monotonic()
        calls = 0
        for n in self.warmup_sizes:
            if self.stop_event.is_set():
                return
            h = torch.zeros(n, self.hidden_size, dtype=self.dtype, device=self.device.device)
            for layer in self.layers:
                routing = None
                topk = self.routed_layers.get(layer, 0)
                if topk:
                    ids = (torch.arange(n * topk, device=h.device, dtype=torch.int32)
                           % max(topk, 1)).view(n, topk)
                    routing = Routing(torch.full((n, topk), 1.0 / topk, device=h.device),
                                      ids)
                self.compute_fn(layer, h, routing)
                calls += 1
        self.warmup = {"sizes": list(self.warmup_sizes), "calls": calls,
                       "seconds": round(time.monotonic() - t0, 3)}
        if calls:
            logger.info("AFD FFN rank %d warmed up %d layer(s) x %d size(s) (%s) in %.1fs",
                        self.placement.rank, len(self.layers), len(self.warmup_sizes),
                        self.warmup_sizes, self.warmup["seconds"])

    def _listen_loop(self) -> None:
        while not self.stop_event.is_set():
            try:
                self.connector = create_connector(
                    self.config, hidden_size=self.hidden_size, dtype=self.dtype,
                    max_tokens=self.max_tokens, rank=self.placement.rank,
                    ffn_group=self.placement.group, routing_topk=self.routing_topk,
                    fingerprint=self.fingerprint, device=self.device.device,
                    **self.connector_kwargs)
            except Exception as e:  # a configuration error: nothing to retry
                self.error = f"{type(e).__name__}: {e}"
                logger.error("AFD FFN loop cannot start: %s", self.error)
                return
            try:
                self._serve_peers()
            except AuthConfigError as e:  # e.g. a public address without a secret
                self.error = f"{type(e).__name__}: {e}"
                logger.error("AFD FFN loop cannot serve: %s", self.error)
                return
            except AFDTimeoutError as e:
                if self.serving:  # a peer stopped answering mid-step
                    self._peer_failed(e)
                continue  # otherwise nobody connected within timeout_s: keep waiting
            except Exception as e:
                if self.stop_event.is_set():
                    break
                # A lost or misbehaving peer ends its conversation, not the server.
                if not self.serving:  # e.g. the port is still taken: do not spin
                    self.stop_event.wait(0.5)
                self._peer_failed(e)
            finally:
                self.serving = []
                self.since = time.time()
                conn, self.connector = self.connector, None
                if conn is not None:
                    conn.close()
                    self._bytes_closed[0] += conn.bytes_sent
                    self._bytes_closed[1] += conn.bytes_received
                    self._refusals_closed[0] += conn.auth_failures
                    self._refusals_closed[1] += conn.handshake_failures
                    self.last_refusal = conn.last_refusal or self.last_refusal

    def _peer_failed(self, error: BaseException) -> None:
        self.last_error = f"{type(error).__name__}: {error}"
        kind = error_kind(error)
        self.errors[kind] = self.errors.get(kind, 0) + 1
        if self.serving:
            logger.warning("AFD FFN rank %d: attention peer(s) %s lost: %s; waiting for the "
                           "next one", self.placement.rank, self.serving, self.last_error)
        else:
            logger.warning("AFD FFN rank %d: %s; listening again", self.placement.rank,
                           self.last_error)

    def _serve_peers(self) -> None:
        self.connector.accept()
        peers = self.connector.connected_peers
        self.serving, self.since = list(peers), time.time()
        self.sessions += 1
        logger.info("AFD FFN rank %d (group %s) serving layers %s for attention rank(s) %s",
                    self.placement.rank, self.placement.group, list(self.layers), peers)
        if len(peers) == 1:
            self._serve_peer(peers[0], lambda layer, h, peer, routing:
                             self._run_mlp(layer, h, routing))
            return
        batcher = LayerBatcher(self._run_mlp, max_tokens=self.max_tokens)
        errors: list[BaseException] = []
        device = self.device

        def serve(peer: int) -> None:
            try:
                with device.entered(), torch.inference_mode():
                    self._serve_peer(peer, batcher.compute, batcher)
            except BaseException as e:  # noqa: BLE001 - reported below
                errors.append(e)
                batcher.abort(e)
                self.connector.close()  # the others' receives end too

        threads = [threading.Thread(target=serve, args=(p,), name=f"afd-ffn-peer-{p}",
                                    daemon=True) for p in peers]
        for t in threads:
            t.start()
        for t in threads:
            t.join()
        if errors:
            raise errors[0]

    def _run_mlp(self, layer_idx: int, h: torch.Tensor,
                 routing: Routing | None = None) -> torch.Tensor:
        t0 = now()
        try:
            out = self.compute_fn(layer_idx, h, routing)
        except Exception as e:
            raise FFNComputeError(f"FFN rank {self.placement.rank}: the mlp of layer "
                                  f"{layer_idx} failed on {h.shape[0]} token(s): "
                                  f"{type(e).__name__}: {e}") from e
        elapsed = now() - t0
        self.compute.compute_s += elapsed
        self.compute_hist.observe(elapsed)
        self.tokens_hist.observe(h.shape[0])
        return out

    def _serve_peer(self, peer: int, compute, batcher: LayerBatcher | None = None) -> None:
        """Serve one attention peer's steps until it says goodbye.

        Micro-batches come layer by layer: (layer 0, ubatch 0), (layer 0, ubatch
        1), ..., (layer 1, ubatch 0), ... While this side computes one, the
        attention side computes attention for the next (ping-pong)."""
        conn, answer = self.connector, self.placement.is_lead
        stats = self.peer_stats.setdefault(peer, LinkStats())
        while not self.stop_event.is_set():
            header = conn.recv_step(peer)
            if header.is_goodbye or header.is_shutdown:
                logger.info("AFD FFN: attention rank %d said goodbye", peer)
                return
            num_ubatches = len(header.num_tokens)
            if batcher is not None:
                batcher.begin(peer)
            t_step = now()
            routed = 0
            try:
                for layer_idx in self.layers:
                    for u in range(num_ubatches):
                        t0 = now()
                        # With a batcher, fp8 hidden states stay packed: it
                        # unpacks them straight into the joined MoE input.
                        h = conn.recv_hidden(peer, layer_idx, u, defer=batcher is not None)
                        routing = self._routing_of(conn, peer, layer_idx, u)
                        t1 = now()
                        try:
                            out = compute(layer_idx, h, peer, routing)
                        except FFNComputeError as e:
                            # The attention side fails with this text, not "goodbye".
                            conn.report_error(str(e))
                            raise
                        routed += routing is not None
                        t2 = now()
                        if answer:
                            conn.send_output(peer, layer_idx, u, out)
                        stats.wait_s += t1 - t0
                        stats.send_s += now() - t2
            finally:
                if batcher is not None:
                    batcher.end(peer)
            stats.step_wall_s += now() - t_step
            stats.steps += 1
            stats.layer_calls += len(self.layers) * num_ubatches
            stats.routed_calls += routed
            stats.tokens += len(self.layers) * sum(header.num_tokens)

    def _routing_of(self, conn: AFDConnector, peer: int, layer_idx: int,
                    ubatch: int) -> Routing | None:
        """The routing that came with (layer, ubatch): present exactly for the
        MoE layers when gate_on is "attention" (the connector checked its width)."""
        routing = conn.routing(peer, ubatch)
        expected = layer_idx in self.routed_layers
        if (routing is not None) != expected:
            error = ProtocolError(
                f"layer {layer_idx} from attention rank {peer}: expected "
                f"{'routing' if expected else 'no routing'} with the hidden states, received "
                f"{'none' if routing is None else 'routing'} (gate_on must match on both roles)")
            conn.report_error(str(error))
            raise error
        return routing
