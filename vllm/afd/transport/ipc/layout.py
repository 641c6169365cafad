# SPDX-License-Identifier: Apache-2.0
# SPDX-FileCopyrightText: Copyright contributors to the vllm-afd project
"""Where a device-resident exchange keeps its words and slots.

Each side has, per peer:

    control  mode, abort, step: three words of its own in its device memory,
             read by its kernels and written by its stream; the abort word
             has a mirror the host writes while a take waits (memory.Control:
             pinned host memory on CUDA, polled only by a waiting take)
    region   per micro-batch u: a flag, a record and a payload slot, in this
             side's device memory (memory.py allocates it, not torch's caching
             allocator, and maps the peer's through an IPC handle); written
             by the peer, waited on here

The attention side's mailbox holds the FFN's replies, the FFN's holds the
attention side's calls: a producer pushes into the consumer's memory and
every wait polls local memory only. Each flag and record sits on a line of
its own (LINE bytes), so a producer's payload writes never share a line with
a word the consumer spins on.

Words are int32. A flag is READY or CLEAR (set by the producer after its
payload and record, cleared by the consumer once it has taken them): set and
clear values are constants, so a captured graph replays them unchanged. The
step a call belongs to is not baked either: it is the control's step word,
written once per step before the step runs, copied into each record by the
producer and compared with the consumer's own step word on the device. Step
ids travel as their low 32 bits (they wrap; both sides compare the same bits).
"""

from dataclasses import dataclass

import torch

LINE = 128  # bytes: one flag or record per line (a GPU's L2 sector group)
SLOT_ALIGN = 256  # payload slots start on this boundary (vectorised copies)

CLEAR, READY = 0, 1
# control: mode RUN lets the exchange's operations act; IDLE makes them no-ops
# (vLLM's warm-up, profile and capture runs, a replay with no peer).
IDLE, RUN = 0, 1
# control: abort, 0 while the step goes on; else why it stopped. Once set,
# every later operation of the step does nothing (and every wait returns).
NOT_ABORTED, ABORT_RELEASED, ABORT_TIMEOUT, ABORT_MISMATCH = 0, 1, 2, 3
ABORT_REASONS = {ABORT_RELEASED: "released by the host (the peer is gone, or the link closed)",
                 ABORT_TIMEOUT: "a wait passed its deadline",
                 ABORT_MISMATCH: "a record named another step, layer or size"}

# control words (their index)
MODE, ABORT, STEP = 0, 1, 2
CONTROL_WORDS = 3
# record words: the producer's step (low 32 bits), layer, rows, and the
# routing width packed with the payload (0: none; read by the consumer's host
# after the take). A record of layer FAILED: the producer will not answer
# (calls.Exchange.fail).
FAILED = -1
RECORD_STEP, RECORD_LAYER, RECORD_ROWS, RECORD_TOPK = 0, 1, 2, 3
RECORD_WORDS = 4


def step_word(step_id: int) -> int:
    """A step id's low 32 bits as the int32 a control word or record holds."""
    low = step_id & 0xFFFFFFFF
    return low - (1 << 32) if low >= 1 << 31 else low


def _round_up(n: int, to: int) -> int:
    return -(-n // to) * to


@dataclass(frozen=True)
class Layout:
    """One side's region for one peer: per micro-batch a flag line, a record
    line and a slot of slot_bytes."""

    num_ubatches: int
    slot_bytes: int

    @property
    def stride(self) -> int:
        return 2 * LINE + _round_up(self.slot_bytes, SLOT_ALIGN)

    @property
    def total(self) -> int:
        return self.num_ubatches * self.stride

    def flag(self, u: int) -> int:
        return u * self.stride

    def record(self, u: int) -> int:
        return self.flag(u) + LINE

    def slot(self, u: int) -> int:
        return self.flag(u) + 2 * LINE


class Region:
    """A side's region as views: `memory` is its uint8 device memory (its own,
    or the peer's as mapped here)."""

    def __init__(self, memory: torch.Tensor, layout: Layout) -> None:
        if memory.dtype != torch.uint8 or memory.numel() < layout.total:
            raise ValueError(f"an exchange region needs {layout.total} bytes of uint8 memory, "
                             f"got {memory.numel()} of {memory.dtype}")
        self.memory, self.layout = memory, layout
        words = lambda at, n: memory[at:at + 4 * n].view(torch.int32)  # noqa: E731
        self.flags = [words(layout.flag(u), 1) for u in range(layout.num_ubatches)]
        self.records = [words(layout.record(u), RECORD_WORDS)
                        for u in range(layout.num_ubatches)]
        self.slots = [memory[layout.slot(u):layout.slot(u) + layout.slot_bytes]
                      for u in range(layout.num_ubatches)]
        self._views: dict[tuple, torch.Tensor] = {}

    def payload(self, u: int, dtype: torch.dtype, shape: tuple[int, ...]) -> torch.Tensor:
        """Slot u's first bytes as a tensor of dtype and shape. Cached: steps
        repeat their shapes, and a view costs microseconds to build."""
        key = (u, dtype, shape)
        view = self._views.get(key)
        if view is None:
            nbytes = torch.Size(shape).numel() * dtype.itemsize
            if nbytes > self.layout.slot_bytes:
                raise ValueError(f"a payload of {nbytes} bytes does not fit a slot of "
                                 f"{self.layout.slot_bytes}")
            if len(self._views) > 4096:  # shapes seen once (prefill sizes): start over
                self._views.clear()
            view = self._views[key] = self.slots[u][:nbytes].view(dtype).view(shape)
        return view.detach()  # a fresh alias: a caller's resize_ cannot reach the cache
