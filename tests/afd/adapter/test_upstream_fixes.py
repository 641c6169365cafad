# SPDX-License-Identifier: Apache-2.0
# SPDX-FileCopyrightText: Copyright contributors to the vllm-afd project
"""Upstream bugs our fix patches correct, each checked against the reference
implementation vLLM itself ships (the end-to-end cases are in the oracle)."""

import pytest
import torch

from vllm.config import VllmConfig, set_current_vllm_config
from vllm.model_executor.layers.rotary_embedding import get_rope


@pytest.mark.parametrize("contiguous", [True, False])
def test_cpu_rotary_embedding_takes_tokens_heads_head_size(contiguous):
    """fix_cpu_rotary_embedding_3d_inputs.patch: LFM2's attention hands the
    rotary embedding [tokens, heads, head_size] queries and keys; the CPU
    kernel rotated them wrongly (in every head, by batch shape). Now they
    match the torch reference, in place, for a view it cannot flatten too."""
    torch.manual_seed(0)
    with set_current_vllm_config(VllmConfig()):
        rope = get_rope(32, max_position=2048, is_neox_style=True, dtype=torch.float32,
                        rope_parameters={"rope_type": "default", "rope_theta": 1e6})
    positions = torch.tensor(list(range(50)) + [0] + list(range(13)))

    def tensor(heads: int) -> torch.Tensor:
        if contiguous:
            return torch.randn(64, heads, 32)
        return torch.randn(64, 2 * heads, 32)[:, ::2]  # every other head: no 2D view

    q, k = tensor(8), tensor(4)
    expected = rope.forward_native(positions, q.clone(), k.clone())
    out_q, out_k = rope.forward_cpu(positions, q, k)
    assert out_q is q and out_k is k  # in place, as the callers expect
    torch.testing.assert_close(q, expected[0], atol=1e-5, rtol=1e-5)
    torch.testing.assert_close(k, expected[1], atol=1e-5, rtol=1e-5)
