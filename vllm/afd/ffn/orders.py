# SPDX-License-Identifier: Apache-2.0
# SPDX-FileCopyrightText: Copyright contributors to the vllm-afd project
"""Batch orders: how the workers of a tensor/expert-parallel FFN server agree on
the mlp calls they make. Data plane.

Every worker of such a server gets every token of every attention peer, and
vLLM's collectives inside the mlp (TP all-reduce, EP all-to-all) combine the
workers' parts, so all of them must make the same mlp calls (same layer, same
rows) in the same order. With several peers, each worker's own batching would
differ (the peers' frames arrive in a different interleaving on each), so the
group's lead decides: its LayerBatcher sends each batch it forms as an order,
before running it, and the followers' batchers run exactly those orders.

Messages, in the order the lead sends them (plain lists, cheap to pickle):
  ["batch", [[layer, [[peer, num_tokens], ...]], ...]]  one batch: its mlp calls
                                                        in execution order, each
                                                        naming the peers' rows
  ["gone", peer]     the lead's session of `peer` ended: a follower drops that
                     peer's call still waiting (it arrived before this message,
                     so no order will ever name it)
  ["idle"]           keepalive, so an idle follower's receive does not time out
  ["stop"]           the lead's batcher closed: the followers' receivers end

An OrderChannel carries them from the lead to every follower: send() on the lead
(thread-safe, the batcher serializes it), recv() on a follower (blocking; one
receiving thread). QueueChannel does it in one process (tests, the harness);
TorchDistChannel over a torch.distributed group (the vLLM worker adapter
builds a dedicated gloo group for it, adapter/worker.py).
"""

import logging
import queue
import threading
from typing import Any, Protocol

logger = logging.getLogger(__name__)

Message = list  # see the module docstring


class OrderError(RuntimeError):
    """A follower cannot follow the lead's order: the workers' mlp calls would no
    longer match (reported to the attention peers in the batch)."""


class OrderChannel(Protocol):
    def send(self, message: Message) -> None:
        """Lead: to every follower (thread-safe)."""

    def recv(self) -> Message:
        """Follower: the lead's next message (blocking)."""


class QueueChannel:
    """In one process: one queue per follower."""

    def __init__(self, followers: int = 1) -> None:
        self.queues: list[queue.Queue] = [queue.Queue() for _ in range(followers)]

    def send(self, message: Message) -> None:
        for q in self.queues:
            q.put(message)

    def end(self, follower: int = 0) -> "FollowerEnd":
        """The receiving end of one follower."""
        return FollowerEnd(self.queues[follower])


class FollowerEnd:
    def __init__(self, q: queue.Queue) -> None:
        self.q = q

    def send(self, message: Message) -> None:
        raise RuntimeError("AFD FFN orders: a follower does not send orders")

    def recv(self) -> Message:
        return self.q.get()


class TorchDistChannel:
    """Over a torch.distributed process group whose rank 0 is the lead: each
    message is one broadcast_object_list from it. The group must be used for
    nothing else (a collective of the mlp interleaved with an order's broadcast
    would pair wrong messages)."""

    def __init__(self, group: Any, lead_rank: int) -> None:
        self.group = group
        self.lead_rank = lead_rank  # the lead's rank in the default (world) group
        self._lock = threading.Lock()

    def send(self, message: Message) -> None:
        import torch.distributed as dist

        with self._lock:  # one broadcast at a time on the group
            dist.broadcast_object_list([message], src=self.lead_rank, group=self.group)

    def recv(self) -> Message:
        import torch.distributed as dist

        box: list[Any] = [None]
        dist.broadcast_object_list(box, src=self.lead_rank, group=self.group)
        return box[0]
