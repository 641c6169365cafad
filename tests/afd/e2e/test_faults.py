# SPDX-License-Identifier: Apache-2.0
# SPDX-FileCopyrightText: Copyright contributors to the vllm-afd project
"""Lost peers, refused peers and shutdowns, with real `vllm serve` processes.

A server start costs ~20 s on 2 cores, so the module's servers are shared: each
test asks the Story for what it needs (a fresh attention server, a connected
pair) and the Story starts only what is not running already. Every test runs
alone (`-k`) or in any order; run in file order they reuse each other's
servers:

  1. the attention server starts without an FFN: it serves HTTP, /health is 503
     with the reason, requests get a clear 503 at once; the FFN starts late and
     the attention server connects by itself and answers plain vLLM's tokens;
  2. the FFN is SIGKILLed mid-stream: the stream fails with the reason within
     timeout_s, the attention server stays up (503 meanwhile), a new FFN
     process comes up and the same server answers the reference tokens again;
  3. a mismatched attention server (other model, other micro-batch count) is
     refused within 10 s on both sides, each item named; the good pair still
     serves;
  4. SIGTERM in both orders (attention, then a new attention server's FFN):
     exit 0, no process left, no shared memory left, the survivor serves on.

(An attention server SIGKILLed mid-stream while another one keeps streaming
through the same FFN servers is test_pool.py's third act.)

The reference answer is plain vLLM's (the oracle's in-process run of the same
prompts, tools/models/oracle.py).
"""

import json
import os
import signal
import subprocess
import time
from pathlib import Path

import openai
import pytest

from oracle import engine_cli_args
from servers import Server, cpu, free_port
from helpers.oracle import plain_result

pytestmark = pytest.mark.slow
COMMON = ["--max-model-len", "512", "--dtype", "float32", "--enforce-eager",
          "--max-num-batched-tokens", "64", "--max-num-seqs", "16",
          "--no-enable-prefix-caching"]
NUM_PROMPTS, MAX_TOKENS = 2, 16  # the oracle's first prompts and its token count
TIMEOUT_S = 10  # AFDConfig.timeout_s of every server here: the bound on a lost peer


class Story:
    """The servers of this module: one FFN port; the current FFN and attention
    servers, started when a test needs them and not running."""

    def __init__(self, model: Path, logs: Path, reference: dict):
        self.model = model
        self.logs = logs
        self.port = free_port()
        self.servers: list[Server] = []
        self.reference = [(r["token_ids"], r["logprobs"]) for r in reference["results"]]
        self.prompts = [r["prompt"] for r in reference["results"]]
        self.ffn_server: Server | None = None
        self.attn: Server | None = None
        self.count = 0
        self.extra_env: dict[str, str] = {}  # of the servers started next

    def afd(self, **extra) -> str:
        return json.dumps({"connector": "shm", "port": self.port, "timeout_s": TIMEOUT_S,
                           **extra})

    def name(self, role: str) -> str:
        self.count += 1
        return f"{role}-{self.count}"

    def ffn(self, name: str | None = None) -> Server:
        return self._start(Server(str(self.model), [
            *COMMON, "--afd-role", "ffn", "--afd-config", self.afd()],
            log_path=self.logs / f"{name or self.name('ffn')}.log",
            env={"VLLM_CPU_OMP_THREADS_BIND": cpu(1), **self.extra_env},
            name=name or "FFN server"))

    def attention(self, name: str | None = None, model: Path | None = None,
                  **extra) -> Server:
        model = model or self.model
        name = name or self.name("attention")
        return self._start(Server(str(model), [
            *COMMON, *engine_cli_args(model), "--afd-role", "attention",
            "--afd-config", self.afd(**extra)],
            log_path=self.logs / f"{name}.log",
            env={"VLLM_CPU_OMP_THREADS_BIND": cpu(0), **self.extra_env}, name=name))

    def _start(self, server: Server) -> Server:
        self.servers.append(server.start())
        return server

    @staticmethod
    def running(server: Server | None) -> bool:
        return server is not None and server.proc.poll() is None

    def running_ffn(self) -> Server:
        if not self.running(self.ffn_server):
            self.ffn_server = self.ffn()
        self.ffn_server.wait_ready()
        return self.ffn_server

    def pair(self) -> tuple[Server, Server]:
        """A connected attention server and its FFN (/health 200 on both)."""
        ffn = self.running_ffn()
        if not self.running(self.attn):
            self.attn = self.attention()
        self.attn.wait_ready()
        wait_health(self.attn, 200, timeout=30)
        return self.attn, ffn

    def real_spawn_pair(self) -> tuple[Server, Server]:
        """A fresh pair whose engine processes start as vLLM starts them
        (spawn), for the tests that SIGTERM a server and require exit 0. A
        forked engine core (VLLM_AFD_TEST_FORK_SPAWN, tools/serving/preload.py)
        inherits the API server's listening socket, and vLLM's shutdown looks
        up who holds that port: a forked child exiting right then made the
        lookup raise (psutil.ZombieProcess), exit 1. Spawned ones hold nothing."""
        self.stop(self.attn)
        self.stop(self.ffn_server)
        self.extra_env = {"VLLM_AFD_TEST_FORK_SPAWN": "0"}
        try:
            return self.pair()
        finally:
            self.extra_env = {}

    def stop(self, server: Server | None) -> None:
        if self.running(server):
            server.stop()

    def client(self, server: Server) -> openai.OpenAI:
        return openai.OpenAI(base_url=server.url + "/v1", api_key="x", max_retries=0,
                             timeout=60)

    def complete(self, server: Server):
        comp = self.client(server).completions.create(
            model=str(self.model), prompt=self.prompts, max_tokens=MAX_TOKENS, temperature=0,
            logprobs=1, extra_body={"ignore_eos": True, "return_token_ids": True})
        return [(c.token_ids, c.logprobs.token_logprobs)
                for c in sorted(comp.choices, key=lambda c: c.index)]

    def assert_reference(self, server: Server) -> None:
        """The server answers exactly what plain vLLM answers."""
        for (ids, lps), (ref_ids, ref_lps) in zip(self.complete(server), self.reference,
                                                   strict=True):
            assert ids == ref_ids
            assert max(abs(a - b) for a, b in zip(lps, ref_lps)) < 1e-5

    def stop_all(self) -> None:
        for server in self.servers:
            server.stop()


@pytest.fixture(scope="module")
def story(models_dir, tmp_path_factory):

    logs = tmp_path_factory.mktemp("faults")
    model = models_dir / "tiny-qwen3-moe"
    s = Story(model, logs, plain_result(model, logs, num_prompts=NUM_PROMPTS))
    yield s
    s.stop_all()


def wait_health(server: Server, status: int, timeout: float) -> tuple[float, str]:
    """Poll /health until it answers `status`; (seconds, body)."""
    t0 = time.monotonic()
    while True:
        code, body = server.get("/health", timeout=5)
        if code == status:
            return time.monotonic() - t0, body
        assert time.monotonic() - t0 < timeout, (
            f"{server.name} /health stayed {code} ({body!r}), expected {status}; log "
            f"tail:\n{server.log_tail()}")
        time.sleep(0.2)


def assert_unavailable(story: Story, server: Server, *needles: str) -> None:
    """A request is refused at once with 503 and a reason naming the link."""
    t0 = time.monotonic()
    with pytest.raises(openai.InternalServerError) as info:
        story.complete(server)
    assert time.monotonic() - t0 < 2.0
    assert info.value.status_code == 503
    for needle in ("AFD", *needles):
        assert needle in str(info.value), str(info.value)


def stream_then(story: Story, server: Server, action) -> tuple[BaseException, float]:
    """Start a long greedy stream, run action() after a few chunks, return the
    error the stream ended with and the seconds from action() to it."""
    stream = story.client(server).completions.create(
        model=str(story.model), prompt=story.prompts[0], max_tokens=450, temperature=0,
        stream=True, extra_body={"ignore_eos": True})
    acted_at = None
    try:
        for i, _chunk in enumerate(stream):
            if i == 5:
                action()
                acted_at = time.monotonic()
    except Exception as e:  # noqa: BLE001 - what the client raised is the subject
        assert acted_at is not None, f"stream failed before the fault: {e!r}"
        return e, time.monotonic() - acted_at
    pytest.fail("the stream completed although its peer was killed")


def test_ffn_late(story):
    # A fresh attention server, and no FFN at all.
    story.stop(story.ffn_server)
    story.stop(story.attn)
    attn = story.attn = story.attention()
    attn.wait_http()
    # No FFN yet: not ready, with the reason; requests are refused at once.
    _, body = wait_health(attn, 503, timeout=5)
    assert "FFN rank 0" in body and "connecting" in body, body
    assert_unavailable(story, attn, "FFN rank 0")
    status = json.loads(attn.get("/afd/status")[1])
    assert status["ready"] is False and status["links"][0]["state"] == "connecting"

    story.running_ffn()
    wait_health(attn, 200, timeout=30)  # connected by itself, no restart
    story.assert_reference(attn)


def test_ffn_killed_mid_stream_and_restarted(story):
    attn, ffn = story.pair()
    before = json.loads(attn.get("/afd/status")[1])["links"][0]
    error, seconds = stream_then(story, attn, ffn.kill)
    assert seconds < TIMEOUT_S
    # The stream's last event names the lost link (a 503 in the OpenAI format).
    assert isinstance(error, openai.APIError), repr(error)
    assert "AFD" in str(error) and "FFN" in str(error), str(error)
    assert attn.proc.poll() is None, "the attention server died with its FFN"
    seconds, body = wait_health(attn, 503, timeout=5)
    assert "FFN rank 0" in body and ("down" in body or "connecting" in body), body
    assert_unavailable(story, attn, "FFN rank 0")

    story.running_ffn()  # a new FFN process on the same port
    wait_health(attn, 200, timeout=30)
    story.assert_reference(attn)
    link = json.loads(attn.get("/afd/status")[1])["links"][0]
    assert link["state"] == "ready" and link["reconnects"] == before["reconnects"] + 1, link
    assert link["errors"].get("connection", 0) >= 1, link
    # The link's metrics, next to vLLM's own.
    _, metrics = attn.get("/metrics")
    for line in ('vllm_afd_peer_up{peer="FFN rank 0', "vllm_afd_reconnects_total",
                 "vllm_afd_layer_round_trip_seconds_bucket", "vllm_afd_bytes_sent_total",
                 'vllm_afd_connector_errors_total{kind="connection"', "vllm:num_requests"):
        assert line.split("{")[0] in metrics, line
    assert 'vllm_afd_peer_up{peer="FFN rank 0' in metrics.replace(
        'role="attention",', "").replace('rank="0",', ""), metrics[:2000]


def test_mismatched_attention_is_refused(story, models_dir):
    attn, ffn = story.pair()
    # Another model (other architecture and weights) with another micro-batch count.
    bad = story.attention(model=models_dir / "tiny-deepseek-v2", num_ubatches=2)
    bad.wait_http()
    # Both sides know within 10 s of the bad server being up (its link dials
    # while the model loads, so it may have been refused already).
    t0 = time.monotonic()
    attention_side = ffn_side = None
    while attention_side is None or ffn_side is None:
        assert time.monotonic() - t0 < 10, (attention_side, ffn_side)
        body = bad.get("/health")[1]
        if attention_side is None and ": refused" in body:
            attention_side = body
        workers = json.loads(ffn.get("/afd/status")[1])["workers"]
        if ffn_side is None and "fingerprint['architecture']" in (
                workers[0]["last_refusal"] or ""):
            ffn_side = workers[0]["last_refusal"]
        time.sleep(0.2)
    for item in ("num_ubatches", "fingerprint['architecture']", "fingerprint['weights']"):
        assert item in attention_side and item in ffn_side, (attention_side, ffn_side)
    ffn_log = ffn.log_path.read_text()
    assert "refused attention rank 0" in ffn_log and "num_ubatches" in ffn_log
    _, metrics = ffn.get("/metrics")
    assert "vllm_afd_handshake_failures_total" in metrics
    # The good pair serves on.
    story.assert_reference(attn)
    bad.stop()


def shm_segments(port: int) -> list[str]:
    return sorted(n for n in os.listdir("/dev/shm") if f"vllm-afd-{port}-" in n)


def stop_and_check(server: Server) -> None:
    """SIGTERM the server's main process (as `kill PID`, systemd or docker stop
    do): it must stop its children itself and exit 0. Its log from the
    SIGTERM on is checked (earlier tests may have made this server log a lost
    FFN's traceback)."""
    before = server.log_path.stat().st_size
    t0 = time.monotonic()
    os.kill(server.proc.pid, signal.SIGTERM)
    code = server.proc.wait(timeout=60)
    assert code == 0, f"{server.name} exited {code}; log tail:\n{server.log_tail()}"
    assert time.monotonic() - t0 < 30
    while server.group_alive():  # e.g. multiprocessing's resource tracker, exiting
        assert time.monotonic() - t0 < 30, (
            f"{server.name} left processes behind: "
            + subprocess.run(["ps", "-o", "pid,args", "-g", str(server.proc.pid)],
                             capture_output=True, text=True).stdout)
        time.sleep(0.2)
    with open(server.log_path, "rb") as f:
        f.seek(before)
        log = f.read().decode(errors="replace")
    # vLLM's own shutdown (plain too) may log a traceback of its output handler
    # and resource-tracker notes; none of it may come from or through AFD code.
    for bad in ('/vllm/afd/', "died unexpectedly", "stop failed"):
        assert bad not in log, f"{server.name}: {bad!r} in log:\n{server.log_tail(60)}"
    assert not server.status_dirs_left()


def test_sigterm_attention_first(story):
    """The attention server goes first: the FFN notices at once, goes back to
    waiting and serves the next attention server."""
    attn, ffn = story.real_spawn_pair()
    stop_and_check(attn)
    t0 = time.monotonic()
    while json.loads(ffn.get("/afd/status")[1])["workers"][0]["serving"]:
        assert time.monotonic() - t0 < 5
        time.sleep(0.2)
    attn2, _ = story.pair()
    story.assert_reference(attn2)


def test_sigterm_ffn_first(story):
    """The FFN goes first: the attention server notices within a second or
    two, stays up (503), then exits cleanly on its own SIGTERM."""
    attn, ffn = story.real_spawn_pair()
    stop_and_check(ffn)
    wait_health(attn, 503, timeout=5)
    stop_and_check(attn)
    assert shm_segments(story.port) == []
