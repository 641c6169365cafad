# SPDX-License-Identifier: Apache-2.0
# SPDX-FileCopyrightText: Copyright contributors to the vllm-afd project
"""Soak test: N clients against a two-role AFD deployment for a bounded time.

    python benchmarks/soak.py [--minutes 10 | --quick] [--clients 4]
        [--connector shm|tcp] [--model DIR] [--out DIR]

One `vllm serve --afd-role ffn` and one `vllm serve --afd-role attention` on
loopback (tiny Qwen3-MoE, eager mode). Each client thread loops over real
OpenAI requests (completions and chat, some streaming, prompts of 1-16 words,
max_tokens 1-32, temperature 0) and checks every answer is well-formed; every
tenth request is the canary, a fixed greedy prompt that must always return
plain vLLM's text (computed in-process, AFD off, before the load). A sampler records the resident memory of both server process trees.

Verdict (exit status 1 when any fails):
  errors == 0        every request answered and well-formed, every canary the same
  RSS flat           per server, the slope of its RSS after the warm-up (the first
                     20 % of the run), least squares over every sample, at most
                     max(8, 40 / minutes) MiB per minute: a 1-minute run catches a
                     leak of 40 MiB/min, a 10-minute run one of 8 MiB/min (the noise
                     of allocator caches over 48 s windows reached 19 MiB/min on
                     the attention server of a flat 10-minute run)
  FFN steps grew     /afd/status of the FFN server, start vs end
  servers stayed up  neither server process exited during the load

Writes OUT/soak.json (all samples, link statistics, attention /metrics),
OUT/soak.png (with matplotlib) and OUT/logs/ (server logs, /metrics texts).
"""

from __future__ import annotations

import argparse
import concurrent.futures
import json
import os
import random
import re
import signal
import statistics
import sys
import threading
import time
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO / "tools"))
from servers import Server, cpu, free_port, process_tree_rss_kib  # noqa: E402

NAME = "soak"
SERVER_ARGS = ["--max-model-len", "512", "--dtype", "float32", "--enforce-eager",
               "--max-num-seqs", "16"]
WARMUP_FRACTION = 0.2
RSS_SLOPE_MIB_PER_MIN = (8.0, 40.0)  # limit: max(first, second / minutes of the run)
ROLE_NAMES = {"ffn": "FFN server", "attention": "attention server"}
CANARY_EVERY = 10
CANARY = dict(prompt="The quick brown fox jumps over the lazy dog", max_tokens=16)
WORDS = ("the a of to and in is it that was for on are with as his they be at one have "
         "this from by hot word but what some we can out other were all there when up use "
         "your how said an each she which do their time if will way about many then them "
         "write would like so these her long make thing see him two has look more day "
         "could go come did number sound no most people my over know water than call first "
         "who may down side been now find").split()
KINDS = [("completion", 0.45), ("completion-stream", 0.25), ("chat", 0.15),
         ("chat-stream", 0.15)]
FINISH_REASONS = {"stop", "length"}
REQUEST_TIMEOUT_S = 120
MAX_ERROR_TEXTS = 10


def parse_args(argv=None) -> argparse.Namespace:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--minutes", type=float, default=10.0,
                    help="load duration, fractional allowed (default %(default)s)")
    ap.add_argument("--quick", action="store_true", help="the CI version: --minutes 1")
    ap.add_argument("--clients", type=int, default=4, help="concurrent clients (default 4)")
    ap.add_argument("--connector", default="shm", choices=["shm", "tcp"])
    ap.add_argument("--model", type=Path, default=REPO / "build/models/tiny-qwen3-moe",
                    help="default: %(default)s")
    ap.add_argument("--out", type=Path, default=REPO / "benchmarks/results",
                    help="soak.json and logs/ go here (default: %(default)s)")
    ap.add_argument("--sample-s", type=float,
                    help="RSS sampling period (default: run / 60, within 1-5 s)")
    ap.add_argument("--seed", type=int, default=0)
    args = ap.parse_args(argv)
    if args.quick:
        args.minutes = 1.0
    if args.minutes <= 0 or args.clients < 1:
        ap.error("--minutes must be > 0 and --clients >= 1")
    if not (args.model / "config.json").is_file():
        ap.error(f"no model at {args.model}; generate it with: python tools/make_tiny_models.py"
                 f" --out build/models --models tiny")
    if args.sample_s is None:
        args.sample_s = min(max(args.minutes, 1.0), 5.0)
    return args


# ================================================================== clients
class Client(threading.Thread):
    """One client: requests back to back until `stop`, each checked and timed."""

    def __init__(self, index: int, url: str, model: str, canary_text: str, t0: float,
                 stop: threading.Event, seed: int):
        super().__init__(name=f"client-{index}", daemon=True)
        import openai

        # No retries: a retried request would hide exactly what a soak looks for.
        self.api = openai.OpenAI(base_url=url + "/v1", api_key="soak", max_retries=0,
                                 timeout=REQUEST_TIMEOUT_S)
        self.model, self.canary_text, self.t0, self.stop = model, canary_text, t0, stop
        self.rng = random.Random(seed * 1000 + index)
        self.records: list[dict] = []  # one per request
        self.errors: list[dict] = []

    def run(self) -> None:
        n = 0
        while not self.stop.is_set():
            n += 1
            kind = "canary" if n % CANARY_EVERY == 0 else self.pick_kind()
            max_tokens = CANARY["max_tokens"] if kind == "canary" else self.rng.randint(1, 32)
            start = time.monotonic()
            try:
                tokens = self.request(kind, max_tokens)
                error = None
            except Exception as e:  # any failure is a finding, never a crash
                tokens, error = 0, f"{type(e).__name__}: {e}"[:500]
            end = time.monotonic()
            self.records.append({"t": round(start - self.t0, 3), "kind": kind,
                                 "max_tokens": max_tokens, "tokens": tokens,
                                 "latency_ms": round((end - start) * 1e3, 2),
                                 "ok": error is None})
            if error:
                self.errors.append({"t": round(start - self.t0, 1), "client": self.name,
                                    "kind": kind, "error": error})
                self.stop.wait(0.5)  # a dead server must not become a busy loop

    def pick_kind(self) -> str:
        return self.rng.choices([k for k, _ in KINDS], [w for _, w in KINDS])[0]

    def prompt(self) -> str:
        return " ".join(self.rng.choice(WORDS) for _ in range(self.rng.randint(1, 16)))

    def request(self, kind: str, max_tokens: int) -> int:
        """Send one request, check its answer; return its completion tokens."""
        common = dict(model=self.model, max_tokens=max_tokens, temperature=0)
        if kind == "canary":
            out = self.api.completions.create(prompt=CANARY["prompt"], **common,
                                              extra_body={"ignore_eos": True})
            text, tokens = check_answer(out.choices, out.usage, max_tokens, chat=False)
            if text != self.canary_text:
                raise AssertionError(f"canary changed: {text!r} != {self.canary_text!r}")
            return tokens
        chat = kind.startswith("chat")
        if chat:
            create = self.api.chat.completions.create
            common["messages"] = [{"role": "user", "content": self.prompt()}]
        else:
            create = self.api.completions.create
            common["prompt"] = self.prompt()
        if not kind.endswith("stream"):
            out = create(**common)
            return check_answer(out.choices, out.usage, max_tokens, chat)[1]
        text, finish, usage, chunks = [], [], None, 0
        for chunk in create(**common, stream=True, stream_options={"include_usage": True}):
            chunks += 1
            usage = chunk.usage or usage
            for c in chunk.choices:
                piece = c.delta.content if chat else c.text
                text.append(piece or "")
                if c.finish_reason is not None:
                    finish.append(c.finish_reason)
        if len(finish) != 1:
            raise AssertionError(f"stream of {chunks} chunks ended with finish reasons {finish}")
        return check_counts(finish[0], usage, max_tokens)


def check_answer(choices, usage, max_tokens: int, chat: bool) -> tuple[str, int]:
    """A non-streamed answer: one choice, a known finish reason, sane counts."""
    if not choices:
        raise AssertionError("no choices in the answer")
    c = choices[0]
    text = c.message.content if chat else c.text
    if not isinstance(text, str):
        raise AssertionError(f"answer text is {type(text).__name__}, not str")
    return text, check_counts(c.finish_reason, usage, max_tokens)


def check_counts(finish_reason, usage, max_tokens: int) -> int:
    if finish_reason not in FINISH_REASONS:
        raise AssertionError(f"finish_reason {finish_reason!r}")
    n = usage.completion_tokens if usage else None
    if n is None or not 1 <= n <= max_tokens or (finish_reason == "length" and n != max_tokens):
        raise AssertionError(f"{n} completion tokens for max_tokens={max_tokens}, "
                             f"finish_reason {finish_reason}")
    return n


# =================================================================== servers
def start_servers(args: argparse.Namespace, logs: Path) -> tuple[Server, Server]:
    """FFN and attention servers, each engine bound to its own core (as the tests do)."""
    afd = json.dumps({"connector": args.connector, "port": free_port(), "timeout_s": 60})
    ffn = Server(str(args.model), [*SERVER_ARGS, "--afd-role", "ffn", "--afd-config", afd],
                 log_path=logs / "ffn.log", env={"VLLM_CPU_OMP_THREADS_BIND": cpu(1)},
                 name="FFN server")
    attn = Server(str(args.model), [*SERVER_ARGS, "--afd-role", "attention",
                                    "--afd-config", afd],
                  log_path=logs / "attention.log", env={"VLLM_CPU_OMP_THREADS_BIND": cpu(0)},
                  name="attention server")
    return ffn, attn


def rss_sampler(servers: dict[str, Server], t0: float, period: float,
                stop: threading.Event, samples: list[dict]) -> None:
    """Every `period` s: each server tree's VmRSS, in total and per process."""
    while True:
        sample = {"t": round(time.monotonic() - t0, 2)}
        for key, server in servers.items():
            procs = process_tree_rss_kib(server.proc.pid)
            sample[key] = {"mib": round(sum(procs.values()) / 1024, 1), "procs": procs}
            if server.proc.poll() is not None:  # a dead server ends the soak
                sample[key]["exited"] = server.proc.returncode
                stop.set()
        samples.append(sample)
        if stop.wait(period):
            return


def ffn_status(ffn: Server) -> list[dict]:
    status, body = ffn.get("/afd/status")
    if status != 200:
        raise RuntimeError(f"FFN /afd/status answered {status}: {body[:500]}")
    return json.loads(body)["workers"]


METRICS_OF_INTEREST = ("vllm:request_success_total", "vllm:prompt_tokens_total",
                       "vllm:generation_tokens_total", "vllm:num_preemptions_total",
                       "vllm:num_requests_running", "vllm:num_requests_waiting",
                       "vllm:kv_cache_usage_perc")
# Labels every series of one server carries: dropped from the recorded names.
CONSTANT_LABELS = re.compile(r'(engine|model_name)="[^"]*",?')


def scrape_metrics(server: Server, save: Path) -> dict:
    """The attention server's /metrics: a few vLLM series, and every vllm_afd_
    series when the build has them (recorded, never required); the whole text
    goes to `save`."""
    status, body = server.get("/metrics")
    save.write_text(body)
    vllm, afd = {}, {}
    for line in body.splitlines() if status == 200 else []:
        if line.startswith("#") or " " not in line:
            continue
        series, value = line.rsplit(" ", 1)
        name = series.split("{", 1)[0]
        series = CONSTANT_LABELS.sub("", series).replace(",}", "}").replace("{}", "")
        if name.startswith("vllm_afd_"):
            afd[series] = float(value)
        elif name in METRICS_OF_INTEREST:
            vllm[series] = float(value)
    return {"http_status": status, "vllm": vllm, "vllm_afd": afd}


def metric_total(metrics: dict, name: str) -> float:
    """A counter summed over its labels (e.g. every finished_reason)."""
    return sum(v for k, v in metrics["vllm"].items() if k.split("{", 1)[0] == name)


# =================================================================== verdict
def percentile(values: list[float], p: float) -> float | None:
    """Nearest-rank percentile."""
    if not values:
        return None
    s = sorted(values)
    return s[min(len(s) - 1, max(0, round(p / 100 * len(s) + 0.5) - 1))]


def slope_mib_per_min(points: list[tuple[float, float]]) -> float:
    """Least-squares slope of (seconds, MiB) points, in MiB per minute."""
    n = len(points)
    if n < 2:
        return 0.0
    mean_t = sum(t for t, _ in points) / n
    mean_m = sum(m for _, m in points) / n
    var = sum((t - mean_t) ** 2 for t, _ in points)
    cov = sum((t - mean_t) * (m - mean_m) for t, m in points)
    return 60.0 * cov / var if var else 0.0


def rss_limit(duration_s: float) -> float:
    low, scaled = RSS_SLOPE_MIB_PER_MIN
    return max(low, scaled / max(duration_s / 60.0, 1e-9))


def rss_verdict(samples: list[dict], key: str, warm_t: float, duration_s: float) -> dict:
    """The slope of one server's RSS after the warm-up, against the limit."""
    series = [(s["t"], s[key]["mib"]) for s in samples]
    after = [(t, mib) for t, mib in series if t >= warm_t] or series[-1:]
    warm, end = statistics.median(m for _, m in after[:3]), statistics.median(
        m for _, m in after[-3:])
    slope, limit = slope_mib_per_min(after), rss_limit(duration_s)
    return {"first_mib": series[0][1], "warm_mib": warm, "end_mib": end,
            "max_mib": max(m for _, m in series), "growth_mib": round(end - warm, 1),
            "slope_mib_per_min": round(slope, 2), "limit_mib_per_min": round(limit, 1),
            "samples": len(after), "flat": slope <= limit}


def summarize(args: argparse.Namespace, clients: list[Client], samples: list[dict],
              run: dict) -> dict:
    """Everything into one JSON-able dict; `run` holds what run() measured."""
    duration_s = run["duration_s"]
    records = sorted((r for c in clients for r in c.records), key=lambda r: r["t"])
    errors = sorted((e for c in clients for e in c.errors), key=lambda e: e["t"])
    ok = [r for r in records if r["ok"]]
    lat = [r["latency_ms"] for r in ok]
    tokens = sum(r["tokens"] for r in ok)
    warm_t = WARMUP_FRACTION * duration_s
    rss = {key: rss_verdict(samples, key, warm_t, duration_s) for key in ("ffn", "attention")}
    link = [{"start": a["stats"], "end": b["stats"],
             "delta": {k: b["stats"][k] - a["stats"].get(k, 0) for k in b["stats"]}}
            for a, b in zip(run["link_start"], run["link_end"])]
    per_kind = {}
    for kind in sorted({r["kind"] for r in ok}):
        ms = [r["latency_ms"] for r in ok if r["kind"] == kind]
        per_kind[kind] = {"requests": len(ms), "p50_ms": percentile(ms, 50),
                          "p99_ms": percentile(ms, 99)}
    metrics = run["metrics"]
    for key, name in (("requests_delta", "vllm:request_success_total"),
                      ("generation_tokens_delta", "vllm:generation_tokens_total")):
        ok_end = metrics["end"]["http_status"] == 200
        metrics[key] = (int(metric_total(metrics["end"], name)
                            - metric_total(metrics["start"], name)) if ok_end else None)
    died = sorted({k for smp in samples for k in ("ffn", "attention") if "exited" in smp[k]})
    checks = {"errors_zero": not errors, "rss_flat": all(v["flat"] for v in rss.values()),
              "servers_stayed_up": not died,
              "ffn_steps_grew": bool(link) and all(w["delta"]["steps"] > 0 for w in link),
              "requests_served": bool(ok)}
    return {
        "benchmark": NAME,
        "settings": {"minutes": args.minutes, "clients": args.clients,
                     "connector": args.connector, "model": str(args.model),
                     "server_args": SERVER_ARGS, "sample_s": args.sample_s, "seed": args.seed,
                     "request_mix": dict(KINDS), "canary_every": CANARY_EVERY,
                     "canary": {**CANARY, "text": run["canary"]},
                     "rss_rule": {"warmup_fraction": WARMUP_FRACTION,
                                  "slope_limit_mib_per_min": rss_limit(duration_s)}},
        "machine": {"cpu_count": os.cpu_count(),
                    "load_average_1m_at_start": run["load_at_start"]},
        "startup_s": run["startup_s"], "duration_s": round(duration_s, 1),
        "requests": len(records), "ok": len(ok), "errors": len(errors),
        "error_texts": errors[:MAX_ERROR_TEXTS], "servers_died": died,
        "scrape_error": run.get("scrape_error"),
        "latency_ms": {"p50": percentile(lat, 50), "p90": percentile(lat, 90),
                       "p99": percentile(lat, 99), "max": max(lat, default=None)},
        "per_kind": per_kind,
        "throughput": {"requests_per_s": round(len(ok) / duration_s, 2),
                       "tokens_per_s": round(tokens / duration_s, 1),
                       "completion_tokens": tokens},
        "rss": rss, "ffn_link": link, "attention_metrics": metrics,
        "server_exit_codes": run["exit_codes"], "checks": checks, "passed": all(checks.values()),
        "rss_samples": samples, "request_samples": records,
    }


def print_table(res: dict) -> None:
    s, lat, thr = res["settings"], res["latency_ms"], res["throughput"]
    print(f"\nsoak: {res['duration_s']:.0f} s, {s['clients']} clients, {s['connector']} "
          f"connector, {Path(s['model']).name}; servers ready in {res['startup_s']:.0f} s")
    print(f"requests {res['requests']} ({thr['requests_per_s']}/s), errors {res['errors']}, "
          f"completion tokens {thr['completion_tokens']} ({thr['tokens_per_s']}/s)")
    print(f"latency ms: p50 {lat['p50']}, p90 {lat['p90']}, p99 {lat['p99']}, max {lat['max']}")
    for e in res["error_texts"]:
        print(f"  error at {e['t']} s ({e['client']}, {e['kind']}): {e['error']}")
    print(f"\n{'RSS, MiB':<18}{'first':>8}{'warm':>8}{'end':>8}{'max':>8}{'growth':>8}"
          f"{'MiB/min':>9}{'limit':>7}  flat")
    for key, v in res["rss"].items():
        print(f"{ROLE_NAMES[key]:<18}{v['first_mib']:>8.0f}{v['warm_mib']:>8.0f}"
              f"{v['end_mib']:>8.0f}{v['max_mib']:>8.0f}{v['growth_mib']:>8.1f}"
              f"{v['slope_mib_per_min']:>9.1f}{v['limit_mib_per_min']:>7.0f}  "
              f"{'yes' if v['flat'] else 'NO'}")
    for rank, w in enumerate(res["ffn_link"]):
        d = w["delta"]
        print(f"\nFFN worker {rank} link: steps +{d['steps']}, layer_calls "
              f"+{d['layer_calls']}, tokens +{d['tokens']}, compute {d['compute_s']:.1f} s, "
              f"waiting {d['wait_s']:.1f} s")
    m = res["attention_metrics"]
    print(f"attention /metrics during the load: requests +{m['requests_delta']} (the "
          f"clients: {res['ok']} answered), generation tokens +{m['generation_tokens_delta']}"
          f", vllm_afd_ series: {len(m['end']['vllm_afd']) or 'none'}")
    if res["scrape_error"] or res["servers_died"]:
        print(f"servers died: {res['servers_died']}; {res['scrape_error'] or ''}")
    print("\nchecks: " + ", ".join(f"{k} {'ok' if v else 'FAILED'}"
                                     for k, v in res["checks"].items()))


def plot(res: dict, path: Path) -> None:
    """RSS of both servers and request latency over time (needs matplotlib,
    pinned in setup.py's bench extra; optional: the JSON has every sample)."""
    try:
        import matplotlib
    except ImportError:
        print("[soak] note: matplotlib is not installed, so no plot (`make soak` installs it)")
        return
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, (top, bottom) = plt.subplots(2, 1, figsize=(10, 7), sharex=True)
    warm_t = WARMUP_FRACTION * res["duration_s"]
    for key, v in res["rss"].items():
        ts = [s["t"] for s in res["rss_samples"]]
        top.plot(ts, [s[key]["mib"] for s in res["rss_samples"]],
                 label=f"{ROLE_NAMES[key]} ({v['slope_mib_per_min']:+.1f} MiB/min, "
                       f"limit {v['limit_mib_per_min']:.0f})")
    top.axvline(warm_t, color="gray", linestyle="--", label="end of warm-up")
    top.set_ylabel("RSS of the process tree, MiB")
    top.set_ylim(bottom=0)
    top.legend(fontsize=8)
    top.grid(True, alpha=0.3)
    ok = [r for r in res["request_samples"] if r["ok"]]
    bottom.scatter([r["t"] for r in ok], [r["latency_ms"] for r in ok], s=4, alpha=0.4,
                   label="request latency")
    lat = res["latency_ms"]
    for q, style in (("p50", "-"), ("p99", ":")):
        bottom.axhline(lat[q], color="black", linestyle=style, label=f"{q} {lat[q]:.0f} ms")
    bottom.set_yscale("log")
    bottom.set_xlabel("seconds since the load started")
    bottom.set_ylabel("latency, ms")
    bottom.legend(fontsize=8)
    bottom.grid(True, alpha=0.3)
    s = res["settings"]
    fig.suptitle(f"AFD soak: {s['clients']} clients, {res['duration_s']:.0f} s, "
                 f"{s['connector']} connector, {res['requests']} requests, "
                 f"{res['errors']} errors", fontsize=10)
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)
    print(f"[soak] wrote {path}")


# ====================================================================== main
def plain_canary(model: str, logs: Path) -> str:
    """The canary's greedy text from plain vLLM (tools/oracle.py, AFD off)."""
    import subprocess

    out = logs / "canary-plain.json"
    proc = subprocess.run([sys.executable, str(REPO / "tools" / "oracle.py"), model,
                           "--out", str(out), "--prompt", CANARY["prompt"], "--max-tokens",
                           str(CANARY["max_tokens"])], capture_output=True, text=True,
                          timeout=600, env=dict(os.environ, VLLM_CPU_OMP_THREADS_BIND=cpu(0)))
    if proc.returncode != 0:
        raise RuntimeError(f"plain vLLM canary run failed: {proc.stderr[-2000:]}")
    return json.loads(out.read_text())["results"][0]["text"]


def run(args: argparse.Namespace) -> dict:
    logs = args.out / "logs"
    ffn, attn = start_servers(args, logs)
    servers = {"ffn": ffn, "attention": attn}
    stop = threading.Event()
    clients: list[Client] = []
    samples: list[dict] = []
    info = {"load_at_start": os.getloadavg()[0]}
    try:
        t_start = time.monotonic()
        ffn.start()
        attn.start()
        print(f"[soak] starting FFN and attention servers (logs in {logs})", flush=True)
        # The canary's reference answer is plain vLLM's (in-process, AFD off),
        # computed while the servers start.
        canary = concurrent.futures.ThreadPoolExecutor(1).submit(plain_canary,
                                                                  str(args.model), logs)
        ffn.wait_ready(300)
        attn.wait_ready(300)
        info["startup_s"] = round(time.monotonic() - t_start, 1)
        print(f"[soak] both ready after {info['startup_s']:.0f} s", flush=True)
        model = str(args.model)
        # The deployment's first answer must already be plain vLLM's.
        import openai

        info["canary"] = canary.result(timeout=300)
        api = openai.OpenAI(base_url=attn.url + "/v1", api_key="soak", max_retries=0)
        first = api.completions.create(model=model, temperature=0, extra_body={
            "ignore_eos": True}, **CANARY).choices[0].text
        if first != info["canary"]:
            raise AssertionError(f"the canary differs from plain vLLM's answer: {first!r} != "
                                 f"{info['canary']!r}")
        info["link_start"] = ffn_status(ffn)
        metrics_start = scrape_metrics(attn, logs / "attention-metrics-start.prom")
        t0 = time.monotonic()
        sampler = threading.Thread(target=rss_sampler, daemon=True,
                                   args=(servers, t0, args.sample_s, stop, samples))
        sampler.start()
        clients = [Client(i, attn.url, model, info["canary"], t0, stop, args.seed)
                   for i in range(args.clients)]
        for c in clients:
            c.start()
        print(f"[soak] {args.clients} clients for {args.minutes * 60:.0f} s", flush=True)
        stop.wait(args.minutes * 60)
        stop.set()
        for c in clients:
            c.join(REQUEST_TIMEOUT_S + 10)
        info["duration_s"] = time.monotonic() - t0
        sampler.join(10)
        # A server that died during the load must still give a report, not a traceback.
        try:
            info["link_end"] = ffn_status(ffn)
        except Exception as e:
            info["link_end"], info["scrape_error"] = [], f"FFN /afd/status: {e}"
        try:
            metrics_end = scrape_metrics(attn, logs / "attention-metrics-end.prom")
        except Exception as e:
            metrics_end = {"http_status": None, "vllm": {}, "vllm_afd": {}}
            info["scrape_error"] = f"attention /metrics: {e}"
        info["metrics"] = {"start": metrics_start, "end": metrics_end}
    finally:
        stop.set()
        for server in (attn, ffn):  # attention first: it says goodbye on the link
            server.stop()
    info["exit_codes"] = {key: s.proc.returncode for key, s in servers.items()}
    return summarize(args, clients, samples, info)


def main(argv=None) -> int:
    args = parse_args(argv)
    # SIGTERM/SIGHUP unwind like Ctrl-C, so the finally clause stops both servers.
    for sig in (signal.SIGTERM, signal.SIGHUP):
        signal.signal(sig, lambda signum, _: sys.exit(128 + signum))
    args.out, args.model = args.out.resolve(), args.model.resolve()
    args.out.mkdir(parents=True, exist_ok=True)
    res = run(args)
    path = args.out / f"{NAME}.json"
    path.write_text(json.dumps(res, indent=1) + "\n")
    print_table(res)
    plot(res, args.out / f"{NAME}.png")
    print(f"\n[soak] wrote {path}: {'PASSED' if res['passed'] else 'FAILED'}")
    return 0 if res["passed"] else 1


if __name__ == "__main__":
    sys.exit(main())
