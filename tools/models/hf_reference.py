# SPDX-License-Identifier: Apache-2.0
# SPDX-FileCopyrightText: Copyright contributors to the vllm-afd project
"""Independent references: transformers' own model of a checkpoint, in float32,
and the fp8 transfer codec in plain torch.

Where a fix patch changes plain vLLM on purpose: the oracle records, for each
prompt, the greedy tokens and the log-probability vLLM gave each.
`logprob_errors` recomputes the first token's log-probability with
transformers and returns, per prompt, how far the oracle's was: the patched
tree's must be close (its fix is right), stock's not (the bug it fixes).

fp8 transfer (docs/fp8.md): `fp8_round_trip` is the codec as its format is
stated, and `teacher_forced` runs transformers' model with it hooked in where
AFD quantizes, so an AFD run with transfer_dtype "fp8" can be held to the same
model with the same quantization, not to a bound on its distance from plain.
"""

from __future__ import annotations

from pathlib import Path


def logprob_errors(model: Path, result: dict) -> list[float]:
    """|oracle first-token logprob - transformers'| for each prompt of an oracle
    result, the token being the one the oracle's engine chose."""
    import torch
    from transformers import AutoModelForCausalLM, AutoTokenizer

    tokenizer = AutoTokenizer.from_pretrained(model)
    hf = AutoModelForCausalLM.from_pretrained(model, dtype=torch.float32).eval()
    errors = []
    for r in result["results"]:
        ids = tokenizer(r["prompt"], return_tensors="pt").input_ids
        with torch.no_grad():
            logprobs = torch.log_softmax(hf(ids).logits[0, -1].float(), -1)
        errors.append(abs(r["logprobs"][0] - float(logprobs[r["token_ids"][0]])))
    return errors


def check_patched_is_right(model: Path, ours: dict, stock: dict) -> str:
    """Where a fix patch makes the patched tree's plain answer differ from stock's:
    ours is transformers' (first-token logprobs within 1e-4), stock's is not.
    Returns the figures, for the report."""
    ours_off, stock_off = logprob_errors(model, ours), logprob_errors(model, stock)
    assert max(ours_off) < 1e-4, ours_off
    assert max(stock_off) > 1e-4, stock_off
    return (f"transformers' first-token logprobs: ours within {max(ours_off):.0e}, "
            f"stock {max(stock_off):.0e} off")


# --------------------------------------------------------------- fp8 transfer
# AFDConfig.transfer_dtype "fp8", written again in plain torch from its stated
# format only (docs/fp8.md), not from vllm/afd: each token's hidden state in
# groups of FP8_GROUP elements (the last one zero-padded), one float32 scale per
# group = the group's largest |x| / 448 (1 for an all-zero group), the elements
# as float8 e4m3fn of x / scale (IEEE division, round to nearest even), and
# back as e4m3 * scale in float32, then the model's dtype.
FP8_GROUP = 128
FP8_E4M3_MAX = 448.0  # the largest finite float8 e4m3fn


def fp8_encode(x, group: int = FP8_GROUP, fp8_max: float = FP8_E4M3_MAX):
    """x [tokens, hidden] as the wire carries it: (e4m3 bytes [tokens, hidden]
    as uint8, float32 scales [tokens, groups])."""
    import torch

    tokens, hidden = x.shape
    groups = -(-hidden // group)
    xg = torch.nn.functional.pad(x.float(), (0, groups * group - hidden)).view(
        tokens, groups, group)
    amax = xg.abs().amax(-1)
    scale = torch.where(amax > 0, amax / torch.full_like(amax, fp8_max), torch.ones_like(amax))
    q = (xg / scale[..., None]).to(torch.float8_e4m3fn).view(tokens, groups * group)
    return q[:, :hidden].contiguous().view(torch.uint8), scale


def fp8_decode(q, scale, dtype, group: int = FP8_GROUP):
    """fp8_encode's (bytes, scales) back to a tensor of dtype."""
    import torch

    hidden = q.shape[1]
    full = scale.repeat_interleave(group, dim=1)[:, :hidden]
    return (q.view(torch.float8_e4m3fn).float() * full).to(dtype)


def fp8_round_trip(x, group: int = FP8_GROUP, fp8_max: float = FP8_E4M3_MAX):
    """x [..., hidden] through the fp8 codec and back (same shape and dtype)."""
    flat = x.reshape(-1, x.shape[-1])
    q, scale = fp8_encode(flat, group, fp8_max)
    return fp8_decode(q, scale, x.dtype, group).reshape(x.shape)


def decoder_mlps(hf) -> list:
    """Each decoder layer's mlp (what AFD's FFN role runs: the attention role
    sends its input, after the post-attention norm, and gets its output back)."""
    return [layer.mlp for layer in hf.model.layers]


def with_fp8_transfer(hf, to_ffn: bool = True, to_attention: bool = True,
                      round_trip=fp8_round_trip):
    """Hooks on hf's decoder mlps that pass their input (to_ffn) and output
    (to_attention) through round_trip, where AFD quantizes; returns the handles
    (.remove() each to undo)."""
    handles = []
    for mlp in decoder_mlps(hf):
        if to_ffn:
            handles.append(mlp.register_forward_pre_hook(
                lambda _m, args: (round_trip(args[0]), *args[1:])))
        if to_attention:
            handles.append(mlp.register_forward_hook(
                lambda _m, _args, out: round_trip(out) if not isinstance(out, tuple)
                else (round_trip(out[0]), *out[1:])))
    return handles


def teacher_forced(model: Path, result: dict, to_ffn: bool = True,
                   to_attention: bool = True, round_trip=fp8_round_trip,
                   hf=None) -> list[dict]:
    """transformers' float32 model, with fp8 transfer hooked in as AFD applies it,
    fed each prompt of an oracle result followed by the tokens the oracle's
    engine chose: per prompt, the log-probability of each of those tokens
    ("logprobs") and the greedy token at each position ("greedy"). Both
    directions off: the plain model."""
    import torch
    from transformers import AutoModelForCausalLM, AutoTokenizer

    tokenizer = AutoTokenizer.from_pretrained(model)
    hf = hf or AutoModelForCausalLM.from_pretrained(model, dtype=torch.float32).eval()
    handles = with_fp8_transfer(hf, to_ffn, to_attention, round_trip)
    out = []
    try:
        for r in result["results"]:
            prompt = tokenizer(r["prompt"], return_tensors="pt").input_ids
            generated = torch.tensor([r["token_ids"]])
            ids = torch.cat([prompt, generated[:, :-1]], dim=1)
            with torch.no_grad():
                logits = hf(ids).logits[0, prompt.shape[1] - 1:].float()
            logprobs = torch.log_softmax(logits, -1)
            out.append({"logprobs": logprobs.gather(1, generated.T).view(-1).tolist(),
                        "greedy": logprobs.argmax(-1).tolist()})
    finally:
        for h in handles:
            h.remove()
    return out
