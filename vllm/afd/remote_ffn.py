# SPDX-License-Identifier: Apache-2.0
# SPDX-FileCopyrightText: Copyright contributors to the vllm-afd project
"""RemoteFFN: on the attention role, stands in for a decoder layer's mlp.

Its forward is the custom op `vllm.afd_remote_ffn`, so torch.compile sees one
opaque call per layer (the fake implementation only describes the output
shape; it never touches the link).
"""

import torch
from torch import nn

from vllm.afd.link import get_or_create_link
from vllm.utils.torch_utils import direct_register_custom_op


class RemoteFFN(nn.Module):
    def __init__(self, layer_idx: int, vllm_config):
        super().__init__()
        self.layer_idx = layer_idx
        get_or_create_link(vllm_config).add_layer(layer_idx)

    def forward(self, hidden_states: torch.Tensor, *args, **kwargs) -> torch.Tensor:
        return torch.ops.vllm.afd_remote_ffn(hidden_states, self.layer_idx)

    def extra_repr(self) -> str:
        return f"layer_idx={self.layer_idx}"


def _afd_remote_ffn(hidden_states: torch.Tensor, layer_idx: int) -> torch.Tensor:
    from vllm.afd.link import get_link

    return get_link().exchange(layer_idx, hidden_states)


def _afd_remote_ffn_fake(hidden_states: torch.Tensor, layer_idx: int) -> torch.Tensor:
    return torch.empty_like(hidden_states)


direct_register_custom_op(
    op_name="afd_remote_ffn",
    op_func=_afd_remote_ffn,
    fake_impl=_afd_remote_ffn_fake,
)
