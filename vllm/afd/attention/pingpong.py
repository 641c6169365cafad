# SPDX-License-Identifier: Apache-2.0
# SPDX-FileCopyrightText: Copyright contributors to the vllm-afd project
"""Micro-batch ping-pong on the attention role (num_ubatches > 1). Data plane.

A step's tokens are split into m micro-batches. Each runs the whole model
forward in its own thread (micro-batch 0 in the caller's thread, the others in
persistent worker threads). The threads take turns, one at a time, in a ring:

    ubatch 0: attention L0 -> send (L0, 0) -> pass the turn
    ubatch 1: attention L0 -> send (L0, 1) -> pass the turn
    ubatch 0: receive (L0, 0) -> attention L1 -> send (L1, 0) -> pass the turn
    ubatch 1: receive (L0, 1) -> attention L1 -> ...

so the attention of one micro-batch runs while the FFN server computes the mlp
of the other, and frames leave and arrive in the order the connector contract
wants ((layer, ubatch) ascending). The link passes the turn between its send
and its receive (AttentionLink.exchange asks `current_turn()`).

Every thread enters the DeviceContext of the step (the device and stream of
the runner that asked for it). Whatever else must follow the turn (vLLM's
process-wide forward context) is the caller's `on_turn(u)`, called by the
thread that takes the turn, before it runs model code.
"""

import queue
import threading
from collections.abc import Callable
from typing import Any

import torch

from vllm.afd.transport.device import DeviceContext

_tls = threading.local()  # .turn: (PingPong, ubatch id) while a ping-pong runs


def current_turn() -> "tuple[PingPong, int] | None":
    """(ping-pong, micro-batch) of the calling thread while it runs one."""
    return getattr(_tls, "turn", None)


class PingPong:
    """The turn ring of one step's micro-batch threads.

    The turn is handed from thread to thread directly: each micro-batch has a
    lock that is held while it waits, and passing the turn releases exactly
    the next one's. A Condition with notify_all would wake every waiting
    thread (and make each retake the Condition's lock) at every hand-over,
    and a step has two hand-overs per layer and micro-batch."""

    def __init__(self, num_tokens: list[int],
                 on_turn: Callable[[int], None] | None = None) -> None:
        self.num_tokens = list(num_tokens)
        self.num_ubatches = len(self.num_tokens)
        self.on_turn = on_turn
        self.turn = 0
        self.done = [False] * self.num_ubatches
        self.error: BaseException | None = None
        # _go[u] is released when micro-batch u gets the turn; micro-batch 0
        # starts with it.
        self._go = [threading.Lock() for _ in range(self.num_ubatches)]
        for lock in self._go[1:]:
            lock.acquire()
        self._state = threading.Lock()  # turn, done, error

    def wait_turn(self, u: int) -> None:
        self._go[u].acquire()
        if self.error is not None:
            raise RuntimeError(f"AFD micro-batch {u} stopped: another micro-batch of "
                               f"this step failed ({self.error!r})")
        if self.on_turn is not None:
            self.on_turn(u)

    def _pass_locked(self, u: int) -> None:
        m = self.num_ubatches
        for k in range(1, m + 1):
            nxt = (u + k) % m
            if not self.done[nxt]:
                self.turn = nxt
                # Unlocked already: its turn is granted and not yet taken (a
                # micro-batch that failed outside its turn passed it on).
                if self._go[nxt].locked():
                    self._go[nxt].release()
                return

    def yield_turn(self, u: int) -> None:
        """Let the next micro-batch run; return when it is u's turn again."""
        with self._state:
            self._pass_locked(u)
        self.wait_turn(u)

    def finish(self, u: int, error: BaseException | None = None) -> None:
        with self._state:
            self.done[u] = True
            if error is not None and self.error is None:
                self.error = error
            if self.error is not None:
                # Wake every waiting micro-batch: each stops with the error.
                for v in range(self.num_ubatches):
                    if not self.done[v] and self._go[v].locked():
                        self._go[v].release()
            else:
                self._pass_locked(u)


class _Worker:
    """A persistent thread for micro-batches 1..m-1 (new threads would cost a
    fresh OpenMP team every step)."""

    def __init__(self, index: int) -> None:
        self.jobs: queue.SimpleQueue = queue.SimpleQueue()
        self.thread = threading.Thread(target=self._run, name=f"afd-ubatch-{index}",
                                       daemon=True)
        self.thread.start()

    def _run(self) -> None:
        while True:
            job = self.jobs.get()
            if job is None:
                return
            job()


_workers: list[_Worker] = []
_workers_lock = threading.Lock()


def _worker(i: int) -> _Worker:
    with _workers_lock:
        while len(_workers) <= i:
            _workers.append(_Worker(len(_workers) + 1))
        return _workers[i]


def run_micro_batches(num_tokens: list[int], run: Callable[[int], Any], *,
                      device: DeviceContext,
                      on_turn: Callable[[int], None] | None = None,
                      on_thread: Callable[[int, DeviceContext], None] | None = None
                      ) -> list[Any]:
    """run(u) for every micro-batch u, ping-ponged; their results in order.
    Each thread enters `device` first (on_thread(u, context), for tests and
    logs, sees what it entered). The first error of any micro-batch is raised
    once every thread has stopped."""
    pp = PingPong(num_tokens, on_turn)
    # Grad and inference mode are per thread: the workers run as the caller.
    inference = torch.is_inference_mode_enabled()
    grad = torch.is_grad_enabled()
    results: list[Any] = [None] * pp.num_ubatches
    done = [threading.Event() for _ in range(pp.num_ubatches)]

    def job(u: int) -> None:
        error = None
        _tls.turn = (pp, u)
        try:
            with (device.entered() as context, torch.inference_mode(inference),
                  torch.set_grad_enabled(grad)):
                if on_thread is not None:
                    on_thread(u, context)
                pp.wait_turn(u)
                results[u] = run(u)
        except BaseException as e:  # noqa: BLE001 - handed to the caller below
            error = e
        finally:
            _tls.turn = None
            pp.finish(u, error)
            done[u].set()

    for u in range(1, pp.num_ubatches):
        _worker(u - 1).jobs.put(lambda u=u: job(u))
    job(0)
    for event in done:
        event.wait()
    if pp.error is not None:
        raise pp.error
    return results
