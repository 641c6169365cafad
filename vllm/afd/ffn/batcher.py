# SPDX-License-Identifier: Apache-2.0
# SPDX-FileCopyrightText: Copyright contributors to the vllm-afd project
"""LayerBatcher: one mlp call for the same layer of several attention peers.

An FFN rank gets each attention peer's hidden states on that peer's session
thread (ffn/loop.py), and every session hands its (layer, tokens) to the one
batcher of the rank. Peers join and leave at any time: the batcher only knows
who is inside a step (begin/end). A call runs when every peer inside a step
has handed something in (they are in lockstep, as vLLM data-parallel ranks
are; a lone peer's call runs at once) or when the oldest pending call has
waited window_s (a peer between steps, or slower). The pending calls
are grouped by layer and gathered into one MoE input, computed once per layer,
and each peer gets its rows of the output back (a view: no copy), so the FFN
sees the tokens of all its peers in one batch (and their MoE routing, when it
comes from the attention side, concatenated alike). Hidden states that came as
fp8 arrive still packed (codec.Packed) and are unpacked straight into their
rows of the MoE input: the gather is the unpack. A batch never exceeds
max_tokens, the most the FFN was sized and warmed up for: more calls than that
make several batches (a call is never split).

Failures stay with their calls: an mlp call that raises fails the calls it
was made of (each of their threads gets the exception), and nobody else's. A
peer whose connection fails simply leaves (end), so the others stop waiting
for it.
"""

import threading
import time
from collections.abc import Callable

import torch

from vllm.afd.transport.connectors.codec import Packed
from vllm.afd.transport.wire import Routing

# How long a pending call waits for the other peers' calls to join it.
DEFAULT_WINDOW_S = 0.002


class _Call:
    __slots__ = ("layer", "h", "peer", "routing", "out", "error", "done")

    def __init__(self, layer: int, h: "torch.Tensor | Packed", peer: int,
                 routing: Routing | None = None) -> None:
        self.layer, self.h, self.peer, self.routing = layer, h, peer, routing
        self.out: torch.Tensor | None = None
        self.error: BaseException | None = None  # its mlp call failed
        self.done = False

    def result(self) -> torch.Tensor:
        if self.error is not None:
            raise self.error
        return self.out


class LayerBatcher:
    """run_mlp(layer, x) computes a batch; run_mlp(layer, x, routing) when the
    calls came with routing."""

    def __init__(self, run_mlp: Callable[..., torch.Tensor], max_tokens: int,
                 window_s: float = DEFAULT_WINDOW_S) -> None:
        self.run_mlp = run_mlp
        self.max_tokens = max_tokens
        self.window_s = window_s
        self.cv = threading.Condition()
        self.pending: list[_Call] = []
        self.active: set[int] = set()  # peers inside a step
        self.computing = False
        self.batches = 0  # mlp calls made
        self.calls = 0  # compute() calls served
        self.largest = 0  # tokens of the largest mlp call made

    def begin(self, peer: int) -> None:
        with self.cv:
            self.active.add(peer)

    def end(self, peer: int) -> None:
        with self.cv:
            self.active.discard(peer)
            self.cv.notify_all()  # the others may no longer need to wait for it

    def compute(self, layer: int, h: "torch.Tensor | Packed", peer: int,
                routing: Routing | None = None) -> torch.Tensor:
        if h.shape[0] > self.max_tokens:  # the connector's checks make this impossible
            raise ValueError(f"AFD FFN: a call of {h.shape[0]} tokens from attention rank "
                             f"{peer}; the FFN is sized for {self.max_tokens}")
        call = _Call(layer, h, peer, routing)
        with self.cv:
            self.pending.append(call)
            self.cv.notify_all()
            deadline = time.monotonic() + self.window_s
            while True:
                if call.done:
                    return call.result()
                if not self.computing and self.pending:
                    waiting = {c.peer for c in self.pending}
                    if waiting >= self.active or time.monotonic() >= deadline:
                        batch, self.pending = self.pending, []
                        self.computing = True
                        break
                if self.computing:
                    self.cv.wait()  # the computing thread notifies when it is done
                else:
                    self.cv.wait(max(deadline - time.monotonic(), 0.0))
        try:
            self._run(batch)
        except BaseException as e:  # not an mlp failure (those stay with their calls)
            for c in batch:
                c.error = c.error or e
            raise
        finally:
            with self.cv:
                self.calls += len(batch)
                for c in batch:
                    c.done = True
                self.computing = False
                self.cv.notify_all()
        return call.result()

    def _run(self, batch: list[_Call]) -> None:
        by_layer: dict[int, list[_Call]] = {}
        for c in sorted(batch, key=lambda c: (c.layer, c.peer)):
            by_layer.setdefault(c.layer, []).append(c)
        for layer, calls in by_layer.items():
            for group in self._within_budget(calls):
                try:
                    self._run_group(layer, group)
                except Exception as e:  # noqa: BLE001 - each of its calls raises it
                    for c in group:
                        c.error = e

    def _within_budget(self, calls: list[_Call]) -> list[list[_Call]]:
        """Consecutive groups of calls of at most max_tokens tokens each."""
        groups: list[list[_Call]] = [[]]
        tokens = 0
        for c in calls:
            n = c.h.shape[0]
            if groups[-1] and tokens + n > self.max_tokens:
                groups.append([])
                tokens = 0
            groups[-1].append(c)
            tokens += n
        return groups

    def _run_group(self, layer: int, calls: list[_Call]) -> None:
        x = gather([c.h for c in calls])
        routed = [c.routing for c in calls if c.routing is not None]
        if not routed:
            out = self.run_mlp(layer, x)
        elif len(routed) != len(calls):  # the FFN loop checks this per peer first
            raise RuntimeError(f"AFD FFN: layer {layer}: some peers sent routing, "
                               f"others did not")
        else:
            routing = routed[0] if len(routed) == 1 else Routing(
                torch.cat([r.topk_weights for r in routed]),
                torch.cat([r.topk_ids for r in routed]))
            out = self.run_mlp(layer, x, routing)
        start = 0
        for c in calls:
            n = c.h.shape[0]
            c.out = out[start:start + n]
            start += n
        self.batches += 1
        self.largest = max(self.largest, x.shape[0])


def gather(parts: "list[torch.Tensor | Packed]") -> torch.Tensor:
    """The peers' rows joined into one MoE input, in order; packed (fp8) parts
    are unpacked straight into their rows. One part: itself (unpacked into
    its connector buffer if packed), no copy."""
    if len(parts) == 1:
        part = parts[0]
        return part.tensor() if isinstance(part, Packed) else part
    if not any(isinstance(p, Packed) for p in parts):
        return torch.cat(parts)
    first = parts[0]
    x = torch.empty((sum(p.shape[0] for p in parts), first.shape[1]), dtype=first.dtype,
                    device=first.device)
    start = 0
    for part in parts:
        rows = x[start:start + part.shape[0]]
        if isinstance(part, Packed):
            part.into(rows)
        else:
            rows.copy_(part)
        start += part.shape[0]
    return x
