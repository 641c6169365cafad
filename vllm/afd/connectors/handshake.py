# SPDX-License-Identifier: Apache-2.0
# SPDX-FileCopyrightText: Copyright contributors to the vllm-afd project
"""The connector handshake: Hello from the attention side, HelloAck from the FFN.

Mixed into AFDConnector (connectors/base.py); it relies on the connector's
message helpers (_send_message, _recv_checked, _waiter) and its fields.
"""

from typing import Any

from vllm.afd import wire
from vllm.afd.connectors.errors import AFDConnectionError
from vllm.afd.wire import Hello, HelloAck, ProtocolError
from vllm.logger import init_logger

logger = init_logger(__name__)


class HandshakeMixin:
    # Handshake hooks for transports that need more than a stream of messages.
    def _ack_fields(self, peer: int) -> dict[str, Any]:
        """FFN side: extra HelloAck fields for peer (e.g. shm segment names)."""
        return {}

    def _on_ack(self, ack: HelloAck) -> None:
        """Attention side: act on an accepted HelloAck."""

    def _after_ack(self, peer: int) -> None:
        """FFN side: called once peer's accepted HelloAck is sent."""

    # -------------------------------------------------------------- handshake
    def _hello(self) -> Hello:
        cfg = self.afd_config
        return Hello(protocol_version=wire.PROTOCOL_VERSION, role=self.role, rank=self.rank,
                     num_attention_ranks=cfg.num_attention_ranks,
                     num_ffn_ranks=cfg.num_ffn_ranks, num_ubatches=cfg.num_ubatches,
                     hidden_size=self.hidden_size, dtype=wire.dtype_name(self.dtype),
                     max_tokens=self.max_tokens, connector=self.name,
                     fingerprint=self.fingerprint, routing_topk=self.routing_topk)

    def _hello_problems(self, hello: Hello) -> list[str]:
        """Why the FFN must refuse this Hello (empty: accept)."""
        mine = self._hello()
        problems = []

        def differ(field: str, expected, received) -> None:
            problems.append(f"{field}: expected {expected!r}, received {received!r}")

        for field in ("protocol_version", "num_attention_ranks", "num_ffn_ranks",
                      "hidden_size", "dtype", "connector", "routing_topk"):
            if getattr(hello, field) != getattr(mine, field):
                differ(field, getattr(mine, field), getattr(hello, field))
        if hello.role != "attention":
            differ("role", "attention", hello.role)
        if not 1 <= hello.num_ubatches <= self.num_ubatches:
            # The FFN serves any micro-batch count up to its own.
            differ("num_ubatches", f"1 to {self.num_ubatches}", hello.num_ubatches)
        if hello.max_tokens > self.max_tokens:
            differ("max_tokens", f"at most {self.max_tokens}", hello.max_tokens)
        if hello.rank not in self.expected_peers():
            differ("rank", f"one of {self.expected_peers()}", hello.rank)
        elif hello.rank in self._links:
            problems.append(f"rank: attention rank {hello.rank} is already connected")
        for key in sorted(set(hello.fingerprint) & set(self.fingerprint)):
            if hello.fingerprint[key] != self.fingerprint[key]:
                differ(f"fingerprint[{key!r}]", self.fingerprint[key], hello.fingerprint[key])
        return problems

    def _handshake_as_attention(self, deadline: float) -> None:
        """Send Hello on link 0 and act on the FFN's HelloAck."""
        self._send_message(0, self._hello(), what="the handshake (Hello)", deadline=deadline)
        what = "the handshake reply (HelloAck)"
        ack = self._recv_checked(0, HelloAck, what, deadline, on_wait=self._waiter(
            f"{what} from {self.peer_name(0)}", deadline, connecting=True))
        if not ack.accepted:
            raise ProtocolError(f"{self.peer_name(0)} at {self.address} refused {self.me}: "
                                f"{ack.reason}")
        if ack.protocol_version != wire.PROTOCOL_VERSION:
            raise ProtocolError(f"HelloAck.protocol_version: expected "
                                f"{wire.PROTOCOL_VERSION}, received {ack.protocol_version}")
        if ack.rank != self.ffn_rank or (ack.group and self.ffn_rank not in ack.group):
            raise ProtocolError(f"HelloAck from {self.address}: expected FFN rank "
                                f"{self.ffn_rank}, received rank {ack.rank} (group {ack.group})")
        self.ffn_group = list(ack.group) or [self.ffn_rank]
        self._on_ack(ack)

    def _handshake_as_ffn(self, link: Any, source: str, deadline: float) -> int | None:
        """Run the handshake on a new link: its peer id when accepted, None when
        the other end is not an AFD peer (dropped with a warning). A real peer
        with a mismatched configuration raises ProtocolError here (after
        telling it why), since serving it would compute garbage."""
        key = -1 - len(self._links)  # temporary slot until the Hello names the rank
        self._links[key] = link
        try:
            hello = self._recv_checked(key, Hello, "the handshake (Hello)", deadline,
                                       peer_label=f"connection from {source}")
        except (ProtocolError, AFDConnectionError) as e:
            # A port scanner or a stray client must not take the server down.
            logger.warning("%s: dropping connection from %s: %s", self.me, source, e)
            self._links.pop(key)
            self._failure = None
            return None
        problems = self._hello_problems(hello)
        if problems:
            reason = "; ".join(problems)
            self._send_message(key, HelloAck(accepted=False, reason=reason, rank=self.rank),
                               what="the handshake refusal", deadline=deadline)
            # The link stays in self._links: connect()'s cleanup closes it.
            raise ProtocolError(f"{self.me} refused attention rank {hello.rank} "
                                f"({source}): {reason}")
        peer = hello.rank
        self._links[peer] = self._links.pop(key)
        ack = HelloAck(accepted=True, rank=self.rank, group=self.ffn_group,
                       **self._ack_fields(peer))
        self._send_message(peer, ack, what="the handshake reply", deadline=deadline)
        self._after_ack(peer)
        return peer
