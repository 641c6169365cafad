# SPDX-License-Identifier: Apache-2.0
# SPDX-FileCopyrightText: Copyright contributors to the vllm-afd project
"""The family matrices: every supported architecture through tools/models/oracle.py,
against stock vLLM (or the patched tree where a fix patch changes plain vLLM)."""

import json
import os
import sys
import time
from collections import Counter
from pathlib import Path

import preload
from helpers.oracle import LOGPROB_TOL, ORACLE, assert_micro_batched, assert_same
from hf_reference import check_patched_is_right
from servers import cpu
from stock import STOCK_DIFFERS, run_plain


# checkpoint (tools/models/make_tiny_models.py) -> its architecture
MATRIX = {
    "tiny-mixtral": "MixtralForCausalLM",
    "tiny-qwen2-moe": "Qwen2MoeForCausalLM",
    "tiny-glm4-moe": "Glm4MoeForCausalLM",
    "tiny-gpt-oss": "GptOssForCausalLM",
    "tiny-llama4": "Llama4ForCausalLM",
    "tiny-olmoe": "OlmoeForCausalLM",
    "tiny-ernie45-moe": "Ernie4_5_MoeForCausalLM",
    "tiny-phimoe": "PhiMoEForCausalLM",
    "tiny-granitemoe": "GraniteMoeForCausalLM",
    "tiny-exaone-moe": "ExaoneMoeForCausalLM",
    "tiny-glm4-moe-lite": "Glm4MoeLiteForCausalLM",
    "tiny-afmoe": "AfmoeForCausalLM",
    "tiny-hy-v3": "HYV3ForCausalLM",
    "tiny-lfm2-moe": "Lfm2MoeForCausalLM",
    "tiny-llama": "LlamaForCausalLM",
    "tiny-qwen3": "Qwen3ForCausalLM",
    "tiny-qwen2": "Qwen2ForCausalLM",
    "tiny-lfm2": "Lfm2ForCausalLM",
}


# Hybrid decoders (Gated DeltaNet linear attention beside full attention):
# vLLM's CPU GDN kernel takes bf16 only, so test_families_bf16.py runs them.
HYBRID = {
    "tiny-qwen3-next": "Qwen3NextForCausalLM",
    "tiny-qwen3.5-moe": "Qwen3_5MoeForCausalLM",
    "tiny-qwen3.5": "Qwen3_5ForCausalLM",
}


# Covered by test_oracle.py with their own checkpoints.
ELSEWHERE = {"Qwen3MoeForCausalLM": "tiny-qwen3-moe", "DeepseekV2ForCausalLM": "tiny-deepseek-v2",
             "DeepseekV3ForCausalLM": "tiny-deepseek-v3"}


def run_matrix(models_dir: Path, out: Path, names, dtype: str = "float32",
               *extra: str, env: dict | None = None) -> float:
    """Every named family's plain and AFD runs, in one oracle process (one
    start); its wall time. env: variables to add to the process's."""
    t0 = time.monotonic()
    proc = preload.run(
        [sys.executable, str(ORACLE), "--matrix", str(out), "--dtype", dtype, *extra,
         *[str(models_dir / name) for name in sorted(names)]],
        capture_output=True, text=True, timeout=900, cwd=out,
        env=dict(os.environ, VLLM_CPU_OMP_THREADS_BIND=cpu(0), **(env or {})))
    assert proc.returncode == 0, proc.stdout[-2000:] + proc.stderr[-4000:]
    return time.monotonic() - t0


def run_against_stock(models_dir: Path, out: Path, names, dtype: str = "float32", *,
                      afd_args: tuple[str, ...] = (), every_run: tuple[str, ...] = ()) -> float:
    """AFD on every named family (out/NAME.afd.json, and what afd_args ask, e.g.
    --gate-on both) and its references: stock vLLM's plain run of each
    (out/stock/) and the patched tree's where STOCK_DIFFERS (out/patched/);
    every_run: oracle arguments for all three. Its wall time."""
    t0 = time.monotonic()
    run_plain(ORACLE, out / "stock", [models_dir / n for n in sorted(names)], "--dtype", dtype,
              *every_run, cpus=cpu(0))
    run_matrix(models_dir, out, names, dtype, "--afd-only", *afd_args, *every_run)
    differs = [n for n in names if n in STOCK_DIFFERS]
    if differs:
        (out / "patched").mkdir()
        run_matrix(models_dir, out / "patched", differs, dtype, "--plain-only", *every_run)
    return time.monotonic() - t0


def reference(matrix: Path, name: str) -> dict:
    """The plain run a family's AFD runs must equal: stock vLLM's, or the
    patched tree's where a fix patch makes them differ (STOCK_DIFFERS)."""
    which = "patched" if name in STOCK_DIFFERS else "stock"
    error = matrix / which / f"{name}.error.txt"
    assert not error.exists(), error.read_text()[-4000:]
    plain = json.loads((matrix / which / f"{name}.plain.json").read_text())
    assert plain["link_stats"] is None  # plain: AFD off
    # stock: the untouched wheel's package (tools/models/stock.py), which has no AFD
    assert ("/build/stock/" in plain["vllm"]["file"]) == (which == "stock"), plain["vllm"]
    assert plain["vllm"]["afd"] == (which == "patched"), plain["vllm"]
    return plain


def check_family(models_dir: Path, matrix: Path, name: str) -> tuple[dict, dict]:
    """One family's matrix runs: AFD's greedy tokens and logprobs are its
    reference's (stock vLLM's), every layer through the link, not a degenerate
    checkpoint, the same kernels. Returns (reference, afd)."""
    model = models_dir / name
    error = matrix / f"{name}.error.txt"
    assert not error.exists(), error.read_text()[-4000:]
    plain = reference(matrix, name)
    afd = json.loads((matrix / f"{name}.afd.json").read_text())
    assert all(len(r["token_ids"]) == 16 for r in plain["results"] + afd["results"])
    assert_same(plain, afd, LOGPROB_TOL)
    assert_micro_batched(afd, model, 1)  # every layer went to the FFN engine
    # Not a degenerate checkpoint: the prompts get different continuations.
    assert len({tuple(r["token_ids"]) for r in plain["results"]}) >= 5
    # The split engines picked what plain vLLM picked (adapter/model/kernel_paths.py): the
    # attention role runs every attention layer, the FFN role every MoE layer,
    # and the two roles' linears add up to plain vLLM's.
    kp, ka, kf = plain["kernels"], afd["kernels"], afd["ffn_kernels"]
    assert (ka["attention_backends"], ka["attention_isa"]) == (
        kp["attention_backends"], kp["attention_isa"]), (kp, ka)
    assert not kf["attention_backends"] and not ka["moe_experts"], (ka, kf)
    assert kf["moe_experts"] == kp["moe_experts"], (kp, kf)
    assert dict(sorted((Counter(ka["linear"]) + Counter(kf["linear"])).items())) == (
        kp["linear"]), (kp, ka, kf)
    return plain, afd


def check_stock_difference(models_dir: Path, matrix: Path, name: str,
                           against_transformers: bool = True) -> str:
    """A STOCK_DIFFERS family: stock's plain answer really differs from the
    patched tree's (else the entry is stale), and (float32) the patched tree's
    first-token logprobs are transformers' while stock's are not."""
    stock = json.loads((matrix / "stock" / f"{name}.plain.json").read_text())
    ours = reference(matrix, name)
    pairs = list(zip(stock["results"], ours["results"], strict=True))
    tokens = sum(a["token_ids"] != b["token_ids"] for a, b in pairs)
    logprob = max(abs(x - y) for a, b in pairs for x, y in zip(a["logprobs"], b["logprobs"]))
    assert tokens or logprob > 1e-3, f"{name}: stock now answers as the patched tree " \
        f"(remove it from STOCK_DIFFERS, {STOCK_DIFFERS[name]} may have gone upstream)"
    said = f"stock differs ({tokens} of {len(pairs)} prompts' tokens, logprobs up to " \
        f"{logprob:.0e}; {STOCK_DIFFERS[name]})"
    if against_transformers:
        said += ", " + check_patched_is_right(models_dir / name, ours, stock)
    return said


def check_routed(matrix: Path, name: str, plain: dict, run: str = "afd") -> dict:
    """A gate_on "attention" run of the matrix (DIR/NAME.<run>.json) against
    plain vLLM's: the same tokens and logprobs, with routing really sent."""
    error = matrix / f"{name}.error.txt"
    assert not error.exists(), error.read_text()[-4000:]
    routed = json.loads((matrix / f"{name}.{run}.json").read_text())
    assert_same(plain, routed, LOGPROB_TOL)
    assert routed["link_stats"]["routed_calls"] > 0, routed["link_stats"]
    return routed
