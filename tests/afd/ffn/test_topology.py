# SPDX-License-Identifier: Apache-2.0
# SPDX-FileCopyrightText: Copyright contributors to the vllm-afd project
"""M:N topologies against the oracle, and the layout rules.

Every attention server in a deployment must give exactly plain vLLM's tokens:
  2A:1F  two attention servers, one FFN server gathering both (LayerBatcher)
  3A:2F  uneven: FFN rank 0 serves attention ranks 0 and 2, FFN rank 1 rank 1;
         ranks 0 and 1 are the data-parallel ranks of one attention server,
         on vLLM's Ray DP backend
  2A:2F  one FFN server with tensor parallelism 2 serving two attention
         servers (both ranks get every token of both, the lead decides the
         batches and answers, the follower runs the lead's orders), and the
         same with expert parallelism (4 of the 8 experts per rank) on vLLM's
         Ray executor
Independent attention servers are in-process LLMs (tools/models/oracle.py) run side
by side, the data-parallel one a `vllm serve` answering the openai client; the
FFN servers are `vllm serve --afd-role ffn` processes. The Ray cases use the
session's local Ray head (tools/serving/ray_head.py) and check that the workers really
are its actors.
"""

import json
import os
import subprocess
import sys
import threading
import time
from pathlib import Path

import openai
import pytest
import torch

import preload
from servers import Server, cpu, free_port
from oracle import PROMPTS

from vllm.afd.ffn.batcher import LayerBatcher
from vllm.afd.adapter.config import AFDConfig
from vllm.afd.topology import AFDLayoutError, ffn_placement
from vllm.afd.transport.wire import Routing
from helpers.fp8 import reference_dequantize, reference_quantize
from helpers.oracle import ORACLE, assert_same, ffn_server, plain_result

MODEL = "tiny-qwen3-moe"


def start_attention_servers(model: Path, tmp_path: Path, configs: list[dict]) -> list:
    """tools/models/oracle.py once per attention config, all at the same time."""
    procs = []
    for i, cfg in enumerate(configs):
        out = tmp_path / f"attention-{i}.json"
        cmd = [sys.executable, str(ORACLE), str(model), "--out", str(out),
               "--afd-config", json.dumps({**cfg, "role": "attention"})]
        env = dict(os.environ, VLLM_CPU_OMP_THREADS_BIND=cpu(0))
        log = open(tmp_path / f"attention-{i}.log", "w")
        procs.append((preload.popen(cmd, stdout=log, stderr=subprocess.STDOUT, env=env,
                                       cwd=tmp_path), out, log))
    return procs


def collect(procs: list) -> list[dict]:
    results = []
    for proc, out, log in procs:
        rc = proc.wait(timeout=600)
        log.close()
        assert rc == 0, Path(log.name).read_text()[-4000:]
        results.append(json.loads(out.read_text()))
    return results


def run_attention_servers(model: Path, tmp_path: Path, configs: list[dict]) -> list[dict]:
    return collect(start_attention_servers(model, tmp_path, configs))


def check_all(models_dir, tmp_path, results):
    plain = plain_result(models_dir / MODEL, tmp_path)
    for afd in results:
        assert_same(plain, afd)
        assert afd["link_stats"]["steps"] > 0


def serve_completions(server: Server, model: Path, prompts: list[str]) -> list:
    client = openai.OpenAI(base_url=server.url + "/v1", api_key="x")
    comp = client.completions.create(
        model=str(model), prompt=prompts, max_tokens=16, temperature=0, logprobs=1,
        extra_body={"ignore_eos": True, "return_token_ids": True})
    return sorted(comp.choices, key=lambda c: c.index)


def assert_ray_actors(ray_head, pids: list[int], actor_class: str) -> None:
    """Each pid is a Ray actor of `actor_class` that the test's Ray head started
    (its raylet's session, Ray's process title), not a child of the server."""
    for pid in pids:
        title = Path(f"/proc/{pid}/cmdline").read_bytes().split(b"\0")[0].decode()
        assert title.startswith(f"ray::{actor_class}"), (pid, title)
        assert os.getsid(pid) == os.getsid(ray_head.proc.pid), (pid, title)


@pytest.mark.slow
@pytest.mark.full  # ~2.5 min of a 2-core CI host; test_launch's 2A:1F deploys DP on Ray too
def test_three_attention_two_ffn_uneven_with_data_parallel(models_dir, tmp_path, ray_head):
    """3A:2F: attention ranks 0 and 1 are the two data-parallel ranks of one
    `vllm serve --data-parallel-size 2 --data-parallel-backend ray` (its engines
    and their workers Ray actors of the test's local Ray head), rank 2 an
    independent in-process server; FFN rank 0 serves ranks 0 and 2, FFN rank 1 serves rank 1. Over
    shm, whose segments and notify sockets are per peer: an FFN rank serving
    two attention peers on one host (the README's 2A:1F) is FFN rank 0 here."""
    model = models_dir / MODEL
    base = {"connector": "shm", "port": free_port(), "timeout_s": 120,
            "num_attention_ranks": 3, "num_ffn_ranks": 2}
    dp_server = Server(str(model), [
        "--max-model-len", "512", "--dtype", "float32", "--enforce-eager",
        "--max-num-batched-tokens", "64", "--max-num-seqs", "16",
        "--no-enable-prefix-caching", "--data-parallel-size", "2", "--api-server-count", "1",
        "--data-parallel-backend", "ray",
        "--afd-role", "attention", "--afd-config", json.dumps(base)],
        log_path=tmp_path / "attention-dp.log",
        env={"VLLM_CPU_OMP_THREADS_BIND": f"{cpu(0)}|{cpu(0)}", "RAY_ADDRESS": ray_head.address},
        name="attention server (DP=2)")
    with ffn_server(model, {**base, "ffn_rank": 0}, tmp_path / "ffn0.log", cpus=cpu(1)) as ffn0, \
         ffn_server(model, {**base, "ffn_rank": 1}, tmp_path / "ffn1.log", cpus=cpu(0)) as ffn1, \
         dp_server:
        ffn0.wait_ready()
        ffn1.wait_ready()
        # FFN rank 0 serves each of its peers (ranks 0 and 2) as it connects,
        # and the DP server is ready only after a first step.
        procs = start_attention_servers(model, tmp_path, [{**base, "attention_rank": 2}])
        dp_server.wait_ready()
        choices = serve_completions(dp_server, model, PROMPTS)
        results = collect(procs)
        workers = [json.loads(f.get("/afd/status")[1])["workers"][0] for f in (ffn0, ffn1)]
        links = json.loads(dp_server.get("/afd/status")[1])["links"]
        assert len(links) == 2
        assert_ray_actors(ray_head, [link["pid"] for link in links], "RayWorkerProc")
    check_all(models_dir, tmp_path, results)
    plain = plain_result(model, tmp_path)
    for ref, got in zip(plain["results"], choices):
        assert got.token_ids == ref["token_ids"], ref["prompt"]
        diff = max(abs(a - b) for a, b in zip(got.logprobs.token_logprobs, ref["logprobs"]))
        assert diff <= 1e-5, (ref["prompt"], diff)
    dp_log = (tmp_path / "attention-dp.log").read_text()
    assert "AFD attention rank 0 connected via shm at unix:@vllm-afd-%d" % base["port"] in dp_log
    assert "AFD attention rank 1 connected via shm at unix:@vllm-afd-%d" % (
        base["port"] + 1) in dp_log
    # Both FFN ranks served steps; rank 0 the in-process server's among them.
    assert workers[0]["steps"] > results[0]["link_stats"]["steps"] > 0
    assert workers[1]["steps"] > 0


@pytest.mark.slow
@pytest.mark.parametrize("parallel", ["tp", "ep"])
def test_one_attention_two_ffn_ranks(models_dir, tmp_path, parallel, request):
    """2A:2F: one FFN server of two workers serves two attention servers at
    once (attention rank 1 through the follower's address), its workers
    following the lead's batch orders. The tensor-parallel one runs its workers
    on mp, the expert-parallel one on vLLM's Ray executor (RayExecutorV2, the
    workers Ray actors in a placement group of the test's local Ray head)."""
    base = {"connector": "shm" if parallel == "tp" else "tcp", "port": free_port(),
            "timeout_s": 120, "num_ffn_ranks": 2, "num_attention_ranks": 2}
    attention = [{**base, "attention_rank": a} for a in (0, 1)]
    extra, env = ["--tensor-parallel-size", "2"], {}
    if parallel == "ep":
        ray_head = request.getfixturevalue("ray_head")
        extra += ["--enable-expert-parallel", "--distributed-executor-backend", "ray"]
        env["RAY_ADDRESS"] = ray_head.address
    with ffn_server(models_dir / MODEL, base, tmp_path / "ffn.log", extra=extra,
                   cpus=f"{cpu(0)}|{cpu(1)}", env=env) as ffn:
        ffn.wait_ready()
        results = run_attention_servers(models_dir / MODEL, tmp_path, attention)
        workers = json.loads(ffn.get("/afd/status")[1])["workers"]
        pids = [w["link"]["pid"] for w in workers]
        if parallel == "ep":
            assert_ray_actors(ray_head, pids, "RayWorkerProc")
            # Each actor process started with its worker's OpenMP binding and
            # the preloaded libgomp, as mp gives a worker process (adapter/upstream_fixes/ray_cpu.py).
            for pid, cpus in zip(pids, (cpu(0), cpu(1))):
                environ = dict(v.split("=", 1) for v in Path(f"/proc/{pid}/environ")
                               .read_text().split("\0") if "=" in v)
                assert "libgomp" in environ.get("LD_PRELOAD", ""), environ
                assert environ.get("OMP_NUM_THREADS") == "1", environ
                assert environ.get("GOMP_CPU_AFFINITY") == cpus, environ
        else:
            assert all(os.getsid(pid) == os.getsid(ffn.proc.pid) for pid in pids)
    log = (tmp_path / "ffn.log").read_text()
    if parallel == "ep":
        assert "Local/global number of experts: 4/8" in log
    check_all(models_dir, tmp_path, results)
    assert [w["rank"] for w in workers] == [0, 1] and workers[0]["group"] == [0, 1]
    # Both ranks computed every step of every peer; only the lead answered.
    steps = sum(r["link_stats"]["steps"] for r in results)
    assert workers[0]["steps"] == workers[1]["steps"] == steps
    assert [w["batching"] for w in workers] == ["lead", "follower"]
    assert workers[1]["order_error"] is None


# ---------------------------------------------------------------- layout rules
class _Parallel:
    def __init__(self, tp=1, pp=1, dp=1, dp_rank=0):
        self.world_size, self.pipeline_parallel_size = tp * pp, pp
        self.data_parallel_size, self.data_parallel_rank = dp, dp_rank


class _Vllm:
    def __init__(self, afd, **parallel):
        self.afd_config, self.parallel_config = afd, _Parallel(**parallel)


def ffn(**kw) -> AFDConfig:
    return AFDConfig(role="ffn", **kw)


def test_placement_of_ffn_workers():
    p = ffn_placement(_Vllm(ffn(num_ffn_ranks=2), tp=2), 1)
    assert (p.rank, p.group, p.is_lead) == (1, [0, 1], False)
    p = ffn_placement(_Vllm(ffn(num_attention_ranks=3, num_ffn_ranks=2, ffn_rank=1)), 0)
    assert (p.rank, p.group, p.is_lead) == (1, [1], True)


@pytest.mark.parametrize("kwargs, parallel, message", [
    (dict(num_ffn_ranks=1), dict(tp=2), "take FFN ranks 0-1, but num_ffn_ranks is 1"),
    (dict(num_ffn_ranks=3, ffn_rank=2, num_attention_ranks=2), {},
     "no attention rank maps to FFN ranks 2-2"),
    (dict(), dict(pp=2), "does not support pipeline parallelism"),
    (dict(), dict(dp=2), "one FFN server per data-parallel rank"),
])
def test_impossible_layouts_fail_with_the_reason(kwargs, parallel, message):
    with pytest.raises(AFDLayoutError) as e:
        ffn_placement(_Vllm(ffn(**kwargs), **parallel), 0)
    assert message in str(e.value)


def test_attention_ranks_follow_data_parallel_ranks():
    from vllm.afd.topology import attention_rank

    cfg = AFDConfig(num_attention_ranks=4, attention_rank=2)
    assert attention_rank(_Vllm(cfg, dp=2, dp_rank=1)) == 3
    with pytest.raises(AFDLayoutError, match="take attention ranks 2-4, but "
                                             "num_attention_ranks is 4"):
        attention_rank(_Vllm(cfg, dp=3))
    with pytest.raises(ValueError, match="attention_rank: 4 is not in 0-3"):
        AFDConfig(num_attention_ranks=4, attention_rank=4)


# ---------------------------------------------------------------- the batcher
def test_batcher_joins_peers_in_a_step_into_one_call():
    calls = []

    def mlp(layer, x):
        calls.append((layer, x.shape[0]))
        return x * 2

    b = LayerBatcher(mlp, max_tokens=64, window_s=5.0)  # long: only "everyone is here" may trigger
    for peer in (0, 1, 2):
        b.begin(peer)
    outs = {}

    def peer(p):
        outs[p] = b.compute(7, torch.full((p + 1, 4), float(p)), p)

    threads = [threading.Thread(target=peer, args=(p,)) for p in (0, 1, 2)]
    t0 = time.monotonic()
    for t in threads:
        t.start()
    for t in threads:
        t.join(10)
    assert time.monotonic() - t0 < 4  # did not wait for the window
    assert calls == [(7, 6)]  # one call, 1 + 2 + 3 tokens
    for p in (0, 1, 2):
        assert torch.equal(outs[p], torch.full((p + 1, 4), 2.0 * p))


def test_batcher_never_exceeds_the_ffn_token_budget():
    """The FFN is sized (and warmed up) for max_tokens: three peers' 8-token
    calls of one layer with a budget of 20 make two mlp calls (16 + 8), each
    within it, and every peer still gets its own rows back."""
    calls = []

    def mlp(layer, x):
        calls.append(x.shape[0])
        return x + 1

    b = LayerBatcher(mlp, max_tokens=20, window_s=5.0)
    for peer in (0, 1, 2):
        b.begin(peer)
    outs = {}

    def peer(p):
        outs[p] = b.compute(0, torch.full((8, 4), float(p)), p)

    threads = [threading.Thread(target=peer, args=(p,)) for p in (0, 1, 2)]
    for t in threads:
        t.start()
    for t in threads:
        t.join(10)
    assert sorted(calls) == [8, 16] and b.largest == 16
    for p in (0, 1, 2):
        assert torch.equal(outs[p], torch.full((8, 4), p + 1.0))
    with pytest.raises(ValueError, match="sized for 20"):
        b.compute(0, torch.zeros(21, 4), 0)


def test_batcher_joins_routing_with_the_hidden_states():
    """gate_on "attention": each peer's routing rows stay with its tokens in
    the joined call, in the same (peer) order as the hidden states."""
    calls = []

    def mlp(layer, x, routing=None):
        calls.append((layer, x.clone(), routing))
        # Each row: its hidden value plus its first expert id.
        return x + routing.topk_ids[:, :1].to(x.dtype)

    b = LayerBatcher(mlp, max_tokens=64, window_s=5.0)
    for peer in (0, 1):
        b.begin(peer)
    outs = {}

    def peer(p):
        n = p + 2
        routing = Routing(torch.full((n, 2), 0.5), torch.full((n, 2), 10 * (p + 1),
                                                               dtype=torch.int32))
        outs[p] = b.compute(3, torch.full((n, 4), float(p)), p, routing)

    threads = [threading.Thread(target=peer, args=(p,)) for p in (0, 1)]
    for t in threads:
        t.start()
    for t in threads:
        t.join(10)
    assert len(calls) == 1
    layer, x, routing = calls[0]
    assert layer == 3 and x.shape == (5, 4)
    assert routing.topk_ids[:, 0].tolist() == [10, 10, 20, 20, 20]
    assert routing.topk_weights.shape == (5, 2)
    assert torch.equal(outs[0], torch.full((2, 4), 10.0))
    assert torch.equal(outs[1], torch.full((3, 4), 21.0))


def test_ffn_loop_unpacks_two_peers_fp8_rows_into_one_mlp_call():
    """transfer_dtype fp8 both ways, one FFNLoop serving two attention ranks
    over shm (no vLLM: the data plane with a stand-in mlp): the batcher
    gathers both peers' fp8 payloads by unpacking them straight into the rows
    of one joined MoE input, computes once, and each peer gets its rows back,
    equal to plain torch's quantization of its own tokens."""

    from vllm.afd.ffn.loop import FFNLoop
    from vllm.afd.topology import FFNPlacement
    from vllm.afd.transport import wire
    from vllm.afd.transport.config import LinkConfig
    from vllm.afd.transport.connectors import create_connector
    from vllm.afd.transport.device import DeviceContext

    def through_fp8(x):
        return reference_dequantize(*reference_quantize(x, 128), 128, x.dtype)

    hidden, dtype, tokens = 200, torch.bfloat16, {0: 3, 1: 5}
    cfg = dict(connector="shm", port=free_port(), num_attention_ranks=2, timeout_s=30,
               transfer_to_ffn="fp8", transfer_to_attention="fp8")
    joined = []

    def mlp(layer, x, routing):
        joined.append(x.shape[0])
        return x * 2 + layer

    loop = FFNLoop(LinkConfig(role="ffn", **cfg), layers=[0, 1], compute=mlp,
                   hidden_size=hidden, dtype=dtype, max_tokens=16,
                   placement=FFNPlacement(rank=0, group=[0]), warmup_sizes=[])
    # Lockstep, not timing: a call waits for the other peer's (2 ms by default,
    # which four threads of one process sharing the GIL sometimes miss).
    loop.batcher.window_s = 10.0
    loop.start(DeviceContext.current("cpu"))
    results, errors = {}, []
    both_in_step = threading.Barrier(2)

    def attention(rank):
        try:
            conn = create_connector(LinkConfig(role="attention", **cfg), hidden_size=hidden,
                                    dtype=dtype, max_tokens=16, rank=rank)
            conn.connect()
            g = torch.Generator().manual_seed(rank)
            conn.send_step(wire.StepHeader(step_id=0, num_tokens=[tokens[rank]]))
            both_in_step.wait(30)
            deadline = time.monotonic() + 30
            while loop.batcher.active != {0, 1} and time.monotonic() < deadline:
                time.sleep(0.01)  # both FFN peer threads are inside the step
            for layer in (0, 1):
                h = (torch.randn(tokens[rank], hidden, generator=g) * 5).to(dtype)
                conn.send_hidden(layer, 0, h)
                out = conn.recv_output(layer, 0)
                results[(rank, layer)] = torch.equal(out, through_fp8(through_fp8(h) * 2 + layer))
            conn.send_step(wire.StepHeader(step_id=0, num_tokens=[], flags=wire.GOODBYE))
            conn.close()
        except BaseException as e:  # noqa: BLE001 - reported below
            errors.append(e)

    threads = [threading.Thread(target=attention, args=(r,)) for r in (0, 1)]
    try:
        for t in threads:
            t.start()
        for t in threads:
            t.join(60)
    finally:
        loop.stop()
    assert not errors, errors
    assert results == {(r, layer): True for r in (0, 1) for layer in (0, 1)}, results
    assert joined == [8, 8], joined  # per layer, 3 + 5 tokens in one mlp call


def test_batcher_does_not_wait_for_a_peer_between_steps():
    b = LayerBatcher(lambda layer, x: x + 1, max_tokens=64, window_s=5.0)
    b.begin(0)
    b.begin(1)
    b.end(1)  # peer 1 finished its step
    t0 = time.monotonic()
    out = b.compute(0, torch.zeros(2, 3), 0)
    assert time.monotonic() - t0 < 4 and torch.equal(out, torch.ones(2, 3))


def test_batcher_window_bounds_the_wait_for_a_slow_peer():
    b = LayerBatcher(lambda layer, x: x, max_tokens=64, window_s=0.05)
    b.begin(0)
    b.begin(1)  # in a step, but never sends
    t0 = time.monotonic()
    b.compute(0, torch.zeros(1, 2), 0)
    assert 0.04 <= time.monotonic() - t0 < 2


def test_ray_seams_keep_upstream_values_off_the_cpu():
    """vllm/afd/adapter/upstream_fixes/ray_cpu.py changes RayExecutorV2 only for the CPU key: on GPUs
    (never run here) every seam hands back upstream's own value."""
    from vllm.afd.adapter.upstream_fixes import ray_cpu

    upstream = {"num_gpus": 0, "resources": {"TPU": 1}}
    assert ray_cpu.actor_resources("TPU", upstream) is upstream
    assert ray_cpu.actor_resources("CPU", upstream) == {"num_gpus": 0}
    # (bundle index, node id, node ip), as get_bundles_sorted_by_node gives them:
    # a Ray DP placement group's last bundle is its engine's control bundle.
    bundles = [(1, "n", "ip"), (0, "n", "ip"), (2, "n", "ip")]
    assert ray_cpu.worker_bundles("GPU", bundles, 2) is bundles
    assert ray_cpu.worker_bundles("CPU", bundles, 2) == [(1, "n", "ip"), (0, "n", "ip")]
    assert ray_cpu.worker_bundles("CPU", bundles, 3) is bundles
    env = {"env_vars": {"A": "1"}}
    assert ray_cpu.worker_runtime_envs("GPU", None, env, [{}, {}]) == [env, env]


# ------------------------------------------------ per-peer sessions on one FFN rank
SESSION_HIDDEN = 8


class _Mlp:
    """A deterministic stand-in for the mlp (h * 2 + layer) that records the
    token count of every call, and fails the calls fail_when(layer, x) picks."""

    def __init__(self, fail_when=None) -> None:
        self.calls: list[tuple[int, int]] = []
        self.fail_when = fail_when

    def __call__(self, layer, x, routing=None):
        self.calls.append((layer, x.shape[0]))
        if self.fail_when is not None and self.fail_when(layer, x):
            raise RuntimeError("injected mlp failure")
        return x * 2 + layer


def _session_loop(connector, mlp, layers=(0, 1, 2), num_attention_ranks=2, **cfg):
    """An FFNLoop (FFN rank 0) serving num_attention_ranks attention ranks, and
    a function making one of its attention peers (connected)."""
    from vllm.afd.ffn.loop import FFNLoop
    from vllm.afd.topology import FFNPlacement
    from vllm.afd.transport.config import LinkConfig
    from vllm.afd.transport.connectors import create_connector
    from vllm.afd.transport.device import DeviceContext

    cfg = dict(connector=connector, port=free_port(), timeout_s=10,
               num_attention_ranks=num_attention_ranks, **cfg)
    loop = FFNLoop(LinkConfig(role="ffn", **cfg), layers=list(layers), compute=mlp,
                   hidden_size=SESSION_HIDDEN, dtype=torch.float32, max_tokens=16,
                   placement=FFNPlacement(rank=0, group=[0]), warmup_sizes=[])
    # Long: a call runs only when every peer inside a step handed one in (or
    # that peer left), never because the window ran out.
    loop.batcher.window_s = 5.0
    loop.start(DeviceContext.current("cpu"))
    assert loop.ready.wait(10)

    def attention(rank):
        conn = create_connector(LinkConfig(role="attention", **cfg), hidden_size=SESSION_HIDDEN,
                                dtype=torch.float32, max_tokens=16, rank=rank)
        conn.connect()
        return conn

    return loop, attention


def _wait_for(condition, what, bound=10.0):
    deadline = time.monotonic() + bound
    while not condition():
        assert time.monotonic() < deadline, what
        time.sleep(0.01)


def _hidden(rank, step, layer, n):
    return torch.full((n, SESSION_HIDDEN), 100.0 * rank + 10 * step + layer)


def _joint_step(loop, peers: dict, step, tokens, layers=(0, 1, 2)):
    """One step of every peer in peers ({rank: connector}), in lockstep: the
    FFN batches their calls of each layer into one."""
    from vllm.afd.transport.wire import StepHeader

    # The FFN's session threads leave the batcher just after sending a step's
    # last output: until they have, `active` still shows the step before (and
    # the wait below would pass at once, letting one peer's first call of this
    # step run alone, before the other's header was read).
    _wait_for(lambda: not loop.batcher.active & set(peers), "the step before ended")
    for rank, conn in peers.items():
        conn.send_step(StepHeader(step_id=step, num_tokens=[tokens[rank]]))
    _wait_for(lambda: loop.batcher.active == set(peers), "every session inside the step")
    for layer in layers:
        for rank, conn in peers.items():
            conn.send_hidden(layer, 0, _hidden(rank, step, layer, tokens[rank]))
        for rank, conn in peers.items():
            h = _hidden(rank, step, layer, tokens[rank])
            assert torch.equal(conn.recv_output(layer, 0), h * 2 + layer), (rank, step, layer)


@pytest.mark.parametrize("connector, spin_us", [("shm", None), ("tcp", None), ("tcp", 20000)],
                         ids=["shm", "tcp", "tcp-spin"])
def test_ffn_peers_join_and_leave_their_own_sessions(connector, spin_us):
    """Attention rank 0 is served alone before rank 1 exists; rank 1 joins
    later and both are batched; rank 1's connection is cut mid-step without a
    goodbye: only its session ends, rank 0's step finishes with the right
    outputs (not held for the batcher's window); rank 1 reconnects and both
    are batched again. tcp-spin: the same with every side's waits spinning
    on their sockets (tcp.py), the cut peer's included."""
    mlp = _Mlp()
    extra = {} if spin_us is None else {"connector_extra_config": {"spin_us": spin_us}}
    loop, attention = _session_loop(connector, mlp, **extra)
    tokens = {0: 3, 1: 5}
    conns = []
    try:
        p0 = attention(0)
        conns.append(p0)
        for step in range(3):  # rank 1 does not exist yet
            _joint_step(loop, {0: p0}, step, tokens)
        _wait_for(lambda: loop.peer_stats[0].steps == 3, "three steps counted")
        assert loop.serving == [0]
        assert set(mlp.calls) == {(layer, 3) for layer in (0, 1, 2)}
        time.sleep(0.5)
        p1 = attention(1)
        conns.append(p1)
        _wait_for(lambda: loop.serving == [0, 1], "both served")
        mlp.calls.clear()
        _joint_step(loop, {0: p0, 1: p1}, 3, tokens)
        assert mlp.calls == [(0, 8), (1, 8), (2, 8)]  # one mlp call of both per layer

        # Mid-step, rank 1's socket is cut (no goodbye, no ErrorFrame).
        from vllm.afd.transport.wire import StepHeader

        _wait_for(lambda: not loop.batcher.active, "step 3 ended")  # _joint_step says why
        for rank, conn in ((0, p0), (1, p1)):
            conn.send_step(StepHeader(step_id=4, num_tokens=[tokens[rank]]))
        _wait_for(lambda: loop.batcher.active == {0, 1}, "both inside step 4")
        for rank, conn in ((0, p0), (1, p1)):
            conn.send_hidden(0, 0, _hidden(rank, 4, 0, tokens[rank]))
        for rank, conn in ((0, p0), (1, p1)):
            conn.recv_output(0, 0)
        p1._streams[0].close()
        t0 = time.monotonic()
        for layer in (1, 2):
            p0.send_hidden(layer, 0, _hidden(0, 4, layer, 3))
            assert torch.equal(p0.recv_output(layer, 0), _hidden(0, 4, layer, 3) * 2 + layer)
        assert time.monotonic() - t0 < 4  # the window is 5 s: rank 1 left, not timed out
        _wait_for(lambda: loop.serving == [0], "rank 1's session ends")
        status = loop.status()
        assert "attention rank 1" in status["last_peer_error"], status
        for step in (5, 6):
            _joint_step(loop, {0: p0}, step, tokens)

        # Rank 1 comes back: a new session, batched with rank 0's again.
        p1.close()
        p1 = attention(1)
        conns.append(p1)
        _wait_for(lambda: loop.serving == [0, 1], "rank 1 back")
        mlp.calls.clear()
        for step in (7, 8):
            _joint_step(loop, {0: p0, 1: p1}, step, tokens)
        assert mlp.calls == [(layer, 8) for _ in (7, 8) for layer in (0, 1, 2)]
        assert loop.batcher.largest == 8
        if spin_us:  # the answers of the batched steps were caught spinning
            assert p0._streams[0].spin_hits > 0 and p1._streams[0].spin_hits > 0
        doc = loop.document()
        assert loop.sessions == 3 and doc["reconnects"] == 2, doc
        assert doc["handshake_failures"] == 0 and doc["bytes_received"] > 0, doc
    finally:
        for conn in conns:
            conn.close()
        loop.stop()
    assert loop.serving == [] and not loop.thread.is_alive()


def test_a_rank_with_a_live_session_is_refused_until_it_ends():
    """A second attention rank 0 while the first one's session lives: refused
    as already connected (counted on the FFN rank); once that session ended,
    the same rank is served."""
    from vllm.afd.transport.wire import GOODBYE, ProtocolError, StepHeader

    loop, attention = _session_loop("loopback", _Mlp(), num_attention_ranks=1)
    first = second = None
    try:
        first = attention(0)
        _joint_step(loop, {0: first}, 0, {0: 2})
        with pytest.raises(ProtocolError, match="rank: attention rank 0 is already connected"):
            attention(0)
        doc = loop.document()
        assert doc["handshake_failures"] == 1 and doc["auth_failures"] == 0, doc
        assert "already connected" in loop.status()["last_refusal"]
        _joint_step(loop, {0: first}, 1, {0: 2})  # the live session never noticed
        first.send_step(StepHeader(step_id=0, num_tokens=[], flags=GOODBYE))
        first.close()
        _wait_for(lambda: loop.serving == [], "the first session ends")
        second = attention(0)
        _joint_step(loop, {0: second}, 0, {0: 4})
        assert loop.serving == [0] and loop.sessions == 2
    finally:
        for conn in (first, second):
            if conn is not None:
                conn.close()
        loop.stop()


def test_a_failed_mlp_call_fails_only_the_peers_in_it():
    """The joined call of ranks 0 and 1 fails: each of them gets the FFN's
    error text; rank 2, between steps meanwhile, is served on, and rank 0
    reconnects and is served too."""
    from vllm.afd.transport.errors import AFDConnectionError
    from vllm.afd.transport.wire import StepHeader

    failed = []

    def fail_once(layer, x):
        if layer == 1 and x.shape[0] == 5 and not failed:
            failed.append(layer)
            return True
        return False

    loop, attention = _session_loop("shm", _Mlp(fail_once), num_attention_ranks=3)
    tokens = {0: 2, 1: 3, 2: 4}
    conns = []
    try:
        p0, p1, p2 = (attention(r) for r in (0, 1, 2))
        conns += [p0, p1, p2]
        _wait_for(lambda: loop.serving == [0, 1, 2], "three sessions")
        _joint_step(loop, {2: p2}, 0, tokens)
        for rank, conn in ((0, p0), (1, p1)):
            conn.send_step(StepHeader(step_id=0, num_tokens=[tokens[rank]]))
        _wait_for(lambda: loop.batcher.active == {0, 1}, "ranks 0 and 1 inside a step")
        for layer in (0, 1):
            for rank, conn in ((0, p0), (1, p1)):
                conn.send_hidden(layer, 0, _hidden(rank, 0, layer, tokens[rank]))
            if layer == 0:
                for conn in (p0, p1):
                    conn.recv_output(0, 0)
        for conn in (p0, p1):
            with pytest.raises(AFDConnectionError, match=r"the mlp of layer 1 failed on 5 "
                                                         r"token\(s\): RuntimeError: injected"):
                conn.recv_output(1, 0)
        _wait_for(lambda: loop.serving == [2], "ranks 0 and 1's sessions end")
        assert loop.status()["link"]["errors"], loop.status()
        _joint_step(loop, {2: p2}, 1, tokens)
        p0.close()
        p0 = attention(0)
        conns.append(p0)
        _joint_step(loop, {0: p0, 2: p2}, 2, tokens)
    finally:
        for conn in conns:
            conn.close()
        loop.stop()


@pytest.mark.parametrize("connector", ["shm", "tcp"])
def test_a_lone_peers_failed_mlp_call_is_reported_and_the_loop_serves_on(connector):
    """A lone attention peer's calls run at once in the batcher (the mlp
    between its enter_alone and leave_alone, the reply before any
    bookkeeping; prepared calls on shm and tcp): its outputs are exact and the
    batcher's counts add up; an mlp call that raises reaches the attention
    side with the layer, the token count and the error, ends that session
    only, and leaves the batcher free: the rank reconnects and is served."""
    from vllm.afd.transport.errors import AFDConnectionError
    from vllm.afd.transport.wire import StepHeader

    failed = []

    def fail_once(layer, x):
        if layer == 1 and x.shape[0] == 3 and not failed:
            failed.append(layer)
            return True
        return False

    mlp = _Mlp(fail_once)
    loop, attention = _session_loop(connector, mlp, num_attention_ranks=1)
    conns = []
    try:
        p0 = attention(0)
        conns.append(p0)
        _joint_step(loop, {0: p0}, 0, {0: 2})
        # The FFN counts a step after its last answer: wait for it to get there.
        _wait_for(lambda: loop.stats().steps == 1, "the step counted")
        assert (loop.batcher.calls, loop.batcher.batches, loop.batcher.largest) == (3, 3, 2)
        assert loop.compute_hist.count == 3 and loop.stats().compute_s > 0
        p0.send_step(StepHeader(step_id=1, num_tokens=[3]))
        p0.send_hidden(0, 0, _hidden(0, 1, 0, 3))
        assert torch.equal(p0.recv_output(0, 0), _hidden(0, 1, 0, 3) * 2)
        p0.send_hidden(1, 0, _hidden(0, 1, 1, 3))
        with pytest.raises(AFDConnectionError, match=r"the mlp of layer 1 failed on 3 "
                                                     r"token\(s\): RuntimeError: injected"):
            p0.recv_output(1, 0)
        _wait_for(lambda: loop.serving == [], "the session ends")
        assert not loop.batcher.computing and loop.batcher.calls == 5
        p0.close()
        p0 = attention(0)
        conns.append(p0)
        _wait_for(lambda: loop.serving == [0], "the rank is served again")
        _joint_step(loop, {0: p0}, 2, {0: 4})
        assert loop.batcher.largest == 4 and loop.error is None
    finally:
        for conn in conns:
            conn.close()
        loop.stop()


def test_ffn_loop_serves_a_resumed_step_from_its_layers():
    """A step re-sent after a failover (StepHeader.from_layer): micro-batch 0
    from layer 2 on, micro-batch 1 with nothing left; the next plain step is
    whole. Stats count the calls served."""
    from vllm.afd.transport.wire import StepHeader

    mlp = _Mlp()
    loop, attention = _session_loop("loopback", mlp, layers=(0, 1, 2, 3),
                                    num_attention_ranks=1, num_ubatches=2)
    conn = None
    try:
        conn = attention(0)
        conn.send_step(StepHeader(step_id=5, num_tokens=[3, 2], from_layer=[2, 99]))
        for layer in (2, 3):
            h = _hidden(0, 5, layer, 3)
            conn.send_hidden(layer, 0, h)
            assert torch.equal(conn.recv_output(layer, 0), h * 2 + layer)
        assert mlp.calls == [(2, 3), (3, 3)]
        conn.send_step(StepHeader(step_id=6, num_tokens=[3, 2]))
        for layer in range(4):
            for u, n in enumerate((3, 2)):
                h = _hidden(u, 6, layer, n)
                conn.send_hidden(layer, u, h)
                assert torch.equal(conn.recv_output(layer, u), h * 2 + layer)
        _wait_for(lambda: loop.peer_stats[0].steps == 2, "both steps counted")
        stats = loop.peer_stats[0]
        assert stats.layer_calls == 2 + 8 and stats.tokens == 2 * 3 + 4 * 5
    finally:
        if conn is not None:
            conn.close()
        loop.stop()


def test_batcher_failure_stays_with_its_calls():
    """An mlp call that raises fails the calls it was made of, nobody else's;
    the batcher serves the next calls as before."""
    def mlp(layer, x):
        if layer == 1:
            raise RuntimeError("boom")
        return x + 1

    b = LayerBatcher(mlp, max_tokens=64, window_s=5.0)
    for peer in (0, 1):
        b.begin(peer)
    results = {}

    def peer(p):
        try:
            results[p] = b.compute(1, torch.zeros(2, 3), p)
        except RuntimeError as e:
            results[p] = str(e)

    threads = [threading.Thread(target=peer, args=(p,)) for p in (0, 1)]
    for t in threads:
        t.start()
    for t in threads:
        t.join(10)
    assert results == {0: "boom", 1: "boom"}
    b.end(1)
    assert torch.equal(b.compute(0, torch.zeros(2, 3), 0), torch.ones(2, 3))
