# SPDX-License-Identifier: Apache-2.0
# SPDX-FileCopyrightText: Copyright contributors to the vllm-afd project
"""An in-process attention engine on vLLM's batch-queue path loses its FFN
server and gets it back (run as a subprocess by test_batch_queue_failover.py).

    batch_queue_probe.py MODEL OUT_JSON LOG_DIR

EngineCore takes step_with_batch_queue instead of step when it keeps more than
one batch in flight (async scheduling, pipeline parallel: max_concurrent_batches
> 1). The CPU platform turns async scheduling off, so the probe makes
VllmConfig.max_concurrent_batches 2, as those modes do; EngineCore.__init__ then
builds its batch queue and the patched line wraps step_with_batch_queue in the
AFD guard (the probe checks that this is the step function that runs). Then:
generates the oracle's prompts; starts a long generation and kills the FFN
server (SIGKILL, whole process group) while its requests are in flight (every
request must finish with an error, keeping only the tokens made before the
loss, and the engine must live); starts a new FFN server on the same port and
generates until the link is back.
"""

import json
import os
import sys
import threading
import time
from pathlib import Path

os.environ["VLLM_ENABLE_V1_MULTIPROCESSING"] = "0"
REPO = Path(__file__).resolve().parents[3]
sys.path[:0] = [str(REPO / "tools" / "models"), str(REPO / "tools" / "serving")]

from oracle import PROMPTS  # noqa: E402
from servers import Server, cpu, free_port  # noqa: E402

ARGS = dict(max_model_len=512, dtype="float32", seed=0, max_num_batched_tokens=64,
            max_num_seqs=16, enforce_eager=True, enable_prefix_caching=False)


def ffn_server(model: str, afd: dict, log: Path) -> Server:
    args = ["--max-model-len", "512", "--dtype", "float32", "--enforce-eager",
            "--max-num-batched-tokens", "64", "--max-num-seqs", "16",
            "--afd-role", "ffn", "--afd-config", json.dumps(afd)]
    return Server(model, args, log_path=log, env={"VLLM_CPU_OMP_THREADS_BIND": cpu(1)},
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
    long_tokens = int(sys.argv[4])
    from vllm import LLM, SamplingParams
    from vllm.config import VllmConfig
    from vllm.v1.engine.core import EngineCore

    # Two batches in flight, as under async scheduling or pipeline parallelism:
    # EngineCore.__init__ builds its batch queue and picks step_with_batch_queue.
    VllmConfig.max_concurrent_batches = property(lambda self: 2)
    steps = {"n": 0}
    upstream_step = EngineCore.step_with_batch_queue

    def counted(self):
        steps["n"] += 1
        return upstream_step(self)

    EngineCore.step_with_batch_queue = counted

    afd = {"connector": "tcp", "port": free_port(), "timeout_s": 10}
    ffn = ffn_server(model, afd, log_dir / "ffn-1.log")
    report: dict = {}
    try:
        ffn.wait_ready()
        llm = LLM(model=model, afd_role="attention", afd_config=afd, **ARGS)
        core = llm.llm_engine.engine_core.engine_core
        # The step function is the patched line's: the AFD guard around the
        # batch-queue step (functools.wraps keeps what it wraps).
        code = core.step_fn.__code__
        report["step_fn"] = {"code": code.co_name, "file": code.co_filename,
                             "wraps": core.step_fn.__wrapped__.__func__.__name__,
                             "batch_queue": core.batch_queue is not None}
        params = SamplingParams(temperature=0, max_tokens=16, logprobs=1, ignore_eos=True)
        report["before"] = outcome(llm.generate(PROMPTS, params, use_tqdm=False))
        report["batch_queue_steps"] = steps["n"]

        # The FFN dies while a long generation's requests are in flight.
        long = SamplingParams(temperature=0, max_tokens=long_tokens, logprobs=1,
                              ignore_eos=True)
        start = steps["n"]

        generated = threading.Event()

        def kill_mid_generation():
            # Prefill done, decoding under way. A generation that ends first
            # (its requests failed early) must not leave this waiting forever:
            # the report then says the FFN was never killed mid-generation.
            while steps["n"] < start + 12 and not generated.is_set():
                time.sleep(0.005)
            mid_generation, at = not generated.is_set(), steps["n"] - start
            ffn.kill()
            report["killed_at_step"] = at if mid_generation else None

        killer = threading.Thread(target=kill_mid_generation)
        killer.start()
        t0 = time.monotonic()
        try:
            report["lost"] = outcome(llm.generate(PROMPTS, long, use_tqdm=False))
        finally:
            generated.set()
        report["lost_s"] = time.monotonic() - t0
        killer.join()

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
        from vllm.afd.adapter.attention import runner as link  # the engine runs in this process

        report["link"] = link._link.document()
    finally:
        ffn.stop()
        out_path.write_text(json.dumps(report))


if __name__ == "__main__":
    main()
