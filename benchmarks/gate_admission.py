# SPDX-License-Identifier: Apache-2.0
# SPDX-FileCopyrightText: Copyright contributors to the vllm-afd project
"""How long connections that never authenticate keep a real attention server out.

    python benchmarks/gate_admission.py [--model build/models/tiny-qwen3-moe]
        [--silent 64] [--slow 16] [--storm-s 10] [--repeat 2] [--out FILE]

One FFN server (`vllm serve --afd-role ffn`, tcp), ready. Then, alternately,
an attention server is started against it and timed from its start to its
/health answering 200 (its link to the FFN up):
  clean     nobody else at the FFN's AFD port
  attacked  --silent connections that connect and never speak, --slow ones
            that send a byte a second and a connect/close storm (two threads),
            opened before the attention server starts and kept until it is
            ready (the storm runs --storm-s seconds at most)
The FFN server's processes' RSS and open descriptors are read before the
attack and once the attackers are gone (their pending handshakes ended).
Writes OUT (JSON) and prints a table.
"""

from __future__ import annotations

import argparse
import json
import os
import socket
import statistics
import sys
import threading
import time
from pathlib import Path

REPO = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(REPO / "tools" / "serving"))

from servers import Server, cpu, free_port  # noqa: E402

COMMON = ["--max-model-len", "512", "--dtype", "float32", "--enforce-eager",
          "--max-num-batched-tokens", "64", "--max-num-seqs", "16",
          "--no-enable-prefix-caching"]


def group_usage(pgid: int) -> tuple[int, int]:
    """(RSS in KiB, open descriptors) summed over a process group."""
    rss = fds = 0
    for pid in filter(str.isdigit, os.listdir("/proc")):
        try:
            if os.getpgid(int(pid)) != pgid:
                continue
            with open(f"/proc/{pid}/status") as f:
                rss += next(int(line.split()[1]) for line in f if line.startswith("VmRSS:"))
            fds += len(os.listdir(f"/proc/{pid}/fd"))
        except (OSError, StopIteration):
            continue
    return rss, fds


class Attack:
    def __init__(self, port: int, silent: int, slow: int, storm_s: float) -> None:
        self.port, self.stop = port, threading.Event()
        self.sockets = [socket.create_connection(("127.0.0.1", port)) for _ in range(silent)]
        self.threads = [threading.Thread(target=self._slow, daemon=True) for _ in range(slow)]
        self.threads += [threading.Thread(target=self._storm, args=(storm_s,), daemon=True)
                         for _ in range(2)]
        for t in self.threads:
            t.start()

    def _slow(self) -> None:
        try:
            with socket.create_connection(("127.0.0.1", self.port)) as s:
                while not self.stop.wait(1.0):
                    s.sendall(b"\x00")
        except OSError:
            pass  # dropped by the gate

    def _storm(self, seconds: float) -> None:
        end = time.monotonic() + seconds
        while not self.stop.is_set() and time.monotonic() < end:
            try:
                socket.create_connection(("127.0.0.1", self.port)).close()
            except OSError:
                pass

    def end(self) -> None:
        self.stop.set()
        for t in self.threads:
            t.join(5)
        for s in self.sockets:
            s.close()


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--model", default=str(REPO / "build/models/tiny-qwen3-moe"))
    ap.add_argument("--silent", type=int, default=64)
    ap.add_argument("--slow", type=int, default=16)
    ap.add_argument("--storm-s", type=float, default=10.0)
    ap.add_argument("--repeat", type=int, default=2)
    ap.add_argument("--wait-s", type=float, default=600.0,
                    help="give up on an attention server not ready after this long "
                         "(recorded as null)")
    ap.add_argument("--out", default=str(REPO / "benchmarks/results/gate_admission.json"))
    args = ap.parse_args()
    logs = Path(args.out).with_suffix("")
    afd_port = free_port()
    config = {"connector": "tcp", "port": afd_port, "timeout_s": 30}
    ffn = Server(args.model, [*COMMON, "--afd-role", "ffn", "--afd-config", json.dumps(config)],
                 log_path=logs / "ffn.log", name="ffn",
                 env={"VLLM_CPU_OMP_THREADS_BIND": cpu(1)}).start()
    rows = []
    try:
        ffn.wait_ready()
        for i in range(args.repeat):
            for kind in ("clean", "attacked"):
                before = group_usage(ffn.proc.pid)
                attack = (Attack(afd_port, args.silent, args.slow, args.storm_s)
                          if kind == "attacked" else None)
                attention = Server(args.model, [
                    *COMMON, "--afd-role", "attention", "--afd-config", json.dumps(config)],
                    log_path=logs / f"attention-{kind}-{i}.log", name="attention",
                    env={"VLLM_CPU_OMP_THREADS_BIND": cpu(0)}).start()
                try:
                    ready_s = attention.wait_ready(timeout=args.wait_s)
                except TimeoutError:
                    ready_s = None  # kept out for longer than --wait-s
                finally:
                    attention.stop()
                    if attack is not None:
                        attack.end()
                time.sleep(12)  # the Hello timeout (10 s) ends any handshake left
                after = group_usage(ffn.proc.pid)
                rows.append({"kind": kind, "repeat": i,
                             "ready_s": None if ready_s is None else round(ready_s, 2),
                             "ffn_rss_kib_before": before[0], "ffn_rss_kib_after": after[0],
                             "ffn_fds_before": before[1], "ffn_fds_after": after[1]})
                print(json.dumps(rows[-1]), flush=True)
    finally:
        ffn.stop()
    summary = {kind: statistics.median(r["ready_s"] if r["ready_s"] is not None
                                       else float("inf") for r in rows if r["kind"] == kind)
               for kind in ("clean", "attacked")}
    result = {"silent": args.silent, "slow": args.slow, "storm_s": args.storm_s,
              "wait_s": args.wait_s, "rows": rows,
              "median_ready_s": {k: None if v == float("inf") else v
                                 for k, v in summary.items()}}
    Path(args.out).parent.mkdir(parents=True, exist_ok=True)
    Path(args.out).write_text(json.dumps(result, indent=1) + "\n")
    print(f"| attention /health 200 | clean {summary['clean']:.1f} s | attacked "
          f"{summary['attacked']:.1f} s |")
    return 0


if __name__ == "__main__":
    sys.exit(main())
