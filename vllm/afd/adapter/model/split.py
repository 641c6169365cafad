# SPDX-License-Identifier: Apache-2.0
# SPDX-FileCopyrightText: Copyright contributors to the vllm-afd project
"""Role-aware model construction and weight filtering.

A decoder layer shaped `self_attn` + one FFN module is split between the roles
(the module is `mlp`, `block_sparse_moe` or `feed_forward`: families.FFN_ATTRS;
"mlp" below stands for any of them):
- attention role: everything but each layer's `mlp`, which is built on the meta
  device (no memory) and replaced by a RemoteFFN that calls the FFN server;
- FFN role: only each layer's `mlp` (gate, routed and shared experts, or the
  dense MLP of the first layers). The whole model is built on the meta device,
  the `mlp` scopes on the real one, and everything else is then dropped.

A model opts in with two lines around the code that builds `self.mlp`:

    afd_scope = model_split.begin_mlp(vllm_config)
    self.mlp = ...                                  # unchanged upstream code
    afd_scope.close()

After construction (build_model, called by the model loader) the attention role
swaps each meta-built mlp for a RemoteFFN. Swapping afterwards, not inside the
layer, keeps upstream's own checks on the model (isinstance tests on `mlp`,
expert counts for EPLB) working on both roles.

gate_on "attention" (model/routing.py): the attention role keeps each MoE
layer's router linear and any correction bias of the MoE block's own
(materialized, loaded from `layers.N.mlp.gate.*` or the family's other router
names: _GATE_NAME; a router left unread is an error) and router inside its
RemoteFFN; the FFN role, unchanged otherwise, routes MoE
layers with what the attention side sent.
"""

import re
from collections.abc import Iterable

import torch
from torch import nn

from vllm.afd.adapter.config import AFDConfig
from vllm.afd.adapter.model.families import FFN_ATTRS
from vllm.logger import init_logger

logger = init_logger(__name__)

_ATTRS = "|".join(FFN_ATTRS)
# Checkpoint and module names of the parts the FFN role owns.
_MLP_NAME = re.compile(rf"(^|\.)layers\.(\d+)\.({_ATTRS})(\.|$)")
# The MoE router linear, which the attention role also owns with gate_on
# "attention" (dense layers' gate_proj / gate_up_proj do not match). Checkpoints
# name it `gate` (its correction bias `gate.e_score_correction_bias`, or ERNIE
# 4.5's `moe_statics.e_score_correction_bias`) or `router` (gpt-oss's and Llama
# 4's, with gpt-oss's bias; Granite's `router.layer`; AFMoE's and HunYuan V3's
# `router.gate`); a correction bias of the MoE block's own is `expert_bias`
# (AFMoE, HunYuan V3) or `e_score_correction_bias` (EXAONE).
_GATE_NAME = re.compile(rf"(^|\.)layers\.(\d+)\.({_ATTRS})\.((gate|router|moe_statics)\."
                        rf"|(expert_bias|e_score_correction_bias)$)")


class _MLPScope:
    """The device context active while one decoder layer builds its mlp."""

    def __init__(self, device: torch.device | str | None):
        self._ctx = torch.device(device) if device is not None else None
        if self._ctx is not None:
            self._ctx.__enter__()

    def close(self) -> None:
        if self._ctx is not None:
            self._ctx.__exit__(None, None, None)
            self._ctx = None


def afd_config_of(vllm_config) -> AFDConfig | None:
    return getattr(vllm_config, "afd_config", None)


def begin_mlp(vllm_config=None) -> _MLPScope:
    """vllm_config None: the one being built (set_current_vllm_config around the
    model's construction), for decoder layers that are not handed it."""
    if vllm_config is None:
        from vllm.config import get_current_vllm_config_or_none

        vllm_config = get_current_vllm_config_or_none()
    afd = afd_config_of(vllm_config)
    if afd is None:
        return _MLPScope(None)
    if afd.is_attention:
        return _MLPScope("meta")
    # FFN role: the model is being built on meta (build_model); the mlp is real.
    return _MLPScope(vllm_config.device_config.device)


def _is_ffn_module(name: str) -> bool:
    """name is a decoder layer's FFN module itself (not one inside it)."""
    m = _MLP_NAME.search(name)
    return m is not None and m.end() == len(name)


def _layer_index(prefix: str) -> int:
    m = _MLP_NAME.search(prefix)
    if m is None:
        raise ValueError(f"AFD: cannot find the decoder layer index in {prefix!r}")
    return int(m.group(2))


def _forget_layers(vllm_config, drop) -> None:
    """Unregister layers this role will never run from the static forward context."""
    ctx = vllm_config.compilation_config.static_forward_context
    for name in [n for n in ctx if drop(n)]:
        del ctx[name]


def is_ffn_name(name: str) -> bool:
    return _MLP_NAME.search(name) is not None


def filter_weights(model: nn.Module, weights: Iterable[tuple[str, torch.Tensor]]):
    """Keep only the checkpoint tensors the role `model` was built for owns."""
    role = getattr(model, "afd_role", None)
    if role is None:
        yield from weights
        return
    keep_ffn = role == "ffn"
    keep_gate = not keep_ffn and getattr(model, "afd_gate_on", "ffn") == "attention"
    gate_tensors: dict[int, int] = {}  # layer -> router tensors read
    for name, tensor in weights:
        gate = _GATE_NAME.search(name) if keep_gate else None
        if gate is not None:
            layer = int(gate.group(2))
            gate_tensors[layer] = gate_tensors.get(layer, 0) + 1
        if is_ffn_name(name) == keep_ffn or gate is not None:
            yield name, tensor
    if keep_gate:
        _check_routers_loaded(model, gate_tensors)


def _check_routers_loaded(model: nn.Module, gate_tensors: dict[int, int]) -> None:
    """gate_on "attention": every router gate the attention role routes with
    read its tensors. vLLM's own check exempts layers with a quant method (every
    linear), so a router whose checkpoint names nothing matched would route with
    uninitialized memory."""
    from vllm.afd.adapter.model.remote_ffn import RemoteFFN

    for module in model.modules():
        if not isinstance(module, RemoteFFN) or module.layer_router is None:
            continue
        wanted = sum(1 for _ in module.parameters())  # the router linear's, the block's own
        if gate_tensors.get(module.layer_idx, 0) < wanted:
            raise ValueError(
                f"AFD gate_on 'attention': layer {module.layer_idx}'s router has {wanted} "
                f"tensors but the checkpoint gave the attention role "
                f"{gate_tensors.get(module.layer_idx, 0)} (names matching {_GATE_NAME.pattern}); "
                "this model's router cannot move to the attention role: use gate_on 'ffn'")


class MissingForRole(nn.Module):
    """Stands in for a module the other role owns; calling it is a bug."""

    def __init__(self, name: str, role: str):
        super().__init__()
        self.afd_name = name
        self.afd_role = role

    def forward(self, *args, **kwargs):
        raise RuntimeError(f"AFD: {self.afd_name} is not built on the {self.afd_role} role")


def build_model(vllm_config, construct):
    """Construct the model for this server's role (`construct()` builds it as
    upstream does); the FFN role then keeps only the decoder layers' mlps."""
    afd = afd_config_of(vllm_config)
    if afd is None:
        return construct()
    if afd.is_attention:
        model = construct()
        _swap_in_remote_ffn(model, vllm_config)
        from vllm.afd.adapter.attention import runner

        if runner._link is not None:  # every remote layer registered: connect now
            runner._link.start()
    else:
        from vllm.model_executor.layers import rotary_embedding

        # get_rope() caches rotary embeddings process-wide; ones built here live on
        # meta and must not be handed to a model built later in this process.
        ropes_before = set(rotary_embedding._ROPE_DICT)
        with torch.device("meta"):
            model = construct()
        for key in set(rotary_embedding._ROPE_DICT) - ropes_before:
            del rotary_embedding._ROPE_DICT[key]
        _strip_to_ffn(model, vllm_config)
        if afd.gate_on == "attention":
            from vllm.afd.adapter.model.routing import use_received_routing

            # Read by the FFN loop: which layers expect routing, and how wide.
            model.afd_routed_layers = use_received_routing(ffn_layers(model))
    _check_no_meta(model, afd.role)
    model.afd_role = afd.role  # read by filter_weights
    model.afd_gate_on = afd.gate_on
    return model


def _swap_in_remote_ffn(model: nn.Module, vllm_config) -> None:
    from vllm.afd.adapter.model import routing
    from vllm.afd.adapter.model.remote_ffn import RemoteFFN

    gate_on_attention = vllm_config.afd_config.gate_on == "attention"
    swapped = []
    for name, module in list(model.named_modules()):
        if _is_ffn_module(name):
            parent_name, _, attr = name.rpartition(".")
            parent = model.get_submodule(parent_name)
            router = owned = None
            if gate_on_attention and routing.moe_runners(module):
                router, owned = routing.take_router(module, vllm_config.device_config.device)
            setattr(parent, attr, RemoteFFN(_layer_index(name), vllm_config, router, owned))
            swapped.append(name)
    if not swapped:
        raise ValueError(
            f"AFD: {type(model).__name__} has no decoder layers shaped self_attn + mlp "
            "that support the attention role (see vllm/afd/adapter/model/split.py)")
    _forget_layers(vllm_config, lambda n: any(n == s or n.startswith(s + ".")
                                              for s in swapped))


def _strip_to_ffn(model: nn.Module, vllm_config) -> None:
    kept = [n for n, _ in model.named_modules() if _is_ffn_module(n)]
    if not kept:
        raise ValueError(
            f"AFD: {type(model).__name__} has no decoder layers shaped self_attn + mlp "
            "that support the FFN role (see vllm/afd/adapter/model/split.py)")

    def walk(module: nn.Module, prefix: str) -> None:
        for child_name, child in list(module.named_children()):
            name = f"{prefix}.{child_name}" if prefix else child_name
            if name in kept:
                continue
            if any(k.startswith(name + ".") for k in kept):
                walk(child, name)
            elif any(True for _ in child.parameters()) or any(True for _ in child.buffers()):
                setattr(module, child_name, MissingForRole(name, "ffn"))

    walk(model, "")
    _forget_layers(vllm_config, lambda name: not is_ffn_name(name))


def _check_no_meta(model: nn.Module, role: str) -> None:
    meta = [n for n, t in [*model.named_parameters(), *model.named_buffers()]
            if t.device.type == "meta"]
    if meta:
        raise RuntimeError(
            f"AFD {role} role: these tensors were never materialized (the model does "
            f"not mark its FFN construction with afd_seams.begin_mlp()/afd_scope.close()?): "
            f"{meta[:8]}")


def ffn_layers(model: nn.Module) -> dict[int, nn.Module]:
    """The mlp of every decoder layer the FFN role serves, by layer index."""
    out = {}
    for name, module in model.named_modules():
        if _is_ffn_module(name) and not isinstance(module, MissingForRole):
            out[_layer_index(name)] = module
    return dict(sorted(out.items()))
