# SPDX-License-Identifier: Apache-2.0
# SPDX-FileCopyrightText: Copyright contributors to the vllm-afd project
"""The in-process FFN engine (loopback) returns warmed up.

Both roles in one process share vLLM's process-wide forward context, which the
FFN's warm-up sets and restores on its loop's thread; an attention step that
overlapped the warm-up lost its context (a model whose warm-up took 2.7 s here
failed its first step with "Forward context is not set"). So FFNEngine waits
for the warm-up when the connector is loopback.
"""

import json
import os
import sys
from pathlib import Path

import preload
from servers import cpu

REPO = Path(__file__).resolve().parents[3]
SCRIPT = """
import json, os, sys
sys.path.insert(0, sys.argv[2])
os.environ["VLLM_ENABLE_V1_MULTIPROCESSING"] = "0"
import oracle
engine = oracle.start_inprocess_ffn(dict(
    model=sys.argv[1], max_model_len=512, dtype="float32", seed=0, enforce_eager=True,
    max_num_batched_tokens=64, max_num_seqs=16, afd_role="attention",
    afd_config={"connector": "loopback", "port": 7700, "timeout_s": 60}))
print("STATUS " + json.dumps(engine.status()))
engine.shutdown()
"""


def test_the_loopback_ffn_engine_returns_warmed_up(models_dir):
    proc = preload.run(
        [sys.executable, "-c", SCRIPT, str(models_dir / "tiny-qwen3-moe"),
         str(REPO / "tools" / "models")],
        capture_output=True, text=True, timeout=300,
        env=dict(os.environ, VLLM_CPU_OMP_THREADS_BIND=cpu(0)))
    assert proc.returncode == 0, proc.stderr[-4000:]
    line = next(x for x in proc.stdout.splitlines() if x.startswith("STATUS "))
    (status,) = json.loads(line[len("STATUS "):])
    assert status["ready"] and not status["error"], status
    assert status["warmup"]["calls"] > 0, status
