# SPDX-License-Identifier: Apache-2.0
# SPDX-FileCopyrightText: Copyright contributors to the vllm-afd project
"""The correctness oracle: plain vLLM and AFD give identical greedy tokens.

Each case runs tools/models/oracle.py (an in-process LLM, 10 prompts of different
lengths, a 64-token step budget so steps mix prefill and decode, fp32) once as
plain vLLM and once as the attention role against a real `vllm serve --afd-role
ffn` process (loopback: an FFN engine in the oracle's own process), and compares
token ids exactly and logprobs within 1e-5. The nccl connector needs GPUs; its
protocol is tested against a fake communicator in test_connectors.py.

gate_on "attention" cases run the MoE routers on the attention role; they also
check, on both roles, that every MoE layer call really carried its routing.
"""

import os
import sys

import pytest

import preload
from servers import cpu, free_port
from helpers.oracle import ORACLE, assert_micro_batched, assert_routing, assert_same, ffn_server, ffn_stats, loopback_result, plain_result, run_oracle


pytestmark = pytest.mark.slow


CASES = [
    # (model, connector, compile, micro-batches, gate_on)
    # shm at m = 1 against a real FFN server is test_faults.py's every case
    # (plain vLLM's reference text through the OpenAI server).
    ("tiny-qwen3-moe", "loopback", False, 1, "ffn"),
    ("tiny-deepseek-v2", "loopback", False, 1, "ffn"),
    # Routers on the attention role, compiled with micro-batches (Qwen3-MoE:
    # softmax top-k). DeepSeek-V3 (grouped top-k with a correction bias) with
    # its routers on the attention role is test_deepseek_v3_... below.
    ("tiny-qwen3-moe", "shm", True, 2, "attention"),
    # tcp's prepared layer calls (step_calls.py, tcp_frames.py), one micro-batch and two.
    ("tiny-qwen3-moe", "tcp", False, 2, "ffn"),
    # The device-resident connector, the CPU as its device (transport/ipc/),
    # routing packed into the peer's slot with the MoE layers' calls.
    ("tiny-qwen3-moe", "ipc", False, 2, "attention"),
]


@pytest.mark.parametrize("model_name, connector, compile_model, num_ubatches, gate_on", CASES,
                         ids=[f"{m}-{c}{'-compile' if k else ''}{f'-m{u}' if u > 1 else ''}"
                              f"{'-gate-attention' if g == 'attention' else ''}"
                              for m, c, k, u, g in CASES])
def test_afd_matches_plain(models_dir, tmp_path, model_name, connector, compile_model,
                           num_ubatches, gate_on, kernel_paths):
    model = models_dir / model_name
    # Every model on the oracle's 10 prompts of different lengths, steps mixing
    # prefill and decode. DeepSeek too: with its MLA backend pinned (CPU_MLA)
    # and one thread, plain vLLM gives the same bits run to run.
    num_prompts = 10
    # Plain vLLM eager, for the compiled case too: compiled plain vLLM gives the
    # eager bits on Qwen3-MoE (measured 2026-12-01: the same tokens, logprobs
    # within 5e-7), so compiled AFD is held to the run every case shares.
    afd_config = {"connector": connector, "port": free_port(), "timeout_s": 60,
                  "num_ubatches": num_ubatches, "ubatch_policy": "fixed", "gate_on": gate_on}
    if connector == "loopback":
        # Both roles in the oracle's process (tools/models/oracle.py starts the FFN engine).
        assert not compile_model and num_ubatches == 1 and gate_on == "ffn"
        plain = plain_result(model, tmp_path, False, num_prompts)
        afd = loopback_result(model, tmp_path)
    else:
        with ffn_server(model, afd_config, tmp_path / "ffn.log") as ffn:
            plain = plain_result(model, tmp_path, False, num_prompts)  # while it starts
            ffn.wait_ready()
            afd = run_oracle(model, tmp_path / "afd.json", {**afd_config, "role": "attention"},
                             compile_model=compile_model, num_prompts=num_prompts)
            assert_routing(model, gate_on, ffn_stats(ffn))
            # The runner names its profile and warm-up runs (on CPU, compiled
            # models have them); none reached the FFN, which saw exactly the
            # attention side's real steps.
            if compile_model:
                assert sum(afd["dummy_runs"].values()) >= 1, afd["dummy_runs"]
            assert ffn_stats(ffn)["steps"] == afd["link_stats"]["steps"] > 0
    assert_same(plain, afd)
    assert_micro_batched(afd, model, num_ubatches)
    assert_routing(model, gate_on, afd["link_stats"])
    # Plain vLLM and AFD ran the same attention kernels (one pinned for MLA).
    assert plain["attention_backends"] == afd["attention_backends"], (plain, afd)
    kernel_paths.add(f"{model_name}: attention {'/'.join(afd['attention_backends'])} "
                     f"(host AMX: {'yes' if afd['amx'] else 'no'})")


def test_deepseek_runs_the_same_mla_kernels_on_an_amx_host(models_dir, tmp_path, kernel_paths):
    """An Intel host with AMX tiles, simulated (--fake-amx: vLLM's own AMX
    check answers yes; AMX itself cannot run here). Left to itself vLLM picks
    AMX_MLA there, which refuses the fp32 DeepSeek checkpoint in plain vLLM
    already: the failure CI met on such a host. With the backend the suite
    pins (tools/models/oracle.py MLA_BACKEND), plain vLLM and AFD run CPU_MLA there
    as on every other CPU, and agree token for token."""
    model = models_dir / "tiny-deepseek-v2"
    unpinned = preload.run(
        [sys.executable, str(ORACLE), str(model), "--out", str(tmp_path / "x.json"),
         "--num-prompts", "1", "--fake-amx"], capture_output=True, text=True, timeout=600,
        env=dict(os.environ, VLLM_CPU_OMP_THREADS_BIND=cpu(0)), cwd=tmp_path)
    assert unpinned.returncode != 0
    assert "Using AMX_MLA backend" in unpinned.stdout + unpinned.stderr
    # How AMX_MLA refuses it depends on the vLLM kernels this CPU loads: with
    # AVX-512 (_C_AVX512) its weight packing rejects fp32; an AVX2-only host
    # (_C_AVX2, e.g. an AMD EPYC Zen 3) has no AMX packing op at all.
    output = unpinned.stdout + unpinned.stderr
    assert ("expect weight to be bfloat16" in output
            or "no attribute 'convert_weight_packed'" in output), output[-2000:]
    # Plain vLLM on this host (pinned, so the same kernels an AMX host runs),
    # and AFD on the simulated AMX host.
    plain = plain_result(model, tmp_path)
    afd = run_oracle(model, tmp_path / "afd.json",
                     {"connector": "loopback", "port": free_port(), "timeout_s": 60,
                      "role": "attention"}, extra=("--fake-amx",))
    assert afd["amx"] and plain["attention_backends"] == afd["attention_backends"] == ["CPU_MLA"]
    assert_same(plain, afd)
    kernel_paths.add("tiny-deepseek-v2 on a simulated AMX host: attention CPU_MLA (pinned; "
                     "unpinned vLLM picks AMX_MLA and refuses fp32)")


def test_deepseek_v3_routers_on_attention_then_micro_batched(models_dir, tmp_path,
                                                            kernel_paths):
    """DeepSeek-V3 over tcp with its routers (grouped top-k with a correction
    bias) on the attention role, one FFN server serving m = 1, then m = 2:
    plain vLLM's tokens and logprobs both times.

    Until 2026-12-05, m = 2 left plain vLLM's greedy path on a few of the 10
    prompts (DeepSeek-V2 and V3) while every mlp gave the same bits for a split
    batch: vLLM's CPU rotary kernel rotated DeepSeek's
    3D q_pe by the batch's shape (fix_cpu_rotary_embedding_3d_inputs.patch), so
    a micro-batch's rows came out other than the whole step's."""
    model = models_dir / "tiny-deepseek-v3"
    config = {"connector": "tcp", "port": free_port(), "timeout_s": 60, "num_ubatches": 2,
              "ubatch_policy": "fixed", "gate_on": "attention"}
    with ffn_server(model, config, tmp_path / "ffn.log") as ffn:
        plain = plain_result(model, tmp_path)  # while the FFN server starts
        ffn.wait_ready()
        afd = run_oracle(model, tmp_path / "afd.json",
                         {**config, "num_ubatches": 1, "role": "attention"})
        m2 = run_oracle(model, tmp_path / "afd-m2.json", {**config, "role": "attention"})
        served = ffn_stats(ffn)
    assert_same(plain, afd)
    assert_micro_batched(afd, model, 1)
    assert plain["attention_backends"] == afd["attention_backends"] == ["CPU_MLA"]
    for run in (afd, m2):
        assert_routing(model, "attention", run["link_stats"])
    assert served["steps"] == sum(r["link_stats"]["steps"] for r in (afd, m2))
    assert_routing(model, "attention", served)
    assert_micro_batched(m2, model, 2)
    assert_same(plain, m2)
    kernel_paths.add(f"tiny-deepseek-v3: attention {'/'.join(afd['attention_backends'])} "
                     f"(host AMX: {'yes' if afd['amx'] else 'no'})")


@pytest.fixture(scope="module")
def ubatch_ffn(models_dir, tmp_path_factory):
    """One FFN server (shm, up to 4 micro-batches) for the micro-batch cases: it
    serves one attention peer after the other."""
    config = {"connector": "shm", "port": free_port(), "timeout_s": 60, "num_ubatches": 4,
              "ubatch_policy": "fixed"}
    log = tmp_path_factory.mktemp("ubatch-ffn") / "ffn.log"
    with ffn_server(models_dir / "tiny-qwen3-moe", config, log) as ffn:
        ffn.wait_ready()
        yield config


# m = 2 is the compiled gate-on-attention case above.
@pytest.mark.parametrize("num_ubatches", [pytest.param(3, marks=pytest.mark.full), 4])
def test_micro_batches_match_plain(models_dir, tmp_path, ubatch_ffn, num_ubatches):
    """m micro-batches ping-ponged through the FFN: the same tokens, and
    logprobs, as plain vLLM; steps mix prefill and decode, and a request may
    straddle two micro-batches."""
    model = models_dir / "tiny-qwen3-moe"
    plain = plain_result(model, tmp_path)
    afd = run_oracle(model, tmp_path / "afd.json",
                     {**ubatch_ffn, "num_ubatches": num_ubatches, "role": "attention"})
    assert_same(plain, afd)
    assert_micro_batched(afd, model, num_ubatches)


def test_auto_policy_matches_plain(models_dir, tmp_path, ubatch_ffn):
    """ubatch_policy "auto" with up to 2 micro-batches: the rule measures both
    counts and runs some steps split and some whole, within one generate; the
    tokens and logprobs are plain vLLM's all the same."""
    model = models_dir / "tiny-qwen3-moe"
    plain = plain_result(model, tmp_path)
    afd = run_oracle(model, tmp_path / "afd.json",
                     {**ubatch_ffn, "num_ubatches": 2, "ubatch_policy": "auto",
                      "role": "attention"})
    assert_same(plain, afd)
    rule = afd["ubatches"]
    assert rule["policy"] == "auto" and rule["max"] == 2
    assert rule["steps"].get("1", 0) > 0 and rule["steps"].get("2", 0) > 0, rule
    assert sum(rule["steps"].values()) == afd["link_stats"]["steps"], rule
