# SPDX-License-Identifier: Apache-2.0
# SPDX-FileCopyrightText: Copyright contributors to the vllm-afd project
"""The attention role's end of the link: one per process, shared by every RemoteFFN.

Each forward pass is one step: the first remote layer of a pass announces the
step (StepHeader), then every layer sends its hidden states and waits for the
FFN's result. With gate_on "attention", MoE layers pass their routing along
(vllm.afd.routing).

The connection is kept by a supervisor thread, started once the model is
built: it dials the FFN rank (and the rest of its tensor/expert-parallel
group), retries with backoff while the FFN is not there or refuses us, and
reconnects when a step loses it. A step never waits for a connection: while
the link is not up, or when it breaks mid-step, the step raises AFDLinkDown at
once, the engine fails that step's requests with the reason
(vllm.afd.failover) and keeps serving; the API server answers 503 meanwhile
(vllm.afd.api). The state and counters are published for the API server's
/health and /metrics (vllm.afd.link_status, vllm.afd.metrics).

Warm-up and profile runs (no attention metadata) never touch the link: the
attention server starts, compiles and serves /health without an FFN.
"""

import atexit
import os
import threading
import time

import torch

from vllm.afd import link_status
from vllm.afd.config import AFDConfig
from vllm.afd.fingerprint import model_fingerprint
from vllm.afd.failover import AFDLinkDown
from vllm.afd.metrics import LATENCY_BUCKETS_S, Histogram
from vllm.afd.stats import LinkStats, now
from vllm.afd.topology import attention_rank
from vllm.logger import init_logger

logger = init_logger(__name__)

# Between connection attempts after a failure (an attempt itself dials for up
# to timeout_s, retrying every 0.05-0.5 s).
RECONNECT_BACKOFF_S = (0.5, 5.0)
PUBLISH_INTERVAL_S = 1.0

_link: "AttentionLink | None" = None
_link_lock = threading.Lock()


def _is_dummy_run() -> bool:
    """A warm-up, profile or compile run: real shapes, no attention metadata
    (what vLLM's attention backends also test for)."""
    from vllm.forward_context import get_forward_context, is_forward_context_available

    return not is_forward_context_available() or get_forward_context().attn_metadata is None


def _error_kind(error: BaseException) -> str:
    from vllm.afd.connectors.errors import AFDTimeoutError
    from vllm.afd.wire import ProtocolError

    if isinstance(error, AFDTimeoutError):
        return "timeout"
    if isinstance(error, ProtocolError):
        return "protocol"
    return "connection"


class AttentionLink:
    def __init__(self, afd_config: AFDConfig, hidden_size: int, dtype: torch.dtype,
                 max_tokens: int, rank: int = 0, fingerprint: dict[str, str] | None = None):
        self.afd_config = afd_config
        self.hidden_size = hidden_size
        self.dtype = dtype
        self.max_tokens = max_tokens
        self.rank = rank
        self.fingerprint = dict(fingerprint or {})
        self.layers: list[int] = []
        self.routing_topk = 0  # experts per token of the routed layers (0: none)
        self.step_id = 0
        self.connector = None  # the FFN rank that answers (its group's lead)
        self.followers: list = []  # the other ranks of its group: they only listen
        self.stats = LinkStats()
        self.round_trip = Histogram(LATENCY_BUCKETS_S)
        ffn_rank = rank % afd_config.num_ffn_ranks
        self.peer = (f"FFN rank {ffn_rank} ({afd_config.connector} "
                     f"{afd_config.host}:{afd_config.port + ffn_rank})")
        self.state = link_status.STARTING
        self.since = time.time()
        self.last_error: str | None = None
        self.errors: dict[str, int] = {}
        self.connects = 0
        self._bytes_closed = [0, 0]  # sent, received by connectors already closed
        self._step_start = 0.0
        self._step_calls_left = 0
        self._lock = threading.Lock()
        self._state_changed = threading.Condition(self._lock)
        self._publish_lock = threading.Lock()
        self._wake = threading.Event()
        self._closed = threading.Event()
        self._connecting: list = []  # connectors being connected: close() interrupts them
        self._thread: threading.Thread | None = None
        self._last_logged = ""

    def add_layer(self, layer_idx: int, routing_topk: int = 0) -> None:
        """Register a remote layer; routing_topk > 0: it sends routing that wide."""
        if layer_idx not in self.layers:
            self.layers.append(layer_idx)
            self.layers.sort()
        self.routing_topk = max(self.routing_topk, routing_topk)

    # ----------------------------------------------------------- supervision
    def start(self) -> None:
        """Start keeping the connection (after the model registered its layers)."""
        with self._lock:
            if self._thread is not None or self._closed.is_set():
                return
            self._thread = threading.Thread(target=self._supervise, name="afd-link",
                                            daemon=True)
            self._thread.start()

    def _supervise(self) -> None:
        backoff = RECONNECT_BACKOFF_S[0]
        while not self._closed.is_set():
            if self.connector is None:
                with self._lock:
                    if self.state == link_status.STARTING:
                        self._set_state(link_status.CONNECTING)
                self._publish()
                try:
                    lead, followers = self._connect()
                except Exception as e:  # noqa: BLE001 - kept as the link's state
                    if self._closed.is_set():
                        break
                    from vllm.afd.wire import ProtocolError

                    refused = isinstance(e, ProtocolError)
                    with self._lock:
                        self._count_error(e)
                        self._set_state(
                            link_status.REFUSED if refused else
                            link_status.DOWN if self.connects else link_status.CONNECTING,
                            error=f"{type(e).__name__}: {e}")
                    # The same failure again (an FFN still down or still
                    # mismatched) is logged once, then at debug level.
                    repeated = str(e) == self._last_logged
                    self._last_logged = str(e)
                    (logger.debug if repeated else logger.error if refused else logger.warning)(
                        "AFD attention rank %d: no link to %s: %s; retrying every %.0f-%.0fs",
                        self.rank, self.peer, e, *RECONNECT_BACKOFF_S)
                    self._publish()
                    self._wake.wait(backoff)
                    self._wake.clear()
                    backoff = min(backoff * 2, RECONNECT_BACKOFF_S[1])
                    continue
                with self._lock:
                    if self._closed.is_set():
                        for c in [lead, *followers]:
                            c.close()
                        break
                    self.connector, self.followers = lead, followers
                    self.connects += 1
                    self._set_state(link_status.READY)
                backoff = RECONNECT_BACKOFF_S[0]
                logger.info("AFD attention rank %d: link to %s is up%s", self.rank, self.peer,
                            f" (reconnect {self.connects - 1})" if self.connects > 1 else "")
            else:
                self._check_idle_peer()
            self._publish()
            self._wake.wait(PUBLISH_INTERVAL_S)
            self._wake.clear()
        self._publish()

    def _check_idle_peer(self) -> None:
        """Between steps nobody reads the link: notice an FFN that went away
        (said goodbye on SIGTERM, or died) so /health says so before the next
        request fails on it."""
        with self._lock:
            connectors = ([self.connector] if self.connector is not None else []) \
                + self.followers
            gone = [c for c in connectors if getattr(c, "peer_closed", lambda: False)()]
            if not gone:
                return
            error = f"{gone[0].peer_name(0)} at {gone[0].address} closed the connection"
            self.errors["connection"] = self.errors.get("connection", 0) + 1
            self._set_state(link_status.DOWN, error=error)
            self._drop_connectors()
        logger.warning("AFD attention rank %d: %s; reconnecting", self.rank, error)

    def _connect(self):
        """Connect to the FFN rank and, for a tensor/expert-parallel FFN server,
        every rank of its group (each gets every token; the lead answers)."""
        from vllm.afd.connectors.base import create_connector

        kwargs = dict(hidden_size=self.hidden_size, dtype=self.dtype,
                      max_tokens=self.max_tokens, rank=self.rank,
                      routing_topk=self.routing_topk)
        if self.fingerprint:
            kwargs["fingerprint"] = self.fingerprint
        first = create_connector(self.afd_config, **kwargs)
        connectors = {first.ffn_rank: first}
        self._connecting = [first]
        try:
            first.connect()
            for rank in first.ffn_group:
                if rank not in connectors:
                    connectors[rank] = create_connector(self.afd_config, ffn_rank=rank,
                                                        **kwargs)
                    self._connecting.append(connectors[rank])
                    connectors[rank].connect()
        except BaseException:
            for c in connectors.values():
                c.close()
            raise
        finally:
            self._connecting = []
        lead = connectors.pop(first.ffn_group[0])
        return lead, list(connectors.values())

    def _set_state(self, state: str, error: str | None = None) -> None:
        """Under self._lock."""
        if state != self.state:
            self.state, self.since = state, time.time()
            self._state_changed.notify_all()
        if error is not None:
            self.last_error = error

    def _await_first_connection(self) -> None:
        """Before the link was ever up (offline use, a request racing the
        start), wait for it as a connect would, up to timeout_s; a link that
        was up and is lost, or a refused one, fails at once."""
        deadline = time.monotonic() + self.afd_config.timeout_s
        with self._lock:
            while (self.connector is None and self.connects == 0
                   and self.state in (link_status.STARTING, link_status.CONNECTING)
                   and not self._closed.is_set()):
                remaining = deadline - time.monotonic()
                if remaining <= 0:
                    break
                self._state_changed.wait(remaining)

    def _count_error(self, error: BaseException) -> None:
        kind = _error_kind(error)
        self.errors[kind] = self.errors.get(kind, 0) + 1

    def unavailable_reason(self) -> str:
        reason = f"AFD attention rank {self.rank}: the link to {self.peer} is {self.state}"
        if self.last_error:
            reason += f" (last error: {self.last_error})"
        return reason

    # -------------------------------------------------------------- the step
    def exchange(self, layer_idx: int, hidden_states: torch.Tensor,
                 routing=None) -> torch.Tensor:
        """Run layer `layer_idx`'s mlp on the FFN server (routing: its MoE
        routing, a wire.Routing, when gate_on is "attention"). Inside a
        micro-batch ping-pong (vllm.afd.ubatch), send, let the next
        micro-batch compute while the FFN works, then receive."""
        from vllm.afd.ubatch import current_turn
        from vllm.afd.wire import StepHeader

        if _is_dummy_run():
            return torch.zeros_like(hidden_states)
        connector = self.connector
        if connector is None:
            self.start()
            self._await_first_connection()
            connector = self.connector
            if connector is None:
                raise AFDLinkDown(self.unavailable_reason())
        turn = current_turn()
        pp, ubatch = turn if turn is not None else (None, 0)
        try:
            t0 = now()
            if layer_idx == self.layers[0] and ubatch == 0:
                num_tokens = pp.num_tokens if pp is not None else [hidden_states.shape[0]]
                self.step_id += 1
                header = StepHeader(step_id=self.step_id, num_tokens=num_tokens)
                for follower in self.followers:
                    follower.send_step(header)
                connector.send_step(header)
                self._step_start = t0
                self._step_calls_left = len(self.layers) * len(num_tokens)
                self.stats.tokens += sum(num_tokens) * len(self.layers)
            hidden_states = hidden_states.contiguous()
            # Every member of an expert-parallel FFN group gets the routing.
            for follower in self.followers:
                follower.send_hidden(layer_idx, ubatch, hidden_states, expect_output=False,
                                     routing=routing)
            connector.send_hidden(layer_idx, ubatch, hidden_states, routing=routing)
            t1 = now()
            if pp is not None:
                pp.yield_turn(ubatch)
            t2 = now()
            out = connector.recv_output(layer_idx, ubatch)
            # The received tensor may live in a transport buffer that the next
            # step overwrites; the model keeps layer outputs across layers.
            out = out.to(hidden_states.dtype).clone()
            t3 = now()
        except Exception as e:
            if self.connector is not connector:  # another micro-batch already failed
                raise AFDLinkDown(self.unavailable_reason()) from e
            self._lost(e, layer_idx, ubatch)
            raise AFDLinkDown(f"AFD attention rank {self.rank}: lost the link to "
                              f"{self.peer} at layer {layer_idx} micro-batch {ubatch} of "
                              f"step {self.step_id}: {e}") from e
        stats = self.stats
        stats.send_s += t1 - t0
        stats.wait_s += t3 - t2
        stats.layer_calls += 1
        stats.routed_calls += routing is not None
        self.round_trip.observe(t3 - t0)
        self._step_calls_left -= 1
        if self._step_calls_left == 0:
            stats.steps += 1
            stats.step_wall_s += t3 - self._step_start
        return out

    def _lost(self, error: BaseException, layer_idx: int, ubatch: int) -> None:
        """A step lost the FFN: drop the connection, let the supervisor reconnect."""
        with self._lock:
            self._count_error(error)
            self._set_state(link_status.DOWN, error=f"{type(error).__name__}: {error}")
            self._drop_connectors()
        logger.error("AFD attention rank %d: lost %s at layer %d micro-batch %d of step %d: "
                     "%s; failing the step's requests and reconnecting", self.rank, self.peer,
                     layer_idx, ubatch, self.step_id, error)
        self._wake.set()

    def _drop_connectors(self) -> None:
        connectors = ([self.connector] if self.connector is not None else []) + self.followers
        self.connector, self.followers = None, []
        self._step_calls_left = 0
        for c in connectors:
            self._bytes_closed[0] += c.bytes_sent
            self._bytes_closed[1] += c.bytes_received
            c.close()

    # ------------------------------------------------------------- reporting
    def document(self) -> dict:
        """State and counters, as link_status and metrics read them."""
        connectors = ([self.connector] if self.connector is not None else []) + self.followers
        sent = self._bytes_closed[0] + sum(c.bytes_sent for c in connectors)
        received = self._bytes_closed[1] + sum(c.bytes_received for c in connectors)
        stats = self.stats
        return {"role": "attention", "rank": self.rank, "peer": self.peer,
                "state": self.state, "since": self.since, "last_error": self.last_error,
                "pid": os.getpid(), "connects": self.connects,
                "reconnects": max(0, self.connects - 1), "errors": dict(self.errors),
                "bytes_sent": sent, "bytes_received": received, "steps": stats.steps,
                "layer_calls": stats.layer_calls, "tokens": stats.tokens,
                "layer_round_trip_seconds": self.round_trip.as_dict()}

    def _publish(self) -> None:
        # Serialized, so an older document never replaces a newer one.
        with self._publish_lock:
            link_status.publish(f"link-a{self.rank}", self.document())

    def close(self) -> None:
        """Say goodbye to the FFN (it then waits for the next attention server)."""
        self._closed.set()
        self._wake.set()
        for c in list(self._connecting):
            c.close()  # interrupts a connect in progress
        with self._lock:
            self._drop_connectors()
            self._set_state(link_status.CLOSED)
        if self._thread is not None and self._thread is not threading.current_thread():
            self._thread.join(timeout=5)
        self._publish()



def get_or_create_link(vllm_config) -> AttentionLink:
    global _link
    with _link_lock:
        if _link is None:
            mc = vllm_config.model_config
            _link = AttentionLink(
                vllm_config.afd_config, hidden_size=mc.get_hidden_size(), dtype=mc.dtype,
                max_tokens=vllm_config.scheduler_config.max_num_batched_tokens,
                rank=attention_rank(vllm_config), fingerprint=model_fingerprint(vllm_config))
            # Say goodbye at exit, so the FFN server knows the peer left on purpose.
            atexit.register(_link.close)
        return _link



def get_link() -> AttentionLink:
    if _link is None:
        raise RuntimeError("AFD: no attention link in this process (model not built "
                           "with --afd-role attention?)")
    return _link
