# SPDX-License-Identifier: Apache-2.0
# SPDX-FileCopyrightText: Copyright contributors to the vllm-afd project
"""A lost FFN on vLLM's batch-queue path (async scheduling, pipeline parallel)
fails the in-flight requests, not the engine, keeps only tokens made before the
loss, and the engine serves correct tokens again once an FFN server is back
(batch_queue_probe.py does the run, through the patched EngineCore line)."""

import json
import os
import sys
from pathlib import Path

import pytest

import preload
from servers import cpu
from helpers.oracle import assert_same, plain_result, run_oracle

PROBE = Path(__file__).with_name("batch_queue_probe.py")
LONG_TOKENS = 64
pytestmark = pytest.mark.slow


def test_batch_queue_path_survives_a_lost_ffn(models_dir, tmp_path):
    model = models_dir / "tiny-qwen3-moe"
    out = tmp_path / "probe.json"
    proc = preload.run([sys.executable, str(PROBE), str(model), str(out), str(tmp_path),
                        str(LONG_TOKENS)],
                       capture_output=True, text=True, timeout=600, cwd=tmp_path,
                       env=dict(os.environ, VLLM_CPU_OMP_THREADS_BIND=cpu(0)))
    assert proc.returncode == 0, proc.stdout[-2000:] + proc.stderr[-4000:]
    report = json.loads(out.read_text())
    plain = plain_result(model, tmp_path)

    # The engine really ran the batch-queue path, through the patched line
    # (EngineCore.__init__ wrapped step_with_batch_queue in the AFD guard), and
    # it gives plain vLLM's tokens.
    step_fn = report["step_fn"]
    assert step_fn["batch_queue"] and step_fn["wraps"] == "counted", step_fn
    assert step_fn["code"] == "guarded" and step_fn["file"].endswith(
        "afd/adapter/attention/failover.py"), step_fn
    assert report["batch_queue_steps"] > 0
    assert_same(plain, {"results": report["before"]})
    # FFN killed with requests in flight: every request finishes with an error,
    # within timeout_s (10 s) of the loss; the tokens it kept were made before
    # the loss and are plain vLLM's (no token is invented, none repeated).
    long_plain = run_oracle(model, tmp_path / "plain-long.json",
                            extra=("--max-tokens", str(LONG_TOKENS)))
    assert report["killed_at_step"] is not None, "the long generation ended before the kill"
    assert [r["finish_reason"] for r in report["lost"]] == ["error"] * len(plain["results"])
    assert report["lost_s"] < 10 + 5, report["lost_s"]
    kept = [len(r["token_ids"]) for r in report["lost"]]
    assert 0 < max(kept) < LONG_TOKENS, (kept, report["killed_at_step"])
    for lost, ref in zip(report["lost"], long_plain["results"], strict=True):
        n = len(lost["token_ids"])
        assert lost["token_ids"] == ref["token_ids"][:n], lost["prompt"]
    # The log names the cause.
    log = proc.stdout + proc.stderr
    assert "AFD: step failed" in log and "request(s) finished with an error" in log
    # A new FFN server: the same engine reconnects and serves plain vLLM's tokens again.
    assert_same(plain, {"results": report["after"]})
    assert report["link"]["state"] == "ready" and report["link"]["reconnects"] == 1, report["link"]
