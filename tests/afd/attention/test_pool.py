# SPDX-License-Identifier: Apache-2.0
# SPDX-FileCopyrightText: Copyright contributors to the vllm-afd project
"""An attention rank with a pool of FFN servers (AFDConfig.ffn_pool), on the
data plane with the reference decoder (tools/testing/gpu_check): the FFN servers are
real processes over shm, and one SIGKILLs itself at its k-th mlp call after
warm-up, a kill -9 at a known point mid-step. The step still ends with exactly
the reference decoder's output: the attention side sends the lost layer
calls again to another member and finishes the step there (on ipc, which
checks once per step, it runs the step again whole). Then vLLM servers in
pools: shm under kills, and ipc's whole-step run again through vLLM's
forward."""

import multiprocessing
import os
import signal
import sys
import threading
import time
from pathlib import Path

import pytest
import torch

REPO = Path(__file__).resolve().parents[3]
sys.path.insert(0, str(REPO / "tools" / "testing" / "gpu_check"))

from roles import MAX_UBATCHES, AttentionRole, FFNRole, sample_batch  # noqa: E402
from servers import free_port  # noqa: E402

from vllm.afd.attention.pool import Pool  # noqa: E402
from vllm.afd.transport import leftovers  # noqa: E402
from vllm.afd.transport.config import LinkConfig  # noqa: E402
from vllm.afd.transport.errors import AFDLinkDown  # noqa: E402
from helpers.oracle import COMMON, run_oracle
from helpers.pool_stream import stream_losing_a_member

FAILOVER_BOUND_S = 1.0  # the bound; the step timeout (timeout_s) is 30 s


def _ffn_main(port: int, die_at: int, threads: int, ready, stop, connector: str) -> None:
    # The attention side's count: CPU matmuls reduce in another order with
    # another count, and the outputs are compared bit for bit.
    torch.set_num_threads(threads)
    role = FFNRole(connector, port, "cpu", torch.float32)
    mlps = [layer.mlp for layer in role.model.layers]
    calls = [0]

    def compute(layer: int, h: torch.Tensor, routing) -> torch.Tensor:
        if role.loop.ready.is_set():
            calls[0] += 1
            if calls[0] == die_at:
                os.kill(os.getpid(), signal.SIGKILL)  # mid-step, without a goodbye
        return mlps[layer](h, routing)

    role.loop.compute_fn = compute
    role.start()
    role.loop.ready.wait(60)
    ready.set()
    stop.wait()
    role.stop()


class FFN:
    """An FFN server process on port (die_at > 0: SIGKILLs itself at that mlp
    call after warm-up)."""

    def __init__(self, die_at: int = 0, connector: str = "shm") -> None:
        ctx = multiprocessing.get_context("spawn")
        self.port = free_port()
        self.ready, self.stop_event = ctx.Event(), ctx.Event()
        self.proc = ctx.Process(target=_ffn_main, daemon=True,
                                args=(self.port, die_at, torch.get_num_threads(), self.ready,
                                      self.stop_event, connector))
        self.proc.start()

    @property
    def endpoint(self) -> str:
        return f"127.0.0.1:{self.port}"

    def wait_ready(self) -> "FFN":
        assert self.ready.wait(120), "the FFN process did not get ready"
        return self

    def stop(self) -> None:
        # Not through stop_event: an Event a SIGKILLed process waited on can
        # block its set() for good. SIGTERM ends the process, its sockets close.
        if self.proc.is_alive():
            self.proc.terminate()
        self.proc.join(20)
        if self.proc.is_alive():
            self.proc.kill()


def pool_role(pool: list[str], pool_file: Path | None = None,
              connector: str = "shm") -> AttentionRole:
    config = LinkConfig(role="attention", connector=connector, num_ubatches=MAX_UBATCHES,
                        timeout_s=30, ffn_pool=pool,
                        ffn_pool_file=str(pool_file) if pool_file else None)
    return AttentionRole(connector, 1, "cpu", torch.float32, config=config)


def wait_for(predicate, what: str, timeout: float = 60) -> None:
    deadline = time.monotonic() + timeout
    while not predicate():
        assert time.monotonic() < deadline, what
        time.sleep(0.05)


def members(role: AttentionRole) -> dict[str, dict]:
    return {m["endpoint"]: m for m in role.link.document()["pool"]}


@pytest.fixture
def ffns(request):
    started: list[FFN] = []

    def start(die_at: int = 0, connector: str = "shm") -> FFN:
        started.append(FFN(die_at, connector))
        return started[-1]

    yield start
    for ffn in started:
        ffn.stop()


@pytest.mark.parametrize("num_ubatches, connector", [(1, "shm"), (2, "shm"), (2, "ipc")])
def test_a_killed_member_mid_step_changes_no_output(ffns, num_ubatches, connector):
    """Round robin sends steps 1, 3, ... to A, which dies at its 5th mlp call
    (3 layers x m micro-batches a step: mid-step 3 with m = 1, mid-step 1 with
    m = 2); that step finishes on B with the reference output, and so do the
    next ones, all on B. ipc: the attention side's wait on its own memory ends
    when the connector's watcher sees A's socket hang up, the rest of the step
    does nothing, and its end finds the loss: the step runs again whole on B
    (no layer call resumed)."""
    a, b = ffns(die_at=5, connector=connector), ffns(connector=connector)
    a.wait_ready()
    b.wait_ready()
    role = pool_role([a.endpoint, b.endpoint], connector=connector)
    try:
        wait_for(lambda: len(role.link.pool.ready_members()) == 2, "both members up")
        for seed in range(6):
            tokens, ubatches = sample_batch(num_ubatches, "cpu", seed)
            got = role.step(tokens, ubatches)
            assert torch.equal(got, role.model.reference(tokens, ubatches)), seed
        doc = role.link.document()
        by_endpoint = members(role)
        if connector == "ipc":  # checks once per step: the step runs again whole on B
            assert doc["aborted_steps"] == 1 and doc["failovers"] == 0, doc
        else:  # resumed on B where it stood
            assert doc["failovers"] == 1 and doc["resent_layer_calls"] >= 1, doc
        assert a.proc.join(10) is None and a.proc.exitcode == -signal.SIGKILL
        assert by_endpoint[a.endpoint]["state"] == "down", by_endpoint
        assert by_endpoint[a.endpoint]["failed_over"] == 1
        # Six steps, one of them begun on A and resumed on B.
        assert by_endpoint[a.endpoint]["steps"] + by_endpoint[b.endpoint]["steps"] == 7
        if connector != "ipc":
            assert doc["last_failover_seconds"] and max(
                doc["last_failover_seconds"]) < FAILOVER_BOUND_S, doc["last_failover_seconds"]
        assert doc["state"] == "ready" and doc["steps"] == 6
        # Nothing of AFD's in /dev/shm names the killed process (leftovers.py).
        assert not [p.name for p in leftovers.SHM_DIR.glob(f"vllm-afd-*-{a.proc.pid}x*")]
    finally:
        role.close()


def test_members_join_from_the_pool_file_and_share_the_steps(ffns, tmp_path):
    """The pool file lists A; C is started and appended later: the running link
    dials it and gives it every other step (round robin), no restart. With
    every member gone, steps fail at once with AFDLinkDown; a member back
    serves again."""
    pool_file = tmp_path / "pool.txt"
    a = ffns().wait_ready()
    pool_file.write_text(f"# the FFN pool\n{a.endpoint}\n")
    role = pool_role([], pool_file)
    try:
        tokens, ubatches = sample_batch(1, "cpu", 0)
        reference = role.model.reference(tokens, ubatches)
        assert torch.equal(role.step(tokens, ubatches), reference)
        c = ffns().wait_ready()
        pool_file.write_text(f"{a.endpoint}\n{c.endpoint}  # joined\n")
        wait_for(lambda: len(role.link.pool.ready_members()) == 2, "C dialed")
        for _ in range(4):
            assert torch.equal(role.step(tokens, ubatches), reference)
        by_endpoint = members(role)
        assert by_endpoint[c.endpoint]["steps"] == 2, by_endpoint
        assert by_endpoint[c.endpoint]["layer_calls"] == 2 * 3
        assert by_endpoint[a.endpoint]["steps"] == 3
        # A leaves the file: it is closed, C takes every step.
        pool_file.write_text(f"{c.endpoint}\n")
        wait_for(lambda: a.endpoint not in {m.endpoint for m in role.link.pool.ready_members()},
                 "A removed")
        assert torch.equal(role.step(tokens, ubatches), reference)
        # C gone too: no member left, a clear error at once.
        c.stop()
        wait_for(lambda: not role.link.pool.ready_members(), "C noticed as gone")
        t0 = time.monotonic()
        with pytest.raises(AFDLinkDown, match="is down"):
            role.step(tokens, ubatches)
        assert time.monotonic() - t0 < 1.0
        d = ffns().wait_ready()
        pool_file.write_text(f"{d.endpoint}\n")
        wait_for(lambda: role.link.pool.ready_members(), "D dialed")
        assert torch.equal(role.step(tokens, ubatches), reference)
    finally:
        role.close()


def test_a_pool_file_being_rewritten_closes_nobody(tmp_path):
    """write_text() and most editors truncate the file, then write it: a read in
    between lists nobody, and the write can keep the truncate's mtime (the file
    clock ticks every few ms). Neither may close a member or hide the new list.
    (Members are not started: this is the file's bookkeeping only.)"""
    import os

    pool_file = tmp_path / "pool.txt"
    pool_file.write_text("127.0.0.1:7701\n127.0.0.1:7702\n")
    config = LinkConfig(role="attention", connector="shm", ffn_pool_file=str(pool_file))
    pool = Pool(config, rank=0, device=None, connector_kwargs=dict, lock=threading.Lock(),
                on_state=lambda: None, publish=lambda: None, in_step=lambda m: False)

    def listed() -> list[str]:
        return [m.endpoint for m in pool.members if not m.removed]

    assert listed() == ["127.0.0.1:7701", "127.0.0.1:7702"]
    with open(pool_file, "w"):  # truncated, not yet written
        pass
    pool.sync(start=False)
    assert listed() == ["127.0.0.1:7701", "127.0.0.1:7702"]
    truncated = os.stat(pool_file).st_mtime_ns
    pool_file.write_text("127.0.0.1:7702\n127.0.0.1:7703\n")
    os.utime(pool_file, ns=(truncated, truncated))  # the same clock tick
    pool.sync(start=False)
    assert listed() == ["127.0.0.1:7702", "127.0.0.1:7703"]
    assert [m.endpoint for m in pool.members if m.removed] == ["127.0.0.1:7701"]


def test_pool_configuration_errors():
    from vllm.afd.adapter.config import AFDConfig

    for pool, message in ((["localhost"], "not host:port"),
                          (["127.0.0.1:70000"], "not host:port"),
                          (["127.0.0.1:7700", "127.0.0.1:7700"], "listed twice")):
        with pytest.raises(ValueError, match=message):
            AFDConfig(ffn_pool=pool)
    with pytest.raises(ValueError, match="only the attention role"):
        AFDConfig(role="ffn", ffn_pool=["127.0.0.1:7700"])
    with pytest.raises(ValueError, match="ffn_hosts cannot be combined"):
        AFDConfig(ffn_pool=["127.0.0.1:7700"], num_ffn_ranks=1, ffn_hosts=["127.0.0.2"])
    assert AFDConfig(ffn_pool=["[::1]:7700", "10.0.0.2:7800"]).link_config().has_pool()


LONG_TOKENS = 96  # the streamed completion that outlives a kill
# The stream of the attention server killed in act 3: long enough that it still flows
# when the survivor's stream, started after it, has begun.
KILLED_STREAM_TOKENS = 4 * LONG_TOKENS
CONCURRENT = 8
STALL_BOUND_S = 5.0  # a surviving attention server's stream never pauses longer


@pytest.mark.slow
def test_pool_of_ffn_servers_under_kills(models_dir, tmp_path):
    """Two attention servers (2A, ranks 0 and 1) share a pool of FFN servers
    (`vllm serve --afd-role ffn`, shm), listed in a pool file:

    1. FFN A is SIGKILLed while both attention servers stream and eight more
       requests run: every request completes with plain vLLM's tokens, each
       failover under a second, the metrics count them;
    2. FFN C is started under load and appended to the pool file: its layer
       calls are counted, no attention server restarted;
    3. B leaves the pool file (2A:1F on C) and attention server 1 is SIGKILLed
       mid-stream: attention server 0's stream completes with plain vLLM's
       tokens, never pausing beyond STALL_BOUND_S; C ends only rank 1's
       session, naming it.
    """
    import concurrent.futures
    import json

    import openai
    from oracle import engine_cli_args
    from servers import Server, cpu, metric_samples

    model = models_dir / "tiny-qwen3-moe"
    pool_file = tmp_path / "ffn-pool.txt"
    base = {"connector": "shm", "timeout_s": 30, "num_attention_ranks": 2}
    work = concurrent.futures.ThreadPoolExecutor(4)
    # Plain vLLM's answers, computed while the servers start: LONG_TOKENS greedy
    # tokens of each prompt; the short requests' 16 are their beginning.
    plain = work.submit(run_oracle, model, tmp_path / "plain.json", num_prompts=CONCURRENT,
                        extra=("--max-tokens", str(LONG_TOKENS)))

    def ffn(name: str) -> Server:
        port = free_port()
        server = Server(str(model), [*COMMON, "--afd-role", "ffn", "--afd-config",
                                     json.dumps({**base, "port": port})],
                        log_path=tmp_path / f"{name}.log", name=name,
                        env={"VLLM_CPU_OMP_THREADS_BIND": cpu(1)})
        server.afd_port = port
        return server.start()

    def attention(rank: int) -> Server:
        return Server(str(model), [
            *COMMON, *engine_cli_args(model), "--afd-role", "attention", "--afd-config",
            json.dumps({**base, "attention_rank": rank, "ffn_pool_file": str(pool_file)})],
            log_path=tmp_path / f"attention-{rank}.log", name=f"attention-{rank}",
            env={"VLLM_CPU_OMP_THREADS_BIND": cpu(0)}).start()

    servers = []
    try:
        a, b = ffn("ffn-a"), ffn("ffn-b")
        servers += [a, b]
        pool_file.write_text(f"127.0.0.1:{a.afd_port}\n127.0.0.1:{b.afd_port}\n")
        attns = [attention(0), attention(1)]
        servers += attns
        for server in servers:
            server.wait_ready()
        plain = plain.result(timeout=300)["results"]
        long_prompt, long_ids = plain[0]["prompt"], plain[0]["token_ids"]
        prompts = [r["prompt"] for r in plain]

        def client(server: Server) -> openai.OpenAI:
            return openai.OpenAI(base_url=server.url + "/v1", api_key="x", max_retries=0,
                                 timeout=120)

        def stream(server: Server, started: threading.Event | None = None,
                   max_tokens: int = LONG_TOKENS) -> dict:
            """The long greedy stream: its token ids and the longest gap."""
            ids, gaps, last = [], [], time.monotonic()
            for i, chunk in enumerate(client(server).completions.create(
                    model=str(model), prompt=long_prompt, max_tokens=max_tokens,
                    temperature=0, stream=True,
                    extra_body={"ignore_eos": True, "return_token_ids": True})):
                ids += chunk.choices[0].token_ids or []
                now_ = time.monotonic()
                gaps.append((now_, now_ - last))
                last = now_
                if started is not None and i == 5:
                    started.set()
            return {"ids": ids, "gaps": gaps}

        def complete(server: Server, prompt: str) -> list[int]:
            comp = client(server).completions.create(
                model=str(model), prompt=prompt, max_tokens=16, temperature=0,
                extra_body={"ignore_eos": True, "return_token_ids": True})
            return comp.choices[0].token_ids

        def status(server: Server) -> dict:
            return json.loads(server.get("/afd/status")[1])["links"][0]

        # C starts now, outside the pool (its start-up overlaps act 1).
        c = ffn("ffn-c")
        servers.append(c)

        # 1. FFN A killed under load.
        started = [threading.Event(), threading.Event()]
        streams = [work.submit(stream, attns[r], started[r]) for r in (0, 1)]
        with concurrent.futures.ThreadPoolExecutor(CONCURRENT) as load:
            for event in started:
                assert event.wait(120)
            others = [load.submit(complete, attns[i % 2], p) for i, p in enumerate(prompts)]
            time.sleep(0.5)
            # Frozen first, then killed: the pool takes its members in turn, a
            # step each, so within a step or two each attention server has one
            # in flight on A, which dies with it. Killed at a random moment, A
            # could be between steps (nothing to fail over) under a busy CPU.
            os.killpg(a.proc.pid, signal.SIGSTOP)
            time.sleep(1.0)
            a.kill()
            results = [f.result(timeout=300) for f in others]
        for got, ref in zip(results, plain, strict=True):
            assert got == ref["token_ids"][:16], ref["prompt"]
        for r in (0, 1):
            assert streams[r].result(timeout=300)["ids"] == long_ids, f"attention-{r}"
        failovers = []
        for server in attns:
            doc = status(server)
            failovers += doc["last_failover_seconds"]
            assert doc["state"] == "ready", doc
        assert failovers, "no step was in flight on FFN A when it died"
        assert max(failovers) < FAILOVER_BOUND_S, failovers
        # Each attention server's metrics count what its /afd/status says: its
        # failovers (one observation each), A down and B up in its pool.
        for server in attns:
            doc, metrics = status(server), server.get("/metrics")[1]
            assert sum(metric_samples(metrics, "vllm_afd_failovers_total").values()) \
                == doc["failovers"], doc
            assert sum(metric_samples(metrics, "vllm_afd_failover_seconds_count").values()) \
                == sum(doc["failover_seconds"]["counts"]) \
                == len(doc["last_failover_seconds"]), doc
            member_up = {dict(labels)["endpoint"]: v for labels, v in
                         metric_samples(metrics, "vllm_afd_pool_member_up").items()}
            assert member_up == {f"127.0.0.1:{a.afd_port}": 0.0,
                                 f"127.0.0.1:{b.afd_port}": 1.0}, member_up
        pids = {r: attns[r].proc.pid for r in (0, 1)}
        engine_pids = {r: status(attns[r])["pid"] for r in (0, 1)}

        # 2. FFN C joins under load.
        c.wait_ready()
        pool_file.write_text(f"127.0.0.1:{b.afd_port}\n127.0.0.1:{c.afd_port}\n")
        endpoint_c = f"127.0.0.1:{c.afd_port}"
        deadline = time.monotonic() + 60
        while True:
            complete(attns[0], prompts[0])
            members_0 = {m["endpoint"]: m for m in status(attns[0])["pool"]}
            if members_0.get(endpoint_c, {}).get("layer_calls", 0) > 0:
                break
            assert time.monotonic() < deadline, members_0
        workers_c = json.loads(c.get("/afd/status")[1])["workers"]
        assert workers_c[0]["steps"] > 0, workers_c
        # No attention server restarted: the same server and engine processes.
        assert {r: attns[r].proc.pid for r in (0, 1)} == pids
        assert {r: status(attns[r])["pid"] for r in (0, 1)} == engine_pids

        # 3. 2A:1F (B leaves the pool): attention server 1 killed mid-stream,
        # server 0's stream goes on through the FFN they shared.
        pool_file.write_text(f"{endpoint_c}\n")
        deadline = time.monotonic() + 30
        while any(m["state"] == "ready" and m["endpoint"] != endpoint_c
                  for server in attns for m in status(server)["pool"]):
            assert time.monotonic() < deadline, [status(s)["pool"] for s in attns]
            time.sleep(0.2)
        started = [threading.Event(), threading.Event()]
        # The doomed server's (long) stream first, then the survivor's: killed as
        # soon as the survivor's flows, its ~90 tokens left all come after the
        # kill. (Started together, the survivor's stream had now and then ended
        # before the other began: a kill after it proved nothing.)
        streams = [None, work.submit(stream, attns[1], started[1], KILLED_STREAM_TOKENS)]
        assert started[1].wait(120)
        streams[0] = work.submit(stream, attns[0], started[0])
        assert started[0].wait(120)
        assert not streams[1].done()  # the doomed stream still flows
        killed_at = time.monotonic()
        attns[1].kill()
        survivor = streams[0].result(timeout=300)
        assert survivor["ids"] == long_ids
        after = [gap for t, gap in survivor["gaps"] if t > killed_at]
        assert after and max(after) < STALL_BOUND_S, max(after, default=None)
        with pytest.raises(Exception):  # noqa: B017 - the killed server's stream
            streams[1].result(timeout=60)
        deadline = time.monotonic() + 10
        while True:
            worker = json.loads(c.get("/afd/status")[1])["workers"][0]
            if worker["serving"] == [0]:
                break
            assert time.monotonic() < deadline, worker
            time.sleep(0.2)
        assert "attention rank 1" in worker["last_peer_error"], worker
        assert c.get("/health")[0] == 200
    finally:
        for server in servers:
            server.stop()
        work.shutdown(wait=False, cancel_futures=True)


@pytest.mark.slow
def test_an_ipc_member_lost_mid_step_runs_the_step_again(models_dir, tmp_path):
    """vLLM (V1) attention server, a pool of two FFN servers on the ipc
    connector, which checks its calls once per step: FFN A is frozen, then
    killed, mid-stream. The step A held is aborted at its end and run again
    whole on B (the model's forward repeated, its KV entries written again):
    the stream completes with plain vLLM's greedy tokens."""
    from servers import metric_samples

    tokens = 32
    run = stream_losing_a_member(models_dir / "tiny-qwen3-moe", tmp_path, "ipc", tokens)
    ids, link = run["ids"], run["link"]
    assert ids == run["plain"]["token_ids"][:len(ids)] and len(ids) == tokens
    assert link["aborted_steps"] >= 1 and link["failovers"] == 0, link
    assert sum(metric_samples(run["metrics"], "vllm_afd_aborted_steps_total").values()) >= 1
