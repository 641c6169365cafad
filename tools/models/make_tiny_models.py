# SPDX-License-Identifier: Apache-2.0
# SPDX-FileCopyrightText: Copyright contributors to the vllm-afd project
"""Generate tiny random-weight HF checkpoints for offline tests and benchmarks.

    python tools/models/make_tiny_models.py --out DIR [--seed 0] [--models all]
                                     [--dtype bfloat16|float32]

With a fixed torch/tokenizers/transformers install, the output is a pure
function of (seed, dtype, GENERATOR_VERSION): the same arguments give
byte-identical files. No network access is needed.
"""

import argparse
import hashlib
import json
import os
import shutil
import sys
import tempfile
import time
from pathlib import Path

os.environ.setdefault("HF_HUB_OFFLINE", "1")

# Bump whenever the output for a given seed changes, so stale dirs regenerate.
GENERATOR_VERSION = 1
STAMP = "tiny_model_stamp.json"
VOCAB = 1024
SPECIALS = ["<|endoftext|>", "<|im_start|>", "<|im_end|>"]
CHAT_TEMPLATE = (
    "{% for message in messages %}"
    "{{ '<|im_start|>' + message['role'] + '\\n' + message['content']"
    " + '<|im_end|>\\n' }}"
    "{% endfor %}"
    "{% if add_generation_prompt %}{{ '<|im_start|>assistant\\n' }}{% endif %}"
)

_QWEN3_MOE = dict(
    arch="Qwen3MoeForCausalLM", num_attention_heads=4, num_key_value_heads=2,
    head_dim=32, decoder_sparse_step=1, norm_topk_prob=True,
)
_GQA = dict(num_attention_heads=4, num_key_value_heads=2, head_dim=32)
_MLA = dict(
    num_hidden_layers=3, hidden_size=128, intermediate_size=256,
    num_attention_heads=4, num_key_value_heads=4, q_lora_rank=None,
    kv_lora_rank=512, qk_rope_head_dim=64, qk_nope_head_dim=32, v_head_dim=32,
    n_routed_experts=4, num_experts_per_tok=2, n_shared_experts=1,
    moe_intermediate_size=64, first_k_dense_replace=1,
)
_GDN = dict(
    _GQA, num_hidden_layers=4, hidden_size=128, linear_num_key_heads=1,
    linear_num_value_heads=2, linear_key_head_dim=128, linear_value_head_dim=128,
    linear_conv_kernel_dim=4, layer_types=["linear_attention"] * 3 + ["full_attention"],
)
_QWEN_HYBRID = ("Qwen3NextForCausalLM", "Qwen3_5MoeForCausalLM", "Qwen3_5ForCausalLM")
_LFM2 = dict(
    num_hidden_layers=4, hidden_size=128, num_attention_heads=4, num_key_value_heads=2,
    layer_types=["conv", "full_attention", "conv", "full_attention"], conv_L_cache=3,
    tie_word_embeddings=True,  # as released: vLLM's LFM2 always ties lm_head
)
SPECS = {
    "tiny-qwen3-moe": dict(
        _QWEN3_MOE, num_hidden_layers=4, hidden_size=128, intermediate_size=256,
        num_experts=8, num_experts_per_tok=2, moe_intermediate_size=64,
    ),
    "tiny-deepseek-v2": dict(
        _MLA, arch="DeepseekV2ForCausalLM", topk_method="greedy",
        n_group=1, topk_group=1, norm_topk_prob=False, routed_scaling_factor=1.0,
    ),
    # transformers' DeepseekV3Config has no topk_method/scoring_func, but vLLM
    # only creates gate.e_score_correction_bias for topk_method == "noaux_tc".
    "tiny-deepseek-v3": dict(
        _MLA, arch="DeepseekV3ForCausalLM", topk_method="noaux_tc",
        scoring_func="sigmoid", num_nextn_predict_layers=0, n_group=2,
        topk_group=2, norm_topk_prob=True, routed_scaling_factor=2.5,
    ),
    # A shrunken Qwen3-30B-A3B (hidden 2048, head_dim 128, 4 KV heads), sized
    # so that on a 2-core CPU an eager decode step is mostly GEMM time, not
    # per-layer Python overhead (~2/3 at batch 1, ~4/5 at batch 32), within
    # ~750 MiB of bf16 weights. Smaller hidden sizes were overhead-bound.
    "bench-qwen3-moe": dict(
        _QWEN3_MOE, num_hidden_layers=8, hidden_size=2048, intermediate_size=4096,
        num_attention_heads=16, num_key_value_heads=4, head_dim=128,
        num_experts=16, num_experts_per_tok=4, moe_intermediate_size=384,
    ),
    # One small checkpoint per further model family, in the HF layout vLLM
    # loads. GQA with head_dim 32/64 (head sizes the CPU attention backend
    # supports) and hidden/intermediate sizes that are multiples of 32 (the
    # CPU MoE kernels need them).
    "tiny-mixtral": dict(
        _GQA, arch="MixtralForCausalLM", num_hidden_layers=2, hidden_size=128,
        intermediate_size=64, num_local_experts=8, num_experts_per_tok=2,
    ),
    # Qwen2-MoE derives head_dim from hidden // heads (32) and always has a
    # q/k/v bias; layer 0 is dense through mlp_only_layers.
    "tiny-qwen2-moe": dict(
        arch="Qwen2MoeForCausalLM", num_hidden_layers=3, hidden_size=128,
        num_attention_heads=4, num_key_value_heads=2, intermediate_size=256,
        moe_intermediate_size=64, shared_expert_intermediate_size=128,
        num_experts=8, num_experts_per_tok=2, decoder_sparse_step=1,
        mlp_only_layers=[0], norm_topk_prob=True,
    ),
    # GLM-4.5 style: dense layer 0, sigmoid grouped top-k with a correction
    # bias, one shared expert, q/k/v bias, partial rotary (HF default 0.5).
    "tiny-glm4-moe": dict(
        _GQA, arch="Glm4MoeForCausalLM", num_hidden_layers=3, hidden_size=128,
        intermediate_size=256, moe_intermediate_size=64, n_routed_experts=8,
        n_shared_experts=1, num_experts_per_tok=2, first_k_dense_replace=1,
        n_group=2, topk_group=1, norm_topk_prob=True, routed_scaling_factor=2.5,
        attention_bias=True, use_qk_norm=False, num_nextn_predict_layers=0,
    ),
    # Unquantized (bf16) experts: vLLM's MXFP4 path needs AMX on CPU. Keeps
    # HF's yarn rope defaults (original 4096 x 32) and its alternating
    # sliding/full layers; vLLM slides on even layers. Attention sinks.
    "tiny-gpt-oss": dict(
        arch="GptOssForCausalLM", num_hidden_layers=4, hidden_size=128,
        num_attention_heads=4, num_key_value_heads=2, head_dim=64,
        intermediate_size=64, num_local_experts=8, num_experts_per_tok=2,
        sliding_window=64, max_position_embeddings=4096,
    ),
    # Text-only Llama 4 (Llama4TextConfig): MoE on odd layers (router +
    # shared expert, fused expert tensors), dense on even ones; layer 3 is
    # NoPE (no_rope_layer_interval 4). top-1 routing: vLLM applies the router
    # weight on the input, which the CPU MoE supports only for top_k == 1.
    "tiny-llama4": dict(
        _GQA, arch="Llama4ForCausalLM", num_hidden_layers=4, hidden_size=128,
        intermediate_size=64, intermediate_size_mlp=256, num_local_experts=8,
        num_experts_per_tok=1, interleave_moe_layer_step=2,
        attention_chunk_size=128,
    ),
    # GLM-4.7-Flash: DeepSeek's MLA with a low-rank q (q_a/q_b), GLM-4's MoE
    # (sigmoid grouped top-k, correction bias in the gate, a shared expert),
    # dense layer 0.
    "tiny-glm4-moe-lite": dict(
        _MLA, arch="Glm4MoeLiteForCausalLM", q_lora_rank=64, n_group=1, topk_group=1,
        norm_topk_prob=True, routed_scaling_factor=1.8, num_nextn_predict_layers=0,
    ),
    # AFMoE (Arcee Trinity): gated attention (`self_attn.gate_proj`) with q/k
    # norm, sliding and global layers, norms before and after the FFN, dense
    # layer 0, sigmoid grouped top-k with the correction bias in the MoE block
    # (`mlp.expert_bias`), the router at `mlp.router.gate`, a shared expert.
    "tiny-afmoe": dict(
        _GQA, arch="AfmoeForCausalLM", num_hidden_layers=3, hidden_size=128,
        intermediate_size=256, moe_intermediate_size=64, num_dense_layers=1,
        num_experts=8, num_experts_per_tok=2, num_shared_experts=1, score_func="sigmoid",
        route_norm=True, route_scale=2.0, n_group=1, topk_group=1,
        layer_types=["sliding_attention", "sliding_attention", "full_attention"],
        sliding_window=64, global_attn_every_n_layers=3,
    ),
    # OLMoE: q/k RMSNorm over the whole projection, top-k without
    # renormalization, every layer MoE, no shared expert.
    "tiny-olmoe": dict(
        arch="OlmoeForCausalLM", num_hidden_layers=2, hidden_size=128,
        num_attention_heads=4, num_key_value_heads=2, intermediate_size=64,
        num_experts=8, num_experts_per_tok=2,
    ),
    # ERNIE 4.5 MoE: dense layer 0, a float32 router with a correction bias
    # (`moe_statics`, [1, E] in the checkpoint), one shared expert.
    "tiny-ernie45-moe": dict(
        arch="Ernie4_5_MoeForCausalLM", num_hidden_layers=3, hidden_size=128,
        num_attention_heads=4, num_key_value_heads=2, head_dim=32,
        intermediate_size=256, moe_intermediate_size=64, moe_num_experts=8, moe_k=2,
        moe_num_shared_experts=1, moe_layer_start_index=1, moe_layer_end_index=2,
    ),
    # Phi-3.5-MoE: `block_sparse_moe` (w1/w2/w3 experts) routed by
    # sparsemixer (a custom routing function), LayerNorms with a bias, q/k/v/o
    # and lm_head with a bias (as the released config; vLLM always builds them).
    "tiny-phimoe": dict(
        arch="PhiMoEForCausalLM", num_hidden_layers=2, hidden_size=128,
        num_attention_heads=4, num_key_value_heads=2, intermediate_size=64,
        num_local_experts=8, num_experts_per_tok=2, attention_bias=True,
        lm_head_bias=True,
    ),
    # Granite MoE: fused expert tensors (`input_linear` [E, 2I, H],
    # `output_linear` [E, H, I]), `router.layer`, and Granite's multipliers
    # (embedding, attention, residual, logits) at Granite 3's values.
    "tiny-granitemoe": dict(
        arch="GraniteMoeForCausalLM", num_hidden_layers=2, hidden_size=128,
        num_attention_heads=4, num_key_value_heads=2, intermediate_size=64,
        num_local_experts=8, num_experts_per_tok=2, embedding_multiplier=12.0,
        attention_multiplier=0.015625, residual_multiplier=0.22, logits_scaling=8.0,
    ),
    # EXAONE MoE: dense layer 0 (mlp_layer_types), sigmoid grouped top-k with
    # the correction bias in the MoE block (`mlp.e_score_correction_bias`), one
    # shared expert, q/k norm, sliding layers with NoPE full-attention layers.
    "tiny-exaone-moe": dict(
        _GQA, arch="ExaoneMoeForCausalLM", num_hidden_layers=3, hidden_size=128,
        intermediate_size=256, moe_intermediate_size=64, num_experts=8,
        num_experts_per_tok=2, num_shared_experts=1, n_group=1, topk_group=1,
        first_k_dense_replace=1, mlp_layer_types=["dense", "sparse", "sparse"],
        layer_types=["sliding_attention", "sliding_attention", "full_attention"],
        sliding_window=64, routed_scaling_factor=2.5, norm_topk_prob=True,
    ),
    # HunYuan V3 (Hy3): dense layer 0, sigmoid top-k (one group) with the
    # correction bias in the MoE block (`mlp.expert_bias`), router
    # `mlp.router.gate`, shared expert `mlp.shared_mlp`, q/k norm. vLLM reads the
    # released config's expert_hidden_dim / route_norm / first_k_dense_replace /
    # qk_norm, which transformers' HYV3Config lacks: written beside its fields.
    "tiny-hy-v3": dict(
        _GQA, arch="HYV3ForCausalLM", num_hidden_layers=3, hidden_size=128,
        intermediate_size=256, moe_intermediate_size=64, expert_hidden_dim=64,
        num_experts=8, num_experts_per_tok=2, num_shared_experts=1,
        mlp_layer_types=["dense", "sparse", "sparse"], first_k_dense_replace=1,
        router_scaling_factor=2.5, route_norm=True, qk_norm=True,
    ),
    # Hybrid decoders: Gated DeltaNet linear attention (`linear_attn`) on three
    # layers, gated full attention (q_proj twice the heads, q/k norm) on the
    # fourth, and the FFN beside either. vLLM's CPU GDN kernel takes bf16 and
    # key/value head dims of 128 only (32 is refused). Qwen3-Next: a sparse MoE
    # block with a gated shared expert, dense layer 0 (mlp_only_layers);
    # Qwen3.5: the same layers with split in_proj tensors, MoE or dense.
    "tiny-qwen3-next": dict(
        _GDN, arch="Qwen3NextForCausalLM", intermediate_size=256, num_experts=8,
        num_experts_per_tok=2, moe_intermediate_size=64, shared_expert_intermediate_size=64,
        decoder_sparse_step=1, mlp_only_layers=[0], norm_topk_prob=True,
    ),
    "tiny-qwen3.5-moe": dict(
        _GDN, arch="Qwen3_5MoeForCausalLM", num_experts=8, num_experts_per_tok=2,
        moe_intermediate_size=64, shared_expert_intermediate_size=64,
    ),
    "tiny-qwen3.5": dict(_GDN, arch="Qwen3_5ForCausalLM", intermediate_size=256),
    # LFM2: gated short convolutions (`conv`) on some layers, attention with
    # q/k norm on the others, the FFN (`feed_forward`, w1/w2/w3) beside either.
    # LFM2-MoE: dense layer 0, sigmoid top-k with the correction bias in the
    # MoE block (`feed_forward.expert_bias`). vLLM also reads the released
    # config's block_dim and conv_dim, which transformers' Lfm2Config lacks.
    "tiny-lfm2-moe": dict(
        _LFM2, arch="Lfm2MoeForCausalLM", intermediate_size=256, moe_intermediate_size=64,
        num_dense_layers=1, num_experts=8, num_experts_per_tok=2, routed_scaling_factor=2.5,
    ),
    "tiny-lfm2": dict(
        _LFM2, arch="Lfm2ForCausalLM", intermediate_size=256, block_dim=128, conv_dim=128,
        block_auto_adjust_ff_dim=False,
    ),
    "tiny-llama": dict(
        _GQA, arch="LlamaForCausalLM", num_hidden_layers=2, hidden_size=128,
        intermediate_size=256,
    ),
    "tiny-qwen3": dict(
        _GQA, arch="Qwen3ForCausalLM", num_hidden_layers=2, hidden_size=128,
        intermediate_size=256,
    ),
    # Qwen2 / Qwen2.5 dense: head_dim from hidden // heads (32), q/k/v bias.
    "tiny-qwen2": dict(
        arch="Qwen2ForCausalLM", num_hidden_layers=2, hidden_size=128,
        num_attention_heads=4, num_key_value_heads=2, intermediate_size=256,
    ),
}
# Architectures whose HF config class is not arch.replace("ForCausalLM",
# "Config") (Llama4Config is the multimodal wrapper).
CONFIG_CLASS = {"Llama4ForCausalLM": "Llama4TextConfig", "PhiMoEForCausalLM": "PhimoeConfig",
                "Qwen3_5MoeForCausalLM": "Qwen3_5MoeTextConfig",
                "Qwen3_5ForCausalLM": "Qwen3_5TextConfig"}
TINY = [n for n in SPECS if n.startswith("tiny-")]


def _corpus() -> str:
    # Generated rather than read from disk so the tokenizer does not depend on
    # which packages happen to be installed.
    words = (
        "the a an of to and in is it that for on with as was by at from this be are or not have "
        "has had but which one all they you we he she his her their there were been will would "
        "can could should may might must model token layer expert attention router weight cache "
        "batch decode prefill request server client engine worker tensor shape kernel memory "
        "device python json config vocab merge byte number value time step loop queue index "
        "offset length size first last next small large random seed test check pass fail error "
        "result output input hello world question answer user assistant system message"
    ).split()
    lines = []
    n = len(words)
    for i in range(1500):
        # A fixed stride walk over the word list gives varied n-grams cheaply.
        k = 4 + i % 9
        sent = " ".join(words[(i * 7 + j * (i % 13 + 1)) % n] for j in range(k))
        lines.append(sent.capitalize() + (".", "?", "!", ",")[i % 4])
    lines += [f"{i} + {i * 3 % 97} = {i + i * 3 % 97}" for i in range(300)]
    lines += [f"def f_{i}(x, y={i}):\n    return [x * y for _ in range({i % 7})]\n"
              for i in range(100)]
    lines.append("{\"key\": [1, 2, 3], \"ok\": true, \"none\": null}\t<tag/>")
    return "\n".join(lines)


def build_tokenizer():
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers
    from tokenizers import processors, trainers
    from transformers import PreTrainedTokenizerFast

    tok = Tokenizer(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    tok.post_processor = processors.ByteLevel(trim_offsets=False)
    trainer = trainers.BpeTrainer(
        vocab_size=VOCAB, special_tokens=SPECIALS, show_progress=False,
        initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
    )
    tok.train_from_iterator(_corpus().split("\n"), trainer=trainer)
    assert tok.get_vocab_size() == VOCAB, tok.get_vocab_size()
    assert tok.token_to_id(SPECIALS[0]) == 0
    return PreTrainedTokenizerFast(
        tokenizer_object=tok, bos_token=SPECIALS[0], eos_token=SPECIALS[0],
        pad_token=SPECIALS[0], additional_special_tokens=SPECIALS[1:],
        model_max_length=2048, chat_template=CHAT_TEMPLATE,
    )


def build_config(name: str) -> dict:
    import transformers

    spec = dict(SPECS[name])
    arch = spec.pop("arch")
    cls = getattr(transformers,
                  CONFIG_CLASS.get(arch, arch.replace("ForCausalLM", "Config")))
    kwargs = dict(
        vocab_size=VOCAB, max_position_embeddings=2048, rms_norm_eps=1e-6,
        hidden_act="silu", tie_word_embeddings=False, bos_token_id=0,
        eos_token_id=0, pad_token_id=0, architectures=[arch],
    )
    cfg = cls(**dict(kwargs, **spec))
    d = cfg.to_dict()
    for k, v in spec.items():
        # Aliased keys (num_experts -> num_local_experts in transformers 5) are
        # written under both names so older loaders and vLLM both find them.
        assert getattr(cfg, k) == v, f"{name}: config dropped {k}"
        d[k] = v
    return d


def weight_shapes(cfg: dict) -> dict[str, tuple[tuple[int, ...], str]]:
    """Checkpoint tensor names (HF layout vLLM loads) -> (shape, init kind)."""
    if _arch(cfg).startswith("Lfm2"):
        return _lfm2_shapes(cfg)
    h, nl = cfg["hidden_size"], cfg["num_hidden_layers"]
    out = {
        "model.embed_tokens.weight": ((VOCAB, h), "normal"),
        "model.norm.weight": ((h,), "ones"),
        "lm_head.weight": ((VOCAB, h), "normal"),
    }
    for i in range(nl):
        p = f"model.layers.{i}."
        out[p + "input_layernorm.weight"] = ((h,), "ones")
        out[p + "post_attention_layernorm.weight"] = ((h,), "ones")
        if _arch(cfg) == "AfmoeForCausalLM":  # norms before and after the FFN
            out[p + "pre_mlp_layernorm.weight"] = ((h,), "ones")
            out[p + "post_mlp_layernorm.weight"] = ((h,), "ones")
        if cfg.get("layer_types", [None] * nl)[i] == "linear_attention":
            out.update(_gated_delta_net_shapes(cfg, p + "linear_attn."))
        else:
            out.update(_attention_shapes(cfg, p + "self_attn."))
        out.update(_ffn_shapes(cfg, i, p))
    if _arch(cfg) == "PhiMoEForCausalLM":  # LayerNorm, and lm_head with a bias
        out.update({k[:-len("weight")] + "bias": ((h if "norm" in k else VOCAB,), "bias")
                    for k in list(out)
                    if k.endswith("norm.weight") or k == "lm_head.weight"})
    return out


def _lfm2_shapes(cfg: dict) -> dict:
    """LFM2's own names: operator/ffn norms, `conv` or `self_attn` (its
    `out_proj`, q/k `layernorm`), `feed_forward` w1/w3/w2, `embedding_norm`,
    and no lm_head (tied to the embeddings)."""
    h, nh, nkv = cfg["hidden_size"], cfg["num_attention_heads"], cfg["num_key_value_heads"]
    hd = h // nh
    out = {
        "model.embed_tokens.weight": ((VOCAB, h), "normal"),
        "model.embedding_norm.weight": ((h,), "ones"),
    }
    names = ("w1", "w3", "w2")
    for i, kind in enumerate(cfg["layer_types"]):
        p = f"model.layers.{i}."
        out[p + "operator_norm.weight"] = ((h,), "ones")
        out[p + "ffn_norm.weight"] = ((h,), "ones")
        if kind == "conv":
            out[p + "conv.in_proj.weight"] = ((3 * h, h), "normal")
            out[p + "conv.conv.weight"] = ((h, 1, cfg["conv_L_cache"]), "normal")
            out[p + "conv.out_proj.weight"] = ((h, h), "normal")
        else:
            a = p + "self_attn."
            out[a + "q_proj.weight"] = ((nh * hd, h), "normal")
            out[a + "k_proj.weight"] = ((nkv * hd, h), "normal")
            out[a + "v_proj.weight"] = ((nkv * hd, h), "normal")
            out[a + "out_proj.weight"] = ((h, nh * hd), "normal")
            out[a + "q_layernorm.weight"] = ((hd,), "ones")
            out[a + "k_layernorm.weight"] = ((hd,), "ones")
        m = p + "feed_forward."
        if "num_experts" not in cfg or i < cfg["num_dense_layers"]:
            out.update(_glu(m, h, cfg["intermediate_size"], names))
            continue
        e = cfg["num_experts"]
        out[m + "gate.weight"] = ((e, h), "normal")
        out[m + "expert_bias"] = ((e,), "bias")
        for j in range(e):
            out.update(_glu(f"{m}experts.{j}.", h, cfg["moe_intermediate_size"], names))
    return out


def _arch(cfg: dict) -> str:
    return cfg["architectures"][0]


def _attention_shapes(cfg: dict, a: str) -> dict:
    h, nh, arch = cfg["hidden_size"], cfg["num_attention_heads"], _arch(cfg)
    out = {}
    if "kv_lora_rank" in cfg:  # MLA (DeepSeek V2/V3)
        r, nope = cfg["qk_rope_head_dim"], cfg["qk_nope_head_dim"]
        kvr, vd = cfg["kv_lora_rank"], cfg["v_head_dim"]
        if cfg.get("q_lora_rank"):  # low-rank q (GLM-4.7-Flash, DeepSeek-V3 releases)
            qr = cfg["q_lora_rank"]
            out[a + "q_a_proj.weight"] = ((qr, h), "normal")
            out[a + "q_a_layernorm.weight"] = ((qr,), "ones")
            out[a + "q_b_proj.weight"] = ((nh * (nope + r), qr), "normal")
        else:
            out[a + "q_proj.weight"] = ((nh * (nope + r), h), "normal")
        out[a + "kv_a_proj_with_mqa.weight"] = ((kvr + r, h), "normal")
        out[a + "kv_a_layernorm.weight"] = ((kvr,), "ones")
        out[a + "kv_b_proj.weight"] = ((nh * (nope + vd), kvr), "normal")
        out[a + "o_proj.weight"] = ((h, nh * vd), "normal")
        return out
    # Qwen2-MoE has no head_dim field (vLLM uses hidden // heads).
    hd, nkv = cfg.get("head_dim") or h // nh, cfg["num_key_value_heads"]
    # Qwen3-Next's and Qwen3.5's q_proj also projects the output gate.
    gated = 2 if arch in _QWEN_HYBRID else 1
    out[a + "q_proj.weight"] = ((gated * nh * hd, h), "normal")
    out[a + "k_proj.weight"] = ((nkv * hd, h), "normal")
    out[a + "v_proj.weight"] = ((nkv * hd, h), "normal")
    out[a + "o_proj.weight"] = ((h, nh * hd), "normal")
    # vLLM's Qwen2 attention always has a q/k/v bias (Qwen2Config has no field).
    if (cfg.get("qkv_bias") or cfg.get("attention_bias")
            or arch in ("Qwen2ForCausalLM", "PhiMoEForCausalLM")):
        out[a + "q_proj.bias"] = ((nh * hd,), "normal")
        out[a + "k_proj.bias"] = ((nkv * hd,), "normal")
        out[a + "v_proj.bias"] = ((nkv * hd,), "normal")
    if arch in ("GptOssForCausalLM", "PhiMoEForCausalLM"):
        out[a + "o_proj.bias"] = ((h,), "normal")
    if arch == "GptOssForCausalLM":
        out[a + "sinks"] = ((nh,), "normal")
    if arch == "OlmoeForCausalLM":  # over the whole q / k projection
        out[a + "q_norm.weight"] = ((nh * hd,), "ones")
        out[a + "k_norm.weight"] = ((nkv * hd,), "ones")
    # Llama 4's qk-norm has no weight.
    if arch == "AfmoeForCausalLM":  # gated attention output
        out[a + "gate_proj.weight"] = ((nh * hd, h), "normal")
    if arch.startswith("Qwen3") or arch in (
            "ExaoneMoeForCausalLM", "AfmoeForCausalLM", "HYV3ForCausalLM") or (
            arch == "Glm4MoeForCausalLM" and cfg.get("use_qk_norm")):
        out[a + "q_norm.weight"] = ((hd,), "ones")
        out[a + "k_norm.weight"] = ((hd,), "ones")
    return out


def _gated_delta_net_shapes(cfg: dict, a: str) -> dict:
    h, k_heads, v_heads = (cfg["hidden_size"], cfg["linear_num_key_heads"],
                           cfg["linear_num_value_heads"])
    qk, v = k_heads * cfg["linear_key_head_dim"], v_heads * cfg["linear_value_head_dim"]
    out = {
        a + "conv1d.weight": ((2 * qk + v, 1, cfg["linear_conv_kernel_dim"]), "normal"),
        a + "A_log": ((v_heads,), "normal"),
        a + "dt_bias": ((v_heads,), "normal"),
        a + "norm.weight": ((cfg["linear_value_head_dim"],), "ones"),
        a + "out_proj.weight": ((h, v), "normal"),
    }
    if _arch(cfg) == "Qwen3NextForCausalLM":  # q, k, v, z and b, a fused
        out[a + "in_proj_qkvz.weight"] = ((2 * qk + 2 * v, h), "normal")
        out[a + "in_proj_ba.weight"] = ((2 * v_heads, h), "normal")
        return out
    out[a + "in_proj_qkv.weight"] = ((2 * qk + v, h), "normal")
    out[a + "in_proj_z.weight"] = ((v, h), "normal")
    out[a + "in_proj_b.weight"] = ((v_heads, h), "normal")
    out[a + "in_proj_a.weight"] = ((v_heads, h), "normal")
    return out


def _glu(q: str, h: int, inter: int, names=("gate_proj", "up_proj", "down_proj")):
    g, u, d = names
    return {
        f"{q}{g}.weight": ((inter, h), "normal"),
        f"{q}{u}.weight": ((inter, h), "normal"),
        f"{q}{d}.weight": ((h, inter), "normal"),
    }


def _moe_block(m: str, h: int, e: int, mi: int, router: str, bias: tuple[str, tuple],
               shared: int, shared_name: str = "shared_experts.") -> dict:
    out = {m + router: ((e, h), "normal"), m + bias[0]: (bias[1], "bias")}
    for j in range(e):
        out.update(_glu(f"{m}experts.{j}.", h, mi))
    out.update(_glu(m + shared_name, h, mi * shared))
    return out


def _ffn_shapes(cfg: dict, i: int, p: str) -> dict:
    h, arch = cfg["hidden_size"], _arch(cfg)
    out = {}
    if arch in ("MixtralForCausalLM", "PhiMoEForCausalLM"):
        m, e = p + "block_sparse_moe.", cfg["num_local_experts"]
        out[m + "gate.weight"] = ((e, h), "normal")
        for j in range(e):
            out.update(_glu(f"{m}experts.{j}.", h, cfg["intermediate_size"],
                            ("w1", "w3", "w2")))
        return out
    if arch == "GraniteMoeForCausalLM":
        m, e, inter = p + "block_sparse_moe.", cfg["num_local_experts"], cfg["intermediate_size"]
        out[m + "router.layer.weight"] = ((e, h), "normal")
        out[m + "input_linear.weight"] = ((e, 2 * inter, h), "normal")
        out[m + "output_linear.weight"] = ((e, h, inter), "normal")
        return out
    if arch == "GptOssForCausalLM":
        # Fused expert tensors, [E, in, out]; gate/up interleaved along 2I.
        m, e, inter = p + "mlp.", cfg["num_local_experts"], cfg["intermediate_size"]
        out[m + "router.weight"] = ((e, h), "normal")
        out[m + "router.bias"] = ((e,), "normal")
        out[m + "experts.gate_up_proj"] = ((e, h, 2 * inter), "normal")
        out[m + "experts.gate_up_proj_bias"] = ((e, 2 * inter), "normal")
        out[m + "experts.down_proj"] = ((e, inter, h), "normal")
        out[m + "experts.down_proj_bias"] = ((e, h), "normal")
        return out
    if arch == "Llama4ForCausalLM":
        m, inter = p + "feed_forward.", cfg["intermediate_size"]
        step = cfg["interleave_moe_layer_step"]
        if step > 0 and (i + 1) % step == 0:
            e = cfg["num_local_experts"]
            out[m + "router.weight"] = ((e, h), "normal")
            # The HF Llama 4 layout: fused [E, H, 2I] (gate | up) and [E, I, H].
            out[m + "experts.gate_up_proj"] = ((e, h, 2 * inter), "normal")
            out[m + "experts.down_proj"] = ((e, inter, h), "normal")
            out.update(_glu(m + "shared_expert.", h, inter))
        else:
            out.update(_glu(m, h, cfg["intermediate_size_mlp"]))
        return out
    m = p + "mlp."
    # Per-expert tensors, a router, its correction bias and shared experts,
    # under names and shapes of each family's own.
    if arch == "AfmoeForCausalLM":
        if i < cfg["num_dense_layers"]:
            return _glu(m, h, cfg["intermediate_size"])
        e = cfg["num_experts"]
        return _moe_block(m, h, e, cfg["moe_intermediate_size"], "router.gate.weight",
                          ("expert_bias", (e,)), cfg["num_shared_experts"])
    if arch == "ExaoneMoeForCausalLM":
        if cfg["mlp_layer_types"][i] != "sparse":
            return _glu(m, h, cfg["intermediate_size"])
        e = cfg["num_experts"]
        return _moe_block(m, h, e, cfg["moe_intermediate_size"], "gate.weight",
                          ("e_score_correction_bias", (e,)), cfg["num_shared_experts"])
    if arch == "HYV3ForCausalLM":
        if i < cfg["first_k_dense_replace"]:
            return _glu(m, h, cfg["intermediate_size"])
        e = cfg["num_experts"]
        return _moe_block(m, h, e, cfg["expert_hidden_dim"], "router.gate.weight",
                          ("expert_bias", (e,)), cfg["num_shared_experts"], "shared_mlp.")
    if arch == "Ernie4_5_MoeForCausalLM":
        if i < cfg["moe_layer_start_index"] or i > cfg["moe_layer_end_index"]:
            return _glu(m, h, cfg["intermediate_size"])
        e = cfg["moe_num_experts"]
        return _moe_block(m, h, e, cfg["moe_intermediate_size"], "gate.weight",
                          ("moe_statics.e_score_correction_bias", (1, e)),
                          cfg["moe_num_shared_experts"])
    if "n_routed_experts" in cfg:  # DeepSeek V2/V3, GLM-4 MoE
        n_exp = cfg["n_routed_experts"]
        sparse = i >= cfg["first_k_dense_replace"]
    elif "num_experts" in cfg:  # Qwen3-MoE, Qwen2-MoE, OLMoE (every layer)
        n_exp = cfg["num_experts"]
        sparse = (i not in (cfg.get("mlp_only_layers") or [])
                  and (i + 1) % cfg.get("decoder_sparse_step", 1) == 0)
    else:  # dense
        n_exp, sparse = 0, False
    mlps = []
    if sparse:
        mi = cfg.get("moe_intermediate_size") or cfg["intermediate_size"]  # OLMoE: none
        out[m + "gate.weight"] = ((n_exp, h), "normal")
        if (cfg.get("topk_method") == "noaux_tc"
                or arch in ("Glm4MoeForCausalLM", "Glm4MoeLiteForCausalLM")):
            out[m + "gate.e_score_correction_bias"] = ((n_exp,), "bias")
        mlps += [(f"{m}experts.{e}.", mi) for e in range(n_exp)]
        if cfg.get("n_shared_experts"):
            mlps.append((m + "shared_experts.", mi * cfg["n_shared_experts"]))
        if arch == "Qwen2MoeForCausalLM" or arch in _QWEN_HYBRID:
            mlps.append((m + "shared_expert.",
                         cfg["shared_expert_intermediate_size"]))
            out[m + "shared_expert_gate.weight"] = ((1, h), "normal")
    else:
        mlps.append((m, cfg["intermediate_size"]))
    for q, inter in mlps:
        out.update(_glu(q, h, inter))
    return out


def make_tensor(seed: int, key: str, shape, kind: str, dtype):
    import torch

    if kind == "ones":
        return torch.ones(shape, dtype=dtype)
    # One generator per tensor, keyed by model and tensor name: adding or
    # reordering tensors never changes the others, and models sharing tensor
    # names (deepseek v2/v3) still get independent weights.
    digest = hashlib.sha256(f"{seed}:{key}".encode()).digest()
    g = torch.Generator().manual_seed(int.from_bytes(digest[:8], "little"))
    t = torch.randn(shape, generator=g, dtype=torch.float32) * 0.02
    # The correction bias is a float32 parameter in vLLM (and real ckpts).
    return t if kind == "bias" else t.to(dtype)


def _write_json(path: Path, obj) -> None:
    path.write_text(json.dumps(obj, indent=2, sort_keys=True) + "\n")


def make_models(out_dir, names=None, seed: int = 0, dtype: str = "bfloat16",
                verbose: bool = False) -> dict[str, Path]:
    """Generate (or reuse) the named models under out_dir; return name -> dir."""
    import torch
    from safetensors.torch import save_file

    names = list(SPECS) if names is None else list(names)
    unknown = [n for n in names if n not in SPECS]
    if unknown:
        raise ValueError(f"unknown models {unknown}; choose from {list(SPECS)}")
    torch_dtype = {"bfloat16": torch.bfloat16, "float32": torch.float32}[dtype]
    out_dir = Path(out_dir)
    out_dir.mkdir(parents=True, exist_ok=True)
    stamp = {"generator_version": GENERATOR_VERSION, "seed": seed, "dtype": dtype}
    result, tok = {}, None

    def stamp_of(name: str) -> dict:
        # The spec too: editing a family's spec regenerates its directory.
        spec = hashlib.sha256(json.dumps(SPECS[name], sort_keys=True).encode()).hexdigest()
        return dict(stamp, name=name, spec=spec[:16])

    def fresh(d: Path) -> bool:
        st = d / STAMP
        return st.exists() and json.loads(st.read_text()) == stamp_of(d.name)

    for name in names:
        d = result[name] = out_dir / name
        if fresh(d):
            if verbose:
                print(f"skip  {name}: {d} (stamp matches)")
            continue
        t0 = time.perf_counter()
        if tok is None:
            tok = build_tokenizer()
        # Build in a sibling temp dir and rename, so an interrupted run never
        # leaves a half-written model that looks complete.
        tmp = Path(tempfile.mkdtemp(prefix=f".{name}.", dir=out_dir))
        try:
            tok.save_pretrained(tmp)
            cfg = build_config(name)
            cfg["dtype"] = dtype
            _write_json(tmp / "config.json", cfg)
            _write_json(tmp / "generation_config.json",
                        {"bos_token_id": 0, "eos_token_id": 0, "pad_token_id": 0})
            tensors = {
                k: make_tensor(seed, f"{name}/{k}", shape, kind, torch_dtype)
                for k, (shape, kind) in sorted(weight_shapes(cfg).items())
            }
            save_file(tensors, str(tmp / "model.safetensors"),
                      metadata={"format": "pt"})
            _write_json(tmp / STAMP, stamp_of(name))
            # mkdtemp and safetensors create owner-only modes; loosen them so
            # the checkpoint is readable from containers running as other uids.
            tmp.chmod(0o755)
            for f in tmp.iterdir():
                f.chmod(0o644)
            if fresh(d):  # a concurrent run finished it first; keep theirs
                shutil.rmtree(tmp)
            else:
                shutil.rmtree(d, ignore_errors=True)
                tmp.rename(d)
        except BaseException:
            shutil.rmtree(tmp, ignore_errors=True)
            raise
        if verbose:
            n_par = sum(t.numel() for t in tensors.values())
            size = (d / "model.safetensors").stat().st_size / 2**20
            print(f"wrote {name}: {d} ({len(tensors)} tensors, "
                  f"{n_par / 1e6:.1f}M params, {size:.1f} MiB, "
                  f"{time.perf_counter() - t0:.1f}s)")
    return result


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--out", required=True, type=Path)
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--models", default="all",
                    help=f"all, tiny, or comma list of {','.join(SPECS)}")
    ap.add_argument("--dtype", default="bfloat16", choices=["bfloat16", "float32"])
    args = ap.parse_args(argv)
    sel = {"all": list(SPECS), "tiny": TINY}.get(args.models)
    sel = sel or [s.strip() for s in args.models.split(",") if s.strip()]
    make_models(args.out, sel, seed=args.seed, dtype=args.dtype, verbose=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
