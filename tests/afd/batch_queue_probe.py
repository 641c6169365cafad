# SPDX-License-Identifier: Apache-2.0
# SPDX-FileCopyrightText: Copyright contributors to the vllm-afd project
"""An in-process attention engine on vLLM's batch-queue path loses its FFN
server and gets it back (run as a subprocess by test_batch_queue_failover.py).

    batch_queue_probe.py MODEL OUT_JSON LOG_DIR

EngineCore takes step_with_batch_queue instead of step when it keeps more than
one batch in flight (async scheduling, pipeline parallel). The CPU platform
turns async scheduling off, so the probe gives the engine a two-batch queue the
way EngineCore.__init__ does for those modes, then: generates the oracle's
prompts; kills the FFN server (SIGKILL, whole process group); generates again
(every request must finish with an error, the engine must live); starts a new
FFN server on the same port and generates until the link is back.
"""

import json
import os
import sys
import time
from collections import deque
from pathlib import Path

os.environ["VLLM_ENABLE_V1_MULTIPROCESSING"] = "0"
REPO = Path(__file__).resolve().parents[2]
sys.path.insert(0, str(REPO / "tools"))

from oracle import PROMPTS  # noqa: E402
from servers import Server, free_port  # noqa: E402

ARGS = dict(max_model_len=512, dtype="float32", seed=0, max_num_batched_tokens=64,
            max_num_seqs=16, enforce_eager=True, enable_prefix_caching=False)


def ffn_server(model: str, afd: dict, log: Path) -> Server:
    args = ["--max-model-len", "512", "--dtype", "float32", "--enforce-eager",
            "--max-num-batched-tokens", "64", "--max-num-seqs", "16",
            "--afd-role", "ffn", "--afd-config", json.dumps(afd)]
    return Server(model, args, log_path=log, env={"VLLM_CPU_OMP_THREADS_BIND": "1"},
                  name="FFN server").start()


def outcome(outs) -> list[dict]:
    rows = []
    for o in outs:
        c = o.outputs[0]
        rows.append({"prompt": o.prompt, "finish_reason": c.finish_reason,
                     "token_ids": list(c.token_ids),
                     "logprobs": [lp[t].logprob for t, lp in zip(c.token_ids, c.logprobs or [])]})
    return rows


def main() -> None:
    model, out_path, log_dir = sys.argv[1], Path(sys.argv[2]), Path(sys.argv[3])
    from vllm import LLM, SamplingParams
    from vllm.afd.attention.failover import guard_step

    afd = {"connector": "tcp", "port": free_port(), "timeout_s": 10}
    ffn = ffn_server(model, afd, log_dir / "ffn-1.log")
    report: dict = {}
    try:
        ffn.wait_ready()
        llm = LLM(model=model, afd_role="attention", afd_config=afd, **ARGS)
        core = llm.llm_engine.engine_core.engine_core
        params = SamplingParams(temperature=0, max_tokens=16, logprobs=1, ignore_eos=True)
        steps = {"n": 0}

        def counted():
            steps["n"] += 1
            return core.step_with_batch_queue()

        # What EngineCore.__init__ sets up when max_concurrent_batches > 1 (with
        # the AFD seam around it), the step counted.
        core.batch_queue_size = 2
        core.batch_queue = deque(maxlen=2)
        core.step_fn = guard_step(core, counted)
        report["before"] = outcome(llm.generate(PROMPTS, params, use_tqdm=False))
        report["batch_queue_steps"] = steps["n"]

        ffn.kill()
        t0 = time.monotonic()
        report["lost"] = outcome(llm.generate(PROMPTS, params, use_tqdm=False))
        report["lost_s"] = time.monotonic() - t0

        ffn = ffn_server(model, afd, log_dir / "ffn-2.log")
        ffn.wait_ready()
        t0 = time.monotonic()
        attempts = 0
        while True:
            attempts += 1
            after = outcome(llm.generate(PROMPTS, params, use_tqdm=False))
            if all(r["finish_reason"] != "error" for r in after) or attempts >= 30:
                break
            time.sleep(1)
        report.update(after=after, attempts=attempts, back_s=time.monotonic() - t0)
        from vllm.afd.attention import runner as link  # the engine runs in this process

        report["link"] = link._link.document()
    finally:
        ffn.stop()
        out_path.write_text(json.dumps(report))


if __name__ == "__main__":
    main()
