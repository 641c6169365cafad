# SPDX-License-Identifier: Apache-2.0
# SPDX-FileCopyrightText: Copyright contributors to the vllm-afd project
"""A MoE model's shapes, as the planner needs them: parameter and byte counts per
layer for the attention side and the FFN side, KV-cache bytes per token, and the
bytes a token's hidden state takes on the link in each direction.

From a Hugging Face config.json (a file or a model directory) or a preset name.
"""

from __future__ import annotations

import json
import logging
from dataclasses import dataclass, replace
from pathlib import Path

logger = logging.getLogger(__name__)

#: bytes per element of each dtype the planner knows
DTYPE_BYTES = {"fp32": 4.0, "bf16": 2.0, "fp16": 2.0, "fp8": 1.0}
#: fp8 transfer carries one float32 scale per this many elements (vllm-afd's format)
FP8_SCALE_GROUP = 128


def dtype_bytes(dtype: str) -> float:
    try:
        return DTYPE_BYTES[dtype]
    except KeyError:
        raise ValueError(f"unknown dtype {dtype!r}; one of {sorted(DTYPE_BYTES)}") from None


def transfer_bytes_per_token(hidden: int, dtype: str, with_scales: bool = True) -> float:
    """Bytes of one token's hidden state on the link. fp8 adds a float32 scale per
    128 elements (+3.1 %), as the op library packs it; with_scales=False gives the
    bare payload (what Step-3's published arithmetic counts)."""
    payload = hidden * dtype_bytes(dtype)
    if dtype == "fp8" and with_scales:
        payload += -(-hidden // FP8_SCALE_GROUP) * 4
    return payload


@dataclass(frozen=True)
class ModelShape:
    name: str
    hidden: int
    layers: int
    vocab: int
    # attention: GQA (heads, kv_heads, head_dim) or MLA (kv_lora_rank > 0)
    heads: int
    kv_heads: int
    head_dim: int
    q_lora_rank: int = 0  # low-rank query (DeepSeek MLA, Step-3 MFA's share_q_dim)
    kv_lora_rank: int = 0  # MLA: the compressed KV the cache holds
    qk_nope_head_dim: int = 0
    qk_rope_head_dim: int = 0
    v_head_dim: int = 0
    # MLP / MoE
    experts: int = 0
    top_k: int = 0
    moe_intermediate: int = 0
    shared_intermediate: int = 0  # all shared experts together (0: none)
    dense_layers: int = 0  # layers with a dense MLP instead of experts
    dense_intermediate: int = 0
    # dtypes
    weight_dtype: str = "bf16"
    kv_dtype: str = "bf16"
    a2f_dtype: str = "bf16"  # attention -> FFN transfer
    f2a_dtype: str = "bf16"  # FFN -> attention transfer

    @property
    def is_mla(self) -> bool:
        return self.kv_lora_rank > 0

    @property
    def moe_layers(self) -> int:
        return self.layers - self.dense_layers

    @property
    def weight_bytes(self) -> float:
        return dtype_bytes(self.weight_dtype)

    # ---- attention side, per layer
    def attention_params(self) -> int:
        """Projection weights of one attention layer (q, k, v, o or MLA's)."""
        h = self.hidden
        if self.is_mla:
            qk_head = self.qk_nope_head_dim + self.qk_rope_head_dim
            q = (h * self.q_lora_rank + self.q_lora_rank * self.heads * qk_head
                 if self.q_lora_rank else h * self.heads * qk_head)
            kv_down = h * (self.kv_lora_rank + self.qk_rope_head_dim)
            kv_up = self.kv_lora_rank * self.heads * (self.qk_nope_head_dim + self.v_head_dim)
            o = self.heads * self.v_head_dim * h
            return q + kv_down + kv_up + o
        q_out = self.heads * self.head_dim
        q = h * self.q_lora_rank + self.q_lora_rank * q_out if self.q_lora_rank else h * q_out
        kv = 2 * h * self.kv_heads * self.head_dim
        return q + kv + q_out * h

    def kv_elements_per_token(self) -> int:
        """KV-cache elements one token keeps per layer."""
        if self.is_mla:
            return self.kv_lora_rank + self.qk_rope_head_dim
        return 2 * self.kv_heads * self.head_dim

    def kv_bytes_per_token(self) -> float:
        return self.kv_elements_per_token() * dtype_bytes(self.kv_dtype)

    def attention_core_flops_per_token(self, context: int) -> float:
        """Scores and weighted sum over `context` cached tokens, one decode token,
        one layer. MLA decodes in the absorbed form: every head attends over the
        latent (kv_lora_rank + rope) and sums the latent (kv_lora_rank)."""
        if self.is_mla:
            per_head = (self.kv_lora_rank + self.qk_rope_head_dim) + self.kv_lora_rank
        else:
            per_head = 2 * self.head_dim
        return 2.0 * self.heads * per_head * context

    def embedding_params(self) -> int:
        """Input embedding and LM head (untied), read by the attention side."""
        return 2 * self.vocab * self.hidden

    # ---- FFN side, per layer
    def expert_params(self) -> int:
        """One routed expert: gate, up and down projections."""
        return 3 * self.hidden * self.moe_intermediate

    def shared_params(self) -> int:
        return 3 * self.hidden * self.shared_intermediate

    def router_params(self) -> int:
        return self.hidden * self.experts

    def dense_mlp_params(self) -> int:
        return 3 * self.hidden * self.dense_intermediate

    def ffn_weight_bytes(self) -> float:
        """All FFN-side weights of the model (what the FFN devices must hold)."""
        moe = self.moe_layers * (self.experts * self.expert_params() + self.shared_params()
                                 + self.router_params())
        return (moe + self.dense_layers * self.dense_mlp_params()) * self.weight_bytes

    def attention_weight_bytes(self) -> float:
        """What every attention device holds: all layers' attention and the embeddings."""
        return (self.layers * self.attention_params() + self.embedding_params()) * self.weight_bytes

    def a2f_bytes_per_token(self) -> float:
        return transfer_bytes_per_token(self.hidden, self.a2f_dtype)

    def f2a_bytes_per_token(self) -> float:
        return transfer_bytes_per_token(self.hidden, self.f2a_dtype)

    def with_dtypes(self, **dtypes: str | None) -> ModelShape:
        changes = {k: v for k, v in dtypes.items() if v}
        for v in changes.values():
            dtype_bytes(v)
        return replace(self, **changes)


# Built-in shapes, from each model's published config.json.
PRESETS: dict[str, ModelShape] = {
    # deepseek-ai/DeepSeek-V3 config.json: MLA, 256 experts top-8, 1 shared, 3 dense
    # layers; weights fp8 as released (block-quantized).
    "deepseek-v3": ModelShape(
        name="deepseek-v3", hidden=7168, layers=61, vocab=129280, heads=128, kv_heads=128,
        head_dim=192, q_lora_rank=1536, kv_lora_rank=512, qk_nope_head_dim=128,
        qk_rope_head_dim=64, v_head_dim=128, experts=256, top_k=8, moe_intermediate=2048,
        shared_intermediate=2048, dense_layers=3, dense_intermediate=18432,
        weight_dtype="fp8", a2f_dtype="fp8"),
    # Qwen/Qwen3-235B-A22B config.json: GQA 64/4 heads of 128, 128 experts top-8.
    "qwen3-235b-a22b": ModelShape(
        name="qwen3-235b-a22b", hidden=4096, layers=94, vocab=151936, heads=64, kv_heads=4,
        head_dim=128, experts=128, top_k=8, moe_intermediate=1536, weight_dtype="bf16"),
    # stepfun-ai/step3 config.json: MFA (64 query heads of 256 on one KV head, low-rank
    # query 2048), 48 experts top-3 + 1 shared (5120), MoE on layers 4-59 (5 dense);
    # deployed with fp8 weights, fp8 A->F and bf16 F->A (the Step-3 paper).
    "step3": ModelShape(
        name="step3", hidden=7168, layers=61, vocab=128815, heads=64, kv_heads=1, head_dim=256,
        q_lora_rank=2048, experts=48, top_k=3, moe_intermediate=5120, shared_intermediate=5120,
        dense_layers=5, dense_intermediate=18432, weight_dtype="fp8", a2f_dtype="fp8"),
    # The repo's benchmark model (tools/models/make_tiny_models.py bench-qwen3-moe).
    "bench-qwen3-moe": ModelShape(
        name="bench-qwen3-moe", hidden=2048, layers=8, vocab=1024, heads=16, kv_heads=4,
        head_dim=128, experts=16, top_k=4, moe_intermediate=384, weight_dtype="bf16"),
}


def _first(cfg: dict, *keys: str, default=None):
    for k in keys:
        if cfg.get(k) is not None:
            return cfg[k]
    return default


def _weight_dtype(cfg: dict) -> str:
    quant = cfg.get("quantization_config") or {}
    if "fp8" in str(quant.get("quant_method", "")).lower() or "e4m3" in str(quant.get("fmt", "")):
        return "fp8"
    torch_dtype = str(_first(cfg, "torch_dtype", "dtype", default="bfloat16"))
    return {"float32": "fp32", "float16": "fp16"}.get(torch_dtype, "bf16")


def _dense_layers(cfg: dict, layers: int, is_moe: bool) -> int:
    if not is_moe:
        return layers
    enum = cfg.get("moe_layers_enum")  # Step-3: "4,5,...,59"
    if enum is not None:
        moe = {int(x) for x in str(enum).split(",") if str(x).strip()} if isinstance(enum, str) \
            else {int(x) for x in enum}
        return layers - len(moe)
    dense = int(cfg.get("first_k_dense_replace") or 0)
    dense += len([i for i in cfg.get("mlp_only_layers") or [] if i >= dense])
    step = int(cfg.get("decoder_sparse_step") or 1)
    if step > 1:  # Qwen-MoE: every step-th layer is MoE
        dense = layers - layers // step
    return dense


def from_hf_config(cfg: dict, name: str = "model") -> ModelShape:
    """The shape a Hugging Face config.json describes (DeepSeek-V2/V3, Qwen2/3-MoE,
    Mixtral, Step-3 and others with the usual keys)."""
    if isinstance(cfg.get("text_config"), dict):  # multimodal wrappers (Step-3)
        cfg = {**cfg, **cfg["text_config"]}
    hidden = int(cfg["hidden_size"])
    layers = int(cfg["num_hidden_layers"])
    heads = int(cfg["num_attention_heads"])
    kv_heads = int(_first(cfg, "num_key_value_heads", "num_attention_groups", default=heads))
    head_dim = int(_first(cfg, "head_dim", default=hidden // heads))
    experts = int(_first(cfg, "n_routed_experts", "num_experts", "num_local_experts",
                         "moe_num_experts", default=0))
    top_k = int(_first(cfg, "num_experts_per_tok", "moe_top_k", default=0)) if experts else 0
    moe_inter = int(_first(cfg, "moe_intermediate_size", "intermediate_size", default=0))
    shared = int(_first(cfg, "share_expert_dim", default=0))
    if not shared and cfg.get("n_shared_experts"):
        shared = int(cfg["n_shared_experts"]) * moe_inter
    if not shared and cfg.get("shared_expert_intermediate_size"):  # Qwen2-MoE
        shared = int(cfg["shared_expert_intermediate_size"])
    dense = _dense_layers(cfg, layers, experts > 0)
    weight = _weight_dtype(cfg)
    shape = ModelShape(
        name=name, hidden=hidden, layers=layers, vocab=int(cfg.get("vocab_size", 0)),
        heads=heads, kv_heads=kv_heads, head_dim=head_dim,
        q_lora_rank=int(_first(cfg, "q_lora_rank", "share_q_dim", default=0) or 0),
        kv_lora_rank=int(cfg.get("kv_lora_rank") or 0),
        qk_nope_head_dim=int(cfg.get("qk_nope_head_dim") or 0),
        qk_rope_head_dim=int(cfg.get("qk_rope_head_dim") or 0),
        v_head_dim=int(cfg.get("v_head_dim") or 0),
        experts=experts, top_k=top_k, moe_intermediate=moe_inter if experts else 0,
        shared_intermediate=shared, dense_layers=dense,
        dense_intermediate=int(cfg.get("intermediate_size") or 0),
        weight_dtype=weight, a2f_dtype="fp8" if weight == "fp8" else "bf16",
        f2a_dtype="bf16")
    logger.debug("model shape from config: %s", shape)
    return shape


def load_model(spec: str) -> ModelShape:
    """A preset name, or a config.json path (or the directory holding it)."""
    if spec in PRESETS:
        return PRESETS[spec]
    path = Path(spec)
    if path.is_dir():
        path = path / "config.json"
    if not path.is_file():
        raise ValueError(f"{spec!r} is neither a preset ({', '.join(PRESETS)}) nor a "
                         "config.json (or a directory with one)")
    return from_hf_config(json.loads(path.read_text()), name=path.parent.name or path.stem)
