# SPDX-License-Identifier: Apache-2.0
# SPDX-FileCopyrightText: Copyright contributors to the vllm-afd project
"""The attention side's protocol state: one step at a time, outputs in send order.

    conn.send_step(StepHeader(step_id=s, num_tokens=[n0, n1]))
    for layer in layers:
        for u in (0, 1): conn.send_hidden(layer, u, h[u])
        for u in (0, 1): conn.recv_output(layer, u, out=o[u])

Mixed into AFDConnector (base.py), whose message helpers it uses.
"""

import torch

from vllm.afd.transport import wire
from vllm.afd.transport.connectors.peer_step import PeerStep
from vllm.afd.transport.errors import What
from vllm.afd.transport.wire import StepHeader


class AttentionSide:
    # The step (peer_step.py) is self._steps[0], set by send_step.
    def send_step(self, header: StepHeader) -> None:
        """Announce a step (or, with the SHUTDOWN flag, the end of serving)."""
        self._require("attention")
        last = self._steps.get(0)
        waiting = last.waiting_for() if last is not None else None
        if waiting is not None:
            raise ValueError(f"{self.me}: step {last.header.step_id} still waits for the "
                             f"output of layer {waiting[0]} ubatch {waiting[1]}")
        min_step = last.header.step_id + 1 if last is not None else 0
        wire.check_step(header, num_ubatches=self.num_ubatches, max_tokens=self.max_tokens,
                        min_step_id=min_step, context=f"{self.me}, send_step")
        self._send_message(0, header, what=What("step {}", header.step_id))
        if not (header.is_shutdown or header.is_goodbye):
            self._steps[0] = PeerStep(header)

    def send_hidden(self, layer_id: int, ubatch_id: int, h: torch.Tensor,
                    expect_output: bool = True, routing: wire.Routing | None = None) -> None:
        """Send micro-batch ubatch_id's hidden states for layer_id to the FFN.
        expect_output=False: a member of an FFN group that computes but does
        not answer (its group's lead does). routing: the MoE router's top-k
        weights and ids for these tokens (needs routing_topk > 0)."""
        self._require("attention")
        step = self._current_step(ubatch_id)
        header = step.header
        if any(u == ubatch_id for _, u, _ in step.in_flight):
            raise ValueError(f"{self.me}: ubatch {ubatch_id} of step {header.step_id} already "
                             f"has hidden states in flight; receive its output first")
        shape = [header.num_tokens[ubatch_id], self.hidden_size]
        self._check_local(h, shape, What("hidden states of layer {} ubatch {}", layer_id,
                                         ubatch_id))
        topk = 0
        if routing is not None:
            self._check_routing(routing, shape[0], What("routing of layer {} ubatch {}",
                                                        layer_id, ubatch_id))
            topk = self.routing_topk
        frame = wire.layer_frame(h, step_id=header.step_id, layer_id=layer_id,
                                 ubatch_id=ubatch_id, topk=topk,
                                 scale_group=self.codec.send_scale_group)
        # The FFN may overwrite this micro-batch's receive buffer once it has
        # these hidden states: the last output must have been copied out.
        self._release_received(0, ubatch_id)
        payload = self.codec.encode(0, ubatch_id, h, routing)  # codec.py
        self._send_message(0, frame, payload, what=What(
            "layer {} ubatch {} hidden states of step {}", layer_id, ubatch_id, header.step_id))
        if expect_output:
            step.in_flight.append((layer_id, ubatch_id, shape))

    def recv_output(self, layer_id: int, ubatch_id: int,
                    out: torch.Tensor | None = None) -> torch.Tensor:
        """Wait (up to timeout_s) for the FFN's output of (layer, ubatch).

        With out (the caller's tensor of that shape and the connector's dtype,
        on any device): the output is written into it, ordered on the current
        stream, and out is returned. Without: a tensor on the connector's
        device that may be a transport buffer, valid until the next
        send_hidden on the same ubatch."""
        self._require("attention")
        step = self._current_step(ubatch_id)
        if not step.in_flight:
            raise ValueError(f"{self.me}: recv_output(layer {layer_id}, ubatch {ubatch_id}) "
                             f"but no hidden states are in flight")
        next_layer, next_ubatch, shape = step.in_flight[0]
        if (next_layer, next_ubatch) != (layer_id, ubatch_id):
            raise ValueError(f"{self.me}: outputs come back in send order; the next one is "
                             f"layer {next_layer} ubatch {next_ubatch}, not layer {layer_id} "
                             f"ubatch {ubatch_id}")
        if out is not None:
            self._check_local(out, shape, What("output buffer of layer {} ubatch {}",
                                               layer_id, ubatch_id))
        step_id = step.header.step_id
        what = What("the output of layer {} ubatch {} of step {}", layer_id, ubatch_id, step_id)
        result, _ = self._recv_tensor(0, what, step_id=step_id, layer_id=layer_id,
                                      ubatch_id=ubatch_id, shape=shape, out=out)
        step.in_flight.popleft()
        return result

    # The step channel: a layer call's two halves as the link makes them, one
    # micro-batch's call in flight at a time. Here the general path (the
    # reference every transport's answers match); connectors whose message
    # ends this host posts override them with their prepared calls
    # (step_calls.py), which keep this path for what they do not take.
    def send_call(self, layer_id: int, ubatch_id: int, h: torch.Tensor,
                  routing: wire.Routing | None = None) -> None:
        """send_hidden(layer_id, ubatch_id, h, routing=routing), answered by
        recv_call."""
        self.send_hidden(layer_id, ubatch_id, h, routing=routing)

    def recv_call(self, layer_id: int, ubatch_id: int,
                  out: torch.Tensor | None = None) -> torch.Tensor:
        """The output of send_call's (layer_id, ubatch_id): recv_output's."""
        return self.recv_output(layer_id, ubatch_id, out=out)

    def check_step(self) -> None:
        """After the step's last call, before its results are used: raise the
        link error a call of the step met without raising (connectors that
        check once per step: checks_per_step). Here every call checked its
        own."""

    # ------------------------------------------------------------- internals
    def _current_step(self, ubatch_id: int) -> PeerStep:
        step = self._steps.get(0)
        if step is None:
            raise ValueError(f"{self.me}: send_step() first")
        header = step.header
        if not 0 <= ubatch_id < len(header.num_tokens):
            raise ValueError(f"{self.me}: ubatch {ubatch_id} is not in step {header.step_id} "
                             f"({len(header.num_tokens)} ubatches)")
        return step

    def _check_routing(self, routing: wire.Routing, rows: int, what: What) -> None:
        """Our own caller's routing (a mismatch is a bug on this side)."""
        if self.routing_topk == 0:
            raise ValueError(f"{self.me}: {what}: this connector was built without routing "
                             f"(routing_topk=0; AFDConfig.gate_on is 'ffn')")
        expected = [rows, self.routing_topk]
        for name, t, dtype in (("topk_weights", routing.topk_weights, wire.ROUTING_WEIGHT_DTYPE),
                               ("topk_ids", routing.topk_ids, wire.ROUTING_ID_DTYPE)):
            if list(t.shape) != expected or t.dtype != dtype or not t.is_contiguous():
                raise ValueError(f"{self.me}: {what}: {name} must be contiguous {expected} "
                                 f"{dtype}, got {list(t.shape)} {t.dtype}")
