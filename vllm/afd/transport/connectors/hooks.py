# SPDX-License-Identifier: Apache-2.0
# SPDX-FileCopyrightText: Copyright contributors to the vllm-afd project
"""TransportHooks: what a connector implements to move AFD messages.

The protocol (steps, frames, their checks, the handshake, authentication) is
the same for every transport and lives in base.py, attention_side.py,
ffn_side.py and ../handshake.py. A transport provides the hooks below and is
registered by name (registry.py, or the `vllm_afd.connectors` entry-point
group); `AFDConfig.connector` may then name it.

Class attributes state what a transport can do; the adapter and the handshake
act on them:

    authenticates        peers live in other processes and prove the secret
    stages_through_host  payloads cross host memory, so the peers may run on
                         different device kinds (a CUDA attention server and a
                         CPU FFN server); otherwise both must be on one kind
    graph_capturable     an exchange may be captured inside a device graph
                         (FULL CUDA graphs); otherwise the attention role
                         lowers FULL graph modes to piecewise ones
    checks_per_step      a layer call's failure may show only at the step's
                         end (check_step): its host never waits on a call's
                         outcome. A step such a connector loses runs again
                         whole (AttentionLink.run_step), never resumed mid-step
"""

from abc import ABC, abstractmethod
from typing import Any, ClassVar

import torch

from vllm.afd.transport.errors import WaitCallback
from vllm.afd.transport.wire import LayerFrame


class TransportHooks(ABC):
    name: ClassVar[str]
    authenticates: ClassVar[bool] = False
    stages_through_host: ClassVar[bool] = False
    graph_capturable: ClassVar[bool] = False
    checks_per_step: ClassVar[bool] = False
    # Keys this transport reads from connector_extra_config (others are refused).
    extra_config_keys: ClassVar[frozenset[str]] = frozenset()

    @property
    @abstractmethod
    def address(self) -> str:
        """Where the FFN rank of this connection listens, for messages."""

    # ------------------------------------------------------------- moving bytes
    @abstractmethod
    def _open(self, deadline: float) -> None:
        """Rendezvous with the peer(s), run the handshake and fill self._streams."""

    # FFN side, per-peer sessions (AFDConnector.listen / accept_session). Not
    # abstract: a transport without them still serves through accept().
    def _listen(self) -> None:
        """Start listening for attention peers (bind the address); raise
        AFDConnectionError when it is taken."""
        raise NotImplementedError(f"connector {self.name!r} cannot serve per-peer "
                                  f"sessions: it does not implement _listen/_next_link")

    def _next_link(self, timeout: float) -> "tuple[Any, str] | None":
        """The next incoming raw link and a description of its source, waiting
        up to timeout seconds; None on timeout or once close() was called.
        The link is not handshaken yet."""
        raise NotImplementedError(f"connector {self.name!r} cannot serve per-peer "
                                  f"sessions: it does not implement _listen/_next_link")

    def _hello_timeout(self) -> float:
        """Seconds an incoming peer has for its handshake (a silent client must
        not hold the FFN's accept loop for long)."""
        return self.timeout_s

    @abstractmethod
    def _transmit(self, peer: int, header: bytes, frame: LayerFrame | None,
                  payload: "torch.Tensor | list[torch.Tensor] | None",
                  deadline: float) -> None:
        """Send one encoded message and its payload: one contiguous tensor, or
        a list of them forming one payload back to back (frame.nbytes in all),
        on any device. The payload may be read after this returns (zero-copy
        sends): the caller keeps it unchanged until the peer answers. Raise
        LinkClosed/LinkTimeout."""

    @abstractmethod
    def _receive(self, peer: int, deadline: float | None,
                 on_wait: WaitCallback) -> "tuple[bytes | memoryview, int]":
        """Receive one encoded message and the payload length the sender
        announced (0: none, or the payload travels out of band). Raise
        LinkClosed/LinkTimeout/ProtocolError."""

    @abstractmethod
    def _receive_payload(self, peer: int, frame: LayerFrame, dtype: torch.dtype,
                         announced: int, deadline: float,
                         out: torch.Tensor | None) -> torch.Tensor:
        """The payload of a checked frame as dtype and frame.shape. With out
        (that shape and dtype, any device): written into out, ordered on the
        current stream, and out returned. Without: a tensor on self.device
        (routed frames: the base class asks for raw uint8 bytes and splits
        them itself)."""

    def _release_received(self, peer: int, ubatch_id: int) -> None:
        """Called before a message that lets peer overwrite the buffer this
        side last received ubatch_id into: block until that payload has been
        copied out of it (asynchronous device copies)."""

    def _send_slot(self, peer: int, ubatch_id: int, nbytes: int,
                   device: torch.device) -> "torch.Tensor | None":
        """This transport's own memory to pack a payload of nbytes into (a
        uint8 tensor of exactly that size, the same for every call of (peer,
        ubatch_id)), or None: the codec packs into its buffer (codec.py)."""
        return None

    @abstractmethod
    def _close_transport(self) -> None:
        """Release everything _open created; idempotent; must not raise."""

    # -------------------------------------------------------------- handshake
    def _hello_transport(self) -> bytes:
        """Attention side: this transport's data in the Hello."""
        return b""

    def _transport_problems(self, peer: int, hello_transport: bytes) -> list[str]:
        """FFN side: why this transport must refuse the Hello's transport data
        (empty: accept). Runs after the protocol's own checks passed; the
        attention side is told the reasons."""
        return []

    def _ack_transport(self, peer: int, hello_transport: bytes) -> bytes:
        """FFN side: this transport's data in an accepting HelloAck (e.g. the
        names of shared-memory segments made for peer)."""
        return b""

    def _on_ack(self, ack_transport: bytes) -> None:
        """Attention side: act on the FFN's transport data; a ProtocolError
        refuses the ack (the FFN is told why in the HelloConfirm)."""

    def _on_refused(self, peer: int) -> None:
        """FFN side: the peer refused the ack; undo _ack_transport."""

    def _on_confirmed(self, peer: int) -> None:
        """Both sides: the handshake is complete (attention: peer 0). Costly
        set-up that needs both sides (NCCL communicators) happens here."""

    def peer_closed(self) -> bool:
        """Whether a peer hung up, without reading the stream (idle checks)."""
        return False
