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

Roles, for the workers of a tensor/expert-parallel FFN server (ffn/orders.py):
all of them must make the same mlp calls in the same order, so
  "alone"     (one worker; the default) batches as above;
  "lead"      batches as above, and sends each batch's mlp calls as an order
              (layer and peers' token counts, in execution order) before
              running them; when one of its peers' sessions ends it sends
              ["gone", peer];
  "follower"  never decides: a thread receives the lead's orders, and a call
              runs when the next ordered mlp call names its peer; that mlp
              call is gathered from the named peers' calls in the order's sequence.
              Each peer has at most one call pending (its session thread waits
              in compute), so an order names calls by peer; an ordered call of
              another layer or size is an OrderError naming both. Every wait is
              bounded by timeout_s: an ordered call that does not arrive in
              time is an OrderError too. An OrderError breaks the follower (its mlp
              calls no longer pair with the lead's collectives): it fails every
              call from then on. A call no order names within timeout_s fails
              alone. ["gone", peer] fails that peer's waiting call if it came
              before the message (the lead will never order it; a call of the
              peer's next session, arriving later, waits for its orders).
"""

import logging
import threading
import time
from collections import deque
from collections.abc import Callable

import torch

from vllm.afd.ffn.orders import OrderChannel, OrderError
from vllm.afd.transport.connectors.codec import Packed
from vllm.afd.transport.wire import Routing

logger = logging.getLogger(__name__)

# How long a pending call waits for the other peers' calls to join it.
DEFAULT_WINDOW_S = 0.002
# A lead that sent nothing for this long sends ["idle"] (keepalive()): a
# follower's receive never sits long enough for its channel to time out.
KEEPALIVE_S = 60.0
# How often a waiting follower call looks at its deadlines.
FOLLOWER_POLL_S = 0.05
ROLES = ("alone", "lead", "follower")


class _Call:
    __slots__ = ("layer", "h", "peer", "routing", "out", "error", "done", "seq", "since")

    def __init__(self, layer: int, h: "torch.Tensor | Packed", peer: int,
                 routing: Routing | None = None) -> None:
        self.layer, self.h, self.peer, self.routing = layer, h, peer, routing
        self.out: torch.Tensor | None = None
        self.error: BaseException | None = None  # its mlp call failed
        self.done = False
        self.seq = 0  # follower: arrival order (against ["gone", peer])
        self.since = 0.0  # follower: when it arrived

    def result(self) -> torch.Tensor:
        if self.error is not None:
            raise self.error
        return self.out


class LayerBatcher:
    """run_mlp(layer, x) computes a batch; run_mlp(layer, x, routing) when the
    calls came with routing; run_mlp(layer, x, routing, reply) for a lone
    call that replies: run_mlp calls reply(out) as soon as out exists."""

    def __init__(self, run_mlp: Callable[..., torch.Tensor], max_tokens: int,
                 window_s: float = DEFAULT_WINDOW_S, *, role: str = "alone",
                 orders: OrderChannel | None = None, timeout_s: float = 60.0) -> None:
        if role not in ROLES:
            raise ValueError(f"LayerBatcher role: {role!r} is not one of {ROLES}")
        if (role == "alone") != (orders is None):
            raise ValueError(f"LayerBatcher role {role!r}: an order channel is needed exactly "
                             f"for 'lead' and 'follower'")
        self.run_mlp = run_mlp
        self.max_tokens = max_tokens
        self.window_s = window_s
        self.role, self.orders, self.timeout_s = role, orders, timeout_s
        self._lock = threading.Lock()
        self.cv = threading.Condition(self._lock)
        self.sleepers = 0  # compute() calls asleep in the batching path's cv.wait
        self.pending: list[_Call] = []
        self.active: set[int] = set()  # peers inside a step
        self.computing = False
        self.batches = 0  # mlp calls made
        self.calls = 0  # compute() calls served
        self.largest = 0  # tokens of the largest mlp call made
        self.closed = False
        # lead
        self._last_sent = time.monotonic()
        # follower: peer -> its waiting call; the lead's orders not run yet, one
        # ("run", layer, [(peer, num_tokens), ...]) or ("gone", peer, seq) each
        self.waiting: dict[int, _Call] = {}
        self.todo: deque[tuple] = deque()
        self.head_since = time.monotonic()  # when todo[0] became the next to run
        self.seq = 0
        self.broken: OrderError | None = None
        self.receiver: threading.Thread | None = None
        if role == "follower":
            self.receiver = threading.Thread(target=self._receive, daemon=True,
                                             name="afd-ffn-orders")
            self.receiver.start()

    # --- lead: sending orders ----------------------------------------------
    def _send(self, message: list) -> None:
        self.orders.send(message)  # thread-safe (OrderChannel)
        self._last_sent = time.monotonic()

    def leave(self, peer: int) -> None:
        """The session of `peer` ended (for good: a new one is a new peer)."""
        if self.role == "lead" and not self.closed:
            try:
                self._send(["gone", peer])
            except Exception as e:  # noqa: BLE001 - the followers time its call out
                logger.warning("AFD FFN lead: cannot tell the followers that attention "
                               "rank %d left: %s", peer, e)

    def keepalive(self) -> None:
        """Lead: called now and then (the accept loop); sends ["idle"] when it
        sent nothing for KEEPALIVE_S."""
        if (self.role == "lead" and not self.closed
                and time.monotonic() - self._last_sent > KEEPALIVE_S):
            self._send(["idle"])

    def close(self) -> None:
        """The loop stops: a lead tells its followers (their receivers end)."""
        with self.cv:
            if self.closed:
                return
            self.closed = True
            if self.role == "follower":  # its waiting calls will never be ordered now
                self.broken = self.broken or OrderError("AFD FFN follower: the loop stopped")
                self._break(self.broken)
            self.cv.notify_all()
        if self.role == "lead":
            # A follower gone already must not hold the stop: bounded, on the side.
            sender = threading.Thread(target=self._send_stop, daemon=True)
            sender.start()
            sender.join(2.0)

    def _send_stop(self) -> None:
        try:
            self.orders.send(["stop"])
        except Exception as e:  # noqa: BLE001 - stopping anyway
            logger.debug("AFD FFN lead: stop not sent: %s", e)

    def begin(self, peer: int) -> None:
        with self.cv:
            self.active.add(peer)

    def end(self, peer: int) -> None:
        with self.cv:
            self.active.discard(peer)
            self.cv.notify_all()  # the others may no longer need to wait for it

    def compute(self, layer: int, h: "torch.Tensor | Packed", peer: int,
                routing: Routing | None = None,
                reply: Callable[[torch.Tensor], None] | None = None) -> torch.Tensor:
        """peer's call of layer: its mlp output, computed alone or joined with
        other peers' calls of the layer. reply(out), when given, is called
        with it as soon as it exists: for a lone peer before any of the
        batcher's bookkeeping (the attention side waits on nothing else)."""
        if self.role == "alone" and self.enter_alone(peer):
            # A lone peer's call (nobody else inside a step, nothing pending or
            # computing) runs at once, without a _Call, the wait or the
            # grouping: each costs tens of microseconds on a cold cache, per
            # layer call. Its size is read after the reply: a tensor's
            # attribute costs a microsecond there too (the connector's checks
            # bound it by max_tokens).
            ran = False
            try:
                x = h if type(h) is torch.Tensor else gather([h])
                if reply is not None:  # run_mlp replies before its bookkeeping
                    out = self.run_mlp(layer, x, routing, reply)
                else:
                    out = (self.run_mlp(layer, x) if routing is None
                           else self.run_mlp(layer, x, routing))
                ran = True
            finally:
                self.leave_alone(len(x) if ran else 0, ran)
            return out
        rows = h.shape[0]
        if rows > self.max_tokens:  # the connector's checks make this impossible
            raise ValueError(f"AFD FFN: a call of {rows} tokens from attention rank "
                             f"{peer}; the FFN is sized for {self.max_tokens}")
        call = _Call(layer, h, peer, routing)
        out = self._follow(call) if self.role == "follower" else self._join(call)
        if reply is not None:
            reply(out)
        return out

    def _join(self, call: _Call) -> torch.Tensor:
        """call, joined with the other peers' calls of its layer that come
        within the window (or every active peer's), run by whichever thread
        finds the batch ready."""
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
                self.sleepers += 1
                try:
                    if self.computing:
                        self.cv.wait()  # the computing thread notifies when it is done
                    else:
                        self.cv.wait(max(deadline - time.monotonic(), 0.0))
                finally:
                    self.sleepers -= 1
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

    def enter_alone(self, peer: int) -> bool:
        """Whether `peer`'s call may run at once, alone: the batcher batches
        alone ("alone" role), nobody else is inside a step, nothing is pending
        or computing. True: it counts as computing until leave_alone."""
        # The condition's lock itself (a C call; the Condition's own enter is
        # Python): this is on the path from a layer's hidden states to its mlp.
        with self._lock:
            if (self.role != "alone" or self.computing or self.pending
                    or not self.active <= {peer}):
                return False
            self.computing = True
            return True

    def leave_alone(self, rows: int, ran: bool = True) -> None:
        """The call enter_alone let in is done (its mlp ran, or raised)."""
        with self._lock:
            self.calls += 1
            if ran:
                self.batches += 1
                if rows > self.largest:
                    self.largest = rows
            self.computing = False
            if self.sleepers:
                self.cv.notify_all()  # a peer that came meanwhile

    def _run(self, batch: list[_Call]) -> None:
        by_layer: dict[int, list[_Call]] = {}
        for c in sorted(batch, key=lambda c: (c.layer, c.peer)):
            by_layer.setdefault(c.layer, []).append(c)
        groups = [(layer, group) for layer, calls in by_layer.items()
                  for group in self._within_budget(calls)]
        if self.role == "lead":
            # Sent before running: the followers start while the lead computes,
            # and meet it in each mlp call's collectives.
            self._send(["batch", [[layer, [[c.peer, c.h.shape[0]] for c in group]]
                                 for layer, group in groups]])
        for layer, group in groups:
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


    # --- follower -----------------------------------------------------------
    def _receive(self) -> None:
        """The follower's receiving thread: the lead's messages, in order, into todo."""
        while True:
            try:
                message = self.orders.recv()
            except BaseException as e:  # noqa: BLE001 - the orders are lost for good
                with self.cv:
                    if not self.closed:
                        self._break(OrderError(f"AFD FFN follower: the lead's orders were "
                                              f"lost: {type(e).__name__}: {e}"))
                return
            kind = message[0]
            with self.cv:
                if kind == "stop":
                    self.closed = True
                    self.cv.notify_all()
                    return
                if not self.todo:
                    self.head_since = time.monotonic()
                if kind == "batch":
                    for layer, rows in message[1]:
                        self.todo.append(("run", layer, [(p, n) for p, n in rows]))
                elif kind == "gone":
                    self.seq += 1
                    self.todo.append(("gone", message[1], self.seq))
                self.cv.notify_all()

    def _break(self, error: OrderError) -> None:
        """The follower can no longer pair its mlp calls with the lead's (called
        with self.cv held): every call, waiting or to come, fails with error."""
        if self.broken is None:
            self.broken = error
            logger.error("%s", error)
        for c in self.waiting.values():
            c.error, c.done = self.broken, True
        self.waiting.clear()
        self.cv.notify_all()

    def _next_group(self) -> "tuple[int, list[_Call]] | None":
        """The next ordered mlp call, when all its calls are here (self.cv held).
        Applies the ["gone", peer] messages before it."""
        while self.todo and self.todo[0][0] == "gone":
            _, peer, seq = self.todo.popleft()
            self.head_since = time.monotonic()
            call = self.waiting.get(peer)
            if call is not None and call.seq < seq:
                del self.waiting[peer]
                call.error = OrderError(f"AFD FFN follower: the lead's session of attention "
                                       f"rank {peer} ended before its layer {call.layer} "
                                       f"call was ordered")
                call.done = True
                self.cv.notify_all()
        if not self.todo:
            return None
        _, layer, rows = self.todo[0]
        calls = []
        for peer, n in rows:
            call = self.waiting.get(peer)
            if call is None:
                return None
            if call.layer != layer or call.h.shape[0] != n:
                self._break(OrderError(
                    f"AFD FFN follower: the lead ordered layer {layer} with {n} token(s) of "
                    f"attention rank {peer}, but this worker has layer {call.layer} with "
                    f"{call.h.shape[0]} token(s) of it"))
                return None
            calls.append(call)
        self.todo.popleft()
        for call in calls:
            del self.waiting[call.peer]
        return layer, calls

    def _ordered(self, peer: int) -> bool:
        return any(item[0] == "run" and any(p == peer for p, _ in item[2])
                   for item in self.todo)

    def _follow(self, call: _Call) -> torch.Tensor:
        with self.cv:
            if self.broken is not None:
                raise self.broken
            if call.peer in self.waiting:  # its session thread waits in compute
                raise RuntimeError(f"AFD FFN follower: attention rank {call.peer} has a "
                                   f"call waiting already")
            self.seq += 1
            call.seq, call.since = self.seq, time.monotonic()
            self.waiting[call.peer] = call
            self.cv.notify_all()
        while True:
            # Whoever finds the next ordered mlp call ready runs it, its own or
            # not (one at a time, in the order's sequence), then looks again.
            found = self._await_turn(call)
            if found is None:
                return call.result()
            layer, calls = found
            try:
                self._run_group(layer, calls)
            except Exception as e:  # noqa: BLE001 - each of its calls raises it
                for c in calls:
                    c.error = e
            finally:
                with self.cv:
                    self.calls += len(calls)
                    for c in calls:
                        c.done = True
                    self.computing = False
                    self.head_since = time.monotonic()
                    self.cv.notify_all()

    def _await_turn(self, call: _Call) -> "tuple[int, list[_Call]] | None":
        """None when `call` is done; else the next ordered mlp call, ready to
        run by this thread (self.computing set)."""
        with self.cv:
            while True:
                if call.done:
                    return None
                if self.broken is not None:
                    if self.waiting.get(call.peer) is call:
                        self._break(self.broken)  # fails this call too
                        continue
                    self.cv.wait(FOLLOWER_POLL_S)  # in a group being run: it ends it
                    continue
                if not self.computing:
                    found = self._next_group()
                    if found is not None:
                        self.computing = True
                        return found
                    if call.done or self.broken is not None:
                        continue
                now = time.monotonic()
                if not self.computing and self.todo and now - self.head_since > self.timeout_s:
                    _, layer, rows = self.todo[0]
                    missing = [p for p, _ in rows if p not in self.waiting]
                    self._break(OrderError(
                        f"AFD FFN follower: the lead ordered layer {layer} with attention "
                        f"rank(s) {[p for p, _ in rows]}, but the call(s) of {missing} did "
                        f"not arrive within {self.timeout_s:g}s"))
                    continue
                if (self.waiting.get(call.peer) is call and not self._ordered(call.peer)
                        and now - call.since > self.timeout_s):
                    del self.waiting[call.peer]
                    call.error = OrderError(
                        f"AFD FFN follower: the lead ordered no call for layer {call.layer} "
                        f"of attention rank {call.peer} within {self.timeout_s:g}s")
                    call.done = True
                    continue
                self.cv.wait(FOLLOWER_POLL_S)

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
