# SPDX-License-Identifier: Apache-2.0
# SPDX-FileCopyrightText: Copyright contributors to the vllm-afd project
"""A fake device stream for the device-resident exchange (vllm/afd/transport/ipc/):
the CPU stands in for a GPU, which cannot exist here.

Operations run in order on a thread of their own, as a stream runs them after
the host enqueued them. What a GPU does that could hide a bug is made to
happen: with `deferred_s` > 0 a post's payload and record become visible to
the peer that much later unless the flag's store (the release) drains them
first, as unfenced writes may (fenced_stores=False: a broken device whose
flag does not wait); the stream's own later operations see them (same-stream
order). A take polls the flag the peer writes. capture() records operations
into a graph instead of running them; replay() runs them again, and the host
calls a graph must not contain (set_word, read_word) raise during a capture.
"""

import contextlib
import queue
import threading
import time

import torch

from vllm.afd.transport.ipc.layout import (ABORT, ABORT_MISMATCH, ABORT_TIMEOUT, CLEAR, MODE,
                                           NOT_ABORTED, READY, RECORD_LAYER, RECORD_ROWS,
                                           RECORD_STEP, RUN, STEP)

POLL_S = 0.0002


class FakeGraph:
    def __init__(self, stream: "FakeStream") -> None:
        self.stream, self.ops = stream, []

    def replay(self) -> None:
        for op in self.ops:
            self.stream._queue.put(op)


class FakeStream:
    def __init__(self, control: torch.Tensor, deferred_s: float = 0.0,
                 fenced_stores: bool = True) -> None:
        """control: this side's control words (every operation is skipped
        once they say IDLE or aborted). fenced_stores False is a broken device
        (its stores do not wait for earlier writes): for negative controls."""
        self.control, self.deferred_s, self.fenced_stores = control, deferred_s, fenced_stores
        self._queue: queue.Queue = queue.Queue()
        self._pending: list[threading.Timer] = []
        self._graph: FakeGraph | None = None
        self.executed = 0  # operations that acted (not skipped)
        self.errors: list[BaseException] = []
        self._worker = threading.Thread(target=self._run, daemon=True)
        self._worker.start()

    # ---------------------------------------------------------------- host
    @contextlib.contextmanager
    def capture(self):
        self.synchronize()
        self._graph = graph = FakeGraph(self)
        try:
            yield graph
        finally:
            self._graph = None

    def synchronize(self, timeout: float = 30.0) -> None:
        done = threading.Event()
        self._queue.put(done.set)
        if not done.wait(timeout):
            raise TimeoutError("fake stream: still busy")
        self._drain()
        if self.errors:
            raise self.errors[0]

    def set_word(self, control: torch.Tensor, index: int, value: int) -> None:
        self._no_capture("set_word")

        def op():
            control[index] = value
        self._queue.put(op)

    def signal(self, control: torch.Tensor, index: int, value: int) -> None:
        control[index] = value  # at once, from any thread

    def read_word(self, control: torch.Tensor, index: int) -> int:
        self._no_capture("read_word")
        self.synchronize()
        return int(control[index])

    # ------------------------------------------------------------ operations
    def copy(self, dst: torch.Tensor, src: torch.Tensor) -> None:
        self._enqueue(lambda: dst.copy_(src), reads=True)

    def post(self, control: torch.Tensor, src: torch.Tensor, dst: torch.Tensor,
             record: torch.Tensor, flag: torch.Tensor, layer: int, rows: int,
             topk: int = 0) -> None:
        def op():
            self._write(dst, src.clone())
            self._write(record, torch.tensor([int(control[STEP]), layer, rows, topk],
                                             dtype=torch.int32))
            if self.fenced_stores:
                self._drain()
            flag[0] = READY
        self._enqueue(op, reads=True)

    def take(self, control: torch.Tensor, mirror: torch.Tensor, flag: torch.Tensor,
             record: torch.Tensor, layer: int, rows: int, deadline_s: float) -> None:
        def abort(why: int) -> None:
            control[ABORT] = why
            mirror[0] = why

        def op():
            deadline = time.monotonic() + deadline_s
            while int(flag[0]) != READY:
                if int(mirror[0]) != NOT_ABORTED:  # the host's release
                    abort(int(mirror[0]))
                if self._stopped():
                    return
                if time.monotonic() > deadline:
                    abort(ABORT_TIMEOUT)
                    return
                time.sleep(POLL_S)
            got = [int(x) for x in record]
            if (got[RECORD_STEP] != int(control[STEP])
                    or got[RECORD_LAYER:RECORD_ROWS + 1] != [layer, rows]):
                abort(ABORT_MISMATCH)
                return
            flag[0] = CLEAR
        self._enqueue(op)

    # ------------------------------------------------------------- internals
    def _no_capture(self, what: str) -> None:
        if self._graph is not None:
            raise RuntimeError(f"fake stream: {what} from the host during a capture (a "
                               f"graph cannot contain it)")

    def _enqueue(self, op, reads: bool = False) -> None:
        """reads: the operation reads memory this stream may have written
        (its own late writes land first)."""
        def guarded():
            if self._stopped():
                return
            if reads:
                self._drain()
            self.executed += 1
            op()
        if self._graph is not None:
            self._graph.ops.append(guarded)
        else:
            self._queue.put(guarded)

    def _stopped(self) -> bool:
        return int(self.control[MODE]) != RUN or int(self.control[ABORT]) != NOT_ABORTED

    def _write(self, dst: torch.Tensor, data: torch.Tensor) -> None:
        if self.deferred_s <= 0:
            dst.copy_(data)
            return
        timer = threading.Timer(self.deferred_s, dst.copy_, (data,))
        self._pending.append(timer)
        timer.start()

    def _drain(self) -> None:
        pending, self._pending = self._pending, []
        for timer in pending:
            timer.join()

    def _run(self) -> None:
        while True:
            op = self._queue.get()
            try:
                op()
            except BaseException as e:  # noqa: BLE001 - reported by synchronize
                self.errors.append(e)


def kernel(stream: FakeStream, fn) -> None:
    """The model's compute between exchanges (an mlp, the attention part), as
    a stream operation: skipped like the others once the step stops."""
    stream._enqueue(fn, reads=True)
