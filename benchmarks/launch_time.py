# SPDX-License-Identifier: Apache-2.0
# SPDX-FileCopyrightText: Copyright contributors to the vllm-afd project
"""Launch-to-ready time: `vllm-afd launch` against starting the same servers by hand.

    python benchmarks/launch_time.py [--models build/models] [--repeat 2] [--out DIR]

A local one-node Ray cluster (tools/serving/ray_head.py; its own start is not counted).
For 1A:1F (shm) and 2A:1F (tcp, with a secret), each repeat measures:
  by hand   the plan's exact command lines (vllm-afd launch --dry-run's), started
            together as plain processes, until every /health answers 200
  launch    `python -m vllm.afd.deploy.launch SPEC` from its start until it prints
            "ready in" (placement groups, actors, the same servers, readiness)
The difference is what Ray placement and supervision cost. Writes OUT/launch_time.json.
"""

from __future__ import annotations

import argparse
import json
import os
import signal
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

REPO = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(REPO / "tools" / "serving"))

from ray_head import RayHead  # noqa: E402
from servers import cpu, free_port, http_get  # noqa: E402

from vllm.afd.deploy.launch import spec as spec_file  # noqa: E402
from vllm.afd.deploy.launch.plan import Node, make_plan  # noqa: E402

COMMON = ["--max-model-len", "512", "--dtype", "float32", "--enforce-eager",
          "--max-num-batched-tokens", "64", "--max-num-seqs", "16",
          "--no-enable-prefix-caching"]
SECRET = "launch-bench-" + "s" * 24


def make_spec(model: Path, attention_servers: int, connector: str) -> dict:
    spec = {"model": str(model), "name": f"bench-{attention_servers}a1f-{free_port()}",
            "connector": connector, "afd_port": free_port(), "args": COMMON,
            "env": {"HF_HUB_OFFLINE": "1", "VLLM_CPU_KVCACHE_SPACE": "1"},
            "attention": {"servers": attention_servers, "http_port": free_port(),
                          "resources": {"CPU": 1},
                          "env": {"VLLM_CPU_OMP_THREADS_BIND": cpu(0)}},
            "ffn": {"http_port": free_port(), "resources": {"CPU": 1},
                    "env": {"VLLM_CPU_OMP_THREADS_BIND": cpu(1)}}}
    if connector != "shm":
        spec["secret"] = {"env": "VLLM_AFD_BENCH_TOKEN"}
    return spec


def by_hand(spec: dict, node_ip: str, log_dir: Path) -> float:
    plans = make_plan(spec_file.parse(spec), [Node("local", node_ip, {"CPU": 64.0})])
    vllm = str(Path(sys.executable).with_name("vllm"))
    procs = []
    t0 = time.monotonic()
    for p in plans:
        env = dict(os.environ, **p.env)
        if spec.get("secret"):
            env["VLLM_AFD_TOKEN"] = SECRET
        with open(log_dir / f"hand-{p.name}.log", "wb") as log:
            procs.append(subprocess.Popen([vllm, *p.argv[1:]], env=env, stdout=log,
                                          stderr=subprocess.STDOUT, start_new_session=True))
    try:
        waiting = {p.http_port for p in plans}
        while waiting:
            for port in list(waiting):
                try:
                    if http_get(f"http://127.0.0.1:{port}/health", timeout=2)[0] == 200:
                        waiting.discard(port)
                except OSError:
                    pass
            if any(proc.poll() is not None for proc in procs):
                raise RuntimeError(f"a server exited; logs in {log_dir}")
            time.sleep(0.2)
        return time.monotonic() - t0
    finally:
        for proc in procs:
            os.killpg(proc.pid, signal.SIGTERM)
        for proc in procs:
            try:
                proc.wait(30)
            except subprocess.TimeoutExpired:
                os.killpg(proc.pid, signal.SIGKILL)


def launched(spec: dict, address: str, work: Path) -> tuple[float, float]:
    """(wall seconds to 'ready in', the launcher's own figure)."""
    path = work / f"{spec['name']}.json"
    path.write_text(json.dumps(spec))
    t0 = time.monotonic()
    proc = subprocess.Popen([sys.executable, "-m", "vllm.afd.deploy.launch", str(path), "--address",
                             address, "--log-dir", str(work / "logs")],
                            stdout=subprocess.PIPE, stderr=subprocess.DEVNULL, text=True,
                            env=os.environ,
                            start_new_session=True)
    try:
        for line in proc.stdout:
            if line.startswith("ready in"):
                return time.monotonic() - t0, float(line.split()[2])
        raise RuntimeError(f"the launcher exited with {proc.wait()} before ready")
    finally:
        proc.send_signal(signal.SIGINT)
        try:
            proc.wait(60)
        except subprocess.TimeoutExpired:
            os.killpg(proc.pid, signal.SIGKILL)


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--models", default=str(REPO / "build" / "models"))
    parser.add_argument("--model", default="tiny-qwen3-moe")
    parser.add_argument("--repeat", type=int, default=2)
    parser.add_argument("--out", default=str(REPO / "benchmarks" / "results"))
    args = parser.parse_args()
    model = Path(args.models) / args.model
    os.environ["VLLM_AFD_BENCH_TOKEN"] = SECRET  # the specs' secret: {env: ...}
    work = Path(tempfile.mkdtemp(prefix="launch-bench-"))
    (work / "logs").mkdir()
    results = {"model": args.model, "repeat": args.repeat, "cases": {}}
    with RayHead() as head:
        node_ip = head.address.split(":")[0]
        for name, servers, connector in (("1A:1F", 1, "shm"), ("2A:1F", 2, "tcp")):
            hand, wall, own = [], [], []
            for _ in range(args.repeat):
                hand.append(by_hand(make_spec(model, servers, connector), node_ip, work))
                w, o = launched(make_spec(model, servers, connector), head.address, work)
                wall.append(w)
                own.append(o)
            case = {"connector": connector, "by_hand_s": hand, "launch_wall_s": wall,
                    "launch_reported_s": own,
                    "median_by_hand_s": statistics.median(hand),
                    "median_launch_s": statistics.median(wall)}
            case["launch_overhead_s"] = case["median_launch_s"] - case["median_by_hand_s"]
            results["cases"][name] = case
            print(f"{name} ({connector}): by hand {case['median_by_hand_s']:.1f} s, "
                  f"vllm-afd launch {case['median_launch_s']:.1f} s (its own figure "
                  f"{statistics.median(own):.1f} s), overhead "
                  f"{case['launch_overhead_s']:+.1f} s", flush=True)
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    (out / "launch_time.json").write_text(json.dumps(results, indent=2) + "\n")
    print(f"wrote {out / 'launch_time.json'}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
