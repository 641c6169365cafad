# SPDX-License-Identifier: Apache-2.0
# SPDX-FileCopyrightText: Copyright contributors to the vllm-afd project
"""An independent reference where a fix patch changes plain vLLM on purpose:
transformers' own model of a checkpoint, in float32.

The oracle records, for each prompt, the greedy tokens and the log-probability
vLLM gave each. `logprob_errors` recomputes the first token's log-probability
with transformers and returns, per prompt, how far the oracle's was: the
patched tree's must be close (its fix is right), stock's not (the bug it fixes).
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
