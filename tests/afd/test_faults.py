# SPDX-License-Identifier: Apache-2.0
# SPDX-FileCopyrightText: Copyright contributors to the vllm-afd project
"""Lost peers, refused peers and shutdowns, with real `vllm serve` processes.

The tests of this module run in order on one story, so that each server start
(~20 s on 2 cores) serves several checks:

  1. the attention server starts without an FFN: it serves HTTP, /health is 503
     with the reason, requests get a clear 503 at once; the FFN starts late and
     the attention server connects by itself and answers (the reference);
  2. the FFN is SIGKILLed mid-stream: the stream fails with the reason within
     timeout_s, the attention server stays up (503 meanwhile), a new FFN
     process comes up and the same server answers the reference tokens again;
  3. a mismatched attention server (other model, other micro-batch count) is
     refused within 10 s on both sides, each item named; the good pair still
     serves;
  4. the attention server is SIGKILLed mid-stream: the FFN goes back to
     waiting and serves the next attention server, correctly;
  5. SIGTERM in both orders (attention, then a new attention server's FFN):
     exit 0, no process left, no shared memory left, the survivor serves on.

The reference answer is the AFD answer of step 1; test_serve.py shows that it
equals plain vLLM's.
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
from servers import Server, free_port

pytestmark = pytest.mark.slow
COMMON = ["--max-model-len", "512", "--dtype", "float32", "--enforce-eager",
          "--max-num-batched-tokens", "64", "--max-num-seqs", "16",
          "--no-enable-prefix-caching"]
PROMPTS = ["The capital of France is", "Disaggregated serving means"]
TIMEOUT_S = 10  # AFDConfig.timeout_s of every server here: the bound on a lost peer


class Story:
    """The servers of this module: one FFN port, servers started and stopped
    by the tests in turn."""

    def __init__(self, model: Path, logs: Path):
        self.model = model
        self.logs = logs
        self.port = free_port()
        self.servers: list[Server] = []
        self.reference = None

    def afd(self, **extra) -> str:
        return json.dumps({"connector": "shm", "port": self.port, "timeout_s": TIMEOUT_S,
                           **extra})

    def ffn(self, name: str) -> Server:
        return self._start(Server(str(self.model), [
            *COMMON, "--afd-role", "ffn", "--afd-config", self.afd()],
            log_path=self.logs / f"{name}.log", env={"VLLM_CPU_OMP_THREADS_BIND": "1"},
            name=name))

    def attention(self, name: str, model: Path | None = None, **extra) -> Server:
        model = model or self.model
        return self._start(Server(str(model), [
            *COMMON, *engine_cli_args(model), "--afd-role", "attention",
            "--afd-config", self.afd(**extra)],
            log_path=self.logs / f"{name}.log", env={"VLLM_CPU_OMP_THREADS_BIND": "0"},
            name=name))

    def _start(self, server: Server) -> Server:
        self.servers.append(server.start())
        return server

    def client(self, server: Server) -> openai.OpenAI:
        return openai.OpenAI(base_url=server.url + "/v1", api_key="x", max_retries=0,
                             timeout=60)

    def complete(self, server: Server):
        comp = self.client(server).completions.create(
            model=str(self.model), prompt=PROMPTS, max_tokens=12, temperature=0, logprobs=1,
            extra_body={"ignore_eos": True, "return_token_ids": True})
        return [(c.token_ids, c.logprobs.token_logprobs)
                for c in sorted(comp.choices, key=lambda c: c.index)]

    def assert_reference(self, server: Server) -> None:
        for (ids, lps), (ref_ids, ref_lps) in zip(self.complete(server), self.reference):
            assert ids == ref_ids
            assert max(abs(a - b) for a, b in zip(lps, ref_lps)) < 1e-5

    def stop_all(self) -> None:
        for server in self.servers:
            server.stop()


@pytest.fixture(scope="module")
def story(models_dir, tmp_path_factory):
    s = Story(models_dir / "tiny-qwen3-moe", tmp_path_factory.mktemp("faults"))
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
        model=str(story.model), prompt=PROMPTS[0], max_tokens=450, temperature=0,
        stream=True, extra_body={"ignore_eos": True})
    acted_at = None
    try:
        for i, _chunk in enumerate(stream):
            if i == 5:
                action()
                acted_at = time.monotonic()
    except openai.APIError as e:
        assert acted_at is not None, f"stream failed before the fault: {e}"
        return e, time.monotonic() - acted_at
    pytest.fail("the stream completed although its peer was killed")


def test_ffn_late(story):
    attn = story.attention("attention-a")
    attn.wait_http()
    # No FFN yet: not ready, with the reason; requests are refused at once.
    _, body = wait_health(attn, 503, timeout=5)
    assert "FFN rank 0" in body and "connecting" in body, body
    assert_unavailable(story, attn, "FFN rank 0")
    status = json.loads(attn.get("/afd/status")[1])
    assert status["ready"] is False and status["links"][0]["state"] == "connecting"

    ffn = story.ffn("ffn-1")
    ffn.wait_ready()
    wait_health(attn, 200, timeout=30)  # connected by itself, no restart
    story.reference = story.complete(attn)
    story.attn, story.ffn_server = attn, ffn


def test_ffn_killed_mid_stream_and_restarted(story):
    attn, ffn = story.attn, story.ffn_server
    error, seconds = stream_then(story, attn, ffn.kill)
    assert seconds < TIMEOUT_S
    assert "AFD" in str(error) and "FFN" in str(error), str(error)
    assert attn.proc.poll() is None, "the attention server died with its FFN"
    seconds, body = wait_health(attn, 503, timeout=5)
    assert "FFN rank 0" in body and ("down" in body or "connecting" in body), body
    assert_unavailable(story, attn, "FFN rank 0")

    ffn2 = story.ffn("ffn-2")
    ffn2.wait_ready()
    wait_health(attn, 200, timeout=30)
    story.assert_reference(attn)
    status = json.loads(attn.get("/afd/status")[1])
    link = status["links"][0]
    assert link["state"] == "ready" and link["reconnects"] == 1, link
    assert link["errors"].get("connection", 0) >= 1, link
    # The link's metrics, next to vLLM's own.
    _, metrics = attn.get("/metrics")
    for line in ('vllm_afd_peer_up{peer="FFN rank 0', "vllm_afd_reconnects_total",
                 "vllm_afd_layer_round_trip_seconds_bucket", "vllm_afd_bytes_sent_total",
                 'vllm_afd_connector_errors_total{kind="connection"', "vllm:num_requests"):
        assert line.split("{")[0] in metrics, line
    assert 'vllm_afd_peer_up{peer="FFN rank 0' in metrics.replace(
        'role="attention",', "").replace('rank="0",', ""), metrics[:2000]
    story.ffn_server = ffn2


def test_mismatched_attention_is_refused(story, models_dir):
    # Another model (other architecture and weights) with another micro-batch count.
    bad = story.attention("attention-bad", model=models_dir / "tiny-deepseek-v2",
                          num_ubatches=2)
    bad.wait_http()
    seconds, body = wait_health(bad, 503, timeout=10)
    t0 = time.monotonic()
    while ": refused" not in body:
        assert time.monotonic() - t0 < 10, body
        time.sleep(0.2)
        body = bad.get("/health")[1]
    assert time.monotonic() - t0 < 10
    for item in ("num_ubatches", "fingerprint['architecture']", "fingerprint['weights']"):
        assert item in body, body
    # The FFN says so too, naming the items, and keeps serving the good peer.
    ffn_log = story.ffn_server.log_path.read_text()
    assert "refused attention rank 0" in ffn_log and "num_ubatches" in ffn_log
    assert "fingerprint['architecture']" in ffn_log
    workers = json.loads(story.ffn_server.get("/afd/status")[1])["workers"]
    assert "fingerprint['architecture']" in workers[0]["last_refusal"], workers
    _, metrics = story.ffn_server.get("/metrics")
    assert "vllm_afd_handshake_failures_total" in metrics
    story.assert_reference(story.attn)
    bad.stop()


def test_attention_killed_ffn_serves_the_next(story):
    ffn = story.ffn_server
    error, _ = stream_then(story, story.attn, story.attn.kill)
    assert isinstance(error, (openai.APIConnectionError, openai.APIError))
    t0 = time.monotonic()
    while True:  # the FFN noticed and waits for the next peer
        workers = json.loads(ffn.get("/afd/status")[1])["workers"]
        if workers[0]["serving"] == [] and workers[0]["last_peer_error"]:
            break
        assert time.monotonic() - t0 < TIMEOUT_S, workers
        time.sleep(0.2)
    assert "attention rank 0" in ffn.log_path.read_text()
    assert ffn.get("/health")[0] == 200
    attn2 = story.attention("attention-b")
    attn2.wait_ready()
    story.assert_reference(attn2)
    story.attn = attn2


def shm_segments(port: int) -> list[str]:
    return sorted(n for n in os.listdir("/dev/shm") if f"vllm-afd-{port}-" in n)


def stop_and_check(server: Server) -> None:
    """SIGTERM the server's main process (as `kill PID`, systemd or docker stop
    do): it must stop its children itself and exit 0."""
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
    log = server.log_path.read_text()
    # vLLM's own shutdown (plain too) may log a traceback of its output handler
    # and resource-tracker notes; none of it may come from or through AFD code.
    for bad in ('/vllm/afd/', "died unexpectedly", "stop failed"):
        assert bad not in log, f"{server.name}: {bad!r} in log:\n{server.log_tail(60)}"
    assert not [n for n in os.listdir("/dev/shm")
                if n.startswith(f"vllm-afd-status-{server.proc.pid}-")]


def test_sigterm_attention_first(story):
    """The attention server goes first: the FFN notices at once, goes back to
    waiting and serves the next attention server."""
    ffn = story.ffn_server
    stop_and_check(story.attn)
    t0 = time.monotonic()
    while json.loads(ffn.get("/afd/status")[1])["workers"][0]["serving"]:
        assert time.monotonic() - t0 < 5
        time.sleep(0.2)
    attn = story.attention("attention-c")
    attn.wait_ready()
    story.assert_reference(attn)
    story.attn = attn


def test_sigterm_ffn_first(story):
    """The FFN goes first: the attention server notices within a second or
    two, stays up (503), then exits cleanly on its own SIGTERM."""
    stop_and_check(story.ffn_server)
    wait_health(story.attn, 503, timeout=5)
    stop_and_check(story.attn)
    assert shm_segments(story.port) == []
