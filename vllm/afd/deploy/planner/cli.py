# SPDX-License-Identifier: Apache-2.0
# SPDX-FileCopyrightText: Copyright contributors to the vllm-afd project
"""`vllm-afd plan`: its arguments and what each mode does.

  vllm-afd plan --model deepseek-v3 --hardware h200 --tpot-ms 50 --context 4096
  vllm-afd plan --calibrate [--calibrate-model DIR] [--out FILE]  # this host's `cpu` profile
  vllm-afd plan --check-bench BENCH.json --hardware FILE # the profile against `make bench`
"""

from __future__ import annotations

import argparse
import json
import logging
import sys
from pathlib import Path

logger = logging.getLogger(__name__)

DEFAULT_CPU_PROFILE = "benchmarks/results/cpu-profile.toml"


def add_arguments(p: argparse.ArgumentParser) -> None:
    p.add_argument("--model", default="deepseek-v3",
                   help="a preset (deepseek-v3, qwen3-235b-a22b, step3, bench-qwen3-moe) or a "
                        "HF config.json (file or model directory)")
    p.add_argument("--hardware", default="h200",
                   help="a built-in profile (h100, h200, h800, b200, a100, l40s, h20, "
                        "ascend-910b, ascend-910c) or a profile file (the cpu one "
                        "--calibrate writes)")
    p.add_argument("--tpot-ms", type=float, default=50.0, help="TPOT SLO (default 50)")
    p.add_argument("--context", type=int, default=4096,
                   help="tokens of context per sequence (KV read per decode token)")
    p.add_argument("--link", choices=("scale_out", "scale_up", "same_host"), default=None,
                   help="the A<->F link (default: scale_out, same_host for a cpu profile)")
    for name in ("weight", "kv", "a2f", "f2a"):
        p.add_argument(f"--{name}-dtype", choices=("bf16", "fp8", "fp16", "fp32"), default=None,
                       help=f"override the model's {name} dtype")
    p.add_argument("--max-batch", type=int, default=None,
                   help="cap on sequences per attention device")
    p.add_argument("--top", type=int, default=10, help="rows of the table")
    p.add_argument("--json", action="store_true", help="machine-readable output")
    p.add_argument("--plot", metavar="FILE.png", help="write tokens/s per device against A:F")
    p.add_argument("--calibrate", action="store_true",
                   help="measure this host's cpu profile (about 30 s) and write it to --out")
    p.add_argument("--calibrate-model", metavar="DIR",
                   help="with --calibrate: also run this checkpoint in plain vLLM on the "
                        "profile's cores (about 1.5 min more) and record its layers' measured "
                        "times, which the plan then uses for that model instead of the "
                        "roofline (eager vLLM's work around the kernels, which no roofline "
                        "sees)")
    p.add_argument("--out", default=DEFAULT_CPU_PROFILE,
                   help=f"where --calibrate writes (default {DEFAULT_CPU_PROFILE})")
    p.add_argument("--check-bench", metavar="BENCH.json",
                   help="compare the --hardware cpu profile's prediction with a `make bench` "
                        "result (benchmarks/results/afd_vs_colocated.json); exit 1 beyond 15 %%")


def run(args: argparse.Namespace) -> int:
    from vllm.afd.deploy.planner.hardware import load_hardware
    from vllm.afd.deploy.planner.model import load_model

    if args.calibrate:
        from vllm.afd.deploy.planner.calibrate import calibrate

        path = calibrate(args.out, args.calibrate_model)
        print(path.read_text())
        print(f"wrote {path}")
        return 0
    if args.check_bench:
        from vllm.afd.deploy.planner import benchcheck

        hw = load_hardware(args.hardware if args.hardware != "h200" else args.out)
        bench = json.loads(Path(args.check_bench).read_text())
        benchcheck.check_host(bench, hw)
        rows = benchcheck.compare(bench, hw)
        print(f"profile {hw.path} ({hw.measured}) against {args.check_bench}:")
        print(benchcheck.table(rows))
        misses = [(r.batch, r.microbatches, p) for r in rows for p in benchcheck.PARTS
                  if abs(r.error(p)) > benchcheck.TOLERANCE]
        print(f"{len(misses)} of {len(rows) * len(benchcheck.PARTS)} beyond "
              f"{benchcheck.TOLERANCE:.0%}" + (f": {misses}" if misses else ""))
        return 1 if misses else 0

    from vllm.afd.deploy.planner import report
    from vllm.afd.deploy.planner.search import search

    model = load_model(args.model).with_dtypes(
        weight_dtype=args.weight_dtype, kv_dtype=args.kv_dtype, a2f_dtype=args.a2f_dtype,
        f2a_dtype=args.f2a_dtype)
    hw = load_hardware(args.hardware)
    link = args.link or ("same_host" if hw.kind == "cpu" else "scale_out")
    results = search(model, hw, args.tpot_ms / 1e3, args.context, link, max_batch=args.max_batch)
    out = (report.as_json if args.json else report.table)(
        model, hw, results, args.tpot_ms / 1e3, args.context, link, args.top)
    print(out)
    if args.plot:
        from vllm.afd.deploy.planner.plot import write_plot

        try:
            path = write_plot(results, args.plot, f"{model.name} on {hw.name}, TPOT <= "
                                                  f"{args.tpot_ms:g} ms, context {args.context}")
        except RuntimeError as e:
            print(f"vllm-afd plan: {e}", file=sys.stderr)
            return 2
        print(f"wrote {path}", file=sys.stderr)
    return 0 if results else 1


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="vllm-afd plan")
    add_arguments(parser)
    logging.basicConfig(level=logging.INFO)
    try:
        return run(parser.parse_args(argv))
    except ValueError as e:
        print(f"vllm-afd plan: {e}", file=sys.stderr)
        return 2


if __name__ == "__main__":
    sys.exit(main())
