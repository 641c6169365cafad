# SPDX-License-Identifier: Apache-2.0
# SPDX-FileCopyrightText: Copyright contributors to the vllm-afd project
"""The FFN side's protocol state: per attention peer, its step and what awaits output.

    header = conn.recv_step(peer)
    for layer in layers:
        for u in range(len(header.num_tokens)):
            h = conn.recv_hidden(peer, layer, u)      # on the connector's device
            conn.send_output(peer, layer, u, mlp(h, conn.routing(peer, u)))

After connect(), one thread per peer may drive its own peer's conversation.
A session from accept_session() (base.py) holds one peer, driven by its own
thread; the FFN server's loop gives each attention peer one.
Mixed into AFDConnector (base.py), whose message helpers it uses.
"""

import time

import torch

from vllm.afd.transport import wire
from vllm.afd.transport.connectors.codec import Packed
from vllm.afd.transport.connectors.peer_step import PeerStep
from vllm.afd.transport.errors import What
from vllm.afd.transport.wire import ProtocolError, StepHeader


class FFNSide:
    # Each peer's step (peer_step.py) is self._steps[peer], set by recv_step.
    def recv_step(self, peer: int = 0, timeout_s: float | None = None) -> StepHeader:
        """Wait for peer's next StepHeader; by default as long as the peer stays
        connected. A header with is_goodbye or is_shutdown ends the peer's
        conversation."""
        self._require("ffn", peer)
        last = self._steps.get(peer)
        deadline = None if timeout_s is None else time.monotonic() + timeout_s
        header = self._recv_checked(peer, StepHeader, "the next step", deadline)
        try:
            wire.check_step(header, num_ubatches=self.num_ubatches,
                            max_tokens=self.max_tokens,
                            min_step_id=last.header.step_id + 1 if last else 0,
                            context=f"from {self.peer_name(peer)}")
        except ProtocolError as e:
            raise self._fail(e) from None
        if not (header.is_goodbye or header.is_shutdown):
            step = self._steps[peer] = PeerStep(header)
            if last is not None:  # what the last step's replies spent, not reported yet
                step.reply_send_s = last.reply_send_s
        return header

    def recv_hidden(self, peer: int, layer_id: int, ubatch_id: int, *,
                    defer: bool = False) -> "torch.Tensor | Packed":
        """Wait (up to timeout_s) for peer's hidden states of (layer, ubatch),
        on the connector's device, ordered on the current stream. The tensor
        may be a transport buffer, valid until send_output on the same
        (peer, ubatch). defer: hidden states that came as fp8 are returned
        still packed (codec.Packed: shape, dtype, into(target), tensor()), so
        a batcher can unpack them straight into its joined MoE input."""
        self._require("ffn", peer)
        step = self._steps.get(peer)
        if step is None:
            raise ValueError(f"{self.me}: recv_hidden before recv_step from "
                             f"{self.peer_name(peer)}")
        header = step.header
        if not 0 <= ubatch_id < len(header.num_tokens):
            raise ValueError(f"{self.me}: ubatch {ubatch_id} is not in step {header.step_id} "
                             f"of {self.peer_name(peer)} ({len(header.num_tokens)} ubatches)")
        shape = [header.num_tokens[ubatch_id], self.hidden_size]
        what = What("the hidden states of layer {} ubatch {} of step {}", layer_id, ubatch_id,
                    header.step_id)
        h, routing = self._recv_tensor(peer, what, step_id=header.step_id, layer_id=layer_id,
                                       ubatch_id=ubatch_id, shape=shape,
                                       routing_topk=self.routing_topk, defer=defer)
        step.awaiting[ubatch_id] = (layer_id, shape)
        step.routings[ubatch_id] = routing
        return h

    def routing(self, peer: int, ubatch_id: int) -> wire.Routing | None:
        """The routing that came with the last recv_hidden of (peer, ubatch), or
        None (a dense layer, or gate_on "ffn"). Same device and lifetime as
        that recv_hidden's tensor."""
        step = self._steps.get(peer)
        return None if step is None else step.routings.get(ubatch_id)

    def send_output(self, peer: int, layer_id: int, ubatch_id: int, out: torch.Tensor) -> None:
        """Send the FFN output of (layer, ubatch) back to peer."""
        self._require("ffn", peer)
        step = self._steps.get(peer)
        awaited = None if step is None else step.awaiting.get(ubatch_id)
        if awaited is None or awaited[0] != layer_id:
            raise ValueError(f"{self.me}: send_output(layer {layer_id}, ubatch {ubatch_id}) "
                             f"to {self.peer_name(peer)} without its hidden states "
                             f"(awaiting: {awaited})")
        step_id = step.header.step_id
        self._check_local(out, awaited[1], What("output of layer {} ubatch {}", layer_id,
                                                 ubatch_id))
        frame = wire.layer_frame(out, step_id=step_id, layer_id=layer_id,
                                 ubatch_id=ubatch_id, scale_group=self.codec.send_scale_group)
        # The peer may overwrite the hidden states' buffer once it has the
        # output: they must have been copied out of it.
        self._release_received(peer, ubatch_id)
        payload = self.codec.encode(peer, ubatch_id, out, None)  # codec.py
        self._send_message(peer, frame, payload, what=What(
            "layer {} ubatch {} output of step {}", layer_id, ubatch_id, step_id))
        del step.awaiting[ubatch_id]
        step.routings.pop(ubatch_id, None)

    # The step channel, FFN side: a layer call's hidden states taken, its
    # output replied, as the FFN loop serves them. Here the general path (the
    # reference); connectors whose message ends this host posts override them
    # with their prepared calls (step_calls.py), which keep this path for
    # what they do not take.
    def take_call(self, peer: int, layer_id: int, ubatch_id: int) -> "torch.Tensor | Packed":
        """recv_hidden(peer, layer_id, ubatch_id, defer=True): fp8 hidden states
        stay packed (the batcher unpacks them into its joined MoE input)."""
        return self.recv_hidden(peer, layer_id, ubatch_id, defer=True)

    def reply_call(self, peer: int, layer_id: int, ubatch_id: int, out: torch.Tensor) -> None:
        """send_output(peer, layer_id, ubatch_id, out), its time kept for
        take_reply_send_s."""
        t0 = time.perf_counter()
        self.send_output(peer, layer_id, ubatch_id, out)
        self._steps[peer].reply_send_s += time.perf_counter() - t0

    def take_reply_send_s(self, peer: int) -> float:
        """Seconds reply_call spent sending to peer since the last call."""
        step = self._steps.get(peer)
        if step is None:
            return 0.0
        spent, step.reply_send_s = step.reply_send_s, 0.0
        return spent
