# SPDX-License-Identifier: Apache-2.0
# SPDX-FileCopyrightText: Copyright contributors to the vllm-afd project
"""Role-aware construction: each role allocates exactly its part of the checkpoint."""

import json
import re
import subprocess
import sys
from pathlib import Path

import pytest
from safetensors import safe_open

PROBE = Path(__file__).with_name("role_params_probe.py")
MLP = re.compile(r"(^|\.)layers\.\d+\.mlp\.")


def probe(model: Path, role: str) -> dict:
    proc = subprocess.run([sys.executable, str(PROBE), str(model), role],
                          capture_output=True, text=True, timeout=300, cwd="/")
    assert proc.returncode == 0, proc.stderr[-4000:]
    return json.loads(proc.stdout.strip().splitlines()[-1])


def checkpoint_counts(model: Path) -> tuple[int, int]:
    """(numel of the MLP/MoE tensors, numel of everything else) in the checkpoint."""
    ffn = rest = 0
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
    return ffn, rest


@pytest.mark.parametrize("model_name", ["tiny-qwen3-moe", "tiny-deepseek-v2",
                                        "tiny-deepseek-v3"])
def test_roles_split_the_checkpoint(models_dir, model_name):
    model = models_dir / model_name
    ckpt_ffn, ckpt_rest = checkpoint_counts(model)
    plain, attn, ffn = (probe(model, r) for r in ("plain", "attention", "ffn"))
    print(f"{model_name}: checkpoint mlp={ckpt_ffn} rest={ckpt_rest}; plain="
          f"{plain['num_params']} attention={attn['num_params']} ffn={ffn['num_params']}")
    assert plain["num_params"] == ckpt_ffn + ckpt_rest
    assert ffn["num_params"] == ckpt_ffn
    assert attn["num_params"] == ckpt_rest
    assert not attn["meta"] and not ffn["meta"]
    # The FFN role holds no attention, embedding, norm or lm_head parameter ...
    assert all(MLP.search(n) for n in ffn["names"]), [n for n in ffn["names"]
                                                      if not MLP.search(n)]
    # ... and the attention role no MLP/expert parameter.
    assert not any(MLP.search(n) for n in attn["names"])
    # Every decoder layer's mlp is remote on the attention role, and only the
    # FFN role registers MoE layers (attention layers never exist there).
    layers = {int(m.group(1)) for n in plain["names"] if (m := re.search(r"layers\.(\d+)", n))}
    assert attn["remote_layers"] == sorted(layers)
    assert all(".mlp" in n for n in ffn["forward_context"])
    assert not any(".mlp" in n for n in attn["forward_context"])
