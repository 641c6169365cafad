# SPDX-License-Identifier: Apache-2.0
# SPDX-FileCopyrightText: Copyright contributors to the vllm-afd project
"""The connector handshake: Hello from the attention side, HelloAck from the FFN,
with a challenge-response in between when the FFN has a secret (auth.py), and a
HelloConfirm from the attention side once its own checks of the ack passed.

A Handshake is an object each connector holds (AFDConnector.handshake): it
keeps the secret and the counters, and talks through the connector it was
given: its identity (role, rank, sizes, fingerprint, device), its message
helpers (_send_message, _recv_checked, _waiter), its links (_streams) and the
transport's handshake hooks (_hello_transport, _ack_transport, _on_ack,
_on_confirmed, _on_refused; connectors/hooks.py).

The FFN side never lets a bad peer take it down: a stray client, a peer that
fails authentication and a peer with a mismatched configuration are each told
why (when it is an AFD peer), logged, counted and dropped, and the FFN keeps
accepting. Order of the checks on the FFN side: protocol version (so old peers
learn why), then authentication, and only then the configuration, so an
unauthenticated peer learns nothing about the model being served.
"""

import logging
import threading
import time
from collections import deque
from collections.abc import Collection
from typing import Any

from vllm.afd.transport import auth, wire
from vllm.afd.transport.errors import AFDConnectionError
from vllm.afd.transport.wire import (AuthChallenge, AuthProof, Hello, HelloAck, HelloConfirm,
                                     ProtocolError)

logger = logging.getLogger(__name__)

# Refusal reasons kept for reports (AFDConnector.refusals); older ones drop out,
# so a peer retrying in a loop cannot grow the list without bound.
REFUSALS_KEPT = 32


class _Dropped(Exception):
    """Internal: the FFN dropped the connection being handshaken (already logged
    and counted)."""


def source_host(source: str) -> str:
    """The address of a connection's source "host:port" (a peer's name as
    transports give it: "local peer", a rank, stay as they are)."""
    return source.rsplit(":", 1)[0] if ":" in source else source


class KnockLog:
    """Connections dropped before they proved anything (silent, not AFD, a
    wrong secret) are logged at most once per LOG_EVERY_S per (listening
    address, source address): a scanner or a flood must not fill the log.
    The next line says how many went unlogged; the counters count every one."""

    LOG_EVERY_S = 60.0

    def __init__(self) -> None:
        self._lock = threading.Lock()
        self._sources: dict[tuple[str, str], list] = {}  # -> [last logged, unlogged]

    def unlogged(self, address: str, source: str) -> int | None:
        """None: do not log this one; else how many were not logged before it."""
        host = source_host(source)
        now = time.monotonic()
        with self._lock:
            entry = self._sources.setdefault((address, host), [None, 0])
            if entry[0] is not None and now - entry[0] < self.LOG_EVERY_S:
                entry[1] += 1
                return None
            unlogged, entry[:] = entry[1], [now, 0]
            if len(self._sources) > 4096:  # bounded: forget the oldest sources
                for key in list(self._sources)[:1024]:
                    del self._sources[key]
            return unlogged

    @staticmethod
    def note(unlogged: int) -> str:
        return (f" ({unlogged} more from this address since the last such line; logged "
                f"once a minute per address)" if unlogged else "")


KNOCKS = KnockLog()


class RankClaims:
    """The attention ranks a gate's handshakes may still admit: not one with a
    live session (busy, a live view the FFN loop passes) nor one that another
    handshake, running at the same time, has claimed. A claim is taken when a
    peer passed every check and held until its session closes."""

    def __init__(self, busy: Collection[int] = ()) -> None:
        self.busy = busy
        self._claimed: set[int] = set()
        self._lock = threading.Lock()

    def __contains__(self, rank: int) -> bool:
        return rank in self._claimed or rank in self.busy

    def claim(self, rank: int) -> bool:
        with self._lock:
            if rank in self:
                return False
            self._claimed.add(rank)
            return True

    def release(self, rank: int) -> None:
        with self._lock:
            self._claimed.discard(rank)


class Handshake:
    def __init__(self, conn: Any, secret: bytes | None) -> None:
        """conn: the connector this handshake is for (see the module
        docstring); secret: the shared secret its peers prove (auth.py), None
        when there is none or the transport has nothing to prove (in-process
        loopback)."""
        self.conn = conn
        self.secret = secret
        # FFN side: connections dropped or refused during the handshake (stray
        # clients, authentication failures, mismatched configurations).
        self.failures = 0
        # Either side: handshakes that failed authentication (wrong or missing
        # secret on either end).
        self.auth_failures = 0
        # FFN side: "<peer>: <reason>" of the latest refused peers, oldest first.
        self.refusals: deque[str] = deque(maxlen=REFUSALS_KEPT)
        # FFN side, a gate's session (gate.py): the ranks this handshake may not
        # admit (served by another session, or being admitted by another
        # handshake), and the rank it claimed once its peer passed every
        # check, freed when the session closes (release_claim).
        self.claims: RankClaims | None = None
        self.claimed: int | None = None
        self.source = ""  # FFN side: where the connection being handshaken comes from

    @property
    def has_secret(self) -> bool:
        return self.secret is not None

    @property
    def last_refusal(self) -> str | None:
        return self.refusals[-1] if self.refusals else None

    def release_claim(self) -> None:
        """The claimed rank may be admitted again (the session ended or failed)."""
        if self.claims is not None and self.claimed is not None:
            self.claims.release(self.claimed)
            self.claimed = None

    def add(self, other: "Handshake") -> None:
        """Count another handshake's failures and refusals here (a gate's
        sessions add up on the gate)."""
        self.failures += other.failures
        self.auth_failures += other.auth_failures
        self.refusals.extend(other.refusals)

    def refusal_note(self) -> str:
        """For a timeout's message: how many peers were refused, and why the last."""
        if not self.failures:
            return ""
        last = f"; the last refusal: {self.last_refusal}" if self.last_refusal else ""
        return (f" ({self.failures} connection(s) dropped or refused during the "
                f"handshake{last})")

    # ------------------------------------------------------------ the Hello
    def hello(self, auth_nonce: bytes = b"") -> Hello:
        """This side's Hello (what the FFN compares with its own)."""
        c = self.conn
        cfg = c.afd_config
        return Hello(protocol_version=wire.PROTOCOL_VERSION, role=c.role, rank=c.rank,
                     num_attention_ranks=cfg.num_attention_ranks,
                     num_ffn_ranks=cfg.num_ffn_ranks, num_ubatches=cfg.num_ubatches,
                     hidden_size=c.hidden_size, dtype=wire.dtype_name(c.dtype),
                     max_tokens=c.max_tokens, connector=c.name,
                     fingerprint=c.fingerprint, routing_topk=c.routing_topk,
                     auth_nonce=auth_nonce, device_kind=c.device.type,
                     transport=c._hello_transport(),
                     transfer_to_ffn=cfg.transfer_to_ffn,
                     transfer_to_attention=cfg.transfer_to_attention,
                     scale_group=max(c.codec.send_scale_group, c.codec.receive_scale_group))

    def problems(self, hello: Hello) -> list[str]:
        """Why the FFN must refuse this Hello (empty: accept)."""
        c = self.conn
        mine = self.hello()
        problems = []

        def differ(field: str, expected, received) -> None:
            problems.append(f"{field}: expected {expected!r}, received {received!r}")

        for field in ("protocol_version", "num_attention_ranks", "num_ffn_ranks",
                      "hidden_size", "dtype", "connector", "routing_topk",
                      "transfer_to_ffn", "transfer_to_attention", "scale_group"):
            if getattr(hello, field) != getattr(mine, field):
                differ(field, getattr(mine, field), getattr(hello, field))
        if hello.role != "attention":
            differ("role", "attention", hello.role)
        if (hello.device_kind and hello.device_kind != mine.device_kind
                and not c.stages_through_host):
            problems.append(
                f"device_kind: expected {mine.device_kind!r}, received {hello.device_kind!r} "
                f"(connector {c.name!r} keeps payloads on the device; peers on different "
                f"device kinds need one that stages through host memory, e.g. 'shm' or "
                f"'tcp')")
        if not 1 <= hello.num_ubatches <= c.num_ubatches:
            # The FFN serves any micro-batch count up to its own.
            differ("num_ubatches", f"1 to {c.num_ubatches}", hello.num_ubatches)
        if hello.max_tokens > c.max_tokens:
            differ("max_tokens", f"at most {c.max_tokens}", hello.max_tokens)
        if hello.rank not in c.expected_peers():
            differ("rank", f"one of {c.expected_peers()}", hello.rank)
        elif hello.rank in c._streams or (self.claims is not None
                                          and hello.rank in self.claims):
            problems.append(f"rank: attention rank {hello.rank} is already connected")
        unavailable = wire.FINGERPRINT_UNAVAILABLE
        for key in sorted(set(hello.fingerprint) & set(c.fingerprint)):
            expected, received = c.fingerprint[key], hello.fingerprint[key]
            # An item one side could not compute (vllm/afd/adapter/model/fingerprint.py) is no
            # evidence of a mismatch.
            if expected != received and unavailable not in (expected, received):
                differ(f"fingerprint[{key!r}]", expected, received)
        if not problems:  # the transport's own checks last: they may map memory
            problems += c._transport_problems(hello.rank, hello.transport)
        return problems

    # ------------------------------------------------------- attention side
    def as_attention(self, deadline: float) -> None:
        """Send Hello on link 0, prove the secret if asked, act on the HelloAck."""
        c = self.conn
        hello = self.hello(auth.new_nonce() if self.secret is not None else b"")
        c._send_message(0, hello, what="the handshake (Hello)", deadline=deadline)
        what = "the handshake reply (HelloAck)"
        reply = c._recv_checked(0, wire.Message, what, deadline, on_wait=c._waiter(
            f"{what} from {c.peer_name(0)}", deadline, connecting=True))
        if isinstance(reply, AuthChallenge):
            reply = self._answer_challenge(hello, reply, deadline)
        elif not isinstance(reply, HelloAck):
            raise ProtocolError(f"unexpected message from {c.peer_name(0)} at "
                                f"{c.address} while waiting for {what}: expected HelloAck "
                                f"or AuthChallenge, received {type(reply).__name__}")
        elif self.secret is not None and reply.accepted:
            # Whatever answers there did not prove the secret: not our FFN server.
            self.auth_failures += 1
            raise ProtocolError(
                f"{c.peer_name(0)} at {c.address} accepted {c.me} without "
                f"authenticating: this side has a secret, the FFN server has none or does "
                f"not check it; {auth.HOW_TO_FIX}")
        self._check_ack(reply)
        try:
            c._on_ack(reply.transport)
        except ProtocolError as e:
            self._tell_peer(0, HelloConfirm(accepted=False, reason=str(e)[:wire.MAX_TEXT]),
                            deadline)
            raise
        c._send_message(0, HelloConfirm(accepted=True), what="the handshake confirmation",
                        deadline=deadline)
        c._on_confirmed(0)

    def _answer_challenge(self, hello: Hello, challenge: AuthChallenge,
                          deadline: float) -> HelloAck:
        c = self.conn
        ffn = f"{c.peer_name(0)} at {c.address}"
        if self.secret is None:
            self.auth_failures += 1
            raise ProtocolError(f"{ffn} requires authentication and {c.me} has no "
                                f"secret: {auth.HOW_TO_FIX}")
        if not auth.verify(self.secret, "ffn", hello.auth_nonce, challenge.nonce, hello,
                           challenge.proof):
            self.auth_failures += 1
            reason = (f"{ffn} failed authentication: its proof does not match the secret "
                      f"of {c.me}; {auth.HOW_TO_FIX}")
            self._tell_peer(0, wire.ErrorFrame(text=reason), deadline)
            raise ProtocolError(reason)
        answer = AuthProof(proof=auth.proof(self.secret, "attention", hello.auth_nonce,
                                            challenge.nonce, hello))
        c._send_message(0, answer, what="the authentication proof", deadline=deadline)
        what = "the handshake reply (HelloAck)"
        return c._recv_checked(0, HelloAck, what, deadline, on_wait=c._waiter(
            f"{what} from {c.peer_name(0)}", deadline, connecting=True))

    def _check_ack(self, ack: HelloAck) -> None:
        c = self.conn
        if not ack.accepted:
            raise ProtocolError(f"{c.peer_name(0)} at {c.address} refused {c.me}: "
                                f"{ack.reason}")
        if ack.protocol_version != wire.PROTOCOL_VERSION:
            raise ProtocolError(f"HelloAck.protocol_version: expected "
                                f"{wire.PROTOCOL_VERSION}, received {ack.protocol_version}")
        if ack.rank != c.ffn_rank or (ack.group and c.ffn_rank not in ack.group):
            raise ProtocolError(f"HelloAck from {c.address}: expected FFN rank "
                                f"{c.ffn_rank}, received rank {ack.rank} (group {ack.group})")
        num_ffn_ranks = c.afd_config.num_ffn_ranks
        if (any(r >= num_ffn_ranks for r in ack.group)
                or len(set(ack.group)) != len(ack.group)):
            # The group names the ranks this side connects to next.
            raise ProtocolError(f"HelloAck.group from {c.address}: expected distinct "
                                f"FFN ranks in 0-{num_ffn_ranks - 1}, received {ack.group}")
        c.ffn_group = list(ack.group) or [c.ffn_rank]

    # ------------------------------------------------------------ FFN side
    def as_ffn(self, link: Any, source: str, deadline: float) -> int | None:
        """Run the handshake on a new link: its peer id when accepted, None when
        the connection was dropped (not an AFD peer, failed authentication, or
        a mismatched configuration: told why, logged, counted; see refusals).
        The caller closes a dropped link and keeps accepting."""
        c = self.conn
        self.source = source
        key = -1 - len(c._streams)  # temporary slot until the Hello names the rank
        c._streams[key] = link
        try:
            return self._admit(key, source, deadline)
        except _Dropped:
            self.release_claim()
            c._streams.pop(key, None)
            c._failure = None  # the receive helpers marked the connector failed
            return None
        except BaseException:
            self.release_claim()
            raise

    def _admit(self, key: int, source: str, deadline: float) -> int:
        c = self.conn
        hello = self._recv(key, Hello, "the handshake (Hello)", f"connection from {source}",
                           deadline, auth_step=False)
        label = f"attention rank {hello.rank}"
        if source != label:  # loopback names its links by rank already
            label += f" ({source})"
        if hello.protocol_version != wire.PROTOCOL_VERSION:
            self._refuse(key, label, f"protocol_version: expected {wire.PROTOCOL_VERSION!r}, "
                         f"received {hello.protocol_version!r}", deadline)
        if self.secret is not None:
            self._authenticate(key, hello, label, deadline)
        elif hello.auth_nonce:
            self._refuse(key, label, f"authentication: the attention server has a secret "
                         f"and this FFN server has none; {auth.HOW_TO_FIX}", deadline,
                         auth_failure=True)
        problems = self.problems(hello)
        if problems:
            self._refuse(key, label, "; ".join(problems), deadline)
        peer = hello.rank
        if self.claims is not None:
            if not self.claims.claim(peer):  # another handshake admitted it meanwhile
                self._refuse(key, label, f"rank: attention rank {peer} is already "
                             f"connected", deadline)
            self.claimed = peer
        c._streams[peer] = c._streams.pop(key)
        if hasattr(c._streams[peer], "name"):  # links that name their peer in messages
            c._streams[peer].name = label
        try:
            ack = HelloAck(accepted=True, rank=c.rank, group=c.ffn_group,
                           transport=c._ack_transport(peer, hello.transport))
            c._send_message(peer, ack, what="the handshake reply", deadline=deadline)
            confirm = self._recv(peer, HelloConfirm, "the handshake confirmation (HelloConfirm)",
                                 label, deadline, auth_step=False)
        except BaseException:
            c._streams[key] = c._streams.pop(peer)
            c._on_refused(peer)
            raise
        if not confirm.accepted:
            c._streams[key] = c._streams.pop(peer)
            c._on_refused(peer)
            self.refusals.append(f"{label}: refused our HelloAck: {confirm.reason}")
            self.failures += 1
            logger.error("%s: %s refused the handshake reply: %s", c.me, label,
                         confirm.reason)
            raise _Dropped()
        try:
            c._on_confirmed(peer)  # e.g. NCCL init, with its own deadline
        except Exception as e:  # noqa: BLE001 - this peer fails, the server goes on
            c._streams[key] = c._streams.pop(peer)
            c._on_refused(peer)
            self._drop(label, e, auth_failure=False)
        return peer

    def _authenticate(self, key: int, hello: Hello, label: str, deadline: float) -> None:
        """Challenge the peer; return only if it proved the secret."""
        c = self.conn
        if len(hello.auth_nonce) != wire.AUTH_NONCE_BYTES:
            self._refuse(key, label, "authentication: this FFN server requires a secret and "
                         f"the attention server has none; {auth.HOW_TO_FIX}", deadline,
                         auth_failure=True)
        nonce = auth.new_nonce()
        challenge = AuthChallenge(nonce=nonce, proof=auth.proof(
            self.secret, "ffn", hello.auth_nonce, nonce, hello))
        try:
            c._send_message(key, challenge, what="the authentication challenge",
                            deadline=deadline)
        except AFDConnectionError as e:
            self._drop(label, e, auth_failure=True)
        answer = self._recv(key, AuthProof, "the authentication proof (AuthProof)", label,
                            deadline, auth_step=True)
        if not auth.verify(self.secret, "attention", hello.auth_nonce, nonce, hello,
                           answer.proof):
            self._refuse(key, label, "authentication failed: the attention server's proof "
                         f"does not match this FFN server's secret; {auth.HOW_TO_FIX}",
                         deadline, auth_failure=True)

    def _recv(self, key: int, kind: type, what: str, label: str, deadline: float,
              auth_step: bool):
        c = self.conn
        try:
            return c._recv_checked(key, kind, what, deadline, peer_label=label)
        except (ProtocolError, AFDConnectionError) as e:
            # A port scanner or a stray client must not take the server down.
            self._drop(label, e, auth_failure=auth_step)

    def _drop(self, label: str, error: Exception, auth_failure: bool) -> None:
        c = self.conn
        self.failures += 1
        if auth_failure:
            self.auth_failures += 1
        unlogged = KNOCKS.unlogged(c.address, self.source)
        if unlogged is not None:
            logger.warning("%s: dropping %s%s: %s%s", c.me, label,
                           " during authentication" if auth_failure else "", error,
                           KNOCKS.note(unlogged))
        raise _Dropped()

    def _refuse(self, key: int, label: str, reason: str, deadline: float,
                auth_failure: bool = False) -> None:
        """Record, log, tell the peer why it is refused (best effort), drop.
        Counted before the peer hears of it, so whoever watches the counters
        sees the refusal no later than the peer does."""
        c = self.conn
        self.refusals.append(f"{label}: {reason}")
        self.failures += 1
        if auth_failure:
            self.auth_failures += 1
            # Anyone can knock: a warning, not an error of this server, and
            # once a minute per source address.
            unlogged = KNOCKS.unlogged(c.address, self.source)
            if unlogged is not None:
                logger.warning("%s refused %s: %s%s", c.me, label, reason,
                               KNOCKS.note(unlogged))
        else:
            logger.error("%s refused %s: %s", c.me, label, reason)
        self._tell_peer(key, HelloAck(accepted=False, reason=reason[:wire.MAX_TEXT],
                                      rank=c.rank), deadline)
        raise _Dropped()

    def _tell_peer(self, key: int, message: wire.Message, deadline: float) -> None:
        """Best-effort message to a peer being refused (it may be gone)."""
        c = self.conn
        try:
            c._send_message(key, message, what=f"the {type(message).__name__}",
                            deadline=deadline)
        except AFDConnectionError as e:
            logger.debug("%s: could not send %s: %s", c.me, type(message).__name__, e)
        c._failure = None
