# SPDX-License-Identifier: Apache-2.0
# SPDX-FileCopyrightText: Copyright contributors to the vllm-afd project
"""What fp8 transfer (AFDConfig.transfer_dtype) does to greedy tokens, against plain vLLM.

    python benchmarks/fp8_accuracy.py [--models DIR] [--model NAME ...]
        [--max-tokens 64] [--num-prompts 8] [--check] [--out-dir benchmarks/results]

For each model: the oracle's prompts through plain vLLM, then through AFD
(both roles in one process, loopback connector) with every transfer setting
of TRANSFERS, each run in a child of this process; greedy decoding, ignore_eos. Per setting:
token agreement (the fraction of positions where AFD's token equals plain
vLLM's), prompts identical over all tokens, the mean position of the first
differing token, and the largest |logprob difference| over the positions before
each prompt's first difference (after it the two runs continue different
texts). The fp8 rows are data about the checkpoints measured (docs/fp8.md):
how far a quantized run strays depends on the model, so they are not held to a
bound; that the codec is the stated one is tests/afd/kernels/test_fp8.py's job.
--check asserts that 'auto' agrees exactly. Writes OUT/fp8_accuracy.json.
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import sys
import tempfile
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO / "tools" / "models"))

TRANSFERS = {
    "auto": "auto",
    "fp8 to FFN": {"to_ffn": "fp8"},
    "fp8 both ways": "fp8",
}

# What --check holds: 'auto' is exact (token agreement 1, |logprob diff| within
# float32 noise). fp8 rows have no bound: on random tiny checkpoints, whose
# logits are nearly flat, the same codec strays by different amounts from one
# checkpoint to the next (docs/fp8.md).
BOUNDS = {
    # transfer: (min token agreement, max |logprob diff| before the first difference)
    "auto": (1.0, 1e-5),
}


def cpu_model() -> str:
    for line in Path("/proc/cpuinfo").read_text().splitlines():
        if line.startswith("model name"):
            return line.split(":", 1)[1].strip()
    return platform.machine()


def compare(plain: list[dict], afd: list[dict]) -> dict:
    tokens = agree = identical = 0
    firsts, max_diff = [], 0.0
    for p, a in zip(plain, afd, strict=True):
        tp, ta = p["token_ids"], a["token_ids"]
        first = next((i for i, (x, y) in enumerate(zip(tp, ta)) if x != y), len(tp))
        firsts.append(first)
        tokens += len(tp)
        agree += sum(x == y for x, y in zip(tp, ta))
        identical += first == len(tp)
        for i in range(first):
            max_diff = max(max_diff, abs(p["logprobs"][i] - a["logprobs"][i]))
    return {"token_agreement": round(agree / tokens, 4), "identical_prompts": identical,
            "prompts": len(plain), "mean_first_difference": round(sum(firsts) / len(firsts), 1),
            "max_logprob_diff": max_diff}


def measure(model: Path, max_tokens: int, num_prompts: int, port: int,
            transfers: list[str]) -> dict:
    """Plain vLLM, then each transfer setting, every run in a child of this
    process (oracle.ForkedRuns: an engine process holds one AFD attention link,
    and none is torn down)."""
    from oracle import ForkedRuns, attention_backend_for, run

    common = dict(compile_model=False, max_tokens=max_tokens, num_prompts=num_prompts,
                  dtype="float32", attention_backend=attention_backend_for(model),
                  teardown=False)
    runs = ForkedRuns([str(model)])

    def results_of(afd_config: str | None) -> list[dict]:
        with tempfile.TemporaryDirectory() as tmp:
            out, error = Path(tmp) / "run.json", Path(tmp) / "error.txt"
            if not runs(lambda: run(str(model), afd_config, **common), out, error):
                raise SystemExit(f"fp8_accuracy: {model.name}: {error.read_text()[-4000:]}")
            return json.loads(out.read_text())["results"]

    plain = results_of(None)
    return {name: compare(plain, results_of(json.dumps({
        "connector": "loopback", "port": port + i, "timeout_s": 60,
        "transfer_dtype": TRANSFERS[name]}))) for i, name in enumerate(transfers)}


def measure_side_by_side(args, names: list[str], transfers: list[str]) -> dict:
    """One model per child of this process (oracle.Child), side by side, each
    bound to its own core; this process imports vLLM once for all of them."""
    import importlib

    from oracle import Child

    importlib.import_module("vllm")  # before the fork, not in every child

    def measure_on(core: int, k: int, name: str) -> dict:
        os.environ["VLLM_CPU_OMP_THREADS_BIND"] = str(core)
        return measure(args.models / name, args.max_tokens, args.num_prompts,
                       args.port + 10 * k, transfers)

    cores = sorted(os.sched_getaffinity(0))
    with tempfile.TemporaryDirectory() as tmp:
        children = {name: Child(lambda k=k, name=name: measure_on(cores[k % len(cores)], k, name),
                                Path(tmp) / f"{name}.json", Path(tmp) / f"{name}.error.txt")
                    for k, name in enumerate(names)}
        results = {}
        for name, child in children.items():
            ok, _ = child.wait(timeout_s=900)
            if not ok:
                raise SystemExit(f"fp8_accuracy: {name} failed: {child.error.read_text()[-4000:]}")
            results[name] = json.loads(child.out.read_text())
    return results


def check(rows_by_model: dict) -> list[str]:
    problems = []
    for model, rows in rows_by_model.items():
        for name, row in rows.items():
            if name not in BOUNDS:
                continue
            min_agree, max_diff = BOUNDS[name]
            if row["token_agreement"] < min_agree or row["max_logprob_diff"] > max_diff:
                problems.append(f"{model} / {name}: {row} outside the bounds (agreement >= "
                                f"{min_agree}, logprob diff <= {max_diff})")
    return problems


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--models", type=Path, default=REPO / "build" / "models")
    ap.add_argument("--model", action="append", help="default: tiny-qwen3-moe, tiny-deepseek-v2")
    ap.add_argument("--max-tokens", type=int, default=64)
    ap.add_argument("--num-prompts", type=int, default=8)
    ap.add_argument("--transfer", action="append", choices=list(TRANSFERS),
                    help="default: all of them")
    ap.add_argument("--port", type=int, default=17300)
    ap.add_argument("--check", action="store_true",
                    help="fail unless 'auto' is exact (BOUNDS)")
    ap.add_argument("--out-dir", type=Path, default=None,
                    help="write fp8_accuracy.json there (default: print only)")
    args = ap.parse_args()
    names = args.model or ["tiny-qwen3-moe", "tiny-deepseek-v2"]
    transfers = args.transfer or list(TRANSFERS)
    if len(names) == 1:
        results = {names[0]: measure(args.models / names[0], args.max_tokens,
                                     args.num_prompts, args.port, transfers)}
    else:
        results = measure_side_by_side(args, names, transfers)
    print("| model | transfer | token agreement | identical prompts | mean first "
          "difference | max logprob diff |\n|---|---|---|---|---|---|")
    for name, rows in results.items():
        for transfer, r in rows.items():
            print(f"| {name} | {transfer} | {r['token_agreement']:.1%} | "
                  f"{r['identical_prompts']}/{r['prompts']} | {r['mean_first_difference']} "
                  f"of {args.max_tokens} | {r['max_logprob_diff']:.2g} |")
    document = {"max_tokens": args.max_tokens, "num_prompts": args.num_prompts,
                "host": cpu_model(), "bounds": BOUNDS,
                "results": results}
    print("RESULT " + json.dumps(document))
    if args.out_dir is not None:
        # Models measured in another run (the bench model needs the memory to
        # itself) keep their rows; the ones measured now replace theirs.
        args.out_dir.mkdir(parents=True, exist_ok=True)
        path = args.out_dir / "fp8_accuracy.json"
        if path.exists():
            earlier = json.loads(path.read_text())
            if (earlier.get("max_tokens"), earlier.get("num_prompts")) == (
                    args.max_tokens, args.num_prompts):
                document["results"] = {**earlier["results"], **results}
        path.write_text(json.dumps(document, indent=1) + "\n")
    problems = check(results) if args.check else []
    for p in problems:
        print("OUT OF BOUNDS: " + p, file=sys.stderr)
    return 1 if problems else 0


if __name__ == "__main__":
    sys.exit(main())
