# SPDX-License-Identifier: Apache-2.0
# SPDX-FileCopyrightText: Copyright contributors to the vllm-afd project
"""The attention side's protocol state: one step at a time, outputs in send order.

    conn.send_step(StepHeader(step_id=s, num_tokens=[n0, n1]))
    for layer in layers:
        for u in (0, 1): conn.send_hidden(layer, u, h[u])
        for u in (0, 1): conn.recv_output(layer, u, out=o[u])

Mixed into AFDConnector (base.py), whose message helpers it uses.
"""

from collections import deque

import torch

from vllm.afd.transport import wire
from vllm.afd.transport.errors import What
from vllm.afd.transport.wire import StepHeader


class AttentionSide:
    def _init_attention_state(self) -> None:
        # The current step and (layer, ubatch, shape) in flight, oldest first.
        self._step: StepHeader | None = None
        self._in_flight: deque[tuple[int, int, list[int]]] = deque()

    def send_step(self, header: StepHeader) -> None:
        """Announce a step (or, with the SHUTDOWN flag, the end of serving)."""
        self._require("attention")
        if self._in_flight:
            layer, ubatch, _ = self._in_flight[0]
            raise ValueError(f"{self.me}: step {self._step.step_id} still waits for the "
                             f"output of layer {layer} ubatch {ubatch}")
        min_step = self._step.step_id + 1 if self._step is not None else 0
        wire.check_step(header, num_ubatches=self.num_ubatches, max_tokens=self.max_tokens,
                        min_step_id=min_step, context=f"{self.me}, send_step")
        self._send_message(0, header, what=What("step {}", header.step_id))
        if not (header.is_shutdown or header.is_goodbye):
            self._step = header

    def send_hidden(self, layer_id: int, ubatch_id: int, h: torch.Tensor,
                    expect_output: bool = True, routing: wire.Routing | None = None) -> None:
        """Send micro-batch ubatch_id's hidden states for layer_id to the FFN.
        expect_output=False: a member of an FFN group that computes but does
        not answer (its group's lead does). routing: the MoE router's top-k
        weights and ids for these tokens (needs routing_topk > 0)."""
        self._require("attention")
        step = self._current_step(ubatch_id)
        if any(u == ubatch_id for _, u, _ in self._in_flight):
            raise ValueError(f"{self.me}: ubatch {ubatch_id} of step {step.step_id} already "
                             f"has hidden states in flight; receive its output first")
        shape = [step.num_tokens[ubatch_id], self.hidden_size]
        self._check_local(h, shape, What("hidden states of layer {} ubatch {}", layer_id,
                                         ubatch_id))
        topk = 0
        if routing is not None:
            self._check_routing(routing, shape[0], What("routing of layer {} ubatch {}",
                                                        layer_id, ubatch_id))
            topk = self.routing_topk
        frame = wire.layer_frame(h, step_id=step.step_id, layer_id=layer_id,
                                 ubatch_id=ubatch_id, topk=topk,
                                 scale_group=self.send_scale_group)
        # The FFN may overwrite this micro-batch's receive buffer once it has
        # these hidden states: the last output must have been copied out.
        self._release_received(0, ubatch_id)
        payload = self._encode(0, ubatch_id, h, routing)  # codec.py
        self._send_message(0, frame, payload, what=What(
            "layer {} ubatch {} hidden states of step {}", layer_id, ubatch_id, step.step_id))
        if expect_output:
            self._in_flight.append((layer_id, ubatch_id, shape))

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
        if not self._in_flight:
            raise ValueError(f"{self.me}: recv_output(layer {layer_id}, ubatch {ubatch_id}) "
                             f"but no hidden states are in flight")
        next_layer, next_ubatch, shape = self._in_flight[0]
        if (next_layer, next_ubatch) != (layer_id, ubatch_id):
            raise ValueError(f"{self.me}: outputs come back in send order; the next one is "
                             f"layer {next_layer} ubatch {next_ubatch}, not layer {layer_id} "
                             f"ubatch {ubatch_id}")
        if out is not None:
            self._check_local(out, shape, What("output buffer of layer {} ubatch {}",
                                               layer_id, ubatch_id))
        what = What("the output of layer {} ubatch {} of step {}", layer_id, ubatch_id,
                    step.step_id)
        result, _ = self._recv_tensor(0, what, step_id=step.step_id, layer_id=layer_id,
                                      ubatch_id=ubatch_id, shape=shape, out=out)
        self._in_flight.popleft()
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

    # ------------------------------------------------------------- internals
    def _current_step(self, ubatch_id: int) -> StepHeader:
        step = self._step
        if step is None:
            raise ValueError(f"{self.me}: send_step() first")
        if not 0 <= ubatch_id < len(step.num_tokens):
            raise ValueError(f"{self.me}: ubatch {ubatch_id} is not in step {step.step_id} "
                             f"({len(step.num_tokens)} ubatches)")
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
