# SPDX-License-Identifier: Apache-2.0
# SPDX-FileCopyrightText: Copyright contributors to the vllm-afd project
"""PeerStep: a peer's current step as one connector sees it.

A connector keeps one per peer (the attention side has one peer, 0), replaced
when the next step begins (send_step, recv_step); a goodbye or shutdown header
ends the conversation and keeps the last step, whose id the next step must
exceed. Nothing else in a connector keeps step state: the protocol's checks
(attention_side.py, ffn_side.py) and the prepared calls (step_calls.py) read
and write it here.
"""

from collections import deque

from vllm.afd.transport.wire import StepHeader


class PeerStep:
    __slots__ = ("header", "in_flight", "posted", "awaiting", "routings", "prepared",
                 "reported_send_ns", "reply_send_s")

    def __init__(self, header: StepHeader) -> None:
        self.header = header
        # Attention side: (layer, ubatch, shape) whose output the general path
        # awaits, oldest first; and ubatch -> the layer whose hidden states a
        # prepared call posted (recv_call takes that answer the same way).
        self.in_flight: deque[tuple[int, int, list[int]]] = deque()
        self.posted: dict[int, int] = {}
        # FFN side: ubatch -> (layer, shape) of hidden states awaiting output,
        # and the routing that came with them (ffn_side.routing()).
        self.awaiting: dict[int, tuple[int, list[int]]] = {}
        self.routings: dict[int, object] = {}
        # The step's prepared calls (step_calls.py): (the C calls' capsule, the
        # op module, per micro-batch a prepared.Ubatch), or None: the general
        # path's step. reported_send_ns: their send time already reported.
        self.prepared: tuple | None = None
        self.reported_send_ns = 0
        # FFN side: seconds reply_call spent sending, not yet reported.
        self.reply_send_s = 0.0

    def waiting_for(self) -> tuple[int, int] | None:
        """(layer, ubatch) of an answer this attention step still awaits."""
        if self.in_flight:
            layer, ubatch, _ = self.in_flight[0]
            return layer, ubatch
        for ubatch, layer in self.posted.items():
            return layer, ubatch
        return None
