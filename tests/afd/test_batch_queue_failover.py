# SPDX-License-Identifier: Apache-2.0
# SPDX-FileCopyrightText: Copyright contributors to the vllm-afd project
"""A lost FFN on vLLM's batch-queue path (async scheduling, pipeline parallel)
fails the in-flight requests, not the engine, and the engine serves correct
tokens again once an FFN server is back (batch_queue_probe.py does the run)."""

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

from test_oracle import assert_same, plain_result

PROBE = Path(__file__).with_name("batch_queue_probe.py")
pytestmark = pytest.mark.slow


def test_batch_queue_path_survives_a_lost_ffn(models_dir, tmp_path):
    model = models_dir / "tiny-qwen3-moe"
    out = tmp_path / "probe.json"
    proc = subprocess.run([sys.executable, str(PROBE), str(model), str(out), str(tmp_path)],
                          capture_output=True, text=True, timeout=600, cwd=tmp_path,
                          env=dict(os.environ, VLLM_CPU_OMP_THREADS_BIND="0"))
    assert proc.returncode == 0, proc.stdout[-2000:] + proc.stderr[-4000:]
    report = json.loads(out.read_text())
    plain = plain_result(model, tmp_path)

    # The engine really ran the batch-queue path, and it gives plain vLLM's tokens.
    assert report["batch_queue_steps"] > 0
    assert_same(plain, {"results": report["before"]})
    # FFN killed: every request finishes with an error, within timeout_s (10 s) of
    # the loss, and no token is invented.
    assert [r["finish_reason"] for r in report["lost"]] == ["error"] * len(plain["results"])
    assert report["lost_s"] < 10 + 5, report["lost_s"]
    # The log names the cause.
    log = proc.stdout + proc.stderr
    assert "AFD: step failed" in log and "request(s) finished with an error" in log
    # A new FFN server: the same engine reconnects and serves plain vLLM's tokens again.
    assert_same(plain, {"results": report["after"]})
    assert report["link"]["state"] == "ready" and report["link"]["reconnects"] == 1, report["link"]
