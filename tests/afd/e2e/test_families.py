# SPDX-License-Identifier: Apache-2.0
# SPDX-FileCopyrightText: Copyright contributors to the vllm-afd project
"""Every supported model family through AFD, token for token (the model matrix).

For each family's tiny checkpoint (tools/models/make_tiny_models.py): tools/models/oracle.py
runs AFD with both roles in one process (loopback: the FFN engine built from the
same checkpoint, only its FFN modules), and the greedy tokens must be those of
stock vLLM (the untouched pinned wheel, tools/models/stock.py, run plain on every
family) and logprobs within 1e-5. Where a fix patch changes plain vLLM on
purpose (tools/models/stock.py STOCK_DIFFERS) the reference is the patched tree's plain
run, and test_stock_differs_where_a_fix_patch_says shows stock's difference and
that the patched answer is transformers'. One process start serves every
family's runs (tools/models/oracle.py --matrix: each run in a child forked from it,
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
import re
from pathlib import Path
from types import SimpleNamespace

import pytest

from servers import free_port
from stock import STOCK_DIFFERS

from vllm.afd.adapter.model.families import (
    FFN_ATTRS, REFUSED, SUPPORTED, UnsupportedModelError, check_model)
from helpers.families import ELSEWHERE, HYBRID, MATRIX, check_family, check_routed, check_stock_difference, reference, run_against_stock, run_matrix
from helpers.oracle import assert_micro_batched, assert_same, ffn_server, ffn_stats, run_oracle

REPO = Path(__file__).resolve().parents[3]
ORACLE = REPO / "tools" / "models" / "oracle.py"

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
