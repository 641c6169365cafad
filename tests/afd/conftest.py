# SPDX-License-Identifier: Apache-2.0
# SPDX-FileCopyrightText: Copyright contributors to the vllm-afd project
"""Fixtures of the vllm/afd tests."""

import pytest
import torch

from servers import free_port

from vllm.afd.attention.link import AttentionLink
from vllm.afd.ffn.loop import FFNLoop
from vllm.afd.topology import FFNPlacement
from vllm.afd.transport.config import LinkConfig

LINK_HIDDEN = 32  # shm_link's hidden size


@pytest.fixture
def shm_link(monkeypatch):
    """An attention link and an FFN loop (mlp: h * 2 + layer, layers 0 and 1)
    over shm, the link installed as this process's (what RemoteFFN and the
    runner seams use)."""
    from vllm.afd.adapter.attention import runner

    port = free_port()
    loop = FFNLoop(LinkConfig(role="ffn", port=port, timeout_s=10), layers=[0, 1],
                   compute=lambda layer, h, routing: h * 2 + layer, hidden_size=LINK_HIDDEN,
                   dtype=torch.float32, max_tokens=16, placement=FFNPlacement(0, [0]),
                   warmup_sizes=[])
    loop.start()
    link = AttentionLink(LinkConfig(port=port, timeout_s=10), hidden_size=LINK_HIDDEN,
                         dtype=torch.float32, max_tokens=16)
    link.add_layer(0)
    link.add_layer(1)
    link.start()
    monkeypatch.setattr(runner, "_link", link)
    yield link
    link.close()
    loop.stop()
