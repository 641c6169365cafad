# SPDX-License-Identifier: Apache-2.0
# SPDX-FileCopyrightText: Copyright contributors to the vllm-afd project
"""The FFN role's loop: receive a step, run each layer's mlp, send back. Data plane.

It imports nothing from vLLM: the caller (the vLLM worker adapter, or the
torch-only harness) hands it the layers to serve and a `compute(layer, h,
routing)` that runs one layer's mlp. It runs in a thread that enters the
device and stream of whoever started it, and:

1. warms up: every layer once per token bucket it will see (so compilation,
   JIT and autotuning happen before a peer waits on them), and only then
2. listens, for as long as it runs: each attention peer that connects and
   passes the handshake gets its own session (a connector holding only that
   peer's link, see AFDConnector.accept_session) served by its own thread.
   Peers join and leave at any time; a rank with a live session is refused
   until that session ends, then may reconnect. All sessions hand their
   calls to one LayerBatcher, which joins the same layer of every peer inside
   a step into mlp calls of at most max_tokens tokens (a lone peer's calls
   run at once). In a tensor/expert-parallel FFN server (topology.py) every
   worker computes every token of every peer; only the group's lead answers.
   Its workers' mlp calls meet in vLLM's collectives, so they must be the same
   on all of them: the lead's batcher decides and sends each batch as an order
   over `orders` (ffn/orders.py), the followers' batchers run exactly those.

A failing mlp call is reported to the attention peers whose tokens it held
(an ErrorFrame), so their servers' errors name it, and ends their sessions. A
lost or misbehaving peer (EOF, timeout, protocol error, its ErrorFrame) ends
its own session only: the others' steps go on. A configuration error stops
the loop and is reported through status().
"""

import logging
import os
import threading
import time
from collections.abc import Callable
from functools import partial
from typing import Any

import torch

from vllm.afd.ffn.batcher import LayerBatcher
from vllm.afd.ffn.orders import OrderChannel, OrderError
from vllm.afd.observability.metrics import LATENCY_BUCKETS_S, TOKEN_BUCKETS, Histogram
from vllm.afd.observability.stats import LinkStats, now
from vllm.afd.topology import FFNPlacement
from vllm.afd.transport.auth import AuthConfigError
from vllm.afd.transport.config import LinkConfig
from vllm.afd.transport.connectors.base import AFDConnector
from vllm.afd.transport.connectors.registry import create_connector
from vllm.afd.transport.device import DeviceContext
from vllm.afd.transport.errors import error_kind
from vllm.afd.transport.wire import ProtocolError, Routing

logger = logging.getLogger(__name__)

# compute(layer, hidden_states, routing or None) -> the layer's mlp output
Compute = Callable[[int, torch.Tensor, "Routing | None"], torch.Tensor]

MAX_WARMUP_BUCKETS = 16
# How often the accept loop looks at stop_event (close() wakes it sooner).
ACCEPT_POLL_S = 1.0


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
                 orders: OrderChannel | None = None,
                 on_thread: Callable[[str, DeviceContext], None] | None = None):
        """layers: the decoder layers to serve. routed_layers: MoE layer ->
        experts per token, when gate_on is "attention" (their routing comes
        with the hidden states). warmup_sizes: token counts to warm up with
        (default warmup_buckets(max_tokens); [] for none). orders: the channel
        of a multi-worker group's batch orders (the lead sends, the followers
        follow; None for a worker alone)."""
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
        self.listener: AFDConnector | None = None  # listens; each peer gets a session
        self._sessions: dict[int, AFDConnector] = {}  # attention rank -> its live session
        self._threads: dict[int, threading.Thread] = {}
        self._lock = threading.Lock()
        # Shared by every session: joins the same layer of the peers inside a step.
        role = "alone" if orders is None else "lead" if placement.is_lead else "follower"
        self.batcher = LayerBatcher(self._run_mlp, max_tokens=max_tokens, role=role,
                                    orders=orders, timeout_s=self.config.timeout_s)
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
        self._observed: list[tuple[float, int]] = []  # (seconds, tokens), see fold_observed
        self.sessions = 0  # sessions started (one per accepted attention peer)
        self.errors: dict[str, int] = {}
        self._bytes_closed = [0, 0]  # sent, received by sessions already closed
        self.serving: list[int] = []  # the attention ranks with a live session
        self.since = time.time()  # when serving last changed

    # --- lifecycle -------------------------------------------------------
    def start(self, device: DeviceContext | None = None) -> None:
        """Start serving in a thread that enters device (default: the calling
        thread's current stream on the CPU)."""
        self.device = device or DeviceContext("cpu")
        self.thread = threading.Thread(target=self._run, name="afd-ffn-loop", daemon=True)
        self.thread.start()

    def stop(self, timeout: float = 10.0) -> None:
        """Close the listener and every session (unblocking their receives), and
        wait for the threads."""
        self.stop_event.set()
        self.batcher.close()
        if self.listener is not None:
            self.listener.close()
        with self._lock:
            sessions, threads = list(self._sessions.values()), list(self._threads.values())
        for conn in sessions:
            conn.close()
        deadline = time.monotonic() + timeout
        for thread in [self.thread, *threads]:
            if thread is not None:
                thread.join(max(deadline - time.monotonic(), 0.0))

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
                "batching": self.batcher.role,
                "order_error": None if self.batcher.broken is None else str(self.batcher.broken),
                "serving": list(self.serving), "last_peer_error": self.last_error,
                "last_refusal": self._last_refusal(), "warmup": dict(self.warmup),
                "layers": list(self.layers), "link": self.document()}

    def _last_refusal(self) -> str | None:
        return self.listener.handshake.last_refusal if self.listener is not None else None

    def document(self) -> dict:
        """State and counters of this FFN rank's link, for /metrics."""
        listener = self.listener
        with self._lock:
            sent, received = self._bytes_closed
            for conn in self._sessions.values():
                sent, received = sent + conn.bytes_sent, received + conn.bytes_received
        # The listener counts the refusals of every session's handshake.
        auth = listener.handshake.auth_failures if listener is not None else 0
        handshake = listener.handshake.failures if listener is not None else 0
        stats = self.stats()
        return {"role": "ffn", "rank": self.placement.rank,
                "peer": ",".join(f"attention rank {p}" for p in self.serving) or "-",
                "state": "ready" if self.serving else "waiting", "since": self.since,
                "last_error": self.last_error, "pid": os.getpid(),
                "reconnects": max(0, self.sessions - 1), "errors": dict(self.errors),
                "auth_failures": auth, "handshake_failures": handshake,
                "bytes_sent": sent, "bytes_received": received, "steps": stats.steps,
                "layer_calls": stats.layer_calls, "tokens": stats.tokens,
                "spin_preemptions": stats.spin_preemptions,
                "spin_backoffs": stats.spin_backoffs,
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
        try:
            listener = create_connector(
                self.config, hidden_size=self.hidden_size, dtype=self.dtype,
                max_tokens=self.max_tokens, rank=self.placement.rank,
                ffn_group=self.placement.group, routing_topk=self.routing_topk,
                fingerprint=self.fingerprint, device=self.device.device,
                **self.connector_kwargs)
        except Exception as e:  # a configuration error: nothing to retry
            self.error = f"{type(e).__name__}: {e}"
            logger.error("AFD FFN loop cannot start: %s", self.error)
            return
        self.listener = listener
        try:
            if self._listen(listener):
                self._accept_loop(listener)
        finally:
            listener.close()

    def _listen(self, listener: AFDConnector) -> bool:
        """Listen on the rank's address, retrying while it is taken (e.g. by a
        server going away); False if the loop stopped or cannot serve."""
        while not self.stop_event.is_set():
            try:
                listener.listen()
                return True
            except (AuthConfigError, NotImplementedError) as e:
                # A public address without a secret; a transport without sessions.
                self.error = f"{type(e).__name__}: {e}"
                logger.error("AFD FFN loop cannot serve: %s", self.error)
                return False
            except Exception as e:
                if self.stop_event.is_set():
                    break
                self._peer_failed(None, e)
                self.stop_event.wait(0.5)  # do not spin while the port is taken
        return False

    def _accept_loop(self, listener: AFDConnector) -> None:
        """Give each attention peer that comes its own session, any time."""
        while not self.stop_event.is_set():
            try:
                self.batcher.keepalive()  # a lead idle for long: its followers hear it
            except Exception as e:  # noqa: BLE001 - the followers time out and say so
                logger.warning("AFD FFN rank %d: keepalive to the followers failed: %s",
                               self.placement.rank, e)
            try:
                # busy is read when a Hello arrives: a live view of the sessions.
                conn = listener.accept_session(ACCEPT_POLL_S, busy=self._sessions.keys())
            except Exception as e:
                if self.stop_event.is_set():
                    break
                self._peer_failed(None, e)  # e.g. shared memory could not be reserved
                self.stop_event.wait(0.5)
                continue
            if conn is None:
                continue  # nobody came, or whoever came was refused (counted on the listener)
            [peer] = conn.connected_peers
            thread = threading.Thread(target=self._session, args=(peer, conn),
                                      name=f"afd-ffn-peer-{peer}", daemon=True)
            with self._lock:
                if self.stop_event.is_set():  # stop() closed the others already
                    conn.close()
                    break
                self._sessions[peer] = conn
                self._threads[peer] = thread
                self.sessions += 1
                self._changed()
            logger.info("AFD FFN rank %d (group %s) serving layers %s for attention rank %d "
                        "(now serving %s)", self.placement.rank, self.placement.group,
                        list(self.layers), peer, self.serving)
            thread.start()

    def _session(self, peer: int, conn: AFDConnector) -> None:
        """One attention peer's session, on its own thread: it ends with that
        peer (goodbye, or its failure) and touches nobody else's."""
        try:
            with self.device.entered(), torch.inference_mode():
                self._serve_peer(peer, conn)
        except BaseException as e:  # noqa: BLE001 - this peer's failure only
            if not self.stop_event.is_set():
                self._peer_failed(peer, e)
        finally:
            conn.close()
            # Before the rank may connect again (still in _sessions): the
            # followers drop its call that no order will name.
            self.batcher.leave(peer)
            with self._lock:
                if self._sessions.get(peer) is conn:
                    del self._sessions[peer]
                    self._threads.pop(peer, None)
                self._bytes_closed[0] += conn.bytes_sent
                self._bytes_closed[1] += conn.bytes_received
                self._changed()

    def _changed(self) -> None:
        """The set of peers served changed (called with self._lock held)."""
        self.serving = sorted(self._sessions)
        self.since = time.time()

    def _peer_failed(self, peer: int | None, error: BaseException) -> None:
        self.last_error = f"{type(error).__name__}: {error}"
        kind = error_kind(error)
        self.errors[kind] = self.errors.get(kind, 0) + 1
        if peer is not None:
            logger.warning("AFD FFN rank %d: attention rank %d lost: %s; still serving %s",
                           self.placement.rank, peer, self.last_error,
                           [p for p in self.serving if p != peer])
        else:
            logger.warning("AFD FFN rank %d: %s; listening again", self.placement.rank,
                           self.last_error)

    def _compute_error(self, layer_idx: int, rows: int, e: Exception) -> FFNComputeError:
        return FFNComputeError(f"FFN rank {self.placement.rank}: the mlp of layer "
                               f"{layer_idx} failed on {rows} token(s): "
                               f"{type(e).__name__}: {e}")

    def _run_mlp(self, layer_idx: int, h: torch.Tensor, routing: Routing | None = None,
                 reply: Callable[[torch.Tensor], None] | None = None) -> torch.Tensor:
        """The batcher's run_mlp. reply (a lone call's): called with the output
        as soon as it exists, before this function's bookkeeping (between an
        mlp and its reply even a tensor's attribute costs a microsecond)."""
        t0 = now()
        try:
            out = self.compute_fn(layer_idx, h, routing)
        except Exception as e:
            raise self._compute_error(layer_idx, h.shape[0], e) from e
        t1 = now()
        if reply is not None:
            reply(out)
        self.compute.compute_s += t1 - t0
        # Into the histograms when the step ends (fold_observed): two calls
        # fewer per layer call.
        self._observed.append((t1 - t0, len(h)))  # len: a C slot, not a Size built
        return out

    def fold_observed(self) -> None:
        """The mlp calls' times and sizes so far into the /metrics histograms."""
        observed = self._observed  # other sessions' threads may append meanwhile
        n = len(observed)
        taken = observed[:n]
        del observed[:n]
        for elapsed, tokens in taken:
            self.compute_hist.observe(elapsed)
            self.tokens_hist.observe(tokens)

    def _serve_peer(self, peer: int, conn: AFDConnector) -> None:
        """Serve one attention peer's steps until it says goodbye.

        Micro-batches come layer by layer: (layer 0, ubatch 0), (layer 0, ubatch
        1), ..., (layer 1, ubatch 0), ... While this side computes one, the
        attention side computes attention for the next (ping-pong). A resumed
        step (StepHeader.from_layer) skips, per micro-batch, the layers done
        elsewhere."""
        answer, batcher = self.placement.is_lead, self.batcher
        stats = self.peer_stats.setdefault(peer, LinkStats())
        spin_seen = [0, 0]  # this session's connector's spin counters, counted so far
        while not self.stop_event.is_set():
            header = conn.recv_step(peer)
            if header.is_goodbye or header.is_shutdown:
                logger.info("AFD FFN: attention rank %d said goodbye", peer)
                return
            num_tokens, from_layer = header.num_tokens, header.from_layer
            # (layer, micro-batch) in the order they come; a resumed step
            # (failover) skips, per micro-batch, the layers done elsewhere.
            calls = [(layer_idx, u) for layer_idx in self.layers for u in range(len(num_tokens))
                     if not (from_layer and layer_idx < from_layer[u])]
            batcher.begin(peer)
            t_step = now()
            routed_topk = self.routing_topk
            # One path for every call: take its hidden states, compute (alone
            # at once, or joined with other peers' calls: batcher.py), and the
            # lead replies as soon as the output exists (inside compute, before
            # the batcher's bookkeeping). Between a received call and its mlp,
            # and between the mlp and its reply, as little as possible: after
            # an mlp has streamed its weights through the caches every Python
            # line costs ~1 us, on the path both sides wait on. So no
            # per-call counting here (the step's counts come after it).
            # Each call's reply, made before the step's first call arrives.
            replies = ([partial(conn.reply_call, peer, layer_idx, u) for layer_idx, u in calls]
                       if answer else [None] * len(calls))
            try:
                for (layer_idx, u), reply in zip(calls, replies):
                    t0 = now()
                    h = conn.take_call(peer, layer_idx, u)
                    stats.wait_s += now() - t0
                    # Without routed layers no routing can come (the connector
                    # was built without: routing_topk 0).
                    routing = (self._routing_of(conn, peer, layer_idx, u) if routed_topk
                               else None)
                    try:
                        batcher.compute(layer_idx, h, peer, routing, reply)
                    except (FFNComputeError, OrderError) as e:
                        # The attention side fails with this text, not "goodbye".
                        conn.report_error(str(e))
                        raise
            finally:
                batcher.end(peer)
                self.fold_observed()
                stats.send_s += conn.take_reply_send_s(peer)
            stats.step_wall_s += now() - t_step
            stats.steps += 1
            stats.layer_calls += len(calls)
            if routed_topk:  # every call of a routed layer came with its routing
                stats.routed_calls += sum(layer in self.routed_layers for layer, _ in calls)
            stats.tokens += sum(num_tokens[u] for _, u in calls)
            stats.add_spin(spin_seen, conn.spin_counters(peer))

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
