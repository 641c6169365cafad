# SPDX-License-Identifier: Apache-2.0
# SPDX-FileCopyrightText: Copyright contributors to the vllm-afd project
"""The model architectures AFD splits, and why others are refused (adapter).

An architecture is supported when its decoder layer is an attention module
(`self_attn`, or in the hybrid Qwen3-Next / Qwen3.5 / LFM2 a Gated DeltaNet
`linear_attn` or short convolution on some layers) + one FFN module (the
sparse MoE block, or a dense MLP) that is called as
`hidden_states = ffn(hidden_states)`, and the
upstream code that builds that
module is marked with `afd_seams.begin_mlp()` ... `afd_scope.close()`
(patches/feat_models_mark_mlp_construction.patch). The module's attribute is
one of FFN_ATTRS; checkpoint and module names of the FFN are
`...layers.N.<attr>.*` (model/split.py).

check_model() runs when the VllmConfig is built (compat.check_vllm_config), so
an unsupported model fails at start-up with its name and the reason, on both
roles, before any weight is read.

Adding a model: mark its FFN construction in the patch, add a Family here, a
tiny checkpoint to tools/models/make_tiny_models.py and a row to the oracle matrix
(tests/afd/e2e/test_families.py); README "Supported models" lists them.
"""

from dataclasses import dataclass

# Attribute names decoder layers give their FFN module, across the families.
FFN_ATTRS = ("mlp", "block_sparse_moe", "feed_forward")


@dataclass(frozen=True)
class Family:
    name: str  # for people: the README table and errors
    ffn_attr: str
    # Dense families have no router: gate_on has nothing to move there. Every MoE
    # family's router can run on the attention role (model/routing.py).
    moe: bool


SUPPORTED: dict[str, Family] = {
    "Qwen3MoeForCausalLM": Family("Qwen3-MoE", "mlp", True),
    "DeepseekV2ForCausalLM": Family("DeepSeek-V2", "mlp", True),
    "DeepseekV3ForCausalLM": Family("DeepSeek-V3", "mlp", True),
    "MixtralForCausalLM": Family("Mixtral", "block_sparse_moe", True),
    "Qwen2MoeForCausalLM": Family("Qwen2-MoE", "mlp", True),
    "Glm4MoeForCausalLM": Family("GLM-4.5/4.6 MoE", "mlp", True),
    "GptOssForCausalLM": Family("gpt-oss", "mlp", True),
    "Llama4ForCausalLM": Family("Llama 4 (text)", "feed_forward", True),
    "OlmoeForCausalLM": Family("OLMoE", "mlp", True),
    "Ernie4_5_MoeForCausalLM": Family("ERNIE 4.5 MoE", "mlp", True),
    "PhiMoEForCausalLM": Family("Phi-3.5-MoE", "block_sparse_moe", True),
    "GraniteMoeForCausalLM": Family("Granite MoE", "block_sparse_moe", True),
    "ExaoneMoeForCausalLM": Family("EXAONE MoE", "mlp", True),
    "Glm4MoeLiteForCausalLM": Family("GLM-4.7-Flash", "mlp", True),
    "AfmoeForCausalLM": Family("AFMoE", "mlp", True),
    "HYV3ForCausalLM": Family("HunYuan V3", "mlp", True),
    "Qwen3NextForCausalLM": Family("Qwen3-Next", "mlp", True),
    "Qwen3_5MoeForCausalLM": Family("Qwen3.5 MoE (text)", "mlp", True),
    "Lfm2MoeForCausalLM": Family("LFM2-MoE", "feed_forward", True),
    "LlamaForCausalLM": Family("Llama (dense)", "mlp", False),
    "Qwen3ForCausalLM": Family("Qwen3 (dense)", "mlp", False),
    "Qwen2ForCausalLM": Family("Qwen2 / Qwen2.5 (dense)", "mlp", False),
    "Qwen3_5ForCausalLM": Family("Qwen3.5 (dense, text)", "mlp", False),
    "Lfm2ForCausalLM": Family("LFM2 (dense)", "feed_forward", False),
}

def _text_model_only(text_arch: str) -> str:
    return ("AFD is checked on Qwen3.5's text model only, not yet with its vision encoder; "
            f"serve the text model (--hf-overrides '{{\"architectures\": [\"{text_arch}\"]}}' "
            "with a text-only checkpoint)")


# Architectures people ask for that AFD refuses, and why (others: not opted in).
REFUSED: dict[str, str] = {
    "Llama4ForConditionalGeneration": (
        "the multimodal Llama 4 model also has a vision encoder whose layers AFD does not "
        "split; serve the text model (--hf-overrides "
        "'{\"architectures\": [\"Llama4ForCausalLM\"]}' with a text-only checkpoint)"),
    "DbrxForCausalLM": (
        "its blocks keep the FFN inside `norm_attn_norm`/`ffn` under transformer.blocks, not "
        "a decoder layer's self_attn + mlp"),
    "MiniCPMForCausalLM": (
        "its MoE layer places its experts on the device itself, outside the construction "
        "scope AFD marks"),
    "GraniteMoeSharedForCausalLM": "its decoder layer has two FFN modules (MoE and shared MLP)",
    "JambaForCausalLM": (
        "not checked with AFD: its Mamba-1 layers run on vLLM's Triton kernels only, which "
        "the CPU builds AFD is checked on lack"),
    "Step3TextForCausalLM": (
        "its MoE layers have two FFN modules (`moe` and `share_expert`) whose outputs the "
        "decoder layer adds"),
    "Gemma4ForCausalLM": (
        "its decoder layer runs its MLP and, in the MoE variants, a router and experts beside "
        "it (two FFN modules)"),
    "LongcatFlashForCausalLM": (
        "its decoder layer has two MLPs (`mlps`) and a shortcut-connected MoE (`mlp`)"),
    "Qwen3_5MoeForConditionalGeneration": _text_model_only("Qwen3_5MoeForCausalLM"),
    "Qwen3_5ForConditionalGeneration": _text_model_only("Qwen3_5ForCausalLM"),
    **dict.fromkeys(("DeepseekV4ForCausalLM", "DeepseekV4ForConditionalGeneration"), (
        "its first MoE layers route each token by its id (`ffn(x, input_ids)`, a hash "
        "router), and AFD sends the FFN role hidden states only")),
}


class UnsupportedModelError(ValueError):
    """The model cannot run with AFD; the message names it and says why."""


def family_of(architectures) -> Family | None:
    for arch in architectures or []:
        if arch in SUPPORTED:
            return SUPPORTED[arch]
    return None


def _served_by_transformers(arch: str) -> bool:
    """vLLM's registry maps the architecture to its Transformers backend (no
    marked FFN construction), not to a model file of its own."""
    from vllm.model_executor.models.registry import _VLLM_MODELS

    return _VLLM_MODELS.get(arch, ("",))[0] == "transformers"


def check_model(model_config, role: str) -> Family:
    """The Family of model_config's architecture, or UnsupportedModelError."""
    archs = list(getattr(model_config, "architectures", None) or [])
    model = getattr(model_config, "model", "?")
    family = family_of(archs)
    where = f"--afd-role {role}: model {model!r} ({', '.join(archs) or 'no architecture'})"
    if family is None:
        reasons = [REFUSED[a] for a in archs if a in REFUSED]
        why = reasons[0] if reasons else (
            "its decoder layers do not mark their FFN construction for AFD "
            "(vllm/afd/adapter/model/families.py lists the supported architectures and how to add one)")
        raise UnsupportedModelError(
            f"{where} cannot be split between attention and FFN servers: {why}. "
            f"Supported: {', '.join(sorted(SUPPORTED))}")
    backend = [a for a in archs if _served_by_transformers(a)]
    if backend:
        raise UnsupportedModelError(
            f"{where} cannot be split between attention and FFN servers: this vLLM release "
            f"serves {backend[0]} through its Transformers backend (as of vLLM 0.34.0, "
            f"OLMoE), whose decoder layers AFD does not mark")
    impl = getattr(model_config, "model_impl", "auto")
    impl = getattr(impl, "value", impl)
    if impl not in ("auto", "vllm"):
        raise UnsupportedModelError(
            f"{where} cannot be split with --model-impl {impl}: AFD marks the FFN "
            f"construction of vLLM's own model classes only. Use --model-impl vllm (or auto).")
    return family
