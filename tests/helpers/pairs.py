# SPDX-License-Identifier: Apache-2.0
# SPDX-FileCopyrightText: Copyright contributors to the vllm-afd project
"""Connected shm and tcp pairs with prepared layer calls, and what drives them:
an echoing FFN, steps of layer calls, a real link and FFN loop."""

import threading
import time

import torch

from helpers.connectors import HIDDEN, Background, free_port
from helpers.devices import DeferredOps
from vllm.afd.attention.link import AttentionLink
from vllm.afd.adapter.config import AFDConfig
from vllm.afd.ffn.loop import FFNLoop
from vllm.afd.topology import FFNPlacement
from vllm.afd.transport.config import LinkConfig
from vllm.afd.transport.connectors import create_connector
from vllm.afd.transport.wire import StepHeader


def shm(role: str, port: int, *, num_ubatches: int = 1, spin_us=None, timeout_s: float = 10):
    extra = {} if spin_us is None else {"spin_us": spin_us}
    cfg = AFDConfig(role=role, connector="shm", port=port, timeout_s=timeout_s,
                    num_ubatches=num_ubatches, connector_extra_config=extra)
    return create_connector(cfg, hidden_size=HIDDEN, dtype=torch.float32, max_tokens=16)


def pair(*, ffn_ubatches: int = 1, attention_ubatches: int = 1, spin_us=None,
         timeout_s: float = 10):
    port = free_port()
    ffn = shm("ffn", port, num_ubatches=ffn_ubatches, spin_us=spin_us, timeout_s=timeout_s)
    attn = shm("attention", port, num_ubatches=attention_ubatches, spin_us=spin_us,
               timeout_s=timeout_s)
    accepting = Background(ffn.accept)
    attn.connect()
    accepting.join_result()
    return ffn, attn


def echo(ffn, layers: int, posted: list | None = None) -> int:
    """Serve steps (output = 2 * hidden + layer) until the attention side
    leaves, through the step channel as the FFN loop does; posted: gets each
    step's count of prepared sends."""
    steps = 0
    while True:
        step = ffn.recv_step(0)
        if step.is_goodbye or step.is_shutdown:
            return steps
        for layer in range(layers):
            for u in range(len(step.num_tokens)):
                ffn.reply_call(0, layer, u, ffn.take_call(0, layer, u) * 2 + layer)
        if posted is not None:
            posted.append(ffn.step_times(0)[2])
        steps += 1


def run_steps(attn, steps: list[list[int]], layers: int,
              step_seconds: list[float] | None = None) -> None:
    g = torch.Generator().manual_seed(0)
    for i, tokens in enumerate(steps):
        t0 = time.monotonic()
        attn.send_step(StepHeader(step_id=i + 1, num_tokens=tokens))
        for layer in range(layers):
            hidden = [torch.randn(n, HIDDEN, generator=g) for n in tokens]
            for u, h in enumerate(hidden):
                attn.send_hidden(layer, u, h)
            for u, h in enumerate(hidden):
                assert torch.equal(attn.recv_output(layer, u), h * 2 + layer)
        if step_seconds is not None:
            step_seconds.append(time.monotonic() - t0)


def wait_cpu_times(ffn, attn) -> tuple[float, float]:
    """Process CPU seconds over an idle wait (1 s for the next step, no
    deadline) and over a wait for an answer that comes 0.5 s late."""
    idle = Background(ffn.recv_step, 0)
    time.sleep(0.05)
    cpu0 = time.process_time()
    time.sleep(1.0)
    idle_cpu = time.process_time() - cpu0
    attn.send_step(StepHeader(step_id=1, num_tokens=[1]))
    assert idle.join_result().step_id == 1

    attn.send_hidden(0, 0, torch.ones(1, HIDDEN))
    ffn.recv_hidden(0, 0, 0)
    cpu0 = time.process_time()
    answer = threading.Timer(0.5, lambda: ffn.send_output(0, 0, 0, torch.ones(1, HIDDEN)))
    answer.start()
    assert torch.equal(attn.recv_output(0, 0), torch.ones(1, HIDDEN))
    waited_cpu = time.process_time() - cpu0
    answer.join()
    return idle_cpu, waited_cpu


def tcp_pair(*, spin_us: int = 20_000, timeout_s: float = 10):
    """An FFN and attention tcp connector linked over loopback (tcp_frames.py's
    prepared calls), as pair links shm ones."""
    port = free_port()

    def make(role):
        cfg = AFDConfig(role=role, connector="tcp", port=port, timeout_s=timeout_s,
                        connector_extra_config={"spin_us": spin_us})
        return create_connector(cfg, hidden_size=HIDDEN, dtype=torch.float32, max_tokens=16)

    ffn, attn = make("ffn"), make("attention")
    accepting = Background(ffn.accept)
    attn.connect()
    accepting.join_result()
    return ffn, attn


def prepared_steps(attn, steps: list[int], layers: int) -> None:
    g = torch.Generator().manual_seed(1)
    for i, rows in enumerate(steps):
        attn.send_step(StepHeader(step_id=i + 1, num_tokens=[rows]))
        for layer in range(layers):
            h = torch.randn(rows, HIDDEN, generator=g)
            out = torch.empty_like(h)
            calls = attn.fast_calls
            attn.send_call(layer, 0, h)
            assert attn.fast_calls == calls + 1  # a C post sent it
            assert attn.recv_call(layer, 0, out) is out
            assert attn.fast_calls == calls + 2  # a C take received it
            assert torch.equal(out, h * 2 + layer)


def loop_and_link(connector: str, layers: list[int]):
    """A real FFN loop (its mlp h @ weight + layer, started) and an attention
    link (not yet started) over connector, up to two micro-batches; and weight."""
    weight = torch.randn(HIDDEN, HIDDEN) / HIDDEN

    def mlp(layer, h, routing):
        return (h @ weight) + layer

    config = dict(connector=connector, port=free_port(), timeout_s=10, num_ubatches=2,
                  connector_extra_config={"spin_us": 20_000})
    loop = FFNLoop(LinkConfig(role="ffn", **config), layers=layers, compute=mlp,
                   hidden_size=HIDDEN, dtype=torch.float32, max_tokens=32,
                   placement=FFNPlacement(rank=0, group=[0]), warmup_sizes=[])
    loop.start()
    link = AttentionLink(LinkConfig(**config), hidden_size=HIDDEN, dtype=torch.float32,
                         max_tokens=32)
    for layer in layers:
        link.add_layer(layer)
    return loop, link, weight


def staged_tcp_pair(attention_ops=None):
    """A tcp pair that takes the prepared calls as CUDA connectors do (staged
    through their pinned host slots) on a fake asynchronous device
    (helpers.devices.DeferredOps: copies land 0.2 s later): no GPU here.
    attention_ops: the attention side's fake device (a DeferredOps)."""
    ffn, attn = tcp_pair()
    for side in (attn, ffn):  # stage as on a GPU
        side.ops, side._on_host = DeferredOps(), False
    if attention_ops is not None:  # the staging slots are made at first use
        attn.ops = attention_ops
    return ffn, attn
