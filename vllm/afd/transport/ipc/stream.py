# SPDX-License-Identifier: Apache-2.0
# SPDX-FileCopyrightText: Copyright contributors to the vllm-afd project
"""What a device does for a device-resident exchange: two stream-ordered
operations per layer call and three host accesses to the control words.

post and take are enqueued on the caller's stream and return at once (on the
CPU, whose "stream" is the calling thread, they run there and then); the host
never reads device memory between them, so a step's calls can be captured
into a graph and replayed. Each first reads its side's control words and does
nothing when the mode is IDLE or the step was aborted (layout.py): that is
how warm-up runs, replays without a peer and a dead peer's step pass through
without touching the peer.

    post(control, src, dst, record, flag, layer, rows, topk)
        src's bytes into dst (the peer's slot; nothing to copy when src is
        dst: packed there already), the control's step word and (layer,
        rows, topk) into the peer's record, then, after all of these are
        visible to the peer (a system-scope release), the peer's flag READY.
        The step word is read when the stream gets there, never baked into a
        graph.
    take(control, mirror, flag, record, layer, rows, deadline_s)
        wait until this side's flag is READY (an acquire: the payload and
        record are then visible), the step is aborted (the control's abort
        word, or its mirror, which the host writes), or deadline_s passed
        (then abort the step: ABORT_TIMEOUT); abort it (ABORT_MISMATCH)
        unless the record names the control's step word, layer and rows;
        else clear the flag. The payload is then this side's slot's. An
        abort is written to the control and to the mirror.
    copy(dst, src)
        a local copy in stream order (a taken payload into the model's buffer)

The control words, from the host (memory.Control: `device` the words the
kernels read, `mirror` the abort word's mirror as they see it, `host` the
mirror as the host does):
    set_word(control.device or control.mirror, index, value)
        outside any graph, ordered after the stream's earlier work and before
        its next
    signal(control.host, 0, value)
        any thread, at once, not ordered with the stream: the abort while a
        take waits
    read_word(control.host, 0)
        once the stream is idle (after a step): why the step stopped

op_stream.py's OpStream is this on the `afd` op library (csrc/cpu/ipc.cpp: the CPU
as a device, processes sharing memory; csrc/cuda/ipc.cu: never run on a GPU
yet); tests/helpers/fake_stream.py is a fake GPU that makes late writes and
captures visible.
"""

from typing import Protocol

import torch


class Stream(Protocol):
    """The device operations of one side's stream (see the module docstring)."""

    def post(self, control: torch.Tensor, src: torch.Tensor, dst: torch.Tensor,
             record: torch.Tensor, flag: torch.Tensor, layer: int, rows: int,
             topk: int = 0) -> None: ...

    def take(self, control: torch.Tensor, mirror: torch.Tensor, flag: torch.Tensor,
             record: torch.Tensor, layer: int, rows: int, deadline_s: float) -> None: ...

    def copy(self, dst: torch.Tensor, src: torch.Tensor) -> None: ...

    def set_word(self, control: torch.Tensor, index: int, value: int) -> None: ...

    def signal(self, control: torch.Tensor, index: int, value: int) -> None: ...

    def read_word(self, control: torch.Tensor, index: int) -> int: ...
