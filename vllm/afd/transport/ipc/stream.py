# SPDX-License-Identifier: Apache-2.0
# SPDX-FileCopyrightText: Copyright contributors to the vllm-afd project
"""What a device does for a device-resident exchange: five stream-ordered
operations, each a no-op once its side's control says so.

Every operation is enqueued on the caller's stream and returns at once; the
host never reads device memory between them, so the operations of a layer
call can be captured into a graph and replayed. Each one first reads its
side's control words and does nothing when the mode is IDLE or the step was
aborted (layout.py): that is how warm-up runs, replays without a peer and a
dead peer's step pass through without touching the peer.

    copy(dst, src)        payload bytes, device to device (local or mapped peer
                          memory); may land at any time before the next store
    copy_word(dst, src)   one int32 from device memory to device memory (the
                          step word into a record: the value is read when the
                          stream gets there, never baked into a graph)
    store(dst, values)    int32 constants, written after every earlier
                          operation of the stream has landed and is visible to
                          the peer (a system-scope release fence, then the write)
    wait(flag, value, deadline_s)
                          the stream stops until the flag equals value (an
                          acquire: what the producer wrote before it is then
                          visible), the step is aborted, or deadline_s passed
                          (then it aborts the step itself: ABORT_TIMEOUT)
    check(record, step, expected)
                          abort the step (ABORT_MISMATCH) unless record's step
                          word equals the control's step word and its other
                          words equal the constants expected

On CUDA: copies are cudaMemcpyAsync (or the pack kernel writing the peer's
slot), store a kernel (__threadfence_system, then volatile writes) or
cuStreamWriteValue32, wait a one-block polling kernel (ld.acquire.sys,
__nanosleep, %globaltimer for the deadline) or cuStreamWaitValue32 with a host
watchdog writing the abort word; csrc/cuda holds them (not written yet: no GPU
has run this). tests/helpers/fake_stream.py is the CPU's stand-in.
"""

from typing import Protocol

import torch


class Stream(Protocol):
    """The device operations of one side's stream (see the module docstring)."""

    def copy(self, dst: torch.Tensor, src: torch.Tensor) -> None: ...

    def copy_word(self, dst: torch.Tensor, src: torch.Tensor) -> None: ...

    def store(self, dst: torch.Tensor, values: tuple[int, ...]) -> None: ...

    def wait(self, flag: torch.Tensor, value: int, deadline_s: float) -> None: ...

    def check(self, record: torch.Tensor, step: torch.Tensor,
              expected: tuple[int, ...]) -> None: ...

    def set_word(self, word: torch.Tensor, value: int) -> None:
        """From the host, outside any graph: a control word (mode, step,
        abort), ordered before the stream's next operation."""

    def signal(self, word: torch.Tensor, value: int) -> None:
        """From the host, any thread, at once and not ordered with the stream
        (it must land while the stream waits): the abort word. On CUDA the
        control words live where the host can write them without the stream
        (mapped pinned memory)."""

    def read_word(self, word: torch.Tensor) -> int:
        """From the host, once the stream is idle (after a step, never inside
        one): a control word."""
