# SPDX-License-Identifier: Apache-2.0
# SPDX-FileCopyrightText: Copyright contributors to the vllm-afd project
"""RemoteFFN: on the attention role, stands in for a decoder layer's mlp (adapter).

Its forward allocates the layer's output and calls the custom op
`vllm.afd_remote_ffn(hidden_states, output, layer_idx)`, which writes the FFN
server's result into `output` (mutates_args) and allocates nothing. That makes
it graph-safe:

- torch.compile sees one opaque call per layer (the fake implementation only
  describes it; it never touches the link);
- the op is one of the compilation's splitting ops on the attention role
  (vllm/afd/compat.py resolve_compilation), so piecewise CUDA graphs capture the
  attention between two exchanges and the exchange itself runs eagerly, every
  step, into the graph's own output buffer;
- FULL graph modes are lowered to piecewise unless the connector can be
  captured (none of ours can).

With gate_on "attention" a MoE layer's RemoteFFN also owns the layer's router
gate (submodule `gate`, loaded from the checkpoint's `mlp.gate.*`) and routes
inside the op (model/routing.py): kept out of torch.compile's graph, the gate
and top-k run eagerly, as they would on the FFN role.
"""

import torch
from torch import nn

from vllm.afd.attention.runner import get_link, get_or_create_link
from vllm.afd.compat import REMOTE_FFN_OP
from vllm.utils.torch_utils import direct_register_custom_op

# layer index -> the RemoteFFN that routes it (gate_on "attention", MoE layers).
# One model per process, as there is one link per process.
_routed: dict[int, "RemoteFFN"] = {}


class RemoteFFN(nn.Module):
    def __init__(self, layer_idx: int, vllm_config, gate: nn.Module | None = None,
                 router=None):
        super().__init__()
        self.layer_idx = layer_idx
        self.router = router  # model/routing.py LayerRouter, or None: no routing sent
        if gate is not None:
            self.gate = gate
            _routed[layer_idx] = self
        else:
            _routed.pop(layer_idx, None)
        get_or_create_link(vllm_config).add_layer(
            layer_idx, routing_topk=router.topk if router is not None else 0)

    def forward(self, hidden_states: torch.Tensor, *args, **kwargs) -> torch.Tensor:
        output = torch.empty_like(hidden_states)
        torch.ops.vllm.afd_remote_ffn(hidden_states, output, self.layer_idx)
        return output

    def extra_repr(self) -> str:
        routed = f", routing_topk={self.router.topk}" if self.router is not None else ""
        return f"layer_idx={self.layer_idx}{routed}"


def _afd_remote_ffn(hidden_states: torch.Tensor, output: torch.Tensor,
                    layer_idx: int) -> None:
    remote = _routed.get(layer_idx)
    link = get_link()
    routing = None
    if remote is not None and link.plan is not None and link.plan.is_real:
        routing = remote.router(hidden_states)
    link.exchange(layer_idx, hidden_states.contiguous(), output, routing)


def _afd_remote_ffn_fake(hidden_states: torch.Tensor, output: torch.Tensor,
                         layer_idx: int) -> None:
    return None


direct_register_custom_op(
    op_name=REMOTE_FFN_OP,
    op_func=_afd_remote_ffn,
    mutates_args=["output"],
    fake_impl=_afd_remote_ffn_fake,
)
