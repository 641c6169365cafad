# SPDX-License-Identifier: Apache-2.0
# SPDX-FileCopyrightText: Copyright contributors to the vllm-afd project
"""The FFN role's worker loop: receive a step, run each layer's mlp, send back.

Runs in a thread of the worker process that holds the (FFN-only) model. With
one attention peer the loop serves it directly; with several (A > F), one
thread per peer receives and answers, and a LayerBatcher joins their
same-layer calls into one mlp call. In a tensor/expert-parallel FFN server
every worker computes every token; only the group's lead answers.

With gate_on "attention" the MoE layers' routing comes with their hidden
states and the mlp runs with it (vllm.afd.routing.call_with_routing).

A failure is kept and reported through status(); the engine turns it into an
unhealthy /health and a log line naming the peer, layer and error.
"""

import os
import threading
import time

import torch

from vllm.afd.auth import AuthConfigError
from vllm.afd.batcher import LayerBatcher
from vllm.afd.fingerprint import model_fingerprint
from vllm.afd.link import _error_kind
from vllm.afd.metrics import LATENCY_BUCKETS_S, TOKEN_BUCKETS, Histogram
from vllm.afd.connectors.base import AFDConnector, AFDTimeoutError, create_connector
from vllm.afd.model_split import ffn_layers
from vllm.afd.routing import call_with_routing
from vllm.afd.stats import LinkStats, now
from vllm.afd.topology import ffn_placement
from vllm.afd.wire import ProtocolError, Routing
from vllm.forward_context import create_forward_context, override_forward_context
from vllm.logger import init_logger

logger = init_logger(__name__)


class FFNLoop:
    def __init__(self, vllm_config, model: torch.nn.Module, worker_rank: int = 0):
        self.vllm_config = vllm_config
        self.afd_config = vllm_config.afd_config
        self.placement = ffn_placement(vllm_config, worker_rank)
        self.layers = ffn_layers(model)
        if not self.layers:
            raise RuntimeError("AFD FFN role: the model has no mlp layers to serve")
        # gate_on "attention": MoE layer -> experts per token of its routing.
        self.routed_layers: dict[int, int] = dict(getattr(model, "afd_routed_layers", {}))
        self.routing_topk = max(self.routed_layers.values(), default=0)
        mc = vllm_config.model_config
        self.hidden_size = mc.get_hidden_size()
        self.dtype = mc.dtype
        self.max_tokens = vllm_config.scheduler_config.max_num_batched_tokens
        self.connector: AFDConnector | None = None
        self.stop_event = threading.Event()
        self.thread: threading.Thread | None = None
        self.error: str | None = None  # fatal: the loop stopped
        self.last_error: str | None = None  # the last peer's failure
        self.peer_stats: dict[int, LinkStats] = {}
        self.compute = LinkStats()  # mlp time, shared by all peers' calls
        self.ready = threading.Event()
        self._ctx = None
        # For /metrics (vllm.afd.metrics): totals over every session so far.
        self.compute_hist = Histogram(LATENCY_BUCKETS_S)
        self.tokens_hist = Histogram(TOKEN_BUCKETS)
        self.sessions = 0  # times this rank started serving its attention peers
        self.errors: dict[str, int] = {}
        self._bytes_closed = [0, 0]  # sent, received by connectors already closed
        self._refusals_closed = [0, 0]  # auth, handshake failures of closed connectors
        self.serving: list[int] = []  # the attention ranks being served now
        self.last_refusal: str | None = None  # the last peer refused at the handshake
        self.since = time.time()
        self.fingerprint = model_fingerprint(vllm_config)

    # --- lifecycle -------------------------------------------------------
    def start(self) -> None:
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
                "last_refusal": self._last_refusal(),
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
            auth += getattr(conn, "auth_failures", 0)
            handshake += getattr(conn, "handshake_failures", 0)
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
        self.ready.set()
        while not self.stop_event.is_set():
            try:
                self.connector = create_connector(
                    self.afd_config, hidden_size=self.hidden_size, dtype=self.dtype,
                    max_tokens=self.max_tokens, rank=self.placement.rank,
                    ffn_group=self.placement.group, routing_topk=self.routing_topk,
                    fingerprint=self.fingerprint)
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
                    self._refusals_closed[0] += getattr(conn, "auth_failures", 0)
                    self._refusals_closed[1] += getattr(conn, "handshake_failures", 0)
                    self.last_refusal = getattr(conn, "last_refusal", None) or self.last_refusal

    def _peer_failed(self, error: BaseException) -> None:
        self.last_error = f"{type(error).__name__}: {error}"
        kind = _error_kind(error)
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
        self._ctx = create_forward_context(None, self.vllm_config)
        if len(peers) == 1:
            self._serve_peer(peers[0], lambda layer, h, peer, routing:
                             self._run_mlp(layer, h, routing))
            return
        batcher = LayerBatcher(self._run_mlp)
        errors: list[BaseException] = []

        def serve(peer: int) -> None:
            try:
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
        with override_forward_context(self._ctx):
            out = call_with_routing(self.layers[layer_idx], h, routing)
        elapsed = now() - t0
        self.compute.compute_s += elapsed
        self.compute_hist.observe(elapsed)
        self.tokens_hist.observe(h.shape[0])
        return out

    @torch.inference_mode()
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
                        h = conn.recv_hidden(peer, layer_idx, u)
                        routing = self._routing_of(conn, peer, layer_idx, u)
                        t1 = now()
                        out = compute(layer_idx, h, peer, routing)
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

