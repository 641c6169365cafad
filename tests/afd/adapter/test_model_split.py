# SPDX-License-Identifier: Apache-2.0
# SPDX-FileCopyrightText: Copyright contributors to the vllm-afd project
"""Role-aware construction: each role allocates exactly its part of the checkpoint."""

import json
import re
import sys
from pathlib import Path

import pytest
from safetensors import safe_open

import preload

PROBE = Path(__file__).with_name("role_params_probe.py")
MLP = re.compile(r"(^|\.)layers\.\d+\.mlp\.")
GATE = re.compile(r"(^|\.)layers\.\d+\.mlp\.gate\.")  # the MoE router gate

_probes: dict[tuple, dict] = {}
SPECS = ["plain", "attention:ffn", "ffn:ffn", "attention:attention", "ffn:attention"]


def probe(model: Path, role: str, gate_on: str = "ffn") -> dict:
    """What the role constructs; every spec of a model is probed in one process."""
    key = (str(model), role, gate_on if role != "plain" else "")
    if key not in _probes:
        proc = preload.run([sys.executable, str(PROBE), str(model), *SPECS],
                           capture_output=True, text=True, timeout=600, cwd="/")
        assert proc.returncode == 0, proc.stderr[-4000:]
        lines = [json.loads(line) for line in proc.stdout.splitlines() if line.startswith("{")]
        assert len(lines) == len(SPECS), proc.stdout[-2000:]
        for spec, got in zip(SPECS, lines):
            r, _, g = spec.partition(":")
            assert (got["role"], got["gate_on"]) == (r, g or "ffn")
            _probes[(str(model), r, g)] = got
    return _probes[key]


def checkpoint_counts(model: Path) -> tuple[int, int, dict[str, int]]:
    """(numel of the MLP/MoE tensors, numel of everything else, {router gate
    tensor: numel}) in the checkpoint."""
    ffn = rest = 0
    gates = {}
    with safe_open(str(model / "model.safetensors"), "pt") as f:
        for name in f.keys():
            n = f.get_slice(name).get_shape()
            numel = 1
            for d in n:
                numel *= d
            if MLP.search(name):
                ffn += numel
            else:
                rest += numel
            if GATE.search(name):
                gates[name] = numel
    return ffn, rest, gates


@pytest.mark.parametrize("gate_on", ["ffn", "attention"])
@pytest.mark.parametrize("model_name", ["tiny-qwen3-moe", "tiny-deepseek-v2",
                                        "tiny-deepseek-v3"])
def test_roles_split_the_checkpoint(models_dir, model_name, gate_on):
    model = models_dir / model_name
    ckpt_ffn, ckpt_rest, ckpt_gates = checkpoint_counts(model)
    plain = probe(model, "plain")
    attn, ffn = probe(model, "attention", gate_on), probe(model, "ffn", gate_on)
    # gate_on "attention": the attention role also holds every MoE router gate
    # (weight, and DeepSeek-V3's e_score_correction_bias), nothing else of the mlps.
    gates = ckpt_gates if gate_on == "attention" else {}
    print(f"{model_name} gate_on={gate_on}: checkpoint mlp={ckpt_ffn} rest={ckpt_rest} "
          f"gates={sum(gates.values())}; plain={plain['num_params']} "
          f"attention={attn['num_params']} ffn={ffn['num_params']}")
    assert ckpt_gates  # every tiny model has MoE layers
    assert plain["num_params"] == ckpt_ffn + ckpt_rest
    assert ffn["num_params"] == ckpt_ffn
    assert attn["num_params"] == ckpt_rest + sum(gates.values())
    assert not attn["meta"] and not ffn["meta"]
    # The FFN role holds no attention, embedding, norm or lm_head parameter ...
    assert all(MLP.search(n) for n in ffn["names"]), [n for n in ffn["names"]
                                                      if not MLP.search(n)]
    # ... and the attention role no MLP/expert parameter (but the gates).
    assert sorted(n for n in attn["names"] if MLP.search(n)) == sorted(gates)
    # Every decoder layer's mlp is remote on the attention role, and only the
    # FFN role registers MoE layers (attention layers never exist there).
    layers = {int(m.group(1)) for n in plain["names"] if (m := re.search(r"layers\.(\d+)", n))}
    assert attn["remote_layers"] == sorted(layers)
    assert all(".mlp" in n for n in ffn["forward_context"])
    assert not any(".mlp" in n for n in attn["forward_context"])


@pytest.mark.parametrize("name, router", [
    ("model.layers.3.mlp.gate.weight", True),
    ("model.layers.3.mlp.gate.e_score_correction_bias", True),  # DeepSeek-V3, GLM-4
    ("model.layers.1.mlp.moe_statics.e_score_correction_bias", True),  # ERNIE 4.5
    ("model.layers.0.block_sparse_moe.router.layer.weight", True),  # Granite
    ("model.layers.0.block_sparse_moe.gate.weight", True),  # Mixtral, Phi-3.5-MoE
    ("model.layers.1.mlp.router.gate.weight", True),  # AFMoE, HunYuan V3
    ("model.layers.1.mlp.expert_bias", True),  # AFMoE, HunYuan V3: the block's own
    ("model.layers.1.mlp.e_score_correction_bias", True),  # EXAONE: the block's own
    ("model.layers.1.mlp.experts.0.expert_bias_scale", False),
    ("model.layers.2.mlp.shared_expert_gate.weight", False),  # Qwen2-MoE: the FFN's
    ("model.layers.0.mlp.gate_proj.weight", False),
    ("model.layers.0.mlp.gate_up_proj.weight", False),
    ("model.layers.0.self_attn.q_proj.weight", False),
])
def test_the_router_tensors_the_attention_role_reads(name, router):
    from vllm.afd.adapter.model import split

    assert (split._GATE_NAME.search(name) is not None) == router


def test_a_router_the_checkpoint_left_unread_is_an_error():
    """gate_on "attention": a router whose tensors the checkpoint did not give
    the attention role would route with uninitialized memory (vLLM's own check
    exempts every linear): loading fails naming the layer instead."""
    import torch
    from torch import nn

    from vllm.afd.adapter.model import split
    from vllm.afd.adapter.model.remote_ffn import RemoteFFN

    remote = RemoteFFN.__new__(RemoteFFN)  # no link: only the loading rule runs
    nn.Module.__init__(remote)
    remote.layer_idx, remote.gate = 1, nn.Linear(8, 4)  # weight and bias
    remote.layer_router = object()  # it routes
    model = nn.Sequential(remote)
    split._check_routers_loaded(model, {1: 2})
    with pytest.raises(ValueError, match="layer 1's router has 2 tensors but the checkpoint "
                                         "gave the attention role 1"):
        split._check_routers_loaded(model, {1: 1, 0: 2})
    # A correction bias of the MoE block's own (AFMoE's `mlp.expert_bias`) counts too.
    remote.register_parameter("expert_bias", nn.Parameter(torch.zeros(4)))
    with pytest.raises(ValueError, match="layer 1's router has 3 tensors"):
        split._check_routers_loaded(model, {1: 2})
    split._check_routers_loaded(model, {1: 3})
