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
  (vllm/afd/adapter/compat.py resolve_compilation), so piecewise CUDA graphs capture the
  attention between two exchanges and the exchange itself runs eagerly, every
  step, into the graph's own output buffer;
- FULL graph modes are lowered to piecewise unless the connector can be
  captured (none of ours can).

In a model that is never traced (compilation mode NONE: enforce_eager),
forward calls the op's function itself: the dispatcher's round trip into a
Python kernel costs microseconds per layer (benchmarks/layer_call.py, "model"
rows). What runs is the same function either way, except that the eager
forward leaves the output's allocation to the link, which makes it after the
send, while the FFN computes (on a CPU host's cold cache an allocation costs
microseconds, on the path both sides wait on when made before). The choice is
made once, from the config: torch.compiler.is_compiling() per call would cost
more than it saves on a CPU host's cold cache (figures: benchmarks/notes.md).

With gate_on "attention" a MoE layer's RemoteFFN also owns the layer's router
linear (submodule `gate`, or gpt-oss's and Llama 4's `router`, loaded from the
checkpoint's `mlp.gate.*` / `mlp.router.*`), and a correction bias that is the
MoE block's own parameter under its name, and routes
inside the op (model/routing.py): kept out of torch.compile's graph, the gate
and top-k run eagerly, as they would on the FFN role.
"""

import torch
from torch import nn

from vllm.afd.adapter.attention.runner import get_link, get_or_create_link
from vllm.afd.adapter.compat import REMOTE_FFN_OP
from vllm.afd.adapter.model.module_call import call_module
from vllm.config import CompilationMode
from vllm.utils.torch_utils import direct_register_custom_op

# layer index -> the RemoteFFN that routes it (gate_on "attention", MoE layers).
# One model per process, as there is one link per process.
_routed: dict[int, "RemoteFFN"] = {}


class RemoteFFN(nn.Module):
    def __init__(self, layer_idx: int, vllm_config, layer_router=None,
                 owned: dict[str, nn.Module | nn.Parameter] | None = None):
        super().__init__()
        self.layer_idx = layer_idx
        # model/routing.py LayerRouter, or None: no routing sent
        self.layer_router = layer_router
        # What it routes with, under the mlp's names, so the checkpoint's
        # `mlp.<name>` tensors load into them.
        for name, part in (owned or {}).items():
            if isinstance(part, nn.Parameter):
                self.register_parameter(name, part)
            else:
                self.add_module(name, part)
        if layer_router is not None:
            _routed[layer_idx] = self
        else:
            _routed.pop(layer_idx, None)
        get_or_create_link(vllm_config).add_layer(
            layer_idx, routing_topk=layer_router.topk if layer_router is not None else 0)
        # Never traced: the op's function without the dispatcher. Without a
        # config (a link installed by hand: benchmarks/layer_call.py) eager too.
        self.eager = vllm_config is None or (
            vllm_config.compilation_config.mode == CompilationMode.NONE)

    def __call__(self, *args, **kwargs):
        # An eager model skips nn.Module's call machinery where it would run
        # nothing (model/module_call.py: costly on a cold cache).
        if self.eager:
            return call_module(self, *args, **kwargs)
        return super().__call__(*args, **kwargs)

    def forward(self, hidden_states: torch.Tensor, *args, **kwargs) -> torch.Tensor:
        if self.eager:
            # The link allocates the output once the hidden states are sent, while
            # the FFN computes (link.exchange without `out`): an allocation costs
            # microseconds on a CPU host's cold cache.
            return _exchange(hidden_states, None, self.layer_idx)
        # Contiguous whatever the input's strides: the link writes rows of bytes.
        output = torch.empty_like(hidden_states, memory_format=torch.contiguous_format)
        torch.ops.vllm.afd_remote_ffn(hidden_states, output, self.layer_idx)
        return output

    def extra_repr(self) -> str:
        routed = (f", routing_topk={self.layer_router.topk}"
                  if self.layer_router is not None else "")
        return f"layer_idx={self.layer_idx}{routed}"


def _exchange(hidden_states: torch.Tensor, output: torch.Tensor | None,
              layer_idx: int) -> torch.Tensor:
    """The layer's mlp of hidden_states from the FFN server, in output (None:
    a new tensor)."""
    remote = _routed.get(layer_idx)
    link = get_link()
    routing = None
    if remote is not None and link.forward_pass is not None and link.forward_pass.is_real:
        routing = remote.layer_router(hidden_states)
    # Not made contiguous here: exchange makes it so (one tensor method less
    # on a cold cache).
    return link.exchange(layer_idx, hidden_states, output, routing)


def _afd_remote_ffn(hidden_states: torch.Tensor, output: torch.Tensor,
                    layer_idx: int) -> None:
    _exchange(hidden_states, output, layer_idx)


def _afd_remote_ffn_fake(hidden_states: torch.Tensor, output: torch.Tensor,
                         layer_idx: int) -> None:
    return None


direct_register_custom_op(
    op_name=REMOTE_FFN_OP,
    op_func=_afd_remote_ffn,
    mutates_args=["output"],
    fake_impl=_afd_remote_ffn_fake,
)
