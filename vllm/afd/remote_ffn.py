# SPDX-License-Identifier: Apache-2.0
# SPDX-FileCopyrightText: Copyright contributors to the vllm-afd project
"""RemoteFFN: on the attention role, stands in for a decoder layer's mlp.

Its forward is the custom op `vllm.afd_remote_ffn`, so torch.compile sees one
opaque call per layer (the fake implementation only describes the output
shape; it never touches the link).

With gate_on "attention" a MoE layer's RemoteFFN also owns the layer's router
gate (submodule `gate`, loaded from the checkpoint's `mlp.gate.*`) and routes
inside the op (vllm.afd.routing.LayerRouter): kept out of torch.compile's
graph, the gate and top-k run eagerly, as they would on the FFN role.
"""

import torch
from torch import nn

from vllm.afd.link import get_or_create_link
from vllm.utils.torch_utils import direct_register_custom_op

# layer index -> the RemoteFFN that routes it (gate_on "attention", MoE layers).
# One model per process, as there is one link per process.
_routed: dict[int, "RemoteFFN"] = {}


class RemoteFFN(nn.Module):
    def __init__(self, layer_idx: int, vllm_config, gate: nn.Module | None = None,
                 router=None):
        super().__init__()
        self.layer_idx = layer_idx
        self.router = router  # vllm.afd.routing.LayerRouter, or None: no routing sent
        if gate is not None:
            self.gate = gate
            _routed[layer_idx] = self
        else:
            _routed.pop(layer_idx, None)
        get_or_create_link(vllm_config).add_layer(
            layer_idx, routing_topk=router.topk if router is not None else 0)

    def forward(self, hidden_states: torch.Tensor, *args, **kwargs) -> torch.Tensor:
        return torch.ops.vllm.afd_remote_ffn(hidden_states, self.layer_idx)

    def extra_repr(self) -> str:
        routed = f", routing_topk={self.router.topk}" if self.router is not None else ""
        return f"layer_idx={self.layer_idx}{routed}"


def _afd_remote_ffn(hidden_states: torch.Tensor, layer_idx: int) -> torch.Tensor:
    from vllm.afd.link import get_link

    remote = _routed.get(layer_idx)
    routing = remote.router(hidden_states) if remote is not None else None
    return get_link().exchange(layer_idx, hidden_states, routing)


def _afd_remote_ffn_fake(hidden_states: torch.Tensor, layer_idx: int) -> torch.Tensor:
    return torch.empty_like(hidden_states)


direct_register_custom_op(
    op_name="afd_remote_ffn",
    op_func=_afd_remote_ffn,
    fake_impl=_afd_remote_ffn_fake,
)
