# SPDX-License-Identifier: Apache-2.0
# SPDX-FileCopyrightText: Copyright contributors to the vllm-afd project
"""Per-layer times of a model's decode steps in plain vLLM on this CPU.

A CPU roofline cannot see what an eager engine does around its kernels:
rotary, the KV-cache write, the paged-attention call and its metadata, the MoE
layer's routing and Python, the sampler and the scheduler (on a GPU, CUDA graphs
hide most of it and the roofline is the better guide). `vllm-afd plan
--calibrate --calibrate-model PATH` therefore also runs the model itself: an
in-process engine on the profile's cores decodes B distinct requests at a few
batch sizes (each three times, the median pass kept), forward hooks time each decoder
layer and its mlp, and the profile's [engine] table holds, per decode token
count, the seconds of one layer's attention half (the decoder layer minus its
mlp), of one mlp, and of the step's work outside the layers (embedding, final
norm, LM head, sampler, scheduler).

On an AFD attention core no mlp runs: its layers' weights and KV cache stay in
caches that, in plain vLLM, each mlp's expert weights sweep. So the attention
half of the device table (one core: an AFD role's) is timed again with every
mlp an identity (`attention_alone`): plain vLLM's attention half, on a core that
also streams the mlps' weights, reads slower than AFD's attention does
(benchmarks/notes.md).

The planner uses the table for that model only (cost.py); every other model
still gets the roofline. It runs in a process of its own (its cores, its
threads, its environment):

    taskset -c 0 python -m vllm.afd.deploy.planner.engine_probe --model PATH --batches 1,8
"""

from __future__ import annotations

import argparse
import json
import os
import random
import statistics
import subprocess
import sys
import time

BATCHES = (1, 2, 4, 8, 16, 32, 64)
DECODE_STEPS = 16
PROMPT_TOKENS = 16
PASSES = 3


def prompt_ids(request: int, vocab: int, length: int = PROMPT_TOKENS) -> list[int]:
    """Distinct token ids per request, spread over the vocabulary: requests
    that differ in a word or two (the first version's text prompts) decode to
    similar hidden states, route to the same few experts, and made a batch of
    2-16 tokens read a fraction of the expert weights a real batch reads."""
    rng = random.Random(request)
    # below 1000: ids any tokenizer of a generated checkpoint knows
    return [rng.randrange(16, max(min(vocab, 1000), 17)) for _ in range(length)]


def median_pass(passes: list[tuple[float, ...]]) -> tuple[float, ...]:
    """The pass whose step (the sum of its parts) is the median; of an even
    count the lower middle one."""
    return sorted(passes, key=sum)[(len(passes) - 1) // 2]


def probe(model: str, batches: list[int], steps: int, attention_alone: bool = False) -> dict:
    """In this process: {"tokens", "layers" (the decoder layers timed),
    "attention_layer", "ffn_layer", "step_other"[, "mlp_alone"]}
    (seconds: medians over the decode steps at each batch size, of the median
    of PASSES passes). attention_alone: attention_layer from further passes
    with every mlp an identity (an AFD attention core's layers)."""
    import torch
    from vllm import LLM, SamplingParams

    llm = LLM(model=model, enforce_eager=True, max_model_len=512,
              max_num_seqs=max(batches), seed=0)
    engine = llm.llm_engine
    try:
        runner = engine.engine_core.engine_core.model_executor.driver_worker.worker.model_runner
        layers = runner.model.model.layers
    except AttributeError as e:
        raise RuntimeError("the engine probe needs vLLM's in-process engine "
                           "(VLLM_ENABLE_V1_MULTIPROCESSING=0) and a decoder with "
                           f"model.layers[i].mlp: {e}") from e
    events: list[tuple[str, float]] = []

    def stamp(tag: str):
        return lambda *_: events.append((tag, time.perf_counter()))

    for layer in layers:
        layer.register_forward_pre_hook(stamp("layer-in"))
        layer.register_forward_hook(stamp("layer-out"))
        layer.mlp.register_forward_pre_hook(stamp("mlp-in"))
        layer.mlp.register_forward_hook(stamp("mlp-out"))

    def spans(kind: str) -> float:
        starts = [t for tag, t in events if tag == f"{kind}-in"]
        ends = [t for tag, t in events if tag == f"{kind}-out"]
        return sum(e - s for s, e in zip(starts, ends))

    params = SamplingParams(max_tokens=steps + 2, temperature=0.0, ignore_eos=True)
    vocab = engine.model_config.get_vocab_size()
    n = len(layers)

    def timed_passes(tag: str) -> dict[int, tuple[float, float, float]]:
        """Every batch size PASSES times, in turn, keeping the median pass of
        each (by its step): a VM's slow phases last seconds and can make one B
        read tens of percent slow. Not the fastest pass: `make bench` reports
        medians, and the fastest of a few passes leans to the VM's fast
        phases."""
        passes: dict[int, list[tuple[float, float, float]]] = {b: [] for b in batches}
        for pass_ in range(PASSES):
            for b in batches:
                for r in range(b):
                    engine.add_request(f"probe-{tag}-{pass_}-{b}-{r}",
                                       {"prompt_token_ids": prompt_ids(r, vocab)}, params)
                rows = []
                while engine.has_unfinished_requests():
                    events.clear()
                    t0 = time.perf_counter()
                    engine.step()
                    step = time.perf_counter() - t0
                    rows.append((step, spans("layer"), spans("mlp")))
                decode = rows[1:-1] or rows  # not the prefill, not the step that finishes
                passes[b].append((statistics.median(r[1] - r[2] for r in decode) / n,
                                  statistics.median(r[2] for r in decode) / n,
                                  statistics.median(r[0] - r[1] for r in decode)))
        return {b: median_pass(p) for b, p in passes.items()}

    with torch.inference_mode():
        chosen = timed_passes("plain")
        table = {part: [chosen[b][i] for b in batches]
                 for i, part in enumerate(("attention_layer", "ffn_layer", "step_other"))}
        if attention_alone:
            # The mlps as identities: the tokens are garbage, the attention's
            # work (its weights, the KV cache of the same context lengths) is not.
            for layer in layers:
                layer.mlp.forward = lambda hidden_states, *args, **kwargs: hidden_states
            alone = timed_passes("alone")
            table["attention_layer"] = [alone[b][0] for b in batches]
            table["mlp_alone"] = [alone[b][1] for b in batches]  # the identities' (a check)
    return {"tokens": list(batches), "layers": n, **table}


def run(model: str, cores: list[int], batches: list[int] = list(BATCHES),
        steps: int = DECODE_STEPS, timeout: float = 900.0,
        attention_alone: bool = False) -> dict:
    """probe() in a fresh process on `cores`, one torch thread per core."""
    env = dict(os.environ, VLLM_ENABLE_V1_MULTIPROCESSING="0",
               VLLM_CPU_OMP_THREADS_BIND=",".join(map(str, cores)),
               OMP_NUM_THREADS=str(len(cores)))
    env.setdefault("VLLM_CPU_KVCACHE_SPACE", "1")
    cmd = [sys.executable, "-m", "vllm.afd.deploy.planner.engine_probe", "--model", str(model),
           "--batches", ",".join(map(str, batches)), "--steps", str(steps),
           *(["--attention-alone"] if attention_alone else [])]
    # The cores from the start (before exec): `-m` imports the vllm package, and
    # torch with it, before main() runs; an OpenMP team started on other cores
    # and then squeezed onto these ran 10x slower.
    proc = subprocess.run(cmd, env=env, capture_output=True, text=True, timeout=timeout,
                          preexec_fn=lambda: os.sched_setaffinity(0, set(cores)))
    lines = [line for line in proc.stdout.splitlines() if line.startswith("{")]
    if proc.returncode != 0 or not lines:
        raise RuntimeError(f"the engine probe of {model} failed (exit {proc.returncode}):\n"
                           f"{proc.stderr[-3000:]}")
    return json.loads(lines[-1])


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--model", required=True)
    ap.add_argument("--batches", default=",".join(map(str, BATCHES)))
    ap.add_argument("--steps", type=int, default=DECODE_STEPS)
    ap.add_argument("--attention-alone", action="store_true",
                    help="the attention half timed with every mlp an identity")
    args = ap.parse_args(argv)
    table = probe(args.model, [int(b) for b in args.batches.split(",")], args.steps,
                  args.attention_alone)
    print(json.dumps(table), flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
