# SPDX-License-Identifier: Apache-2.0
# SPDX-FileCopyrightText: Copyright contributors to the vllm-afd project
"""The FFN side's gate (vllm/afd/transport/gate.py): connections that never
speak, speak a byte a second, or connect and close in a storm cannot keep a
real attention peer out, pending handshakes stay bounded, and one rank gets
one session however its handshakes race. Real sockets on this host: every
connection comes from 127.0.0.1, the real peer's address too."""

import os
import socket
import threading
import time

import pytest

from helpers.connectors import Background, free_port, make
from vllm.afd.transport.wire import ProtocolError
from vllm.afd.transport.gate import Gate

SILENT = 64
SLOW = 16


def wait_until(predicate, what: str, timeout: float = 5.0) -> None:
    deadline = time.monotonic() + timeout
    while not predicate():
        assert time.monotonic() < deadline, f"after {timeout:g}s: {what}"
        time.sleep(0.02)


class Loop:
    """The FFN loop's accept side: accept_session() over and over, the
    admitted sessions kept (busy: their ranks)."""

    def __init__(self, listener) -> None:
        self.listener, self.sessions, self.stop = listener, {}, threading.Event()
        listener.listen()
        self.thread = Background(self._run)

    def _run(self) -> None:
        while not self.stop.is_set():
            session = self.listener.accept_session(0.05, busy=self.sessions.keys())
            if session is not None:
                [peer] = session.connected_peers
                self.sessions[peer] = session

    def session(self, peer: int = 0, timeout: float = 5.0):
        """peer's session, once the loop has it (the peer's connect() returns
        when its side is done)."""
        wait_until(lambda: peer in self.sessions, f"no session for attention rank {peer}",
                   timeout)
        return self.sessions[peer]

    def end_session(self, peer: int = 0) -> None:
        """Close peer's session (the rank may connect again)."""
        self.session(peer).close()
        del self.sessions[peer]

    def close(self) -> None:
        self.stop.set()
        self.thread.join_result()
        for session in self.sessions.values():
            session.close()
        self.listener.close()


def time_to_connect(port: int, **kwargs) -> float:
    attn = make("tcp", "attention", port, **kwargs)
    t0 = time.monotonic()
    try:
        attn.connect()
        return time.monotonic() - t0
    finally:
        attn.close()


def open_fds() -> int:
    return len(os.listdir("/proc/self/fd"))


def test_idle_slow_and_stormy_connections_never_hold_the_gate():
    """Timed against the same connect without them, in one run: 64 silent
    connections, 16 that send a byte a second and a connect/close storm cost
    a real attention peer less than a second; afterwards the pending
    handshakes are gone and the descriptors back at their baseline."""
    port = free_port()
    loop = Loop(make("tcp", "ffn", port, timeout_s=10))  # a Hello may take 10 s
    try:
        baseline = time_to_connect(port)
        loop.end_session()
        fds = open_fds()
        silent = [socket.create_connection(("127.0.0.1", port)) for _ in range(SILENT)]
        stop = threading.Event()

        def slow() -> None:
            with socket.create_connection(("127.0.0.1", port)) as s:
                while not stop.wait(1.0):
                    try:
                        s.sendall(b"\x00")
                    except OSError:
                        return  # dropped by the gate: fine

        def storm() -> None:
            while not stop.is_set():
                try:
                    socket.create_connection(("127.0.0.1", port)).close()
                except OSError:
                    pass

        workers = [threading.Thread(target=slow, daemon=True) for _ in range(SLOW)]
        workers += [threading.Thread(target=storm, daemon=True) for _ in range(2)]
        for w in workers:
            w.start()
        time.sleep(1.0)  # all of them at the gate
        attacked = time_to_connect(port)
        loop.end_session()
        stop.set()
        for w in workers:
            w.join(5)
        for s in silent:
            s.close()
        gate = loop.listener._gate
        assert attacked < baseline + 1.0, (baseline, attacked)
        assert gate.evicted > 0  # more came than the gate keeps pending
        # The Hello timeout (10 s) ends every pending handshake left.
        wait_until(lambda: gate.pending() == 0 and open_fds() <= fds,
                   f"pending {gate.pending()}, descriptors {open_fds()} (baseline {fds})", 15)
    finally:
        loop.close()


def test_a_flood_from_one_source_evicts_its_own_oldest():
    """With at most 4 pending handshakes from one address, 10 silent
    connections leave 4 pending (6 evicted); the real peer from that same
    address still gets in."""
    port = free_port()
    listener = make("tcp", "ffn", port, timeout_s=10)
    listener._gate = Gate(listener, max_pending=8, max_pending_per_source=4)
    loop = Loop(listener)
    silent = []
    try:
        silent = [socket.create_connection(("127.0.0.1", port)) for _ in range(10)]
        wait_until(lambda: listener._gate.evicted >= 6, "6 evictions")
        assert listener._gate.evicted == 6 and listener._gate.pending() == 4
        assert time_to_connect(port) < 2.0
        assert loop.session() is not None
    finally:
        for s in silent:
            s.close()
        loop.close()


def test_one_rank_gets_one_session_however_its_handshakes_race():
    """Two attention peers of rank 0 handshake at once: one session, the other
    refused as already connected; once that session closes, rank 0 is
    admitted again."""
    port = free_port()
    loop = Loop(make("tcp", "ffn", port))
    peers = [make("tcp", "attention", port) for _ in range(2)]
    try:
        start = threading.Barrier(2)

        def dial(attn):
            start.wait()
            attn.connect()

        tries = [Background(dial, attn) for attn in peers]
        errors = []
        for t in tries:
            try:
                t.join_result()
            except ProtocolError as e:
                errors.append(str(e))
        assert len(errors) == 1 and "attention rank 0 is already connected" in errors[0]
        loop.session()
        assert list(loop.sessions) == [0]
        loop.end_session()
        assert time_to_connect(port) < 5.0
        assert loop.session() is not None
    finally:
        for attn in peers:
            attn.close()
        loop.close()


@pytest.mark.parametrize("kind", ["shm", "tcp"])
def test_closing_the_listener_ends_pending_handshakes(kind):
    """close() interrupts the handshakes in progress: a silent connection's
    thread ends at once, not at its Hello deadline."""
    port = free_port()
    loop = Loop(make(kind, "ffn", port, timeout_s=30))
    address = ("127.0.0.1", port) if kind == "tcp" else None
    if address is None:  # shm's rendezvous: the abstract unix socket
        s = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
        s.connect(f"\0vllm-afd-{port}")
    else:
        s = socket.create_connection(address)
    try:
        wait_until(lambda: loop.listener._gate is not None and loop.listener._gate.pending(),
                   "a pending handshake")
        t0 = time.monotonic()
        loop.close()
        assert time.monotonic() - t0 < 5.0
        assert loop.listener._gate.pending() == 0
    finally:
        s.close()
