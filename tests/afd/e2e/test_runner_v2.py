# SPDX-License-Identifier: Apache-2.0
# SPDX-FileCopyrightText: Copyright contributors to the vllm-afd project
"""AFD on Model Runner V2, token for token against stock vLLM on V2.

V2 is vLLM's only model runner from 0.34.0 and CUDA's default in 0.32.0. On
this CPU, vLLM 0.32.0 runs V2 only with a Triton CPU backend, which no package
index these machines reach carries; tools/testing/triton_interpret lets Triton's own
interpreter run V2's kernels instead (numpy, slowly: a test vehicle, not a
serving path). Every run here sets VLLM_AFD_TRITON_INTERPRET=1 and
VLLM_USE_V2_MODEL_RUNNER=1 and checks that V2 really ran (the oracle's
`runner`); the other model tests run V1, as vLLM 0.32.0 picks on a CPU.

- the shim does nothing without its variable, and with it V2 starts;
- the families on V2: stock vLLM 0.32.0 (its wheel untouched, tools/models/stock.py)
  on V2 against AFD on V2, routers on either role (fp32; one in bf16);
- served on V2: an FFN server over shm with two micro-batches and the routers
  on attention; a pool of two FFN servers, one killed mid-stream;
- the runs V2 names (profile, warm-up, capture) and its micro-batch split,
  through the seams, on a real link and FFN loop.

`make test` runs the shim, the seams and the families against stock vLLM; the
tests marked v2_served (real servers, the pool, bf16: minutes more on a slow
CPU, where every V2 process starts fresh) run with `make test-v2`.

Compiled runs are not among them: on V2 a compiled CPU engine warms up with a
profile run whose attention is skipped (uninitialized rows), and the dummy
sampler's Triton argmax then fails in the interpreter on all-NaN logits in
about one start of four, stock vLLM and ours alike (numpy's nanargmax raises
where a GPU kernel would return an index).
"""

import json
import os
import subprocess
import sys
from pathlib import Path
from types import SimpleNamespace

import numpy as np
import pytest
import torch

from selection import selected
from servers import cpu, free_port
from stock import STOCK_DIFFERS, stock_site

import vllm.afd.seams as afd_seams
from vllm.afd.adapter.attention import runner
from vllm.afd.attention.ubatch_rule import UbatchRule
from helpers.families import check_routed
from helpers.pool_stream import stream_losing_a_member
from helpers.oracle import ORACLE, assert_micro_batched, assert_routing, assert_same, ffn_server, ffn_stats, run_oracle

pytestmark = pytest.mark.slow

V2 = {"VLLM_AFD_TRITON_INTERPRET": "1", "VLLM_USE_V2_MODEL_RUNNER": "1"}
# The families on V2: softmax top-k (Qwen3-MoE), MLA with grouped top-k and a
# correction bias (DeepSeek-V3). Every run through Triton's interpreter costs
# 10-20 s of the suite's time: the V2 runs answer half the oracle's prompts
# (5, of different lengths; steps still mix prefill and decode). All 21 fp32
# families ran on V2 by hand (README: where it has run). `make test` runs
# Qwen3-MoE; DeepSeek-V3 (a fix patch's stock difference on V2 too) is `full`:
# `make test-v2` and `make test-full`.
FAMILIES = ["tiny-qwen3-moe", "tiny-deepseek-v3"]
FAMILY_PARAMS = ["tiny-qwen3-moe", pytest.param("tiny-deepseek-v3", marks=pytest.mark.full)]
PROMPTS = ("--num-prompts", "5")


def _oracle_matrix(out: Path, models: list[Path], *args: str, env: dict) -> None:
    proc = subprocess.run([sys.executable, str(ORACLE), "--matrix", str(out), *PROMPTS,
                           *args, *map(str, models)],
                          capture_output=True, text=True, timeout=900, cwd=out,
                          env=dict(os.environ, VLLM_CPU_OMP_THREADS_BIND=cpu(0), **V2, **env))
    assert proc.returncode == 0, proc.stdout[-2000:] + proc.stderr[-4000:]


def _result(matrix: Path, name: str, kind: str) -> dict:
    error = matrix / f"{name}.error.txt"
    assert not error.exists(), error.read_text()[-4000:]
    result = json.loads((matrix / f"{name}.{kind}.json").read_text())
    assert result["runner"] == "v2", (name, kind, result["runner"])
    return result


def test_the_shim_is_inert_unless_asked():
    """Without VLLM_AFD_TRITON_INTERPRET vLLM sees PyPI's Triton as it is (no
    CPU backend: V2 refused); with it, Triton's interpreter and vLLM's check
    passes."""
    probe = ("import os, triton.backends as b; from vllm.triton_utils import HAS_TRITON; "
             "print(sorted(b.backends), HAS_TRITON, os.environ.get('TRITON_INTERPRET'))")
    runs = {}
    for asked in ("0", "1"):
        proc = subprocess.run([sys.executable, "-c", probe], capture_output=True, text=True,
                              timeout=300,
                              env=dict(os.environ, VLLM_AFD_TRITON_INTERPRET=asked))
        assert proc.returncode == 0, proc.stderr[-2000:]
        runs[asked] = proc.stdout.strip().splitlines()[-1]
    assert runs["0"] == "['amd', 'nvidia'] False None", runs
    assert runs["1"] == "['amd', 'cpu', 'nvidia'] True 1", runs


@pytest.fixture(scope="module")
def stock_v2(models_dir, tmp_path_factory, request) -> Path:
    """Stock vLLM 0.32.0 (PYTHONPATH: its untouched wheel) on V2, plain."""
    stock = stock_site()
    out = tmp_path_factory.mktemp("stock-v2")
    _oracle_matrix(out, [models_dir / name for name in _selected(request)], "--plain-only",
                   env={"PYTHONPATH": str(stock),
                        "VLLM_CACHE_ROOT": str(stock.parent / "vllm-cache")})
    return out


@pytest.fixture(scope="module")
def afd_v2(models_dir, tmp_path_factory, request) -> Path:
    """The patched tree on V2: plain, AFD (loopback), AFD with the routers on
    the attention role."""
    out = tmp_path_factory.mktemp("afd-v2")
    _oracle_matrix(out, [models_dir / name for name in _selected(request)], "--gate-on", "both",
                   env={})
    return out


def _selected(request) -> list[str]:
    return selected(request, "name", FAMILIES, ("test_family_on_v2_matches_stock_vllm_on_v2",))


@pytest.mark.parametrize("name", FAMILY_PARAMS)
def test_family_on_v2_matches_stock_vllm_on_v2(models_dir, stock_v2, afd_v2, name,
                                               kernel_paths):
    stock = _result(stock_v2, name, "plain")
    assert stock["vllm"]["afd"] is False and stock["vllm"]["version"] == "0.32.0"
    plain, afd = _result(afd_v2, name, "plain"), _result(afd_v2, name, "afd")
    if name in STOCK_DIFFERS:  # a fix patch changes plain vLLM on purpose (tools/models/stock.py)
        for theirs, mine in zip(stock["results"], plain["results"]):
            assert theirs["token_ids"][0] == mine["token_ids"][0]
        assert stock["results"] != plain["results"]  # else STOCK_DIFFERS is stale
        reference, against = plain, f"patched plain V2 ({STOCK_DIFFERS[name]}; first " \
            "tokens as stock)"
    else:
        reference, against = stock, "stock vLLM 0.32.0 on V2"
    assert_same(reference, afd)
    assert_micro_batched(afd, models_dir / name, 1)
    routed = check_routed(afd_v2, name, reference, "routed")
    assert routed["runner"] == "v2"
    kernel_paths.add(f"{name}: AFD on Model Runner V2 (Triton's interpreter) = {against}, "
                     f"routers on either role")


@pytest.mark.v2_served
def test_bf16_on_v2_matches_stock_vllm_on_v2(models_dir, tmp_path):
    """One family in bf16 on V2: stock plain against AFD with routers on attention."""
    name = "tiny-qwen3-moe"
    stock = stock_site()
    (tmp_path / "stock").mkdir()
    (tmp_path / "afd").mkdir()
    model = models_dir / name
    _oracle_matrix(tmp_path / "stock", [model], "--plain-only", "--dtype", "bfloat16",
                   env={"PYTHONPATH": str(stock),
                        "VLLM_CACHE_ROOT": str(stock.parent / "vllm-cache")})
    _oracle_matrix(tmp_path / "afd", [model], "--afd-only", "--gate-on", "attention",
                   "--dtype", "bfloat16", env={})
    reference = _result(tmp_path / "stock", name, "plain")
    afd = _result(tmp_path / "afd", name, "afd")
    assert reference["dtype"] == afd["dtype"] == "torch.bfloat16"
    assert_same(reference, afd)
    assert_routing(model, "attention", afd["link_stats"])


# (connector, compiled, micro-batches, gate_on): the served cases of test_oracle.py.
SERVED = [("shm", False, 2, "attention"), ("tcp", False, 2, "ffn")]


@pytest.mark.v2_served
@pytest.mark.parametrize("connector, compile_model, num_ubatches, gate_on", SERVED,
                         ids=[f"{c}{'-compile' if k else ''}-m{u}-gate-{g}"
                              for c, k, u, g in SERVED])
def test_served_on_v2_matches_plain_on_v2(models_dir, tmp_path, connector, compile_model,
                                          num_ubatches, gate_on, kernel_paths):
    """A real `vllm serve --afd-role ffn` on V2 and the attention side on V2:
    its micro-batches are V2's own InputBatch slices with V2's per-micro-batch
    metadata, ping-ponged."""
    model = models_dir / "tiny-qwen3-moe"
    config = {"connector": connector, "port": free_port(), "timeout_s": 60,
              "num_ubatches": num_ubatches, "ubatch_policy": "fixed", "gate_on": gate_on}
    with ffn_server(model, config, tmp_path / "ffn.log", env=V2) as ffn:
        plain = run_oracle(model, tmp_path / "plain.json", num_prompts=5,
                           env=V2)  # while it starts
        ffn.wait_ready()
        afd = run_oracle(model, tmp_path / "afd.json", {**config, "role": "attention"},
                         compile_model=compile_model, num_prompts=5, env=V2)
        served = ffn_stats(ffn)
    assert plain["runner"] == afd["runner"] == "v2"
    assert "Using V2 Model Runner" in (tmp_path / "ffn.log").read_text()
    assert_same(plain, afd)
    assert_micro_batched(afd, model, num_ubatches)
    assert_routing(model, gate_on, afd["link_stats"])
    assert served["steps"] == afd["link_stats"]["steps"] > 0
    kernel_paths.add(f"served {connector} m={num_ubatches}: attention and FFN roles on "
                     f"Model Runner V2 (Triton's interpreter)")


@pytest.mark.v2_served
def test_pool_failover_on_v2_changes_no_token(models_dir, tmp_path, kernel_paths):
    """An attention server on V2 with a pool of two FFN servers on V2 (shm):
    FFN A frozen and killed mid-stream, the stream completes with plain V2's
    greedy tokens, the lost step finished on B."""
    tokens = 32
    run = stream_losing_a_member(models_dir / "tiny-qwen3-moe", tmp_path, "shm", tokens, env=V2)
    ids, link = run["ids"], run["link"]
    assert ids == run["plain"]["token_ids"][:len(ids)] and len(ids) == tokens
    assert link["last_failover_seconds"], link
    for name in ("attention", "ffn-b"):
        assert "Using V2 Model Runner" in (tmp_path / f"{name}.log").read_text(), name
    kernel_paths.add("pool failover: attention and FFN roles on Model Runner V2 "
                     "(Triton's interpreter)")


# ------------------------------------------------------------- the seams
def _runner(num_ubatches: int = 1) -> SimpleNamespace:
    """What the seams read of V2's GPUModelRunner: its VllmConfig."""
    afd = SimpleNamespace(is_attention=True, num_ubatches=num_ubatches)
    return SimpleNamespace(vllm_config=SimpleNamespace(
        afd_config=afd, device_config=SimpleNamespace(device=torch.device("cpu")),
        model_config=SimpleNamespace(is_hybrid=False)))


def _batch(tokens: list[int], padded_tokens: int | None = None) -> SimpleNamespace:
    return SimpleNamespace(num_scheduled_tokens=np.array(tokens, dtype=np.int32),
                           num_reqs=len(tokens), num_reqs_after_padding=len(tokens),
                           num_tokens_after_padding=padded_tokens or sum(tokens))


@afd_seams.step_scope
def _execute_model(runner_, dummy_run=False, is_profile=False, tokens=3, fail=False):
    """V2's execute_model as far as AFD sees it: inputs prepared, the step
    begun, the model run (the two remote layers of shm_link), maybe a failure."""
    afd_seams.begin_step(runner_.vllm_config, dummy_run, is_profile, _batch([tokens]), None)
    link = runner.get_link()
    h = torch.ones(tokens, link.hidden_size)
    for layer in (0, 1):
        h = link.exchange(layer, h)
    if fail:
        raise RuntimeError("the model failed")
    return h


@afd_seams.capture_scope
def _capture_model(runner_):
    """V2's capture_model: graphs captured, and a dummy run made inside it."""
    return _execute_model(runner_, dummy_run=True)


def test_v2_names_its_runs_and_only_real_steps_reach_the_ffn(shm_link):
    r, hidden = _runner(), shm_link.hidden_size
    # A real step: (1 * 2 + 0) * 2 + 1 from the FFN; the others: zeros, no frame.
    assert torch.equal(_execute_model(r), torch.full((3, hidden), 5.0))
    assert torch.equal(_execute_model(r, dummy_run=True, is_profile=True),
                       torch.zeros(3, hidden))
    assert torch.equal(_execute_model(r, dummy_run=True), torch.zeros(3, hidden))
    assert torch.equal(_capture_model(r), torch.zeros(3, hidden))
    # The capture's inner dummy run belongs to the capture: no warm-up counted.
    assert shm_link.dummy_runs == {"profile": 1, "warmup": 1, "capture": 1}
    assert shm_link.stats.steps == 1 and shm_link.stats.layer_calls == 2
    assert shm_link.forward_pass is None  # every scope ended its step


def test_a_step_that_raised_ends_failed_and_the_next_one_runs(shm_link):
    r = _runner()
    with pytest.raises(RuntimeError, match="the model failed"):
        _execute_model(r, fail=True)
    assert shm_link.forward_pass is None
    assert torch.equal(_execute_model(r, tokens=2),
                       torch.full((2, shm_link.hidden_size), 5.0))
    # Ended as failed, the first step is not counted as one that completed.
    assert shm_link.stats.steps == 1 and shm_link.stats.layer_calls == 4


def test_without_afd_the_seams_pass_through(shm_link):
    r = SimpleNamespace(vllm_config=SimpleNamespace(afd_config=None))
    with pytest.raises(RuntimeError, match="outside a step"):  # begin_step did nothing
        _execute_model(r)
    assert shm_link.dummy_runs == {} and shm_link.forward_pass is None
    assert afd_seams.ubatch_runner(lambda *args: "upstream's", r.vllm_config, 1) == "upstream's"
    assert afd_seams.ubatched_step(r.vllm_config, None, _batch([4]), False) is False


def test_afd_micro_batch_runner_splits_real_steps_only():
    from vllm.afd.adapter.attention.ubatches_v2 import AFDUBatchRunner

    r = _runner(num_ubatches=2)
    ubatches = object.__new__(AFDUBatchRunner)  # the split needs none of V2's buffers
    ubatches.num_ubatches, ubatches.hybrid, ubatches._slices = 2, False, None
    config = r.vllm_config
    assert not afd_seams.ubatched_step(config, ubatches, _batch([3, 5]), dummy_run=True)
    rule = UbatchRule(2, "fixed")
    assert ubatches.split(_batch([3, 5], padded_tokens=10), rule)
    # Balanced (4 + 4), request 1 straddling; the last takes the padding rows.
    assert [(s.request_slice, s.token_slice) for s in ubatches._slices] == [
        (slice(0, 2), slice(0, 4)), (slice(1, 2), slice(4, 10))]
    ubatches.hybrid = True  # whole requests: 3 + 5
    assert ubatches.split(_batch([3, 5]), rule)
    assert [s.token_slice for s in ubatches._slices] == [slice(0, 3), slice(3, 8)]
    assert not ubatches.split(_batch([1]), rule)  # one token: not split
