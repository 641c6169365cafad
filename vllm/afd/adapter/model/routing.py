# SPDX-License-Identifier: Apache-2.0
# SPDX-FileCopyrightText: Copyright contributors to the vllm-afd project
"""MoE routing on the attention role (AFDConfig.gate_on == "attention").

vLLM's FusedMoE runner (mlp.experts) routes in two pieces: its `gate` (the
router linear, `mlp.gate` in the checkpoint; DeepSeek-V3's also owns
`e_score_correction_bias`) gives logits, and its `router` object turns them
into top-k weights and ids (softmax/top-k/renormalize, grouped top-k with a
correction bias, ...). With gate_on "attention" both pieces move:

- attention role: each MoE layer's RemoteFFN owns the layer's gate, built on
  the meta device with the rest of the mlp and then materialized here (the
  checkpoint's `layers.N.mlp.gate.*` loads into it), and keeps the layer's
  router object; a correction bias the router reads from the mlp itself
  (EXAONE's, AFMoE's, HunYuan V3's) is materialized and owned the same way.
  LayerRouter runs them exactly as the runner would and the routing travels
  with the hidden states (wire.Routing).
- FFN role: each runner's router is wrapped in ReceivedRouter, whose
  select_experts returns the routing received for the current mlp call (set
  by call_with_routing, thread-local), and its gate in SkippedGate, so the
  router GEMM does not run again. Without received routing (a call outside
  the FFN loop) both delegate to what they wrap.

Routing travels as logical expert ids; an FFN with EPLB maps them to physical
experts itself (the wrapped router's mapping), as plain vLLM does after top-k.
"""

import threading

import torch
from torch import nn

from vllm.afd.adapter.model.module_call import call_module
from vllm.afd.transport import wire
from vllm.logger import init_logger

logger = init_logger(__name__)

_tls = threading.local()  # .routing: wire.Routing of the running mlp call; .used


def moe_runners(mlp: nn.Module) -> list[nn.Module]:
    """The FusedMoE runners inside one decoder layer's mlp (none: dense)."""
    from vllm.model_executor.layers.fused_moe.runner.moe_runner import MoERunner

    return [m for m in mlp.modules() if isinstance(m, MoERunner)]


def routing_topk(runner: nn.Module) -> int:
    return runner.moe_config.experts_per_token


# ------------------------------------------------------------ attention side
class LayerRouter:
    """One MoE layer's routing, computed on the attention role as the FusedMoE
    runner computes it on the FFN role: logits = gate(h), then the router's
    select_experts (vLLM's own code, so the results are the same bits)."""

    def __init__(self, gate: nn.Module, router, topk: int) -> None:
        self.gate, self.router, self.topk = gate, router, topk

    def __call__(self, hidden_states: torch.Tensor) -> wire.Routing:
        router_logits = self.gate(hidden_states)
        if isinstance(router_logits, tuple):  # a vLLM linear's (output, bias)
            router_logits = router_logits[0]
        weights, ids = self.router.select_experts(hidden_states=hidden_states,
                                                  router_logits=router_logits)
        return wire.Routing(weights.to(wire.ROUTING_WEIGHT_DTYPE).contiguous(),
                            ids.to(wire.ROUTING_ID_DTYPE).contiguous())


def take_router(mlp: nn.Module, device: torch.device | str
                ) -> tuple[LayerRouter, dict[str, nn.Module | nn.Parameter]]:
    """From a (meta-built) MoE mlp: a LayerRouter, and what it routes with that
    the checkpoint fills, by its names in the mlp: the router linear (`gate`, or
    gpt-oss's and Llama 4's `router`) and the router's tensors that are the
    mlp's own parameters (EXAONE's `e_score_correction_bias`, AFMoE's and
    HunYuan V3's `expert_bias`), materialized on device (their values come
    from the checkpoint later). RemoteFFN owns them under those names."""
    runners = moe_runners(mlp)
    if len(runners) != 1:
        raise ValueError(f"AFD gate_on 'attention': expected one FusedMoE layer in "
                         f"{type(mlp).__name__}, found {len(runners)}")
    runner = runners[0]
    # The runner's gate, or the linear the mlp calls itself before its experts.
    gate = next((g for g in (runner.gate, getattr(mlp, "gate", None),
                             getattr(mlp, "router", None)) if g is not None), None)
    gate_name = next((n for n, m in mlp.named_children() if m is gate), None)
    if gate_name is None:
        raise ValueError(f"AFD gate_on 'attention': {type(mlp).__name__} has no router "
                         f"linear (`gate` or `router`); use gate_on 'ffn' for this model")
    _reject_unsupported(runner.router)
    replaced = _materialize(gate, torch.device(device))
    router = runner.router
    # The router may hold the gate's tensors or the mlp's own (the correction
    # bias): point it at materialized ones; anything else on meta cannot work.
    own = {id(p): name for name, p in mlp.named_parameters(recurse=False)}
    block_params: dict[str, nn.Parameter] = {}
    for name, value in list(vars(router).items()):
        if not isinstance(value, torch.Tensor):
            continue
        if id(value) in own and value.device.type == "meta":
            block_params[own[id(value)]] = replaced[id(value)] = _materialized(
                value, torch.device(device))
        if id(value) in replaced:
            setattr(router, name, replaced[id(value)])
        elif value.device.type == "meta":
            raise ValueError(f"AFD gate_on 'attention': {type(router).__name__}.{name} "
                             f"lives on the meta device and is neither the gate's nor "
                             f"{type(mlp).__name__}'s own parameter")
    return LayerRouter(gate, router, routing_topk(runner)), {gate_name: gate, **block_params}


def _materialize(module: nn.Module, device: torch.device) -> dict[int, torch.Tensor]:
    """Give every meta parameter/buffer of module real (uninitialized) storage,
    keeping its attributes (weight_loader, ...); id(old) -> new."""
    replaced: dict[int, torch.Tensor] = {}
    for mod in module.modules():
        for name, p in list(mod._parameters.items()):
            if p is None or p.device.type != "meta":
                continue
            mod._parameters[name] = replaced[id(p)] = _materialized(p, device)
        for name, b in list(mod._buffers.items()):
            if b is not None and b.device.type == "meta":
                mod._buffers[name] = replaced[id(b)] = torch.empty(b.shape, dtype=b.dtype,
                                                                   device=device)
    return replaced


def _materialized(p: nn.Parameter, device: torch.device) -> nn.Parameter:
    new = nn.Parameter(torch.empty(p.shape, dtype=p.dtype, device=device),
                       requires_grad=p.requires_grad)
    new.__dict__.update(p.__dict__)  # weight_loader and the like
    return new


def _reject_unsupported(router) -> None:
    from vllm.model_executor.layers.fused_moe.router.zero_expert_router import (
        ZeroExpertRouter)

    # Its select_experts also computes an output the runner adds afterwards.
    if isinstance(router, ZeroExpertRouter):
        raise ValueError("AFD gate_on 'attention': zero-expert routing is not supported; "
                         "use gate_on 'ffn'")


# ------------------------------------------------------------------ FFN side
class ReceivedRouter:
    """Stands in for a FusedMoE runner's router on the FFN role: routing comes
    from the attention side when the FFN loop provides it."""

    def __init__(self, inner) -> None:
        self.inner = inner

    def __getattr__(self, name: str):
        # Everything else (eplb_state, top_k, routing_method_type, ...) is the
        # wrapped router's. (vars(), not self.inner: no recursion before __init__.)
        inner = vars(self).get("inner")
        if inner is None:
            raise AttributeError(name)
        return getattr(inner, name)

    def select_experts(self, hidden_states: torch.Tensor, router_logits: torch.Tensor,
                       topk_indices_dtype: torch.dtype | None = None, *,
                       input_ids: torch.Tensor | None = None):
        routing = getattr(_tls, "routing", None)
        if routing is None:
            return self.inner.select_experts(hidden_states, router_logits,
                                             topk_indices_dtype=topk_indices_dtype,
                                             input_ids=input_ids)
        weights, ids = routing
        if ids.shape[0] != hidden_states.shape[0]:
            # E.g. a data-parallel FFN whose runner gathered other ranks' tokens.
            raise RuntimeError(f"AFD FFN: the MoE layer routes {hidden_states.shape[0]} "
                               f"tokens but the attention side sent routing for "
                               f"{ids.shape[0]}")
        _tls.used += 1
        if getattr(self.inner, "eplb_state", None) is not None:
            ids = self.inner._apply_eplb_mapping(ids)  # logical -> physical, records load
        if topk_indices_dtype is not None and ids.dtype != topk_indices_dtype:
            ids = ids.to(topk_indices_dtype)
        return weights, ids


class SkippedGate(nn.Module):
    """Stands in for the runner's gate on the FFN role: with received routing
    the logits are never read, so the router GEMM is skipped."""

    def __init__(self, gate: nn.Module) -> None:
        super().__init__()
        # Not a submodule: the gate's parameters stay registered (and loaded)
        # under mlp.gate only.
        object.__setattr__(self, "inner", gate)

    def forward(self, hidden_states: torch.Tensor):
        if getattr(_tls, "routing", None) is None:
            return self.inner(hidden_states)
        return hidden_states.new_empty((hidden_states.shape[0], self.inner.output_size)), None


def use_received_routing(mlps: dict[int, nn.Module]) -> dict[int, int]:
    """FFN role: wrap the routers (and gates) of these mlps; returns the MoE
    layers and their routing width."""
    routed = {}
    for layer, mlp in mlps.items():
        for runner in moe_runners(mlp):
            _reject_unsupported(runner.router)
            if not isinstance(runner.router, ReceivedRouter):
                runner.router = ReceivedRouter(runner.router)
            # A gate fused with the shared-expert gate is not called separately.
            if (runner.gate is not None and not isinstance(runner.gate, SkippedGate)
                    and not getattr(runner, "_fse_fuse_gate", False)):
                runner.gate = SkippedGate(runner.gate)
            routed[layer] = max(routed.get(layer, 0), routing_topk(runner))
    return routed


def call_with_routing(mlp: nn.Module, hidden_states: torch.Tensor,
                      routing: wire.Routing | None) -> torch.Tensor:
    """mlp(hidden_states), its MoE routed by `routing` (None: as usual)."""
    if routing is None:
        return call_module(mlp, hidden_states)
    _tls.routing, _tls.used = routing, 0
    try:
        out = call_module(mlp, hidden_states)
        used = _tls.used
    finally:
        _tls.routing = None
    if used == 0:
        # A kernel that routes internally (monolithic) never asks the router:
        # its output ignored the received routing, so it must not be sent.
        raise RuntimeError("AFD FFN: the MoE layer did not use the routing sent by the "
                           "attention side (a monolithic MoE kernel routes itself); use "
                           "gate_on 'ffn' with this kernel")
    return out
