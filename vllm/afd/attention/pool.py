# SPDX-License-Identifier: Apache-2.0
# SPDX-FileCopyrightText: Copyright contributors to the vllm-afd project
"""The FFN servers an attention rank can send its steps to. Data plane.

A pool member is one FFN deployment that serves this attention rank's FFN
rank: its connectors (the FFN rank that answers and, for a tensor/expert
parallel FFN server, the other ranks of its group, which only listen), their
state and counters, and a thread that keeps them connected: it dials, retries
with backoff while the FFN is not there or refuses us, notices an FFN that went
away between steps, and reconnects. Without AFDConfig.ffn_pool the pool has one
member, the FFN deployment at host (ffn_hosts) and port.

The link (link.py) picks a ready member per step (Pool.next_member: round
robin over the ready members, in pool order) and, when a member fails mid-step,
another one to finish the step on (failover). Members come and go with
ffn_pool_file (Pool.sync), without a restart: a new one is dialed at once and
takes steps as soon as its handshake passed; a removed one is closed once no
step uses it.
"""

import logging
import os
import threading
import time
from collections.abc import Callable

from vllm.afd.attention import status as link_status
from vllm.afd.transport.backoff import Backoff
from vllm.afd.transport.config import LinkConfig, parse_endpoint
from vllm.afd.transport.connectors.registry import create_connector
from vllm.afd.transport.errors import error_kind
from vllm.afd.transport.wire import ProtocolError, Routing, StepHeader

logger = logging.getLogger(__name__)

# Between connection attempts after a failure (an attempt itself dials for up
# to timeout_s, retrying every 0.05-0.5 s).
RECONNECT_BACKOFF_S = (0.5, 5.0)
CHECK_INTERVAL_S = 1.0  # idle members: how often a lost FFN is looked for


class PoolMember:
    """One FFN deployment (base address host:port; FFN rank f at port + f)."""

    def __init__(self, pool: "Pool", endpoint: str, config: LinkConfig) -> None:
        self.pool = pool
        self.endpoint = endpoint
        self.config = config
        ffn_rank = pool.rank % config.num_ffn_ranks
        self.name = (f"FFN rank {ffn_rank} ({config.connector} {config.host_of(ffn_rank)}:"
                     f"{config.port + ffn_rank})")
        self.lead = None  # the FFN rank that answers (its group's lead)
        self.followers: list = []  # the other ranks of its group: they only listen
        self.state = link_status.STARTING
        self.since = time.time()
        self.last_error: str | None = None
        self.errors: dict[str, int] = {}
        self.connects = 0
        self.steps = 0  # steps begun on this member (resumed ones included)
        self.layer_calls = 0  # outputs received from it
        self.failed_over = 0  # steps moved away from it mid-step
        self.removed = False  # no longer in the pool file: closed once idle
        self.bytes_closed = [0, 0]  # sent, received by connectors already closed
        self._wake = threading.Event()
        self._connecting: list = []
        self._thread: threading.Thread | None = None
        self._last_logged = ""

    @property
    def ready(self) -> bool:
        return self.lead is not None

    def connectors(self) -> list:
        return ([self.lead] if self.lead is not None else []) + self.followers

    # ------------------------------------------------------------- the step
    def send_step(self, header: StepHeader) -> None:
        for c in self.followers:
            c.send_step(header)
        self.lead.send_step(header)

    def send_call(self, layer: int, ubatch: int, hidden_states, routing: Routing | None = None):
        """A layer call's hidden states to the whole FFN group: the followers
        compute without answering, the lead answers (its recv_call). Every
        member of an expert-parallel group gets the routing."""
        for c in self.followers:
            c.send_hidden(layer, ubatch, hidden_states, expect_output=False, routing=routing)
        self.lead.send_call(layer, ubatch, hidden_states, routing)

    # ---------------------------------------------------------- supervision
    def start(self) -> None:
        self._thread = threading.Thread(target=self._supervise, daemon=True,
                                        name=f"afd-link-{self.endpoint}")
        self._thread.start()

    def wake(self) -> None:
        self._wake.set()

    def _supervise(self) -> None:
        pool = self.pool
        with pool.device.entered() as context:
            if pool.on_thread is not None:
                pool.on_thread("afd-link", context)
            backoff = Backoff(*RECONNECT_BACKOFF_S)  # jittered (backoff.py)
            while not pool.closed.is_set():
                if self.removed:
                    with pool.lock:
                        if not pool.in_step(self):  # a step using it finishes first
                            break
                elif self.lead is None:
                    if not self._connect_once():
                        self._wake.wait(backoff.next())
                        self._wake.clear()
                        continue
                    backoff.reset()
                    pool.publish()  # ready
                elif self._check_idle():
                    pool.publish()  # dropped
                # Counters go out with the link's own periodic publish.
                self._wake.wait(CHECK_INTERVAL_S)
                self._wake.clear()
            with pool.lock:
                self.drop()
                if self.removed:
                    self.set_state(link_status.CLOSED)
            if self.removed:
                logger.info("AFD attention rank %d: %s left the pool", pool.rank, self.name)
            pool.publish()

    def _connect_once(self) -> bool:
        pool = self.pool
        with pool.lock:
            if self.state == link_status.STARTING:
                self.set_state(link_status.CONNECTING)
        pool.publish()
        try:
            lead, followers = self._connect()
        except Exception as e:  # noqa: BLE001 - kept as the member's state
            if pool.closed.is_set() or self.removed:
                return False
            refused = isinstance(e, ProtocolError)
            with pool.lock:
                self.count_error(e)
                self.set_state(link_status.REFUSED if refused else
                               link_status.DOWN if self.connects else link_status.CONNECTING,
                               error=f"{type(e).__name__}: {e}")
            # The same failure again (an FFN still down or still mismatched) is
            # logged once, then at debug level.
            repeated = str(e) == self._last_logged
            self._last_logged = str(e)
            (logger.debug if repeated else logger.error if refused else logger.warning)(
                "AFD attention rank %d: no link to %s: %s; retrying every %.0f-%.0fs",
                pool.rank, self.name, e, *RECONNECT_BACKOFF_S)
            pool.publish()
            return False
        with pool.lock:
            if pool.closed.is_set() or self.removed:
                for c in [lead, *followers]:
                    c.close()
                return False
            self.lead, self.followers = lead, followers
            self.connects += 1
            self.set_state(link_status.READY)
        logger.info("AFD attention rank %d: link to %s is up%s", pool.rank, self.name,
                    f" (reconnect {self.connects - 1})" if self.connects > 1 else "")
        return True

    def _connect(self):
        """Connect to the FFN rank and, for a tensor/expert-parallel FFN server,
        every rank of its group (each gets every token; the lead answers)."""
        pool = self.pool
        kwargs = dict(pool.connector_kwargs(), rank=pool.rank)
        first = create_connector(self.config, **kwargs)
        connectors = {first.ffn_rank: first}
        self._connecting = [first]
        try:
            if pool.closed.is_set():
                raise ConnectionError("the link is closed")
            first.connect()
            for rank in first.ffn_group:
                if rank not in connectors:
                    connectors[rank] = create_connector(self.config, ffn_rank=rank, **kwargs)
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

    def _check_idle(self) -> bool:
        """Between steps nobody reads this member's link: notice an FFN that
        went away (said goodbye on SIGTERM, or died), so /health says so and no
        step is sent to it. True when it did (the member dropped)."""
        pool = self.pool
        with pool.lock:
            if pool.in_step(self):
                return False  # a step reads the link now and notices by itself
            gone = [c for c in self.connectors() if c.peer_closed()]
            if not gone:
                return False
            error = f"{gone[0].peer_name(0)} at {gone[0].address} closed the connection"
            self.errors["connection"] = self.errors.get("connection", 0) + 1
            self.set_state(link_status.DOWN, error=error)
            self.drop()
        logger.warning("AFD attention rank %d: %s; reconnecting", pool.rank, error)
        return True

    def interrupt(self) -> None:
        for c in list(self._connecting):
            c.close()  # interrupts a connect in progress

    # ------------------------------------------------------------ state
    def set_state(self, state: str, error: str | None = None) -> None:
        """Under the pool's lock."""
        if state != self.state:
            self.state, self.since = state, time.time()
        if error is not None:
            self.last_error = error
        self.pool.state_changed()

    def count_error(self, error: BaseException) -> None:
        kind = error_kind(error)
        self.errors[kind] = self.errors.get(kind, 0) + 1

    def drop(self) -> None:
        """Close the connectors (under the pool's lock); the thread reconnects."""
        connectors = self.connectors()
        self.lead, self.followers = None, []
        for c in connectors:
            self.bytes_closed[0] += c.bytes_sent
            self.bytes_closed[1] += c.bytes_received
            c.close()
        self._wake.set()

    def fail(self, error: BaseException, report: str | None = None) -> None:
        """A step lost this member (under the pool's lock): report (best effort)
        to the FFN when the failure is ours, drop it, let the thread reconnect."""
        if report is not None:
            for c in self.connectors():
                c.report_error(report)
        else:
            self.count_error(error)
        self.set_state(link_status.DOWN, error=report or f"{type(error).__name__}: {error}")
        self.drop()

    def document(self) -> dict:
        connectors = self.connectors()
        return {"endpoint": self.endpoint, "peer": self.name, "state": self.state,
                "since": self.since, "last_error": self.last_error, "connects": self.connects,
                "errors": dict(self.errors), "steps": self.steps,
                "layer_calls": self.layer_calls, "failed_over": self.failed_over,
                "bytes_sent": self.bytes_closed[0] + sum(c.bytes_sent for c in connectors),
                "bytes_received": self.bytes_closed[1] + sum(c.bytes_received
                                                             for c in connectors)}


class Pool:
    """The members of one attention rank's pool and the choice among them."""

    def __init__(self, config: LinkConfig, *, rank: int, device, connector_kwargs: dict,
                 lock: threading.Lock, on_state: Callable[[], None],
                 publish: Callable[[], None], in_step: Callable[[PoolMember], bool],
                 on_thread=None) -> None:
        self.config = config
        self.rank = rank
        self.device = device
        self.connector_kwargs = connector_kwargs
        self.lock = lock
        self.state_changed = on_state
        self.publish = publish
        self.in_step = in_step
        self.on_thread = on_thread
        self.closed = threading.Event()
        self.members: list[PoolMember] = []
        self._last: PoolMember | None = None  # the member of the last step
        self._file_version: tuple | None = None  # (mtime, size, inode) last read
        self._file_endpoints: list[str] = []
        self._file_error = ""
        self.sync(start=False)

    def endpoints(self) -> list[str]:
        """The configured members: ffn_pool, then ffn_pool_file's lines; without
        either, the FFN deployment at host and port."""
        cfg = self.config
        listed = list(cfg.ffn_pool)
        if cfg.ffn_pool_file:
            listed += [e for e in self._read_file() if e not in listed]
        if not cfg.ffn_pool and not cfg.ffn_pool_file:
            listed = [""]  # the deployment itself
        return listed

    def _read_file(self) -> list[str]:
        path = self.config.ffn_pool_file
        try:
            text = open(path).read()  # noqa: SIM115 - small, re-read every second
        except OSError as e:  # e.g. being replaced: keep the last good list
            self._log_file_error(f"cannot read {path}: {e.strerror or e}")
            return list(self._file_endpoints)
        endpoints = []
        for number, line in enumerate(text.splitlines(), 1):
            line = line.split("#", 1)[0].strip()
            if not line:
                continue
            try:
                parse_endpoint(line)
            except ValueError as e:
                self._log_file_error(f"{path}:{number}: {e}; line ignored")
                continue
            endpoints.append(line)
        if not endpoints and self._file_endpoints and not self.config.ffn_pool:
            # Most editors and write_text() truncate the file before they write
            # it: read in between, it lists nobody, and taking that literally
            # would close every member (an outage) for a file being rewritten.
            # A pool of nobody is never wanted; stopping the server is the way.
            self._log_file_error(f"{path} lists no FFN server; keeping the last list "
                                 f"({', '.join(self._file_endpoints)})")
            return list(self._file_endpoints)
        self._file_endpoints = endpoints
        return endpoints

    def _log_file_error(self, text: str) -> None:
        if text != self._file_error:
            logger.error("AFD attention rank %d: ffn_pool_file %s", self.rank, text)
            self._file_error = text

    def sync(self, start: bool = True) -> None:
        """Add members that appeared in the configuration, mark the ones that
        left it as removed (their threads close them once idle)."""
        with self.lock:  # forget removed members whose thread is done
            self.members = [m for m in self.members if not m.removed or m._thread is None
                            or m._thread.is_alive()]
        if self.config.ffn_pool_file and self.members:
            # Before the read: a write after it is seen next time. The size and
            # inode too: a truncate and the write after it can share one mtime
            # (the file clock ticks every few ms), and a rename keeps the old.
            try:
                st = os.stat(self.config.ffn_pool_file)
                version = (st.st_mtime_ns, st.st_size, st.st_ino)
            except OSError:
                version = None
            if version == self._file_version:
                return
            self._file_version = version
        wanted = self.endpoints()
        added = []
        with self.lock:
            present = {m.endpoint: m for m in self.members if not m.removed}
            for endpoint in wanted:
                if endpoint not in present:
                    member = PoolMember(self, endpoint, self.member_config(endpoint))
                    self.members.append(member)
                    added.append(member)
            for endpoint, member in present.items():
                if endpoint not in wanted:
                    member.removed = True
                    member.wake()
            self.state_changed()
        for member in added:
            if len(self.members) > 1 or self.config.ffn_pool or self.config.ffn_pool_file:
                logger.info("AFD attention rank %d: FFN pool member %s", self.rank,
                            member.name)
            if start:
                member.start()

    def member_config(self, endpoint: str) -> LinkConfig:
        if not endpoint:
            return self.config
        host, port = parse_endpoint(endpoint)
        return self.config.replace(host=host, port=port, ffn_hosts=[], ffn_pool=[],
                                   ffn_pool_file=None)

    def start(self) -> None:
        for member in self.members:
            if member._thread is None:
                member.start()

    def ready_members(self) -> list[PoolMember]:
        return [m for m in self.members if m.ready and not m.removed]

    def next_member(self, exclude: PoolMember | None = None) -> PoolMember | None:
        """Round robin over the ready members, in pool order: the first ready
        one after the member of the last step (under the lock)."""
        order = self.members
        start = order.index(self._last) + 1 if self._last in order else 0
        for member in order[start:] + order[:start]:
            if member.ready and not member.removed and member is not exclude:
                self._last = member
                return member
        return None

    def close(self) -> None:
        self.closed.set()
        for member in list(self.members):
            member.wake()
            member.interrupt()
        with self.lock:
            for member in self.members:
                member.drop()
        for member in list(self.members):
            if member._thread is not None and member._thread is not threading.current_thread():
                member._thread.join(timeout=5)
