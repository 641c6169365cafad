# SPDX-License-Identifier: Apache-2.0
# SPDX-FileCopyrightText: Copyright contributors to the vllm-afd project
"""A layer call through device memory: the stream operations each side enqueues.

Both sides do the same two things per micro-batch u, in turn (one device
operation each, stream.py):

    post(u, layer, t)    t into the peer's slot u, the step word and (layer,
                         rows) into its record u, then its flag u set READY
                         (a release: the slot and record land first)
    take(u, layer, rows) wait for this side's flag u, check the record
                         against this side's step word and (layer, rows),
                         clear the flag: the payload is then slot u's

The attention side posts a call and takes its reply; the FFN takes a call and
posts its reply. A slot is written again only after its consumer's answer
came back (the attention side sends micro-batch u's next call after taking u's
reply; the FFN replies only to a call it took), which the host enforces when
it enqueues (capture included): post and take alternate per micro-batch.

Nothing on the per-layer path reads device memory from the host: it is
stream operations only, so a step's calls can be captured and replayed. The
host touches control words between steps only (begin_step, set_mode,
abort_code) and, from any thread, release(): a dead peer's waits return and
the rest of the step does nothing; the link then fails the step over or fails
it. (taken_topk reads a record after a take: the ipc connector's routed calls,
for now.)
"""

import torch

from vllm.afd.transport.config import ROLES
from vllm.afd.transport.ipc.layout import (ABORT, ABORT_REASONS, ABORT_RELEASED, CONTROL_WORDS,
                                           FAILED, IDLE, MODE, NOT_ABORTED, RECORD_TOPK, RUN,
                                           STEP, Region,
                                           step_word)
from vllm.afd.transport.ipc.memory import Control
from vllm.afd.transport.ipc.stream import Stream


class Exchange:
    """One side's end of the exchange with one peer: `control` this side's
    control words, `local` its region (the peer writes it), `remote` the
    peer's region as mapped here; `stream` the device operations (stream.py)."""

    def __init__(self, role: str, stream: Stream, control: Control, local: Region,
                 remote: Region, timeout_s: float) -> None:
        if role not in ROLES:
            raise ValueError(f"exchange role {role!r}: expected one of {ROLES}")
        if local.layout != remote.layout:
            raise ValueError(f"the two sides' layouts differ: {local.layout} here, "
                             f"{remote.layout} at the peer")
        words = control.device
        if words.dtype != torch.int32 or words.numel() != CONTROL_WORDS:
            raise ValueError(f"control: {CONTROL_WORDS} int32 words, got {words.numel()} "
                             f"of {words.dtype}")
        self.role, self.stream, self.control = role, stream, control
        self.local, self.remote, self.timeout_s = local, remote, timeout_s
        # Host bookkeeping, per micro-batch: whose turn it is (post or take).
        self._posting = [role == "attention"] * local.layout.num_ubatches

    # ---------------------------------------------------------- between steps
    def begin_step(self, step_id: int) -> None:
        """The step the next calls belong to (its low 32 bits), and a clean
        abort word; outside any graph (a graph replays what it captured, so
        the step must be data, not an operation)."""
        self.stream.set_word(self.control.device, ABORT, NOT_ABORTED)
        self.stream.set_word(self.control.mirror, 0, NOT_ABORTED)
        self.stream.set_word(self.control.device, STEP, step_word(step_id))

    def set_mode(self, run: bool) -> None:
        """RUN: calls act. IDLE: every operation is a no-op and no wait blocks
        (warm-up, profile and capture runs; a replay with no peer)."""
        self.stream.set_word(self.control.device, MODE, RUN if run else IDLE)

    def release(self) -> None:
        """From any thread: stop the step here (a dead peer, a closing link).
        A blocked take returns, later operations of the step do nothing."""
        self.stream.signal(self.control.host, 0, ABORT_RELEASED)

    def abort_code(self) -> int:
        """After a step (its stream idle): NOT_ABORTED if it ran through, else
        why it stopped (ABORT_*). The host's read of the exchange's words, once
        per step (the ipc connector reads it per call for now)."""
        return self.stream.read_word(self.control.host, 0)

    def outcome(self) -> str | None:
        """abort_code() in words: None if the step ran through."""
        code = self.abort_code()
        return None if code == NOT_ABORTED else ABORT_REASONS.get(code, f"abort code {code}")

    # ------------------------------------------------------------ layer calls
    def post(self, u: int, layer: int, t: torch.Tensor, rows: int | None = None,
             topk: int = 0) -> None:
        """t (contiguous) to the peer: slot, record, flag. rows: the call's
        token rows, by default t's first dimension (a packed payload's are
        its tokens'); topk: the routing width packed with it. t may be the
        peer's slot itself (peer_slot: packed there)."""
        self._turn(u, posting=True, layer=layer)
        self.stream.post(self.control.device, t, self.remote.payload(u, t.dtype, tuple(t.shape)),
                         self.remote.records[u], self.remote.flags[u], layer,
                         t.shape[0] if rows is None else rows, topk)

    def peer_slot(self, u: int, nbytes: int) -> torch.Tensor:
        """The first nbytes of the peer's slot u, to pack a payload into (then
        post it): valid once this side's turn on u is to post."""
        return self.remote.payload(u, torch.uint8, (nbytes,))

    def take(self, u: int, layer: int, dtype: torch.dtype, shape: tuple[int, ...],
             rows: int | None = None) -> torch.Tensor:
        """The peer's payload for (u, layer), of dtype and shape: a view of
        this side's slot u, valid until this side posts on u again. rows: the
        call's token rows, by default shape[0] (a packed payload's differ)."""
        self._turn(u, posting=False, layer=layer)
        payload = self.local.payload(u, dtype, shape)
        self.stream.take(self.control.device, self.control.mirror, self.local.flags[u],
                         self.local.records[u], layer, shape[0] if rows is None else rows,
                         self.timeout_s)
        return payload

    def taken_topk(self, u: int) -> int:
        """After a take on u (its stream idle: CUDA reads device memory): the
        routing width the producer packed with the payload."""
        return int(self.local.records[u][RECORD_TOPK])

    def take_into(self, u: int, layer: int, out: torch.Tensor) -> torch.Tensor:
        """take, copied into out (the attention side's output buffer)."""
        self.stream.copy(out, self.take(u, layer, out.dtype, tuple(out.shape)))
        return out

    def fail(self) -> None:
        """The FFN side: a failure record (layer FAILED, no rows) on every
        micro-batch whose answer it owes: the attention side's take for it
        aborts at once (a record mismatch) instead of waiting for its deadline.
        The host then tells the peer why by other means (the connector: the
        error's text on its ring)."""
        if self.role != "ffn":
            raise ValueError("only the FFN side owes answers")
        empty = torch.empty(0, dtype=torch.uint8, device=self.local.memory.device)
        for u, posting in enumerate(self._posting):
            if posting:
                self.post(u, FAILED, empty, rows=0)

    def check_post(self, u: int, layer: int) -> None:
        """Raise unless it is this side's turn to post on u (before packing
        into the peer's slot: a slot is written only once its consumer is done)."""
        self._check_turn(u, True, layer)

    def _turn(self, u: int, posting: bool, layer: int) -> None:
        self._check_turn(u, posting, layer)
        self._posting[u] = not posting

    def _check_turn(self, u: int, posting: bool, layer: int) -> None:
        if self._posting[u] != posting:
            did = "post" if posting else "take"
            raise ValueError(
                f"AFD {self.role} exchange: {did} on micro-batch {u} (layer {layer}) out of "
                f"turn: a slot is written again only after its consumer's answer, so post "
                f"and take alternate per micro-batch")
