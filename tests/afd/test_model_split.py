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
