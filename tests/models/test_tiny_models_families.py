# SPDX-License-Identifier: Apache-2.0
# SPDX-FileCopyrightText: Copyright contributors to the vllm-afd project
"""tools/models/make_tiny_models.py's further model families: each generated config
loads with transformers, and each checkpoint is exactly the HF layout, so that
transformers' own loader consumes every tensor and misses none.

Offline and CPU-only; a few seconds. Generation with vLLM is covered for the
original three models by test_tiny_models.py.
"""

import json
from pathlib import Path

import pytest

import make_tiny_models as gen  # tools/models is on sys.path (tests/conftest.py)


# name -> (transformers config class, model_type, FFN attribute of the layers)
FAMILIES = {
    "tiny-mixtral": ("MixtralConfig", "mixtral", "block_sparse_moe"),
    "tiny-qwen2-moe": ("Qwen2MoeConfig", "qwen2_moe", "mlp"),
    "tiny-glm4-moe": ("Glm4MoeConfig", "glm4_moe", "mlp"),
    "tiny-gpt-oss": ("GptOssConfig", "gpt_oss", "mlp"),
    "tiny-llama4": ("Llama4TextConfig", "llama4_text", "feed_forward"),
    "tiny-olmoe": ("OlmoeConfig", "olmoe", "mlp"),
    "tiny-ernie45-moe": ("Ernie4_5_MoeConfig", "ernie4_5_moe", "mlp"),
    "tiny-phimoe": ("PhimoeConfig", "phimoe", "block_sparse_moe"),
    "tiny-granitemoe": ("GraniteMoeConfig", "granitemoe", "block_sparse_moe"),
    "tiny-exaone-moe": ("ExaoneMoeConfig", "exaone_moe", "mlp"),
    "tiny-glm4-moe-lite": ("Glm4MoeLiteConfig", "glm4_moe_lite", "mlp"),
    "tiny-afmoe": ("AfmoeConfig", "afmoe", "mlp"),
    "tiny-hy-v3": ("HYV3Config", "hy_v3", "mlp"),
    "tiny-llama": ("LlamaConfig", "llama", "mlp"),
    "tiny-qwen3": ("Qwen3Config", "qwen3", "mlp"),
    "tiny-qwen2": ("Qwen2Config", "qwen2", "mlp"),
}


@pytest.fixture(scope="module")
def models(models_dir) -> dict[str, Path]:
    """The session's checkpoints (tests/conftest.py builds every tiny model)."""
    return {name: models_dir / name for name in FAMILIES}


def test_families_are_tiny():
    assert set(FAMILIES) <= set(gen.TINY)


@pytest.mark.parametrize("name", FAMILIES)
def test_config_loads(models, name):
    from transformers import AutoConfig

    cls, model_type, _ = FAMILIES[name]
    cfg = AutoConfig.from_pretrained(models[name])
    assert type(cfg).__name__ == cls
    assert cfg.model_type == model_type
    assert cfg.architectures == [gen.SPECS[name]["arch"]]
    assert cfg.vocab_size == gen.VOCAB
    raw = json.loads((models[name] / "config.json").read_text())
    for k, v in gen.SPECS[name].items():
        if k != "arch":
            assert raw[k] == v, k


def test_family_specifics(models):
    def cfg(name):
        return json.loads((models[name] / "config.json").read_text())

    # vLLM builds an MTP layer per num_nextn_predict_layers (HF default 1).
    assert cfg("tiny-glm4-moe")["num_nextn_predict_layers"] == 0
    # CPU MoE with the router weight applied on the input needs top-1.
    assert cfg("tiny-llama4")["num_experts_per_tok"] == 1
    assert "quantization_config" not in cfg("tiny-gpt-oss")
    assert cfg("tiny-gpt-oss")["intermediate_size"] % 32 == 0


@pytest.mark.parametrize("name", FAMILIES)
def test_weights_match_hf_layout(models, name):
    import transformers
    from safetensors import safe_open
    from transformers import AutoModelForCausalLM

    transformers.logging.set_verbosity_error()
    path = models[name]
    _, info = AutoModelForCausalLM.from_pretrained(
        path, output_loading_info=True, dtype="bfloat16")
    assert not any(info.values()), info
    with safe_open(str(path / "model.safetensors"), "pt") as f:
        keys = list(f.keys())
    ffn = FAMILIES[name][2]
    assert any(f".{ffn}." in k for k in keys)


def test_hf_layout_check_has_teeth(models, tmp_path):
    """A checkpoint with a tensor dropped and one renamed is reported."""
    import shutil

    import transformers
    from safetensors.torch import load_file, save_file
    from transformers import AutoModelForCausalLM

    transformers.logging.set_verbosity_error()
    src = models["tiny-glm4-moe"]
    bad = tmp_path / "bad"
    shutil.copytree(src, bad)
    t = load_file(str(src / "model.safetensors"))
    t.pop("model.layers.1.mlp.gate.e_score_correction_bias")
    t["model.layers.1.mlp.shared_expert.up_proj.weight"] = t.pop(
        "model.layers.1.mlp.shared_experts.up_proj.weight")
    save_file(t, str(bad / "model.safetensors"), metadata={"format": "pt"})
    _, info = AutoModelForCausalLM.from_pretrained(
        bad, output_loading_info=True, dtype="bfloat16")
    assert info["missing_keys"] and info["unexpected_keys"], info
