# SPDX-License-Identifier: Apache-2.0
# SPDX-FileCopyrightText: Copyright contributors to the vllm-afd project
"""`make bench-layer-call` (benchmarks/layer_call.py) runs end to end on a short
setting: both regimes through the model's RemoteFFN modules, every layer call
matched with its mlp call, the step's first calls apart; and steps of 3
micro-batches, ping-ponged. (Through the link's exchange, and steps of 2, it
runs in test_harness.py's tree without vLLM, as on a GPU machine.) Its numbers
are the benchmark's to report, not this test's."""

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]


@pytest.mark.skipif((os.cpu_count() or 1) < 2, reason="the benchmark pins two cores")
def test_the_layer_call_benchmark_matches_every_call_with_its_mlp(tmp_path):
    out = tmp_path / "layer_call.json"
    proc = subprocess.run([sys.executable, str(ROOT / "benchmarks" / "layer_call.py"),
                           "--steps", "12", "--tokens", "1", "--stream-mb", "1",
                           "--through", "model", "--ubatches", "3", "--out", str(out)], capture_output=True, text=True, timeout=300)
    assert proc.returncode == 0, proc.stderr[-3000:]
    result = json.loads(out.read_text())
    assert [(c["through"], c["regime"]) for c in result["cases"]] == [
        ("model", "warm"), ("model", "cold")]
    for case in result["cases"]:
        # 12 steps of 8 layer calls: a tenth of them, in whole steps (one), is
        # warm-up; each step's first call is reported apart.
        assert case["layer_calls"] == 11 * 7, case
        for key in ("beyond_compute", "to_the_mlp", "after_the_mlp", "mlp",
                    "first_call_of_a_step_beyond_compute"):
            p = case[key]
            assert p["median_us"] <= p["p90_us"], (key, p)
        assert case["to_the_mlp"]["median_us"] > 0 and case["after_the_mlp"]["median_us"] > 0
    # Micro-batched steps (--ubatches): B = the largest --tokens, at least m,
    # split as the runner splits it; 11 steps after the warm-up one.
    assert [(c["tokens"], c["ubatches"]) for c in result["ubatched"]] == [(3, [1, 1, 1])]
    for case in result["ubatched"]:
        p = case["beyond_compute_per_call"]
        assert 0 < p["median_us"] <= p["p90_us"], case
        assert case["step"]["median_us"] > p["median_us"], case  # a step has 16-24 calls
    assert "B=1   model    warm" in proc.stdout and "B=1   model    cold" in proc.stdout, (
        proc.stdout)
