# SPDX-License-Identifier: Apache-2.0
# SPDX-FileCopyrightText: Copyright contributors to the vllm-afd project
"""A layer call through device memory: the stream operations each side enqueues.

Both sides do the same two things per micro-batch u, in turn:

    post(u, layer, t)    t into the peer's slot u, the step word and (layer,
                         rows) into its record u, then its flag u set READY
                         (a release store: the slot and record land first)
    take(u, layer, rows) wait for this side's flag u, check the record
                         against this side's step word and (layer, rows),
                         clear the flag: the payload is then slot u's

The attention side posts a call and takes its reply; the FFN takes a call and
posts its reply. A slot is written again only after its consumer's answer
came back (the attention side sends micro-batch u's next call after taking u's
reply; the FFN replies only to a call it took), which the host enforces when
it enqueues (capture included): post and take alternate per micro-batch.

Nothing here reads device memory from the host: the per-layer path is
stream operations only, so a step's calls can be captured and replayed. The
host touches control words between steps only (begin_step, set_mode, outcome)
and, from any thread, release(): a dead peer's waits return and the rest of
the step does nothing; the link then fails the step over or fails it.
"""

import torch

from vllm.afd.transport.config import ROLES
from vllm.afd.transport.ipc.layout import (ABORT, ABORT_REASONS, ABORT_RELEASED, CLEAR, IDLE,
                                           MODE, NOT_ABORTED, READY, RECORD_LAYER, RECORD_ROWS,
                                           RECORD_STEP, RUN, STEP, Region, step_word)
from vllm.afd.transport.ipc.stream import Stream



class Exchange:
    """One side's end of the exchange with one peer: `local` is this side's
    region (its control and the mailbox the peer writes), `remote` the peer's
    as mapped here; `stream` the device operations (stream.py)."""

    def __init__(self, role: str, stream: Stream, local: Region, remote: Region,
                 timeout_s: float) -> None:
        if role not in ROLES:
            raise ValueError(f"exchange role {role!r}: expected one of {ROLES}")
        if local.layout != remote.layout:
            raise ValueError(f"the two sides' layouts differ: {local.layout} here, "
                             f"{remote.layout} at the peer")
        self.role, self.stream, self.local, self.remote = role, stream, local, remote
        self.timeout_s = timeout_s
        # Host bookkeeping, per micro-batch: whose turn it is (post or take).
        self._posting = [role == "attention"] * local.layout.num_ubatches

    # ---------------------------------------------------------- between steps
    def begin_step(self, step_id: int) -> None:
        """The step the next calls belong to (its low 32 bits), and a clean
        abort word; outside any graph (a graph replays what it captured, so
        the step must be data, not an operation)."""
        self.stream.set_word(self.local.word(ABORT), NOT_ABORTED)
        self.stream.set_word(self.local.word(STEP), step_word(step_id))

    def set_mode(self, run: bool) -> None:
        """RUN: calls act. IDLE: every operation is a no-op and no wait blocks
        (warm-up, profile and capture runs; a replay with no peer)."""
        self.stream.set_word(self.local.word(MODE), RUN if run else IDLE)

    def release(self) -> None:
        """From any thread: stop the step here (a dead peer, a closing link).
        Blocked waits return, later operations of the step do nothing."""
        self.stream.signal(self.local.word(ABORT), ABORT_RELEASED)

    def outcome(self) -> str | None:
        """After a step (its stream idle): None if it ran through, else why it
        stopped. The host's only read of device memory, once per step."""
        code = self.stream.read_word(self.local.word(ABORT))
        return None if code == NOT_ABORTED else ABORT_REASONS.get(code, f"abort code {code}")

    # ------------------------------------------------------------ layer calls
    def post(self, u: int, layer: int, t: torch.Tensor) -> None:
        """t (rows x hidden, contiguous) to the peer: slot, record, flag."""
        self._turn(u, posting=True, layer=layer)
        s, record = self.stream, self.remote.records[u]
        s.copy(self.remote.payload(u, t.dtype, tuple(t.shape)), t)
        s.copy_word(record[RECORD_STEP:RECORD_STEP + 1], self.local.word(STEP))
        s.store(record[RECORD_LAYER:RECORD_ROWS + 1], (layer, t.shape[0]))
        s.store(self.remote.flags[u], (READY,))

    def take(self, u: int, layer: int, dtype: torch.dtype,
             shape: tuple[int, int]) -> torch.Tensor:
        """The peer's payload for (u, layer): a view of this side's slot u,
        valid until this side posts on u again."""
        self._turn(u, posting=False, layer=layer)
        s = self.stream
        s.wait(self.local.flags[u], READY, self.timeout_s)
        s.check(self.local.records[u], self.local.word(STEP), (layer, shape[0]))
        s.store(self.local.flags[u], (CLEAR,))
        return self.local.payload(u, dtype, shape)

    def take_into(self, u: int, layer: int, out: torch.Tensor) -> torch.Tensor:
        """take, copied into out (the attention side's output buffer)."""
        self.stream.copy(out, self.take(u, layer, out.dtype, tuple(out.shape)))
        return out

    def _turn(self, u: int, posting: bool, layer: int) -> None:
        if self._posting[u] != posting:
            did = "post" if posting else "take"
            raise ValueError(
                f"AFD {self.role} exchange: {did} on micro-batch {u} (layer {layer}) out of "
                f"turn: a slot is written again only after its consumer's answer, so post "
                f"and take alternate per micro-batch")
        self._posting[u] = not posting
