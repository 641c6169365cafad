# SPDX-License-Identifier: Apache-2.0
# SPDX-FileCopyrightText: Copyright contributors to the vllm-afd project
"""The FFN side's gate: attention peers admitted concurrently, none able to hold it.

A listening connector (AFDConnector.listen) hands each incoming connection to
the gate, which runs its handshake (../handshake.py: Hello, the secret's
proof, the configuration checks) on a thread of its own with its own deadline
(the Hello timeout). A connection that connects and never speaks, or sends a
byte a second, costs one pending handshake until its deadline, never anyone
else's time: admitted sessions queue for accept_session() as they finish.

Pending handshakes are bounded: at most MAX_PENDING in all and
MAX_PENDING_PER_SOURCE from one address. A connection over a bound evicts the
oldest pending handshake (of its source when its source is over, else of
all): a real attention server speaks within milliseconds, so the oldest
pending handshake is the one most likely silent, and a flood only churns
itself (it cannot keep a newer connection of the same address out, which may
be the real server behind the same NAT). Evictions are counted (`evicted`,
and as handshake failures) and logged once a minute per source
(handshake.KnockLog), not per connection.
Threads, descriptors and memory stay bounded by MAX_PENDING.

Two handshakes for one attention rank may run at once (a server redialing
while its first try hangs): the rank is claimed when a peer passes every
check (handshake.RankClaims) and stays claimed until its session closes, so
one session per rank is ever handed out.
"""

import logging
import queue
import threading
import time
from typing import Any

from vllm.afd.transport.handshake import KNOCKS, RankClaims, source_host

logger = logging.getLogger(__name__)

MAX_PENDING = 64  # handshakes running at once, in all
MAX_PENDING_PER_SOURCE = 16  # ... from one source address
ACCEPT_POLL_S = 0.1  # how often the accepting thread looks at close()


class _Pending:
    __slots__ = ("session", "link", "host")

    def __init__(self, session, link, host: str) -> None:
        self.session, self.link, self.host = session, link, host


class Gate:
    """Admits attention peers to `listener`'s sessions (see the module docstring)."""

    def __init__(self, listener: Any, max_pending: int = MAX_PENDING,
                 max_pending_per_source: int = MAX_PENDING_PER_SOURCE) -> None:
        self.listener = listener
        self.max_pending, self.max_per_source = max_pending, max_pending_per_source
        self.claims = RankClaims()
        self.evicted = 0  # pending handshakes dropped for a newer connection
        self._admitted: queue.Queue = queue.Queue()  # sessions, or errors to raise
        self._pending: list[_Pending] = []  # oldest first
        self._lock = threading.Lock()
        self._thread: threading.Thread | None = None

    # ------------------------------------------------------------ the FFN loop
    def next_session(self, timeout: float, busy) -> Any:
        """The next admitted session within timeout seconds, else None.
        busy: the ranks with a live session (a live view)."""
        self.claims.busy = busy
        if self._thread is None:
            thread = threading.Thread(target=self._accept, daemon=True,
                                      name=f"afd-gate-{self.listener.address}")
            thread.start()
            self._thread = thread  # once started: close() may join it
        try:
            item = self._admitted.get(timeout=timeout)
        except queue.Empty:
            return None
        if isinstance(item, BaseException):
            raise item
        return item

    def pending(self) -> int:
        with self._lock:
            return len(self._pending)

    def close(self) -> None:
        """Interrupt the pending handshakes and close sessions never handed out
        (the listener closes the listening socket itself)."""
        with self._lock:
            pending, self._pending = self._pending, []
        for entry in pending:
            entry.session.close()
        thread = self._thread
        if thread is not None and thread is not threading.current_thread():
            thread.join(timeout=2 * ACCEPT_POLL_S + 1)
        while True:
            try:
                item = self._admitted.get_nowait()
            except queue.Empty:
                return
            if not isinstance(item, BaseException):
                item.close()

    # ------------------------------------------------------------- internals
    def _accept(self) -> None:
        listener = self.listener
        while not listener._closing.is_set():
            try:
                incoming = listener._next_link(ACCEPT_POLL_S)
            except Exception as e:  # noqa: BLE001 - the loop hears of it and goes on
                if listener._closing.is_set():
                    return
                self._admitted.put(e)
                listener._closing.wait(0.5)
                continue
            if incoming is not None:
                self._start(*incoming)

    def _start(self, link, source: str) -> None:
        """A handshake for link on a thread of its own, room made first."""
        host = source_host(source)
        try:
            listener = self.listener
            session = type(listener)(listener.afd_config, **listener._init_kwargs)
        except Exception as e:  # noqa: BLE001 - e.g. shared memory could not be reserved
            link.close()
            self._admitted.put(e)
            return
        session.handshake.claims = self.claims
        entry = _Pending(session, link, host)
        with self._lock:
            victim = self._victim(host)
            self._pending.append(entry)
        if victim is not None:
            victim.session.close()  # interrupts its handshake, which drops the link
            self._note_eviction(victim.host)
        threading.Thread(target=self._handshake, args=(entry, source), daemon=True,
                         name=f"afd-handshake-{source}").start()

    def _victim(self, host: str):
        """The pending handshake a new one from host replaces (lock held), or None."""
        mine = [p for p in self._pending if p.host == host]
        if len(mine) >= self.max_per_source:
            victim = mine[0]
        elif len(self._pending) >= self.max_pending:
            victim = self._pending[0]
        else:
            return None
        self._pending.remove(victim)
        self.evicted += 1
        return victim

    def _note_eviction(self, host: str) -> None:
        unlogged = KNOCKS.unlogged(f"{self.listener.address} (evictions)", host)
        if unlogged is not None:
            logger.warning("%s: too many pending handshakes from %s (at most %d per source, "
                           "%d in all): the oldest dropped (%d in all so far)%s",
                           self.listener.me, host, self.max_per_source, self.max_pending,
                           self.evicted, KNOCKS.note(unlogged))

    def _handshake(self, entry: _Pending, source: str) -> None:
        listener, session = self.listener, entry.session
        peer = None
        try:
            if listener._closing.is_set():
                return
            deadline = time.monotonic() + listener._hello_timeout()
            peer = session.handshake.as_ffn(entry.link, source, deadline)
        except Exception as e:  # noqa: BLE001 - this connection only
            if not (listener._closing.is_set() or session._closed):
                logger.warning("%s: handshake with %s failed: %s", listener.me, source, e)
        finally:
            with self._lock:
                if entry in self._pending:
                    self._pending.remove(entry)
                listener.handshake.add(session.handshake)
            if peer is None:
                entry.link.close()
                session.close()
        if peer is None:
            return
        if listener._closing.is_set():
            session.close()
            return
        session._connected = True
        logger.info("%s: session with %s via %s at %s", listener.me, session.peer_name(peer),
                    listener.name, listener.address)
        self._admitted.put(session)
