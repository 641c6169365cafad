# SPDX-License-Identifier: Apache-2.0
# SPDX-FileCopyrightText: Copyright contributors to the vllm-afd project
"""One real step on the attention side, from begin_step to end_step.

The link (link.py) makes its layer calls through it, a failover (resume.py)
reads where each micro-batch stands to resume it on another pool member, and
end_step reads whether it finished. Nothing else keeps step state on the
attention side's link: the connector keeps its protocol's (which frames it
expects next), the pool member what it counts.
"""

import torch

from vllm.afd.transport.wire import Routing


class Step:
    """The step's identity, its pool member and where it stands."""

    __slots__ = ("id", "num_tokens", "ubatched", "member", "sender", "lead", "in_flight",
                 "done", "calls_left", "started", "round_trips", "aborted")

    def __init__(self, step_id: int, num_tokens: tuple[int, ...], member,
                 num_layers: int, started: float) -> None:
        self.id = step_id
        self.num_tokens = num_tokens
        # Several micro-batches: their threads take turns (pingpong.py).
        self.ubatched = len(num_tokens) > 1
        self.member = None
        self.sender = self.lead = None
        self.use(member)
        # Per micro-batch: the layer call sent and not yet answered, kept so
        # that a failover sends it again (the caller leaves the tensors as
        # they are until then, as zero-copy sends need).
        self.in_flight: dict[int, tuple[int, torch.Tensor, Routing | None]] = {}
        self.done = [0] * len(num_tokens)  # per micro-batch: layer calls answered
        self.calls_left = num_layers * len(num_tokens)
        self.started = started
        # Layer call round trips, observed into the link's histogram at end_step
        # (not on the path the FFN's answer waits on).
        self.round_trips: list[float] = []
        # Lost where the connector checks once per step (resume.py's abort):
        # the error every later sight of the loss raises; the step is not
        # resumed.
        self.aborted = None

    def use(self, member) -> None:
        """Make the step's calls to member (at the start and after a failover).
        sender: what send_call goes to, the member's lead connector itself
        when it is alone (one Python call less per layer call), the member
        when followers of its FFN group need the hidden states too; lead:
        what answers."""
        self.member = member
        if member is None:
            self.sender = self.lead = None
        else:
            self.lead = member.lead
            self.sender = member if member.followers else member.lead

    def answered(self, u: int) -> None:
        """Micro-batch u's layer call in flight has its output."""
        del self.in_flight[u]
        self.done[u] += 1
        self.calls_left -= 1

    @property
    def finished(self) -> bool:
        return self.calls_left == 0

    def resume_layers(self, layers: list[int]) -> list[int]:
        """Per micro-batch, the first layer a member taking over serves: the
        one in flight, else the next one to be sent (past the last: done)."""
        resume = []
        for u, done in enumerate(self.done):
            if u in self.in_flight:
                resume.append(self.in_flight[u][0])
            else:
                resume.append(layers[done] if done < len(layers) else layers[-1] + 1)
        return resume
