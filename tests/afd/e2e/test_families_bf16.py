# SPDX-License-Identifier: Apache-2.0
# SPDX-FileCopyrightText: Copyright contributors to the vllm-afd project
"""The model matrix in bfloat16, the dtype users serve, where the CPU kinds differ.

vLLM's CPU backend picks kernels by host and dtype. In float32 (the rest of the
suite) every x86 host runs oneDNN GEMMs, the vector attention and the portable
MoE experts. In bfloat16 an Intel host with AMX tiles runs others: SGL's AMX
GEMM for small linears (every linear of a tiny checkpoint), the AMX attention
ISA, AMX_MLA for DeepSeek and the AMX grouped-GEMM experts where their shapes
allow; AMD and AVX2 hosts keep oneDNN and the vector kernels. So this module is
the family matrix that proves AFD on each CPU kind's own kernels: every
supported architecture's checkpoint (helpers.families.MATRIX and ELSEWHERE)
through plain vLLM and AFD (loopback, one process for all), token-exact with
logprobs within 1e-5; the two AFD roles' kernels (vllm/afd/adapter/model/kernel_paths.py)
together those plain vLLM ran (as in float32); and the AMX kernels really ran on an AMX host,
and none elsewhere. The hybrid families (helpers.families.HYBRID: Gated DeltaNet
layers, whose CPU kernel takes bf16 only) are here alone, in a process of their
own, with routers on either role. Qwen2-MoE and Qwen3-Next are also served with
2 micro-batches, and on hosts with AVX512-BF16 but no AMX five families run
with AMX's linear kernel.
"""

import time
from pathlib import Path

import pytest
import torch

from selection import selected
from servers import free_port
from stock import STOCK_DIFFERS

from vllm.afd.adapter.model.families import SUPPORTED
from helpers.families import ELSEWHERE, HYBRID, MATRIX, check_family, check_routed, check_stock_difference, reference, run_against_stock, run_matrix
from helpers.oracle import assert_micro_batched, assert_same, ffn_server, ffn_stats, run_oracle

pytestmark = pytest.mark.slow

DTYPE = "bfloat16"
NAMES = sorted({*MATRIX, *ELSEWHERE.values()})
# `make test` runs one family of each kind of bf16 path: the test model, a dense
# one, MLA (CPU_MLA), attention sinks and biases (GPT-OSS), a shared expert
# (Qwen2-MoE, served below), oneDNN's linear (HunYuan), a short-conv hybrid;
# the two fix patches' stock differences; every hybrid. The other 14 families'
# bf16 paths are these (their fp32 matrix, test_families.py, runs every one):
# `make test-full` runs them all.
CORE = {"tiny-qwen3-moe", "tiny-llama", "tiny-deepseek-v3", "tiny-gpt-oss",
        "tiny-qwen2-moe", "tiny-hy-v3", "tiny-lfm2-moe"}
MATRIX_TESTS = ("test_family_matches_plain_in_bf16",
                "test_stock_differs_in_bf16_where_a_fix_patch_says",
                "test_served_moe_family_in_bf16_with_micro_batches")


def core_or_full(names) -> list:
    return [n if n in CORE or n in HYBRID else pytest.param(n, marks=pytest.mark.full)
            for n in names]
AMX = torch.cpu._is_amx_tile_supported()
TIMINGS: dict[str, float] = {}
# Qwen3.5's vLLM module imports torchvision (through Qwen3-VL's): the hybrid
# families run with this import-only stand-in on the path (its docstring).
STAND_INS = Path(__file__).resolve().parents[2] / "stand_ins"


@pytest.fixture(scope="module")
def matrix(models_dir, tmp_path_factory, request):
    """The selected families' runs (all NAMES under `make test-full`)."""
    out = tmp_path_factory.mktemp("matrix-bf16")
    names = selected(request, "name", NAMES, MATRIX_TESTS)
    TIMINGS["matrix"] = run_against_stock(models_dir, out, names, DTYPE)
    TIMINGS["matrix of"] = len(names)
    return out


@pytest.fixture(scope="module")
def hybrid_matrix(models_dir, tmp_path_factory):
    """The hybrid families (bf16 only), each MoE one also with its routers on
    the attention role (NAME.routed.json), in one process of their own."""
    out = tmp_path_factory.mktemp("matrix-bf16-hybrid")
    TIMINGS["hybrid"] = run_against_stock(models_dir, out, HYBRID, DTYPE,
                                          afd_args=("--gate-on", "both"),
                                          every_run=("--stand-ins", str(STAND_INS)))
    return out


@pytest.mark.parametrize("name", core_or_full(NAMES + sorted(HYBRID)))
def test_family_matches_plain_in_bf16(models_dir, request, name, kernel_paths):
    matrix = request.getfixturevalue("hybrid_matrix" if name in HYBRID else "matrix")
    plain, afd = check_family(models_dir, matrix, name)
    assert plain["amx"] == afd["amx"] == AMX
    assert plain["dtype"] == afd["dtype"] == "torch.bfloat16"
    kp = plain["kernels"]  # the roles ran the same kernels: check_family
    # Each host's own kernels: AMX's where the CPU has its tiles, none elsewhere.
    mla = kp["attention_backends"] in (["CPU_MLA"], ["AMX_MLA"])
    if AMX:
        assert "sgl" in kp["linear"], kp
        assert (kp["attention_backends"] == ["AMX_MLA"]) if mla else (
            "amx" in kp["attention_isa"]), kp
    else:
        assert "sgl" not in kp["linear"] and "amx" not in kp["attention_isa"], kp
        assert not any("amx" in e for e in kp["moe_experts"]), kp
    of = f"bf16 matrix of {TIMINGS.get('matrix of', 0)}: {TIMINGS.get('matrix', 0):.0f}s"
    if name in HYBRID:
        of = f"hybrid matrix of {len(HYBRID)}: {TIMINGS.get('hybrid', 0):.0f}s"
        moe = SUPPORTED[HYBRID[name]].moe
        assert (matrix / f"{name}.routed.json").exists() == moe
        if moe:  # the routers on the attention role, same tokens
            check_routed(matrix, name, plain, "routed")
            of = "routers on either role, " + of
    against = f"patched plain ({STOCK_DIFFERS[name]})" if name in STOCK_DIFFERS else \
        "stock vLLM"
    kernel_paths.add(
        f"{name} bf16: attention {'/'.join(kp['attention_backends'] + kp['attention_isa'])}, "
        f"linear {kp['linear']}, experts {kp['moe_experts'] or '-'}; AFD = {against} "
        f"({of})")


@pytest.mark.parametrize("name", core_or_full(n for n in NAMES if n in STOCK_DIFFERS))
def test_stock_differs_in_bf16_where_a_fix_patch_says(models_dir, matrix, name, kernel_paths):
    """The same fix patches part stock from the patched tree in bf16 (transformers'
    check is float32's: test_families.py, test_stock_reference.py)."""
    said = check_stock_difference(models_dir, matrix, name, against_transformers=False)
    kernel_paths.add(f"{name} bf16: {said}")


# Micro-batches give the FFN's kernels fewer rows than plain vLLM's. With oneDNN
# and the vector kernels a row's result does not depend on the rows beside it
# (served with m = 2 in bf16 on an AMD Zen 5 VM: every family here exact but
# DeepSeek's MLA). SGL's AMX GEMM switches kernels above 4 rows, which may round
# a row differently: not yet run on an AMX host. There, and only there, tokens
# that differ are an expected failure; anything else (a server that did not
# serve, no micro-batches, no routed calls) fails on every host.
AMX_ROWS = ("AMX host: SGL's bf16 GEMM takes another kernel above 4 rows, so a "
            "micro-batch may round differently from the whole batch (not yet measured)")


@pytest.mark.parametrize("name, gate_on", [("tiny-qwen2-moe", "ffn"),
                                           ("tiny-qwen3-next", "attention")])
def test_served_moe_family_in_bf16_with_micro_batches(models_dir, request, tmp_path, name,
                                                      gate_on, kernel_paths):
    """Against a real FFN server over shm, 2 micro-batches, bf16 on both roles:
    Qwen2-MoE (shared expert, its gate and the routed experts on the FFN), and
    the hybrid family group's Qwen3-Next (each micro-batch's Gated DeltaNet
    state and attention metadata sliced by vLLM) with its routers on the
    attention role."""
    model = models_dir / name
    config = {"connector": "shm", "port": free_port(), "timeout_s": 60, "num_ubatches": 2,
              "ubatch_policy": "fixed", "gate_on": gate_on}
    t0 = time.monotonic()
    # The bf16 matrix's reference: stock vLLM's plain run.
    plain = reference(request.getfixturevalue("hybrid_matrix" if name in HYBRID else "matrix"),
                      name)
    with ffn_server(model, config, tmp_path / "ffn.log", dtype=DTYPE) as ffn:
        ffn.wait_ready()
        afd = run_oracle(model, tmp_path / "afd.json", {**config, "role": "attention"},
                         dtype=DTYPE)
        served = ffn_stats(ffn)
    assert plain["dtype"] == afd["dtype"] == "torch.bfloat16"
    assert_micro_batched(afd, model, 2)
    assert served["steps"] == afd["link_stats"]["steps"] > 0
    routed = served["routed_calls"]
    assert (routed > 0) if gate_on == "attention" else routed == 0, served
    try:
        assert_same(plain, afd)
    except AssertionError as e:
        if AMX:
            pytest.xfail(f"{AMX_ROWS}: {str(e)[:500]}")
        raise
    kernel_paths.add(f"{name} bf16 served, m = 2, routers on {gate_on}: "
                     f"linear {plain['kernels']['linear']}, {time.monotonic() - t0:.0f}s")


# An AMX host's small-GEMM kernel on this one. vLLM's CPU backend gives every
# small bf16 linear (all of a tiny checkpoint's, and real models' routers) to
# SGL's packed GEMM where the CPU has AMX tiles; that kernel also runs on any
# CPU with AVX512-BF16 (AMX's attention and experts kernels need the tiles). So
# AMD hosts with AVX512-BF16 run these families as an AMX host would pick their
# linears (oracle.py --fake-amx linear): token-exact AFD with routers on either
# role over packed weights (their bias turned float32, the weight itself
# dropped). AMX hosts run it for real in the matrix above; other hosts lack the
# instructions.
SGL_HOST = torch.cpu._is_avx512_bf16_supported() and not AMX
SGL = ["tiny-deepseek-v3", "tiny-exaone-moe", "tiny-gpt-oss", "tiny-llama", "tiny-qwen2-moe"]
SGL_ROUTED = [n for n in SGL if n != "tiny-llama"]


@pytest.fixture(scope="module")
def sgl_matrix(models_dir, tmp_path_factory):
    if not SGL_HOST:
        pytest.skip("AMX host (the bf16 matrix runs SGL's GEMM there) or no AVX512-BF16")
    out = tmp_path_factory.mktemp("matrix-bf16-sgl")
    fake = ("--fake-amx", "linear")
    # stock vLLM's linears chosen as on an AMX host too (oracle.py fakes it
    # from outside the package): the reference, as in every matrix
    TIMINGS["sgl"] = run_against_stock(models_dir, out, SGL, DTYPE, every_run=fake)
    (out / "routed").mkdir()
    TIMINGS["sgl routed"] = run_matrix(models_dir, out / "routed", SGL_ROUTED, DTYPE, *fake,
                                       "--afd-only", "--gate-on", "attention")
    return out


@pytest.mark.parametrize("name", SGL)
def test_family_matches_plain_on_amx_hosts_linear_kernel(models_dir, sgl_matrix, name,
                                                        kernel_paths):
    plain, afd = check_family(models_dir, sgl_matrix, name)
    assert plain["amx"] is afd["amx"] is False  # this host's own answer, unfaked
    # Every linear of the attention role and of the FFN role is SGL's but the
    # few too large for it (the embedding-sized ones) and MLA's own.
    linear = plain["kernels"]["linear"]
    assert linear.get("sgl", 0) > sum(v for k, v in linear.items() if k != "sgl"), linear
    for role in ("kernels", "ffn_kernels"):
        assert "sgl" in afd[role]["linear"], afd[role]
    text = f"{name} bf16, an AMX host's linears (SGL) on this one: {linear}"
    if name in SGL_ROUTED:
        check_routed(sgl_matrix / "routed", name, plain)
        text += ", routers on either role"
    kernel_paths.add(f"{text} (of {len(SGL)}: {TIMINGS.get('sgl', 0):.0f}s "
                     f"+ {TIMINGS.get('sgl routed', 0):.0f}s routed)")
