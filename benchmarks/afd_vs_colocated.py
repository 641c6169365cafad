# SPDX-License-Identifier: Apache-2.0
# SPDX-FileCopyrightText: Copyright contributors to the vllm-afd project
"""AFD (1 attention : 1 FFN) against plain vLLM on the same cores: decode speed.

    python benchmarks/afd_vs_colocated.py [--quick] [--batch-sizes 1,8,32,64]
        [--ubatches 1,2,3] [--max-tokens 32] [--repeats 3] [--out-dir DIR] [--model DIR]

Model: build/models/bench-qwen3-moe (tools/models/make_tiny_models.py). Every engine
runs in its own subprocess, in eager mode:

  plain vLLM   one in-process LLM on cores 0-1 (VLLM_CPU_OMP_THREADS_BIND=0-1)
  AFD, m       `vllm serve --afd-role ffn` on core 1 (one server, num_ubatches=3,
               serves every m <= 3) and an attention-role LLM on core 0 with
               num_ubatches=m, linked by the shm connector (--connector tcp),
               hidden states exact (--transfer-dtype fp8 / fp8-to-ffn)

For each batch size B: B distinct 16-token prompts, greedy, ignore_eos. t(N) is
the time of a generate() with max_tokens=N, t(1) of one with max_tokens=1 (the
prefill alone); decode = t(N) - t(1), TPOT = decode / (N - 1), decode
throughput = B (N - 1) / decode, all of the repeat with the median decode time.
The headline is the throughput ratio AFD / plain per B and m.

Per decode step the link statistics of both roles (vllm/afd/observability/stats.py, read before
and after each run; decode = N run minus 1 run) split the step: attention
compute inside the link window, attention work outside it (scheduling,
embedding, sampling), attention blocked on the link, FFN compute, FFN idle;
plus the transfer floor, an echo round trip of the same tensors through the same
connector and transfer dtype measured here (the echo another process on the FFN
core), and what is left: idle and overhead.

Writes OUT_DIR/afd_vs_colocated.json and, with matplotlib, .png (with another
connector or transfer dtype: afd_vs_colocated-tcp-fp8.json, ...).
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import signal
import statistics
import subprocess
import sys
import time
import urllib.request
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO / "tools" / "serving"))
from servers import Server, free_port  # noqa: E402

from vllm.afd.observability.stats import LinkStats  # noqa: E402

NAME = "afd_vs_colocated"
PLAIN_CORES, ATTENTION_CORES, FFN_CORES = "0-1", "0", "1"
FFN_UBATCHES = 3  # the FFN server accepts attention peers with any m <= this
PROMPT_TOKENS = 16
ENGINE_ARGS = dict(max_model_len=512, max_num_batched_tokens=2048, max_num_seqs=64,
                   enforce_eager=True)
FULL = dict(batch_sizes=[1, 8, 32, 64], ubatches=[1, 2, 3], max_tokens=32, repeats=3)
QUICK = dict(batch_sizes=[1, 8], ubatches=[1, 2], max_tokens=8, repeats=2)
WORKER_TIMEOUT_S = 3600


# ============================================================ the orchestrator
def parse_args(argv=None) -> argparse.Namespace:
    ints = lambda s: [int(x) for x in s.split(",") if x]  # noqa: E731
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--quick", action="store_true",
                    help="batch sizes 1,8; N=8; m in 1,2; 2 repeats (for development)")
    ap.add_argument("--batch-sizes", type=ints, help="comma-separated (default 1,8,32,64)")
    ap.add_argument("--ubatches", type=ints,
                    help=f"AFD micro-batch counts m, 1-{FFN_UBATCHES} (default 1,2,3)")
    ap.add_argument("--max-tokens", type=int,
                    help="N, tokens generated per request (default 32)")
    ap.add_argument("--repeats", type=int, help="timed runs per batch size (default 3)")
    ap.add_argument("--model", type=Path, default=REPO / "build/models/bench-qwen3-moe",
                    help="default: %(default)s")
    ap.add_argument("--out-dir", type=Path, default=REPO / "benchmarks/results",
                    help="JSON, PNG and logs/ (default: %(default)s)")
    ap.add_argument("--connector", choices=["shm", "tcp"], default="shm",
                    help="the AFD link (default: %(default)s)")
    ap.add_argument("--transfer-dtype", choices=["auto", "fp8", "fp8-to-ffn"], default="auto",
                    help="AFDConfig.transfer_dtype: auto (exact), fp8 (both ways), fp8-to-ffn "
                         "(fp8 hidden states, exact outputs); default: %(default)s")
    ap.add_argument("--gate-on", choices=["ffn", "attention"], default="ffn",
                    help="AFDConfig.gate_on: where the MoE routers run (attention: the "
                         "routing travels with the hidden states); default: %(default)s")
    ap.add_argument("--no-auto", dest="auto", action="store_false",
                    help="skip the AFD run under ubatch_policy 'auto' (the rule choosing m "
                         f"per step, up to {FFN_UBATCHES})")
    ap.add_argument("--spin-us", type=int, default=50000,
                    help="connector_extra_config spin_us on both roles (how long a waiting "
                         "side spins before it sleeps: on the shm lane, or polling the tcp "
                         "socket; each role has a core of its own here, and a wait spans the "
                         "other side's compute of a layer, several ms on this CPU; default: "
                         "%(default)s, 0: the connector's default)")
    ap.add_argument("--stream-copies", choices=["auto", "on", "off"], default="auto",
                    help="shm only: connector_extra_config stream_copies on both roles (how "
                         "payloads go into the slots: cached or non-temporal stores, auto: "
                         "measured; csrc/cpu/slot_copy.h; default: %(default)s)")
    ap.add_argument("--reprint", type=Path, metavar="JSON",
                    help="no run: print a saved result's tables again, with the columns this "
                         "code adds (written back into the JSON)")
    ap.add_argument("--worker", choices=["llm", "floor"], help=argparse.SUPPRESS)
    ap.add_argument("--afd-config", help=argparse.SUPPRESS)
    ap.add_argument("--ffn-url", help=argparse.SUPPRESS)
    ap.add_argument("--dtype", help=argparse.SUPPRESS)
    ap.add_argument("--result", type=Path, help=argparse.SUPPRESS)
    ap.add_argument("--cores", help=argparse.SUPPRESS)
    args = ap.parse_args(argv)
    for key, value in (QUICK if args.quick else FULL).items():
        if getattr(args, key) is None:
            setattr(args, key, value)
    if not args.worker and not args.reprint:
        check_args(ap, args)
    return args


def check_args(ap: argparse.ArgumentParser, args: argparse.Namespace) -> None:
    if not (args.model / "config.json").is_file():
        ap.error(f"no model at {args.model}; generate it with: python "
                 "tools/models/make_tiny_models.py --out build/models --models bench-qwen3-moe")
    if any(not 1 <= m <= FFN_UBATCHES for m in args.ubatches):
        ap.error(f"--ubatches: each m must be in 1-{FFN_UBATCHES}")
    if any(not 1 <= b <= ENGINE_ARGS["max_num_seqs"] for b in args.batch_sizes):
        ap.error(f"--batch-sizes: each must be in 1-{ENGINE_ARGS['max_num_seqs']}")
    if args.max_tokens < 2 or args.repeats < 1:
        ap.error("--max-tokens must be >= 2 and --repeats >= 1")


def core_set(cores: str) -> set[int]:
    lo, _, hi = cores.partition("-")
    return set(range(int(lo), int(hi or lo) + 1))


def engine_env(cores: str) -> dict[str, str]:
    """The in-process LLM (uniprocessor executor) does no OpenMP binding of its
    own, VLLM_CPU_OMP_THREADS_BIND notwithstanding: OMP_NUM_THREADS and the
    worker's own sched_setaffinity (--cores) hold it to its cores."""
    return {"HF_HUB_OFFLINE": "1", "VLLM_CPU_KVCACHE_SPACE": "2",
            "VLLM_CACHE_ROOT": str(REPO / "build" / "vllm-cache"),
            "VLLM_ENABLE_V1_MULTIPROCESSING": "0", "VLLM_CPU_OMP_THREADS_BIND": cores,
            "OMP_NUM_THREADS": str(len(core_set(cores)))}


def run_worker(args: argparse.Namespace, kind: str, name: str, cores: str,
               extra: list[str] | None = None) -> dict:
    """Run this file in --worker mode in a fresh process (own session, killed
    with its group on any exit); return the JSON it writes."""
    logs = args.out_dir / "logs"
    logs.mkdir(parents=True, exist_ok=True)
    result, log_path = logs / f"{name}.json", logs / f"{name}.log"
    result.unlink(missing_ok=True)
    cmd = [sys.executable, str(Path(__file__).resolve()), "--worker", kind,
           "--model", str(args.model), "--result", str(result),
           "--batch-sizes", ",".join(map(str, args.batch_sizes)),
           "--ubatches", ",".join(map(str, args.ubatches)),
           "--max-tokens", str(args.max_tokens), "--repeats", str(args.repeats),
           "--cores", cores, "--connector", args.connector,
           "--transfer-dtype", args.transfer_dtype, "--gate-on", args.gate_on,
           *(["--spin-us", str(args.spin_us)] if args.spin_us is not None else []),
           "--stream-copies", args.stream_copies,
           *(extra or [])]
    print(f"[bench] {name}: cores {cores}, log {log_path}", flush=True)
    t0 = time.monotonic()
    with open(log_path, "wb") as log:
        proc = subprocess.Popen(cmd, stdout=log, stderr=subprocess.STDOUT,
                                stdin=subprocess.DEVNULL, start_new_session=True,
                                env=dict(os.environ, **engine_env(cores)))
    try:
        rc = proc.wait(WORKER_TIMEOUT_S)
    finally:
        kill_group(proc)
    if rc != 0 or not result.is_file():
        tail = "\n".join(log_path.read_text(errors="replace").splitlines()[-30:])
        raise RuntimeError(f"{name} failed (exit {rc}); log tail:\n{tail}")
    print(f"[bench] {name}: done in {time.monotonic() - t0:.0f}s", flush=True)
    return json.loads(result.read_text())


def kill_group(proc: subprocess.Popen) -> None:
    try:
        os.killpg(proc.pid, signal.SIGKILL)
    except ProcessLookupError:
        pass
    proc.wait()


def transfer_dtype(args: argparse.Namespace) -> "str | dict[str, str]":
    return {"to_ffn": "fp8"} if args.transfer_dtype == "fp8-to-ffn" else args.transfer_dtype


def link_config(args: argparse.Namespace, port: int, num_ubatches: int) -> dict:
    config = {"connector": args.connector, "port": port, "num_ubatches": num_ubatches,
              "timeout_s": 120, "transfer_dtype": transfer_dtype(args),
              "gate_on": args.gate_on}
    extra = {} if args.spin_us is None else {"spin_us": args.spin_us}
    if args.connector == "shm" and args.stream_copies != "auto":
        extra["stream_copies"] = args.stream_copies
    if extra:
        config["connector_extra_config"] = extra
    return config


def result_name(args: argparse.Namespace) -> str:
    """afd_vs_colocated, or with the link's settings when not the defaults."""
    parts = [NAME] + ([args.connector] if args.connector != "shm" else []) + (
        [args.transfer_dtype] if args.transfer_dtype != "auto" else []) + (
        ["gate-attention"] if args.gate_on == "attention" else [])
    return "-".join(parts)


def ffn_server(args: argparse.Namespace, afd_port: int) -> Server:
    afd = link_config(args, afd_port, FFN_UBATCHES)
    cli = ["--max-model-len", "512", "--max-num-batched-tokens", "2048",
           "--max-num-seqs", "64", "--enforce-eager",
           "--afd-role", "ffn", "--afd-config", json.dumps(afd)]
    env = engine_env(FFN_CORES)
    env.pop("VLLM_ENABLE_V1_MULTIPROCESSING")
    server = Server(str(args.model), cli, log_path=args.out_dir / "logs" / "ffn-server.log",
                    env=env, name="FFN server")
    if shutil.which("taskset"):  # the API process too, not only the bound worker
        server.cmd = ["taskset", "-c", FFN_CORES, *server.cmd]
    return server


def allowed_cpus(pid: int) -> str:
    for line in Path(f"/proc/{pid}/status").read_text().splitlines():
        if line.startswith("Cpus_allowed_list:"):
            return line.split(":", 1)[1].strip()
    return "?"


def afd_configs(args: argparse.Namespace) -> list[tuple[str, int, str]]:
    """(name, num_ubatches, ubatch_policy) of every AFD run: each m split
    always (fixed), then the rule's choice per step (auto)."""
    configs = [(f"afd_m{m}", m, "fixed") for m in args.ubatches]
    return configs + ([("afd_auto", FFN_UBATCHES, "auto")] if args.auto else [])


def run_afd(args: argparse.Namespace) -> dict[str, dict]:
    """One FFN server; one attention-role run per m against it."""
    afd_port = free_port()
    server = ffn_server(args, afd_port)
    print(f"[bench] FFN server: cores {FFN_CORES}, log {server.log_path}", flush=True)
    runs = {}
    try:
        server.start()
        print(f"[bench] FFN server ready in {server.wait_ready(600):.0f}s "
              f"(cpus {allowed_cpus(server.proc.pid)})", flush=True)
        for name, m, policy in afd_configs(args):
            afd = dict(link_config(args, afd_port, m), ubatch_policy=policy)
            runs[name] = run_worker(args, "llm", name.replace("_", "-"), ATTENTION_CORES,
                                    ["--afd-config", json.dumps(afd), "--ffn-url", server.url])
    finally:
        server.stop()
    return runs


def machine_info() -> dict:
    from vllm.afd.deploy.planner.calibrate import cpu_generation, cpu_isa, cpu_model

    return {"cpu_model": cpu_model(), "cpu_isa": cpu_isa(), "cpu_generation": cpu_generation(),
            "cpu_count": os.cpu_count(),
            "python": sys.version.split()[0], "load_average_1m": os.getloadavg()[0]}


def main_bench(args: argparse.Namespace) -> int:
    # SIGTERM/SIGHUP unwind like Ctrl-C, so the finally clauses stop the FFN
    # server and the workers (each runs in its own session).
    for sig in (signal.SIGTERM, signal.SIGHUP):
        signal.signal(sig, lambda signum, _: sys.exit(128 + signum))
    args.out_dir = args.out_dir.resolve()
    args.model = args.model.resolve()
    t0, load = time.monotonic(), os.getloadavg()[0]
    if load > 0.5:
        print(f"[bench] note: load average {load:.1f} before the start: other processes use "
              f"these cores, so the numbers will be noisy", flush=True)
    plain = run_worker(args, "llm", "plain", PLAIN_CORES)
    floor = run_worker(args, "floor", "transfer-floor", ATTENTION_CORES,
                       ["--dtype", plain["engine"]["dtype"]])
    afd = run_afd(args)
    results = summarize(args, plain, afd, floor)
    results["bench_wall_s"] = round(time.monotonic() - t0, 1)
    results["machine"]["load_average_1m_at_start"] = load
    out = args.out_dir / f"{result_name(args)}.json"
    out.write_text(json.dumps(results, indent=2) + "\n")
    print_tables(results)
    print(f"\n[bench] wrote {out}")
    plot(results, args.out_dir / f"{result_name(args)}.png")
    return 0


# ================================================================== results
def summarize(args: argparse.Namespace, plain: dict, afd: dict[int, dict], floor: dict) -> dict:
    n = args.max_tokens
    plain_by_b = {b: decode_summary(runs, int(b), n) for b, runs in plain["batches"].items()}
    configs = {}
    specs = {name: (m, policy) for name, m, policy in afd_configs(args)}
    for name, run in afd.items():
        m, policy = specs[name]
        per_b = {}
        for b, runs in run["batches"].items():
            s = decode_summary(runs, int(b), n)
            s["ratio_vs_plain"] = s["tokens_per_s"] / plain_by_b[b]["tokens_per_s"]
            bucket = rule_bucket(run.get("ubatches", {}).get(b), int(b))
            chosen = bucket.get("chosen")
            if policy == "auto":
                s["chosen_ubatches"] = chosen
                # Every decode step of B tokens the engine ran with each m (the
                # warm-up's and the prefill-only runs' included): what probing cost.
                s["ubatch_steps"] = bucket.get("steps", {})
            floor_m = str(min(chosen or 1, m)) if policy == "auto" else str(m)
            floor_b = floor.get(floor_m, floor[str(args.ubatches[0])])[b]
            s["split_ms"] = step_split(runs, n, floor_b)
            s["split_ms"]["link_us_per_layer"] = (
                (s["split_ms"]["attention_blocked_on_link"] - s["split_ms"]["ffn_compute"])
                / model_facts(args.model)["num_hidden_layers"] * 1e3)
            s["split_ms"]["ffn_outside_mlp_us_per_layer"] = (
                s["split_ms"]["ffn_outside_mlp"] / model_facts(args.model)["num_hidden_layers"]
                * 1e3 / m)
            s["spin"] = spin_counts(runs)
            per_b[b] = s
        configs[name] = {"num_ubatches": m, "ubatch_policy": policy,
                         "label": f"m={m}" if policy == "fixed" else "auto",
                         "engine": run["engine"], "batches": per_b}
    bound = overlap_bound(configs, plain_by_b)
    add_fractions(configs, bound)
    return {
        "benchmark": NAME, "machine": machine_info(),
        "cores": {"plain": PLAIN_CORES, "afd_attention": ATTENTION_CORES,
                  "afd_ffn": FFN_CORES, "text": core_text()},
        "model": {"path": str(args.model), **model_facts(args.model)},
        "settings": {"max_tokens_N": n, "prompt_tokens": PROMPT_TOKENS,
                     "repeats": args.repeats, "batch_sizes": args.batch_sizes,
                     "ubatches": args.ubatches, "connector": args.connector,
                     "transfer_dtype": transfer_dtype(args), "gate_on": args.gate_on,
                     "connector_extra_config": link_config(args, 0, 1).get(
                         "connector_extra_config", {}),
                     "ffn_server_num_ubatches": FFN_UBATCHES, **ENGINE_ARGS},
        "plain": {"engine": plain["engine"], "batches": plain_by_b},
        "afd": configs, "overlap_bound": bound, "transfer_floor": floor,
    }


def spin_counts(runs: list[dict]) -> dict:
    """Each side's spin preemptions and backoffs in the median run's N-token
    generate (its prefill included: counts, unlike times, do not subtract, and a
    prefill-only run with more of them than the N-token run gave -1): after a
    backoff a side's waits sleep for 0.1-1 s (shm_ring.py), and link/layer jumps
    by the wake-ups; nonzero explains a slow run."""
    raw = median_run(runs)["raw"]
    return {side: {"preemptions": raw[f"{side}_n"].get("spin_preemptions", 0),
                   "backoffs": raw[f"{side}_n"].get("spin_backoffs", 0)}
            for side in ("attention", "ffn")}


def rule_bucket(document: dict | None, b: int) -> dict:
    """The micro-batch rule's state for B-token decode steps, from the link's
    `ubatches` document read after that batch size's runs: the bucket holding
    b (its `chosen` m, None while still probing; its `steps` per m), or {}."""
    for bucket, state in ((document or {}).get("buckets") or {}).items():
        lo, _, hi = bucket.partition("-")
        if int(lo) <= b <= int(hi or lo):
            return state
    return {}


def overlap_bound(configs: dict, plain_by_b: dict) -> dict:
    """The ideal-overlap bound per B: AFD can do no better than its slower side
    fully busy, max(attention, FFN) per step, with each side's single-thread
    work as the same run measured it unsplit (m = 1: attention inside and
    outside the link window, the FFN's compute). Nothing of the link or of
    micro-batch splitting counts against the bound."""
    base = configs.get("afd_m1")
    if base is None:
        return {}
    bound = {}
    for b, s in base["batches"].items():
        sp = s["split_ms"]
        attention = sp["attention_compute"] + sp["attention_outside_link"]
        step = max(attention, sp["ffn_compute"])
        tokens_per_s = int(b) / step * 1e3
        bound[b] = {"attention_ms": attention, "ffn_ms": sp["ffn_compute"], "step_ms": step,
                    "tokens_per_s": tokens_per_s,
                    "ratio_vs_plain": tokens_per_s / plain_by_b[b]["tokens_per_s"]}
    return bound


def own_bound_ms(split: dict, m: int) -> float:
    """A configuration's own pipeline bound: the step it would take with a
    free link and perfect overlap of its micro-batches, from its own measured
    compute (with the split's costs in it, unlike the overlap bound). m = 1:
    nothing overlaps, attn + attn-out + ffn; m > 1: attn-out (no layer call in
    flight then) + max(attn, ffn)."""
    a, out, f = (split["attention_compute"], split["attention_outside_link"],
                 split["ffn_compute"])
    return out + (a + f if m == 1 else max(a, f))


def add_fractions(configs: dict, bound: dict) -> None:
    """Per configuration and B: the fraction of the overlap bound, and the
    step against the configuration's own bound (how well its pipeline runs;
    the rest of the gap to the bound is what splitting costs the compute)."""
    for cfg in configs.values():
        for b, s in cfg["batches"].items():
            if b in bound:
                s["fraction_of_bound"] = s["tokens_per_s"] / bound[b]["tokens_per_s"]
            m = (s.get("chosen_ubatches") or 1 if cfg["ubatch_policy"] == "auto"
                 else cfg["num_ubatches"])
            own = own_bound_ms(s["split_ms"], min(m, int(b)))
            s["own_bound"] = {"num_ubatches": min(m, int(b)), "step_ms": own,
                              "fraction": own / s["split_ms"]["step"]}


def core_text() -> str:
    return (f"plain vLLM: cores {PLAIN_CORES} (VLLM_CPU_OMP_THREADS_BIND={PLAIN_CORES}); "
            f"AFD: attention on core {ATTENTION_CORES}, FFN server on core {FFN_CORES} "
            f"(same total cores)")


def model_facts(model: Path) -> dict:
    cfg = json.loads((model / "config.json").read_text())
    keys = ["architectures", "hidden_size", "num_hidden_layers", "num_experts",
            "num_experts_per_tok", "moe_intermediate_size", "dtype"]
    return {k: cfg.get(k) for k in keys}


def lower_median(runs: list[dict], key) -> dict:
    return sorted(runs, key=key)[(len(runs) - 1) // 2]


def decode_runs(runs: list[dict]) -> list[dict]:
    """Each N-token run minus the prefill: the median 1-token run (time and
    statistics), so one disturbed prefill run spoils no decode figure."""
    ref = lower_median(runs, lambda r: r["t_1"])
    return [{"decode_s": r["t_n"] - ref["t_1"],
             "attention": LinkStats.delta(r["attention_n"], ref["attention_1"]),
             "ffn": LinkStats.delta(r["ffn_n"], ref["ffn_1"]), "raw": r} for r in runs]


def median_run(runs: list[dict]) -> dict:
    """The decode run with the (lower) median time: its TPOT is the headline
    and its statistics give the split, so the two agree."""
    return lower_median(decode_runs(runs), lambda r: r["decode_s"])


def decode_summary(runs: list[dict], b: int, n: int) -> dict:
    d = median_run(runs)["decode_s"]
    return {"tokens_per_s": b * (n - 1) / d, "tpot_ms": d / (n - 1) * 1e3,
            "decode_s": [r["decode_s"] for r in decode_runs(runs)],
            "t_1_s": [r["t_1"] for r in runs], "t_n_s": [r["t_n"] for r in runs],
            "runs": runs}


def step_split(runs: list[dict], n: int, floor: dict) -> dict:
    """Milliseconds per decode step of the median run, from the link statistics."""
    run = median_run(runs)
    ms = lambda s: s / (n - 1) * 1e3  # noqa: E731
    a, f = run["attention"], run["ffn"]
    step = ms(run["decode_s"])
    split = {
        "step": step,
        "attention_compute": ms(a["step_wall_s"] - a["wait_s"] - a["send_s"]),
        "attention_outside_link": step - ms(a["step_wall_s"]),
        "attention_blocked_on_link": ms(a["wait_s"] + a["send_s"]),
        "ffn_compute": ms(f["compute_s"]),
        "ffn_idle": ms(f["wait_s"]),
        "ffn_send": ms(f["send_s"]),
        # The FFN loop's own work per step: neither the mlp nor waiting for
        # hidden states (unpacking, batching, the output's copy and send).
        "ffn_outside_mlp": ms(f["step_wall_s"] - f["compute_s"] - f["wait_s"]),
        "transfer_floor": floor["floor_ms"],
    }
    parts = ("attention_compute", "attention_outside_link", "ffn_compute", "transfer_floor")
    split["idle_overhead"] = step - sum(split[p] for p in parts)
    # Both 1 when the statistics cover exactly the decode steps.
    split["link_steps_per_step"] = a["steps"] / (n - 1)
    split["ffn_steps_per_step"] = f["steps"] / (n - 1)
    return split


def print_tables(res: dict) -> None:
    names = list(res["afd"])
    s = res["settings"]
    print(f"\nAFD 1:1 vs plain vLLM, {Path(res['model']['path']).name}, "
          f"N={s['max_tokens_N']}, {s['repeats']} repeats, {res['machine']['cpu_model']}")
    print(f"cores: {res['cores']['text']}")
    print("decode throughput ratio AFD / plain (plain in tokens/s):\n")
    bound = res.get("overlap_bound", {})
    print(f"{'B':>4} {'plain tok/s':>12} {'plain TPOT':>11} {'bound':>7}"
          + "".join(f" {'AFD ' + res['afd'][k].get('label', 'm=%d' % res['afd'][k]['num_ubatches']):>9} {'of bound':>8}"
                    for k in names))
    for b, p in res["plain"]["batches"].items():
        cells = ""
        for k in names:
            r = res["afd"][k]["batches"][b]
            fraction = r.get("fraction_of_bound")
            cells += f" {r['ratio_vs_plain']:>8.2f}x" + (
                f" {fraction:>7.0%}" if fraction is not None else f" {'-':>8}")
        limit = f"{bound[b]['ratio_vs_plain']:>6.2f}x" if b in bound else f"{'-':>7}"
        print(f"{b:>4} {p['tokens_per_s']:>12.1f} {p['tpot_ms']:>9.1f}ms {limit}{cells}")
    print("(bound: the ideal-overlap bound, max(attention, FFN) per step from the m = 1 run's "
          "single-thread\ntimes, as a ratio to plain; of bound: AFD's throughput as a fraction "
          "of it)")
    if any(int(b) < c["num_ubatches"] for b in res["plain"]["batches"]
           for c in res["afd"].values()):
        print("(a step of B tokens has min(m, B) micro-batches: where B < m, m is that number)")
    if "afd_auto" in res["afd"]:
        picks = ", ".join(
            f"B={b}: m={r.get('chosen_ubatches') or '?'}"
            + (" (steps " + " ".join(f"m={m}:{n}" for m, n in r["ubatch_steps"].items()) + ")"
               if len(r.get("ubatch_steps") or {}) > 1 else "")
            for b, r in res["afd"]["afd_auto"]["batches"].items())
        print(f"auto: the micro-batch rule's choice for decode steps: {picks}")
    print_split(res)


SPLIT_COLUMNS = [("step", "step"), ("attention_compute", "attn"),
                 ("attention_outside_link", "attn-out"),
                 ("attention_blocked_on_link", "blocked"), ("ffn_compute", "ffn"),
                 ("ffn_idle", "ffn-idle"), ("ffn_outside_mlp", "ffn-other"),
                 ("transfer_floor", "floor"),
                 ("idle_overhead", "overhead")]


def print_split(res: dict) -> None:
    print("\nper decode step, ms (attn = attention compute in the link window, attn-out = "
          "attention work outside it,\nblocked = attention waiting on the link, ffn-idle = "
          "FFN waiting for hidden states, ffn-other = the FFN loop's work\noutside the mlp (unpack, batch, copy out, send), floor = echo\nround trips, overhead = step - attn "
          "- attn-out - ffn - floor; negative: overlap):\n")
    print(f"{'m':>4} {'B':>4}" + "".join(f" {label:>9}" for _, label in SPLIT_COLUMNS)
          + f" {'link/layer':>10} {'ffn-other/call':>14} {'own-bound':>9} {'of own':>6}")
    for cfg in res["afd"].values():
        for b, r in cfg["batches"].items():
            sp = r["split_ms"]
            # with m > 1 the FFN computes while attention does: blocked - ffn
            # is no measure of the link there (it goes negative)
            m = min(r.get("chosen_ubatches") or cfg["num_ubatches"], int(b))
            # auto: its probing steps at other m are in the same split
            probed = any(int(k) > 1 and n for k, n in r.get("ubatch_steps", {}).items())
            print(f"{cfg.get('label', cfg['num_ubatches']):>4} {b:>4}"
                  + "".join(f" {sp[key]:>9.2f}" if key in sp else f" {'-':>9}"
                            for key, _ in SPLIT_COLUMNS)
                  + (f" {sp['link_us_per_layer']:>8.0f}us" if m == 1 and not probed
                     else f" {'-':>10}")
                  + (f" {sp['ffn_outside_mlp_us_per_layer']:>12.0f}us"
                     if "ffn_outside_mlp_us_per_layer" in sp else f" {'-':>14}")
                  + (f" {r['own_bound']['step_ms']:>9.2f} {r['own_bound']['fraction']:>6.0%}"
                     if "own_bound" in r else ""))
    spins = []
    for cfg in res["afd"].values():
        for b, r in cfg["batches"].items():
            s = r.get("spin")
            if s and any(v for side in s.values() for v in side.values()):
                a, f = s["attention"], s["ffn"]
                spins.append(f"{cfg.get('label', cfg['num_ubatches'])} B={b}: attention "
                             f"{a['preemptions']}/{a['backoffs']}, FFN "
                             f"{f['preemptions']}/{f['backoffs']}")
    print("\nspin preemptions/backoffs in the median N-token run (a backoff: that side's "
          "waits sleep for 0.1-1 s): " + ("; ".join(spins) if spins else "none"))
    print("\n(link/layer: the attention side's wait on the link beyond the FFN's compute, per "
          "layer: (blocked - ffn) / layers,\nat m = 1 only (auto: where no step probed another "
          "m): with m > 1 the FFN computes while attention does;\n"
          "ffn-other/call: ffn-other per layer call (layer x micro-batch), part of link/layer "
          "at m = 1;\n"
          "own-bound: this configuration's step with a free link and perfect overlap of its own "
          "measured compute\n(m = 1: attn-out + attn + ffn; m > 1: attn-out + max(attn, ffn)); "
          "of own: own-bound / step, how well\nits pipeline runs. of bound = of own x bound / "
          "own-bound: what the configuration's shape costs\n(at m = 1 no overlap, at m > 1 the "
          "split's extra compute))")


# ===================================================================== plot
def plot(res: dict, path: Path) -> None:
    try:
        import matplotlib
    except ImportError:
        print("[bench] note: matplotlib is not installed, so no plot; the JSON has all the "
              "numbers (`make bench` installs it: the pin of setup.py's bench extra)")
        return
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, (left, right) = plt.subplots(1, 2, figsize=(13, 5))
    plot_ratios(left, res)
    plot_split(right, res)
    fig.suptitle(f"AFD 1 attention : 1 FFN vs plain vLLM ({res['cores']['text']})",
                 fontsize=9)
    fig.tight_layout()
    fig.savefig(path, dpi=120)
    plt.close(fig)
    print(f"[bench] wrote {path}")


def plot_ratios(ax, res: dict) -> None:
    for cfg in res["afd"].values():
        bs = sorted(cfg["batches"], key=int)
        ax.plot([int(b) for b in bs], [cfg["batches"][b]["ratio_vs_plain"] for b in bs],
                marker="o", label=f"AFD {cfg.get('label', cfg['num_ubatches'])}")
    ax.axhline(1.0, color="black", linewidth=1, linestyle="--", label="plain vLLM")
    ax.set_xscale("log", base=2)
    sizes = res["settings"]["batch_sizes"]
    ax.set_xticks(sizes, [str(b) for b in sizes])
    ax.set_ylim(bottom=0)
    ax.set_xlabel("batch size")
    ax.set_ylabel("decode throughput, AFD / plain")
    ax.set_title(f"decode throughput ratio (N={res['settings']['max_tokens_N']})")
    ax.legend()
    ax.grid(True, alpha=0.3)


SPLIT_PARTS = [("attention_compute", "attention compute"),
               ("attention_outside_link", "attention outside link"),
               ("ffn_compute", "FFN compute"), ("transfer_floor", "transfer floor"),
               ("idle_overhead", "idle / overhead")]


def plot_split(ax, res: dict) -> None:
    b = split_batch(res)
    labels, steps = ["plain"], [res["plain"]["batches"][b]["tpot_ms"]]
    ax.bar(0, steps[0], color="lightgray")
    for i, cfg in enumerate(res["afd"].values(), start=1):
        sp = cfg["batches"][b]["split_ms"]
        bottom = 0.0
        for j, (key, label) in enumerate(SPLIT_PARTS):
            value = max(sp[key], 0.0)
            ax.bar(i, value, bottom=bottom, color=f"C{j}", label=label if i == 1 else None)
            bottom += value
        labels.append(f"AFD {cfg.get('label', cfg['num_ubatches'])}")
        steps.append(sp["step"])
    ax.scatter(range(len(steps)), steps, marker="_", s=900, color="black", zorder=3,
               label="measured step (TPOT)")
    ax.set_xticks(range(len(labels)), labels)
    ax.set_ylim(0, 1.45 * max(ax.get_ylim()[1], max(steps)))
    ax.set_ylabel("ms per decode step")
    ax.set_title(f"where a decode step goes, B={b} (bars above the mark: overlap)")
    ax.legend(fontsize=8, ncol=2, loc="upper left")


def split_batch(res: dict) -> str:
    bs = list(res["plain"]["batches"])
    for b in ("64", "32"):
        if b in bs:
            return b
    return max(bs, key=int)


# ================================================================== workers
def prompts(b: int) -> list[dict]:
    """b distinct prompts of PROMPT_TOKENS token ids (no special tokens)."""
    return [{"prompt_token_ids": [16 + (i * 7 + r * 37 + i * r) % 1000
                                  for i in range(PROMPT_TOKENS)]} for r in range(b)]


def ffn_stats(url: str | None) -> dict:
    if url is None:
        return {}
    with urllib.request.urlopen(url + "/afd/status", timeout=10) as r:
        return json.loads(r.read())["workers"][0]["stats"]


def timed_generate(llm, params, b: int, link, ffn_url) -> tuple[float, dict, dict]:
    link0, ffn0 = link(), ffn_stats(ffn_url)
    t0 = time.perf_counter()
    outs = llm.generate(prompts(b), params, use_tqdm=False)
    elapsed = time.perf_counter() - t0
    got = {len(o.outputs[0].token_ids) for o in outs}
    if got != {params.max_tokens}:
        raise RuntimeError(f"expected {params.max_tokens} tokens per request, got {got}")
    return (elapsed, LinkStats.delta(link(), link0),
            LinkStats.delta(ffn_stats(ffn_url), ffn0))


def measure_batch(llm, b: int, n: int, repeats: int, link, ffn_url) -> list[dict]:
    from vllm import SamplingParams

    one = SamplingParams(temperature=0, max_tokens=1, ignore_eos=True)
    full = SamplingParams(temperature=0, max_tokens=n, ignore_eos=True)
    runs = []
    for _ in range(repeats):
        t_1, link_1, ffn_1 = timed_generate(llm, one, b, link, ffn_url)
        t_n, link_n, ffn_n = timed_generate(llm, full, b, link, ffn_url)
        runs.append({"t_1": t_1, "t_n": t_n, "attention_1": link_1, "attention_n": link_n,
                     "ffn_1": ffn_1, "ffn_n": ffn_n})
    return runs


def engine_facts(llm) -> dict:
    import torch
    import vllm

    return {"dtype": str(llm.llm_engine.model_config.dtype).removeprefix("torch."),
            "vllm": vllm.__version__, "torch": torch.__version__,
            "torch_threads": torch.get_num_threads(),
            "affinity": sorted(os.sched_getaffinity(0))}


def worker_llm(args: argparse.Namespace) -> dict:
    """Plain vLLM, or the attention role with --afd-config: time every batch size."""
    from vllm import LLM, SamplingParams

    kwargs = dict(model=str(args.model), enable_prefix_caching=False, seed=0, **ENGINE_ARGS)
    if args.afd_config:
        kwargs.update(afd_role="attention", afd_config=json.loads(args.afd_config))
    t0 = time.monotonic()
    llm = LLM(**kwargs)
    init_s = time.monotonic() - t0
    if args.afd_config:
        link = lambda: llm.collective_rpc("afd_link_stats")[0]  # noqa: E731
    else:
        link = lambda: {}  # noqa: E731
    warm = SamplingParams(temperature=0, max_tokens=2, ignore_eos=True)
    for b in args.batch_sizes:
        llm.generate(prompts(b), warm, use_tqdm=False)
    batches, ubatches = {}, {}
    for b in args.batch_sizes:
        batches[str(b)] = measure_batch(llm, b, args.max_tokens, args.repeats, link,
                                        args.ffn_url)
        if args.afd_config:  # what the micro-batch rule chose so far (policy auto)
            ubatches[str(b)] = llm.collective_rpc("afd_link_document")[0].get("ubatches")
    return {"engine": {**engine_facts(llm), "init_s": init_s}, "batches": batches,
            "ubatches": ubatches}


def split_tokens(b: int, m: int) -> list[int]:
    """Micro-batch sizes of a b-token step: min(m, b) parts differing by <= 1."""
    k = min(m, b)
    return [(i + 1) * b // k - i * b // k for i in range(k)]


def pin(cores: str) -> None:
    """Pin the calling thread (Linux: pid 0 is the calling thread; threads
    started later inherit it) to cores, where this machine has them."""
    try:
        os.sched_setaffinity(0, core_set(cores))
    except OSError as e:
        print(f"[bench] cannot pin to cores {cores}: {e}", file=sys.stderr)


def echo_ffn_process(config: dict, hidden: int, dtype_name: str, max_tokens: int,
                     num_layers: int) -> None:
    """The no-op FFN in a process of its own on the FFN core, as the FFN server
    is: two threads of one process (before 2026-12-03) handed the GIL over on
    every message, 60-70 us of a round trip that the real link does not pay."""
    import torch

    from vllm.afd.adapter.config import AFDConfig
    from vllm.afd.transport.connectors import create_connector

    pin(FFN_CORES)
    torch.set_num_threads(1)
    ffn = create_connector(AFDConfig(role="ffn", **config), hidden_size=hidden,
                           dtype=getattr(torch, dtype_name), max_tokens=max_tokens)
    try:
        echo_ffn(ffn, num_layers)
    finally:
        ffn.close()


def echo_ffn(ffn, num_layers: int) -> None:
    """The no-op FFN: send every hidden state straight back."""
    ffn.accept()
    while True:
        step = ffn.recv_step(0)
        if step.is_goodbye or step.is_shutdown:
            return
        for layer in range(num_layers):
            for u in range(len(step.num_tokens)):
                ffn.send_output(0, layer, u, ffn.recv_hidden(0, layer, u))


def floor_steps(attn, splits: dict[int, list[int]], hidden: int, dtype, num_layers: int,
                iters: int = 60, warm: int = 10) -> dict[int, list[float]]:
    """Step times of sequential round trips (the header, then every layer, every
    micro-batch) per batch size, the sizes in turn: a slow phase of the host hits
    them all alike (one size after another, a VM's slow minute once made B = 32's
    floor 25 % above B = 64's)."""
    import torch

    from vllm.afd.transport.wire import StepHeader

    hs = {b: [torch.randn(n, hidden).to(dtype) for n in tokens]
          for b, tokens in splits.items()}
    outs = {b: [torch.empty_like(h) for h in x] for b, x in hs.items()}  # as the model gives
    times: dict[int, list[float]] = {b: [] for b in splits}
    step = 1
    for i in range(warm + iters):
        for b, tokens in splits.items():
            t0 = time.perf_counter()
            attn.send_step(StepHeader(step_id=step, num_tokens=tokens))
            step += 1
            for layer in range(num_layers):
                for u, h in enumerate(hs[b]):
                    attn.send_hidden(layer, u, h)
                    attn.recv_output(layer, u, out=outs[b][u])
            if i >= warm:
                times[b].append(time.perf_counter() - t0)
    return times


def floor_for_m(m: int, args: argparse.Namespace, hidden: int, num_layers: int) -> dict:
    import multiprocessing

    import torch

    from vllm.afd.adapter.config import AFDConfig
    from vllm.afd.transport.connectors import create_connector

    dtype, port = getattr(torch, args.dtype), free_port()
    config = link_config(args, port, m)
    echo = multiprocessing.get_context("spawn").Process(
        target=echo_ffn_process, daemon=True,
        args=(config, hidden, args.dtype, max(args.batch_sizes), num_layers))
    echo.start()
    attn = create_connector(AFDConfig(role="attention", **config), hidden_size=hidden,
                            dtype=dtype, max_tokens=max(args.batch_sizes))
    out = {}
    try:
        attn.connect()
        splits = {b: split_tokens(b, m) for b in args.batch_sizes}
        for b, times in floor_steps(attn, splits, hidden, dtype, num_layers).items():
            floor_s = statistics.median(times)
            out[str(b)] = {"ubatch_tokens": splits[b], "floor_ms": floor_s * 1e3,
                           "round_trip_us": floor_s / (num_layers * len(splits[b])) * 1e6}
    finally:
        attn.close()
        echo.join(10)
        if echo.is_alive():
            echo.kill()
    return out


def worker_floor(args: argparse.Namespace) -> dict:
    """Transfer floor per m and B: attention side on the attention core, echo
    FFN thread on the FFN core, the bench's connector and transfer dtype, no
    compute."""
    import torch

    torch.set_num_threads(1)
    cfg = model_facts(args.model)
    return {str(m): floor_for_m(m, args, cfg["hidden_size"], cfg["num_hidden_layers"])
            for m in args.ubatches}


def main(argv=None) -> int:
    args = parse_args(argv)
    if args.reprint:
        res = json.loads(args.reprint.read_text())
        add_fractions(res["afd"], res.get("overlap_bound", {}))
        for cfg in res["afd"].values():
            for s in cfg["batches"].values():
                s["spin"] = spin_counts(s["runs"])
        args.reprint.write_text(json.dumps(res, indent=2) + "\n")
        print_tables(res)
        return 0
    if args.worker is None:
        return main_bench(args)
    pin(args.cores)  # before torch starts any thread
    result = worker_llm(args) if args.worker == "llm" else worker_floor(args)
    args.result.write_text(json.dumps(result, indent=2))
    return 0


if __name__ == "__main__":
    sys.exit(main())
