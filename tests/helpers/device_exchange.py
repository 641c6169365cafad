# SPDX-License-Identifier: Apache-2.0
# SPDX-FileCopyrightText: Copyright contributors to the vllm-afd project
"""A fake device-resident exchange: the step channel as a transport whose
message ends a device posts would give it (the exchange of a FULL CUDA graph),
on the host, in one process.

What is fake: a GPU exchange writes each message's flag from a kernel and
waits for the peer's flag in a spin kernel, with the hidden states and the
output in device buffers both sides map; here the "device" is this host, the
flags are Python values behind a Condition, and the buffers are host tensors
in a process-wide table (as loopback.py finds its peer). What it shares with
a real one, and the tests check (tests/afd/transport/test_device_exchange.py):

- graph_capturable = True: the adapter keeps FULL graph modes with it;
- a layer call's two ends touch only buffers made when the attention side
  connects (the same addresses at every step, as a graph's replays need) and
  dispatch only copies: no allocation, no host read of a device value;
- every message carries its step and layer as the flag, checked by the
  receiver (a ProtocolError names both);
- the link (attention/link.py) and the FFN loop use it unchanged: it is
  registered by name and AFDConfig.connector names it. Steps and goodbyes
  still go through the loopback queues it inherits (a device exchange keeps
  a host channel for those too).
"""

import threading
import time

import torch

from vllm.afd.transport import wire
from vllm.afd.transport.connectors.loopback import LoopbackConnector
from vllm.afd.transport.connectors.registry import register_connector, unregister_connector
from vllm.afd.transport.errors import AFDConnectionError, AFDTimeoutError
from vllm.afd.transport.wire import ProtocolError

NAME = "fake-device"

# (loopback key, attention rank) -> the Mailbox of that connection.
_mailboxes: dict[tuple[str, int], "Mailbox"] = {}
_mailboxes_lock = threading.Lock()


class Mailbox:
    """One attention rank's connection: per micro-batch a buffer each way and
    its flag, (step, layer) of the message in it, or None once taken."""

    def __init__(self, ubatches: int, max_tokens: int, hidden: int, dtype: torch.dtype):
        shape = (max_tokens, hidden)
        self.hidden = [torch.empty(shape, dtype=dtype) for _ in range(ubatches)]
        self.output = [torch.empty(shape, dtype=dtype) for _ in range(ubatches)]
        self.to_ffn: list[tuple[int, int] | None] = [None] * ubatches
        self.to_attention: list[tuple[int, int] | None] = [None] * ubatches
        self.closed = False
        self.cv = threading.Condition()

    def post(self, flags: list, u: int, flag: tuple[int, int]) -> None:
        with self.cv:
            flags[u] = flag
            self.cv.notify_all()

    def take(self, flags: list, u: int, timeout_s: float, who: str, what: str):
        deadline = time.monotonic() + timeout_s
        with self.cv:
            while flags[u] is None:
                if self.closed:
                    raise AFDConnectionError(f"{who}: the exchange was closed while it "
                                             f"waited for {what}")
                remaining = deadline - time.monotonic()
                if remaining <= 0:
                    raise AFDTimeoutError(f"{who}: no {what} within the timeout")
                self.cv.wait(min(remaining, 0.1))
            flag, flags[u] = flags[u], None
            return flag

    def close(self) -> None:
        with self.cv:
            self.closed = True
            self.cv.notify_all()


class FakeDeviceConnector(LoopbackConnector):
    """The step channel through a Mailbox (see the module docstring)."""

    name = NAME
    graph_capturable = True

    def __init__(self, afd_config, **kwargs) -> None:
        super().__init__(afd_config, **kwargs)
        if self.routing_topk:
            raise ValueError(f"{self.me}: the fake device exchange carries no routing")
        self._boxes: dict[int, Mailbox] = {}  # peer -> its connection's mailbox

    def _open(self, deadline: float) -> None:
        super()._open(deadline)
        if self.is_attention:  # a new connection: new buffers, no stale flags
            box = Mailbox(self.num_ubatches, self.max_tokens, self.hidden_size, self.dtype)
            with _mailboxes_lock:
                _mailboxes[(self.key, self.rank)] = box
            self._boxes[0] = box

    def recv_step(self, peer: int = 0, timeout_s: float | None = None) -> wire.StepHeader:
        header = super().recv_step(peer, timeout_s)
        if peer not in self._boxes:
            with _mailboxes_lock:
                self._boxes[peer] = _mailboxes[(self.key, peer)]
        return header

    def _flag(self, flag: tuple[int, int], step_id: int, layer: int, u: int, what: str):
        if flag != (step_id, layer):
            raise ProtocolError(f"{self.me}: expected the {what} of step {step_id} layer "
                                f"{layer} ubatch {u}, the flag says step {flag[0]} layer "
                                f"{flag[1]}")

    # ----------------------------------------------------- attention side
    def send_call(self, layer_id: int, ubatch_id: int, h: torch.Tensor,
                  routing: wire.Routing | None = None) -> None:
        step = self._current_step(ubatch_id).header
        if routing is not None:
            raise ValueError(f"{self.me}: the fake device exchange carries no routing")
        rows = step.num_tokens[ubatch_id]
        self._check_local(h, [rows, self.hidden_size],
                          f"hidden states of layer {layer_id} ubatch {ubatch_id}")
        box = self._boxes[0]
        box.hidden[ubatch_id][:rows].copy_(h)
        box.post(box.to_ffn, ubatch_id, (step.step_id, layer_id))
        self.bytes_sent += h.nbytes

    def recv_call(self, layer_id: int, ubatch_id: int,
                  out: torch.Tensor | None = None) -> torch.Tensor:
        step = self._current_step(ubatch_id).header
        rows = step.num_tokens[ubatch_id]
        if out is not None:
            self._check_local(out, [rows, self.hidden_size],
                              f"output buffer of layer {layer_id} ubatch {ubatch_id}")
        box = self._boxes[0]
        flag = box.take(box.to_attention, ubatch_id, self.timeout_s, self.me,
                        f"the output of layer {layer_id} ubatch {ubatch_id}")
        self._flag(flag, step.step_id, layer_id, ubatch_id, "output")
        self.bytes_received += rows * self.hidden_size * self.dtype.itemsize
        output = box.output[ubatch_id][:rows]
        return output if out is None else out.copy_(output)

    # ------------------------------------------------------------ FFN side
    def take_call(self, peer: int, layer_id: int, ubatch_id: int) -> torch.Tensor:
        step = self._steps[peer].header
        box = self._boxes[peer]
        flag = box.take(box.to_ffn, ubatch_id, self.timeout_s, self.me,
                        f"the hidden states of layer {layer_id} ubatch {ubatch_id}")
        self._flag(flag, step.step_id, layer_id, ubatch_id, "hidden states")
        rows = step.num_tokens[ubatch_id]
        self.bytes_received += rows * self.hidden_size * self.dtype.itemsize
        return box.hidden[ubatch_id][:rows]  # in place: no copy on the FFN side

    def reply_call(self, peer: int, layer_id: int, ubatch_id: int, out: torch.Tensor) -> None:
        step = self._steps[peer].header
        box = self._boxes[peer]
        box.output[ubatch_id][:out.shape[0]].copy_(out)
        box.post(box.to_attention, ubatch_id, (step.step_id, layer_id))
        self.bytes_sent += out.nbytes

    def _close_transport(self) -> None:
        for box in self._boxes.values():
            box.close()
        super()._close_transport()


def register() -> None:
    register_connector(NAME, f"{__name__}:FakeDeviceConnector", replace=True)


def unregister() -> None:
    unregister_connector(NAME)
