# SPDX-License-Identifier: Apache-2.0
# SPDX-FileCopyrightText: Copyright contributors to the vllm-afd project
"""The afd op library's pack/unpack on this CPU, against a memcpy of the same bytes.

    python benchmarks/kernels.py [--hidden 2048,7168] [--tokens 1,16,128,1024]
        [--threads 1] [--isa avx512|avx2|scalar] [--out-dir benchmarks/results]

For each hidden size, token count and compute dtype: the median time of
afd::pack and afd::unpack, exact and fp8 (e4m3, a fp32 scale per 128
elements), and of a memcpy of the hidden states' bytes (`Tensor.copy_` between
two preallocated buffers) measured in the same run; the op's speed as a
fraction of that memcpy (the issue's target: >= 50 % for pack and unpack); and
the bytes per token per layer each format puts on the wire. The CPU kernels'
instruction set (the library's choice, or --isa) is printed and recorded.
Writes OUT/kernels.json.
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import statistics
import sys
import time
from pathlib import Path

import torch

REPO = Path(__file__).resolve().parents[1]
GROUP = 128
DTYPES = {"bf16": torch.bfloat16, "fp32": torch.float32}


def median_seconds(fn, min_time: float = 0.2, min_reps: int = 5) -> float:
    fn()  # warm
    times: list[float] = []
    start = time.perf_counter()
    while len(times) < min_reps or time.perf_counter() - start < min_time:
        t0 = time.perf_counter()
        fn()
        times.append(time.perf_counter() - t0)
    return statistics.median(times)


def measure(tokens: int, hidden: int, dtype: torch.dtype) -> dict:
    from vllm.afd.kernels import ops
    from vllm.afd.kernels.ops import PackLayout

    x = torch.randn(tokens, hidden).to(dtype)
    out = torch.empty_like(x)
    nbytes = x.numel() * x.element_size()
    src, dst = x.view(-1).view(torch.uint8), torch.empty(nbytes, dtype=torch.uint8)
    memcpy = median_seconds(lambda: dst.copy_(src))
    row = {"tokens": tokens, "hidden": hidden, "dtype": str(dtype).removeprefix("torch."),
           "bytes": nbytes, "memcpy_us": memcpy * 1e6,
           "memcpy_gbps": nbytes / memcpy / 1e9}
    for name, group in (("exact", 0), ("fp8", GROUP)):
        slot = torch.empty(PackLayout.of(tokens, hidden, dtype, group).total, dtype=torch.uint8)
        pack = median_seconds(lambda: ops.pack(x, slot, group))
        unpack = median_seconds(lambda: ops.unpack(slot, out, group))
        row[name] = {"slot_bytes": slot.numel(),
                     "wire_bytes_per_token": slot.numel() / tokens,
                     "pack_us": pack * 1e6, "unpack_us": unpack * 1e6,
                     "pack_vs_memcpy": memcpy / pack, "unpack_vs_memcpy": memcpy / unpack}
    return row


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--hidden", default="2048,7168")
    ap.add_argument("--tokens", default="1,16,128,1024")
    ap.add_argument("--threads", type=int, default=1,
                    help="torch threads (the attention side of `make bench` has 1 core)")
    ap.add_argument("--isa", default=None,
                    help="force the CPU kernels' ISA (default: the library's choice)")
    ap.add_argument("--out-dir", type=Path, default=REPO / "benchmarks" / "results")
    args = ap.parse_args()
    torch.set_num_threads(args.threads)
    from vllm.afd.kernels import ops
    if args.isa:
        ops.set_cpu_isa(args.isa)
    isa = ops.cpu_isa()
    rows = [measure(t, h, d) for h in map(int, args.hidden.split(","))
            for d in DTYPES.values() for t in map(int, args.tokens.split(","))]
    print(f"afd pack/unpack vs memcpy, {args.threads} thread(s), "
          f"{platform.processor() or platform.machine()}, kernels: {isa} "
          f"(this CPU runs {', '.join(ops.cpu_isas())})")
    print(f"{'H':>5} {'dtype':>8} {'T':>5} {'memcpy':>9} {'GB/s':>6} | "
          f"{'pack':>7} {'unpack':>7} exact | {'pack':>7} {'unpack':>7} fp8 | wire B/token")
    for r in rows:
        e, f = r["exact"], r["fp8"]
        print(f"{r['hidden']:>5} {r['dtype']:>8} {r['tokens']:>5} {r['memcpy_us']:>7.1f}us "
              f"{r['memcpy_gbps']:>6.1f} | {e['pack_vs_memcpy']:>6.0%} {e['unpack_vs_memcpy']:>7.0%}"
              f"       | {f['pack_vs_memcpy']:>6.0%} {f['unpack_vs_memcpy']:>7.0%}     | "
              f"{e['wire_bytes_per_token']:.0f} -> {f['wire_bytes_per_token']:.0f}")
    args.out_dir.mkdir(parents=True, exist_ok=True)
    result = {"benchmark": "kernels", "threads": args.threads, "cpu_count": os.cpu_count(),
              "python": sys.version.split()[0], "torch": torch.__version__,
              "group_size": GROUP, "cpu_isa": isa, "cpu_isas": ops.cpu_isas(), "rows": rows}
    path = args.out_dir / "kernels.json"
    path.write_text(json.dumps(result, indent=1))
    print(f"[kernels] wrote {path}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
