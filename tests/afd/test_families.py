# SPDX-License-Identifier: Apache-2.0
# SPDX-FileCopyrightText: Copyright contributors to the vllm-afd project
"""Every supported model family through AFD, token for token (the model matrix).

For each family's tiny checkpoint (tools/make_tiny_models.py): tools/oracle.py
runs AFD with both roles in one process (loopback: the FFN engine built from the
same checkpoint, only its FFN modules), and the greedy tokens must be those of
stock vLLM (the untouched pinned wheel, tools/stock.py, run plain on every
family) and logprobs within 1e-5. Where a fix patch changes plain vLLM on
purpose (tools/stock.py STOCK_DIFFERS) the reference is the patched tree's plain
run, and test_stock_differs_where_a_fix_patch_says shows stock's difference and
that the patched answer is transformers'. One process start serves every
family's runs (tools/oracle.py --matrix: each run in a child forked from it,
never torn down), so a family costs 2-4 s beyond the first. One family per FFN
group (MoE, dense) also runs against a real `vllm serve --afd-role ffn`
process over shm (test_served_family_matches_plain). Qwen3-MoE and DeepSeek are
test_oracle.py's.

And what is refused: an architecture AFD does not split, speculative
decoding, each at config time naming the model and the reason; and the patch
marks the FFN construction of every family families.py lists (a family without
its marks would run its FFN on both roles).
"""

import json
import os
from collections import Counter
import re
import sys
import time
from pathlib import Path
from types import SimpleNamespace

import pytest

import preload
from hf_reference import check_patched_is_right
from servers import cpu, free_port
from stock import STOCK_DIFFERS, run_plain
from test_oracle import (
    LOGPROB_TOL, assert_micro_batched, assert_same, ffn_server, ffn_stats, run_oracle)

from vllm.afd.model.families import (
    FFN_ATTRS, REFUSED, SUPPORTED, UnsupportedModelError, check_model)

REPO = Path(__file__).resolve().parents[2]
ORACLE = REPO / "tools" / "oracle.py"

# checkpoint (tools/make_tiny_models.py) -> its architecture
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
TIMINGS: dict[str, float] = {}


def test_every_supported_family_has_a_checkpoint_in_the_matrix():
    covered = set(MATRIX.values()) | set(HYBRID.values()) | set(ELSEWHERE)
    assert covered == set(SUPPORTED), set(SUPPORTED) ^ covered


def _upstream_module(arch: str) -> Path:
    from vllm.model_executor.models.registry import _VLLM_MODELS

    module, _ = _VLLM_MODELS[arch]
    return REPO / "vllm" / "model_executor" / "models" / f"{module}.py"


@pytest.mark.parametrize("arch", sorted(SUPPORTED))
def test_the_patch_marks_the_ffn_construction(arch):
    """Between begin_mlp() and close() the decoder layer builds exactly its
    FFN attribute, and every assignment of that attribute in the module (each
    branch: MoE and dense, each layer class) lies inside such a scope."""
    family = SUPPORTED[arch]
    path = _upstream_module(arch)
    source = path.read_text()
    scopes = list(re.finditer(r"afd_scope = afd_seams\.begin_mlp\((?:vllm_config)?\)\n(.*?)"
                              r"\n\s*afd_scope\.close\(\)", source, re.S))
    assert scopes, f"{arch}: no begin_mlp()/close() in {path.name}"
    for scope in scopes:
        built = set(re.findall(r"self\.(\w+) = ", scope.group(1)))
        assert built == {family.ffn_attr}, (arch, built)
    line = lambda offset: source.count("\n", 0, offset) + 1  # noqa: E731
    spans = [(line(m.start()), line(m.end())) for m in scopes]
    assigned = [line(m.start()) for m in
                re.finditer(rf"self\.{family.ffn_attr}\s*(?::[^=\n]*)?=[^=]", source)]
    assert assigned, f"{arch}: {path.name} never assigns self.{family.ffn_attr}"
    outside = [n for n in assigned if not any(a <= n <= b for a, b in spans)]
    assert not outside, f"{arch}: self.{family.ffn_attr} built outside begin_mlp()/close() " \
        f"at {path.name}:{outside}"
    assert family.ffn_attr in FFN_ATTRS


def _model_config(*archs: str):
    return SimpleNamespace(architectures=list(archs), model="/models/x")


@pytest.mark.parametrize("arch", ["MiMoV2FlashForCausalLM", *sorted(REFUSED)])
def test_unsupported_architecture_is_refused_with_the_reason(arch):
    with pytest.raises(UnsupportedModelError) as e:
        check_model(_model_config(arch), "attention")
    text = str(e.value)
    assert "'/models/x'" in text and arch in text and "cannot be split" in text
    assert (REFUSED[arch] if arch in REFUSED else "do not mark their FFN construction") in text
    assert "MixtralForCausalLM" in text  # the supported list


def test_an_architecture_the_release_serves_through_transformers_is_refused(monkeypatch):
    """vLLM 0.34.0 serves OLMoE through its Transformers backend (registry:
    OlmoeForCausalLM -> TransformersMoEForCausalLM), whose layers have no mark:
    AFD refuses it there (the 0.34.0 series leaves olmoe.py out)."""
    from vllm.model_executor.models import registry

    check_model(_model_config("OlmoeForCausalLM"), "attention")  # 0.32.0: its own file
    monkeypatch.setitem(registry._VLLM_MODELS, "OlmoeForCausalLM",
                        ("transformers", "TransformersMoEForCausalLM"))
    with pytest.raises(UnsupportedModelError, match="serves OlmoeForCausalLM through its "
                                                    "Transformers backend"):
        check_model(_model_config("OlmoeForCausalLM"), "attention")


def test_transformers_backend_is_refused():
    config = SimpleNamespace(architectures=["LlamaForCausalLM"], model="/models/x",
                             model_impl="transformers")
    with pytest.raises(UnsupportedModelError, match="--model-impl transformers"):
        check_model(config, "ffn")


def test_supported_family_passes():
    assert check_model(_model_config("MixtralForCausalLM"), "ffn").moe
    assert not check_model(_model_config("LlamaForCausalLM"), "attention").moe


def _engine_config(models_dir: Path, name: str, *argv: str):
    from vllm.engine.arg_utils import EngineArgs
    from vllm.utils.argparse_utils import FlexibleArgumentParser

    parser = EngineArgs.add_cli_args(FlexibleArgumentParser())
    args = EngineArgs.from_cli_args(parser.parse_args(
        ["--model", str(models_dir / name), *argv]))
    return args.create_engine_config()


def test_refusals_come_from_the_real_config(models_dir):
    """Through EngineArgs, as `vllm serve` builds it: a refused architecture,
    and speculative decoding, fail naming the model / option; the same model
    without AFD builds."""
    # pydantic wraps the error in a ValidationError (a ValueError) with its text.
    step3 = ["--hf-overrides", '{"architectures": ["Step3TextForCausalLM"]}']
    with pytest.raises(ValueError, match=r"tiny-llama.*Step3TextForCausalLM.*cannot be split"
                                         r".*two FFN modules"):
        _engine_config(models_dir, "tiny-llama", "--afd-role", "ffn", *step3)
    assert _engine_config(models_dir, "tiny-llama", *step3).afd_config is None
    assert _engine_config(models_dir, "tiny-gpt-oss", "--afd-role", "attention", "--afd-config",
                          '{"gate_on": "attention"}').afd_config.gate_on == "attention"
    spec = json.dumps({"method": "ngram", "num_speculative_tokens": 2,
                       "prompt_lookup_max": 2})
    with pytest.raises(ValueError, match="speculative decoding .* cannot be combined with AFD"):
        _engine_config(models_dir, "tiny-llama", "--afd-role", "attention",
                       "--speculative-config", spec)
    assert _engine_config(models_dir, "tiny-llama", "--speculative-config",
                          spec).speculative_config is not None


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
    # stock: the untouched wheel's package (tools/stock.py), which has no AFD
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
    # The split engines picked what plain vLLM picked (model/kernels.py): the
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


@pytest.fixture(scope="module")
def matrix(models_dir, tmp_path_factory) -> Path:
    out = tmp_path_factory.mktemp("matrix")
    TIMINGS["matrix"] = run_against_stock(models_dir, out, MATRIX)
    return out


@pytest.mark.slow
@pytest.mark.parametrize("name", sorted(MATRIX))
def test_family_matches_plain(models_dir, matrix, name, kernel_paths):
    """AFD (loopback, both roles in the oracle's process) against stock vLLM:
    the same greedy tokens and logprobs on the oracle's 10 prompts (steps mixing
    prefill and decode), every layer through the link."""
    assert json.loads((models_dir / name / "config.json").read_text())["architectures"] == [
        MATRIX[name]]
    _, afd = check_family(models_dir, matrix, name)
    against = f"patched plain ({STOCK_DIFFERS[name]})" if name in STOCK_DIFFERS else \
        "stock vLLM"
    kernel_paths.add(f"{name}: attention {'/'.join(afd['attention_backends'])}, AFD = "
                     f"{against} (matrix of {len(MATRIX)}: {TIMINGS.get('matrix', 0):.0f}s)")


@pytest.mark.slow
@pytest.mark.parametrize("name", sorted(n for n in MATRIX if n in STOCK_DIFFERS))
def test_stock_differs_where_a_fix_patch_says(models_dir, matrix, name, kernel_paths):
    kernel_paths.add(f"{name}: {check_stock_difference(models_dir, matrix, name)}")


# Every MoE family with its routers on the attention role (gate_on "attention"):
# checkpoints name the router in several ways (`gate`, `router` in gpt-oss and
# Llama 4, Granite's `router.layer`, `router.gate` in AFMoE and HunYuan V3) and
# keep a correction bias in the gate, in ERNIE's `moe_statics` or in the MoE
# block itself (EXAONE, AFMoE, HunYuan V3), all of which the attention role must
# read and route with.
ROUTED = sorted(n for n, arch in MATRIX.items() if SUPPORTED[arch].moe)


@pytest.fixture(scope="module")
def routed_matrix(models_dir, matrix, tmp_path_factory) -> Path:
    out = tmp_path_factory.mktemp("matrix-routed")
    TIMINGS["routed"] = run_matrix(models_dir, out, ROUTED, "float32",
                                   "--afd-only", "--gate-on", "attention")
    return out


@pytest.mark.slow
@pytest.mark.parametrize("name", ROUTED)
def test_family_matches_plain_with_routers_on_attention(models_dir, matrix, routed_matrix,
                                                         name, kernel_paths):
    """AFD with gate_on "attention" (loopback) against the matrix's reference:
    the routing the attention role computed and sent gives stock vLLM's tokens."""
    plain = reference(matrix, name)
    afd = check_routed(routed_matrix, name, plain)
    kernel_paths.add(f"{name} routers on attention: AFD {afd['wall_s']:.0f}s "
                     f"(of {len(ROUTED)}: {TIMINGS.get('routed', 0):.0f}s)")


# One per family group against a real FFN server, with 2 micro-batches: MoE
# (Mixtral: `block_sparse_moe`, its routers on the attention role), dense
# (Llama) and hybrid (LFM2-MoE: short convolutions with recurrent state, its
# block's own correction bias on the attention role; test_families_bf16.py
# serves Qwen3-Next). test_oracle.py serves Qwen3-MoE and DeepSeek-V3.
SERVED = [("tiny-mixtral", "attention"), ("tiny-llama", "ffn"), ("tiny-lfm2-moe", "attention")]


@pytest.mark.slow
@pytest.mark.parametrize("name, gate_on", SERVED, ids=[n for n, _ in SERVED])
def test_served_family_matches_plain(models_dir, matrix, tmp_path, name, gate_on):
    model = models_dir / name
    config = {"connector": "shm", "port": free_port(), "timeout_s": 60, "num_ubatches": 2,
              "ubatch_policy": "fixed", "gate_on": gate_on}
    # Mixtral's FFN server spawns its worker as vLLM does for users (the other
    # served cases fork it from a preloaded process: tests/conftest.py).
    spawn = {"VLLM_AFD_TEST_FORK_SPAWN": "0"} if name == "tiny-mixtral" else None
    plain = reference(matrix, name)  # stock vLLM's (or the patched tree's: STOCK_DIFFERS)
    with ffn_server(model, config, tmp_path / "ffn.log", env=spawn) as ffn:
        ffn.wait_ready()
        afd = run_oracle(model, tmp_path / "afd.json", {**config, "role": "attention"})
        served = ffn_stats(ffn)
    assert_same(plain, afd)
    assert_micro_batched(afd, model, 2)
    assert served["steps"] == afd["link_stats"]["steps"] > 0
    routed = served["routed_calls"]
    assert (routed > 0) if gate_on == "attention" else routed == 0, served
