# SPDX-License-Identifier: Apache-2.0
# SPDX-FileCopyrightText: Copyright contributors to the vllm-afd project
"""Soak test: N clients against a two-role AFD deployment for a bounded time.

    python benchmarks/soak.py [--minutes 10 | --quick] [--clients 4]
        [--connector shm|tcp] [--model DIR] [--out DIR] [--kill-ffn-every S]

One `vllm serve --afd-role ffn` and one `vllm serve --afd-role attention` on
loopback (tiny Qwen3-MoE, eager mode). Each client thread loops over real
OpenAI requests (completions and chat, some streaming, prompts of 1-16 words,
max_tokens 1-32, temperature 0) and checks every answer is well-formed; every
tenth request is the canary, a fixed greedy prompt that must always return
plain vLLM's text (computed in-process, AFD off, before the load). A sampler
records the resident memory of both server process trees.

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

--kill-ffn-every S (0: off) soaks the FFN pool's failover instead: TWO FFN
servers, the attention server's ffn_pool listing both, and every S seconds one
of them (alternately) SIGKILLed as a whole process group, restarted on the same
ports after --ffn-down-s, and waited for until the attention server shows it
ready again (its member thread redials by itself). A kill never takes the last
ready member: it waits until the other one is ready. Per kill, the attention's
/afd/status tells how it was noticed: mid-step (the killed member's failed_over
grew: the step was resumed on the other member, a failover) or idle (it went
down between steps and was noticed by its member thread; no step to move).
Verdict as above, but:
  errors == 0        every request, through every kill
  kills accounted    every kill noticed, mid_step + idle == kills, and the
                     link's failovers == mid_step (no failover without a kill,
                     no kill lost a step)
  rejoined           every restarted FFN became a ready pool member again
  RSS flat           the attention server over the whole run (rule above); each
                     FFN incarnation from its first ready sample to its kill (or
                     the end), the same rule on that span, judged only when it
                     spans >= FFN_RSS_MIN_LIFE_S (shorter ones are reported)
  members served     every pool member's steps grew (the attention's counters)
Writes OUT/soak-ffn-kills.json/.png (so soak.json stays the steady soak's) and
OUT/logs/ffn-kills/ (every FFN incarnation's log).
"""

from __future__ import annotations

import argparse
import concurrent.futures
import json
import math
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
sys.path.insert(0, str(REPO / "tools" / "serving"))
from servers import Server, cpu, free_port, process_tree_rss_kib  # noqa: E402

NAME = "soak"
KILLS_NAME = "soak-ffn-kills"
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
# --kill-ffn-every: an FFN incarnation's RSS slope is judged only over a span
# this long (a shorter fit is mostly allocator noise); shorter ones are reported.
FFN_RSS_MIN_LIFE_S = 60.0
KILL_NOTICE_TIMEOUT_S = 30.0  # kill -> the attention shows the member not ready
FFN_RESTART_TIMEOUT_S = 300.0  # restart -> /health 200 and the member ready again


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
    ap.add_argument("--kill-ffn-every", type=float, default=0.0, metavar="S",
                    help="two FFN servers in the attention's ffn_pool; every S seconds "
                         "kill -9 one (alternately) and restart it (default 0: off, one FFN)")
    ap.add_argument("--ffn-down-s", type=float, default=5.0,
                    help="with --kill-ffn-every: seconds a killed FFN stays down before "
                         "its restart (default %(default)s)")
    args = ap.parse_args(argv)
    if args.quick:
        args.minutes = 1.0
    if args.minutes <= 0 or args.clients < 1:
        ap.error("--minutes must be > 0 and --clients >= 1")
    if args.kill_ffn_every < 0 or args.ffn_down_s < 0:
        ap.error("--kill-ffn-every and --ffn-down-s must be >= 0")
    if not (args.model / "config.json").is_file():
        ap.error(f"no model at {args.model}; generate it with: python "
                 "tools/models/make_tiny_models.py --out build/models --models tiny")
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


class FfnSlot:
    """--kill-ffn-every: one FFN pool member's ports and its successive server
    processes (incarnations), each started with the same command and ports."""

    def __init__(self, index: int, args: argparse.Namespace, logs: Path) -> None:
        self.index, self.logs = index, logs
        self.afd_port = free_port()
        self.endpoint = f"127.0.0.1:{self.afd_port}"
        afd = json.dumps({"connector": args.connector, "port": self.afd_port, "timeout_s": 60})
        self.server_args = [*SERVER_ARGS, "--afd-role", "ffn", "--afd-config", afd]
        self.model = str(args.model)
        self.http_port = free_port()
        self.incarnation = 0
        # Set by the killer around a kill and restart: the sampler then takes
        # the server's exit as planned, and its RSS as not (yet) serving.
        self.killing = False
        self.ready = False  # a ready pool member of the attention server
        self.server = self._new_server()

    def _new_server(self) -> Server:
        self.incarnation += 1
        # Both FFN engines share core 1 (the attention's has core 0): on 2 cores
        # the pool costs no more CPUs than one FFN.
        return Server(self.model, self.server_args, port=self.http_port,
                      log_path=self.logs / f"ffn{self.index}-{self.incarnation}.log",
                      env={"VLLM_CPU_OMP_THREADS_BIND": cpu(1)},
                      name=f"FFN server {self.index} (incarnation {self.incarnation})")

    @property
    def proc(self):
        return self.server.proc

    def start(self) -> None:
        self.server.start()

    def wait_ready(self, timeout: float) -> None:
        self.server.wait_ready(timeout)

    def get(self, path: str) -> tuple[int, str]:
        return self.server.get(path)

    def stop(self) -> int | None:
        return self.server.stop()

    def kill(self, timeout: float = 10.0) -> bool:
        """SIGKILL the incarnation's whole process group (API server, engine
        core, the worker that runs the FFN loop); True once none is left."""
        self.server.kill()
        deadline = time.monotonic() + timeout
        while self.server.group_alive() and time.monotonic() < deadline:
            time.sleep(0.1)
        return not self.server.group_alive()

    def restart(self) -> None:
        self.server = self._new_server()
        self.server.start()


def start_pool_servers(args: argparse.Namespace, logs: Path) -> tuple[list[FfnSlot], Server]:
    """--kill-ffn-every: two FFN servers and an attention server whose ffn_pool
    lists both."""
    slots = [FfnSlot(i, args, logs / "ffn-kills") for i in range(2)]
    afd = json.dumps({"connector": args.connector, "timeout_s": 60,
                      "ffn_pool": [s.endpoint for s in slots]})
    attn = Server(str(args.model), [*SERVER_ARGS, "--afd-role", "attention",
                                    "--afd-config", afd],
                  log_path=logs / "ffn-kills" / "attention.log",
                  env={"VLLM_CPU_OMP_THREADS_BIND": cpu(0)}, name="attention server")
    return slots, attn


def rss_sampler(servers: dict, t0: float, period: float,
                stop: threading.Event, samples: list[dict]) -> None:
    """Every `period` s: each server tree's VmRSS, in total and per process
    (an FfnSlot's: of its current incarnation, with its number and whether it
    is a ready pool member)."""
    while True:
        sample = {"t": round(time.monotonic() - t0, 2)}
        for key, server in servers.items():
            slot = server if isinstance(server, FfnSlot) else None
            if slot is not None:  # read together: the killer may swap them
                killing, incarnation, ready, server = (slot.killing, slot.incarnation,
                                                       slot.ready, slot.server)
            procs = process_tree_rss_kib(server.proc.pid)
            sample[key] = {"mib": round(sum(procs.values()) / 1024, 1), "procs": procs}
            if slot is not None:
                sample[key].update(incarnation=incarnation, ready=ready and not killing)
                if killing:
                    continue
            # A dead server ends the soak, unless the killer killed it meanwhile.
            if server.proc.poll() is not None and not (
                    slot is not None and (slot.killing or slot.server is not server)):
                sample[key]["exited"] = server.proc.returncode
                stop.set()
        samples.append(sample)
        if stop.wait(period):
            return


def attention_links(attn: Server) -> list[dict]:
    """The attention server's link documents (/afd/status), one per rank."""
    status, body = attn.get("/afd/status")
    if status != 200:
        raise RuntimeError(f"attention /afd/status answered {status}: {body[:500]}")
    return json.loads(body)["links"]


def pool_member(links: list[dict], endpoint: str) -> dict:
    """One pool member's document, its counters summed over the attention ranks."""
    docs = [m for link in links for m in link.get("pool", []) if m["endpoint"] == endpoint]
    if not docs:
        raise RuntimeError(f"no pool member {endpoint} in the attention's /afd/status")
    out = dict(docs[0])
    for key in ("connects", "steps", "layer_calls", "failed_over"):
        out[key] = sum(d[key] for d in docs)
    out["state"] = "ready" if all(d["state"] == "ready" for d in docs) else docs[0]["state"]
    return out


def failover_counts(links: list[dict]) -> dict:
    """The failover counters of every attention rank, summed, and the failover
    times each rank still keeps (its last LAST_FAILOVERS_KEPT)."""
    return {"failovers": sum(link.get("failovers", 0) for link in links),
            "resent_layer_calls": sum(link.get("resent_layer_calls", 0) for link in links),
            "timed": [sum((link.get("failover_seconds") or {}).get("counts", []))
                      for link in links],
            "last": [list(link.get("last_failover_seconds", [])) for link in links]}


def new_failover_times(before: dict | None, after: dict) -> tuple[list[float], int]:
    """The failover times observed between two failover_counts() readings:
    per rank, the newest (timed count growth) entries of its kept list. Also
    how many of them had already rolled out of that list (then not returned)."""
    times, lost = [], 0
    for rank, (count, last) in enumerate(zip(after["timed"], after["last"])):
        prev = before["timed"][rank] if before and rank < len(before["timed"]) else 0
        grew = max(0, count - prev)
        kept = min(grew, len(last))
        times += last[len(last) - kept:] if kept else []
        lost += grew - kept
    return times, lost


class FfnKiller(threading.Thread):
    """Every `every` s, SIGKILL one FFN (alternately), restart it on its ports
    after `down_s`, wait until the attention's pool has it ready again; records
    per kill how the attention noticed it."""

    def __init__(self, slots: list[FfnSlot], attn: Server, t0: float, every: float,
                 down_s: float, stop: threading.Event) -> None:
        super().__init__(name="ffn-killer", daemon=True)
        self.slots, self.attn, self.t0 = slots, attn, t0
        self.every, self.down_s, self.stop = every, down_s, stop
        self.kills: list[dict] = []
        self.failover_times: list[float] = []
        self.failover_times_lost = 0
        self.incarnations: list[dict] = []  # each killed incarnation's FFN /afd/status
        self.error: str | None = None
        self._counts: dict | None = None

    def t(self) -> float:
        return round(time.monotonic() - self.t0, 2)

    def member(self, slot: FfnSlot) -> dict:
        return pool_member(attention_links(self.attn), slot.endpoint)

    def collect_failover_times(self) -> dict:
        counts = failover_counts(attention_links(self.attn))
        times, lost = new_failover_times(self._counts, counts)
        self.failover_times += times
        self.failover_times_lost += lost
        self._counts = counts
        return counts

    def wait_for(self, predicate, timeout: float, poll: float = 0.2) -> bool:
        """Poll predicate() until true (True), timeout or stop (False)."""
        deadline = time.monotonic() + timeout
        while not self.stop.is_set() and time.monotonic() < deadline:
            try:
                if predicate():
                    return True
            except Exception:  # noqa: BLE001 - a server restarting: poll again
                pass
            time.sleep(poll)
        return False

    def run(self) -> None:
        try:
            self.collect_failover_times()
            k = 0
            while not self.stop.wait(max(0.0, self.t0 + self.every * (k + 1)
                                         - time.monotonic())):
                self.kill_and_restart(self.slots[k % len(self.slots)],
                                      self.slots[(k + 1) % len(self.slots)])
                k += 1
        except Exception as e:  # a finding for the report, never a silent thread death
            self.error = f"{type(e).__name__}: {e}"[:1000]
            self.stop.set()

    def kill_and_restart(self, victim: FfnSlot, other: FfnSlot) -> None:
        due = self.t()
        # Never the last ready member: that would be an outage, not a failover.
        if not self.wait_for(lambda: other.ready and self.member(other)["state"] == "ready",
                             FFN_RESTART_TIMEOUT_S):
            return
        rec = {"ffn": victim.index, "endpoint": victim.endpoint,
               "incarnation": victim.incarnation, "delayed_s": round(self.t() - due, 2)}
        try:  # the incarnation's own counters, as a record (best effort)
            self.incarnations.append({"ffn": victim.index, "incarnation": victim.incarnation,
                                      "status": ffn_status(victim)})
        except Exception as e:  # noqa: BLE001
            self.incarnations.append({"ffn": victim.index, "incarnation": victim.incarnation,
                                      "error": str(e)})
        before = self.member(victim)
        counts_before = self.collect_failover_times()
        victim.killing, victim.ready = True, False
        rec["t"] = self.t()
        rec["pids"] = sorted(process_tree_rss_kib(victim.proc.pid))
        rec["all_processes_died"] = victim.kill()
        rec["exit_code"] = victim.proc.returncode
        # Noticed: the member is no longer ready (failed over mid-step, or its
        # thread saw the connection closed between steps).
        noticed = self.wait_for(lambda: self.member(victim)["state"] != "ready",
                                KILL_NOTICE_TIMEOUT_S)
        rec["noticed_s"] = round(self.t() - rec["t"], 2) if noticed else None
        after = self.member(victim)
        counts_after = self.collect_failover_times()
        rec.update(member_before=before, member_after=after,
                   link_failovers=counts_after["failovers"] - counts_before["failovers"],
                   resent_layer_calls=counts_after["resent_layer_calls"]
                   - counts_before["resent_layer_calls"],
                   how=classify_kill(before, after, noticed))
        self.kills.append(rec)
        print(f"[soak] t={rec['t']:.0f}s killed FFN {victim.index} (incarnation "
              f"{rec['incarnation']}): {rec['how']}, noticed in {rec['noticed_s']} s",
              flush=True)
        if self.stop.wait(self.down_s):
            return
        t_restart = time.monotonic()
        victim.restart()
        victim.killing = False
        up = self.wait_for(lambda: victim.get("/health")[0] == 200, FFN_RESTART_TIMEOUT_S, 0.5)
        rec["restart_ready_s"] = round(time.monotonic() - t_restart, 1) if up else None
        back = up and self.wait_for(
            lambda: (m := self.member(victim))["state"] == "ready"
            and m["connects"] > before["connects"], FFN_RESTART_TIMEOUT_S)
        rec["rejoined_s"] = round(time.monotonic() - t_restart, 1) if back else None
        rec["restart_cut_by_the_end"] = not back and self.stop.is_set()
        victim.ready = back
        if not back and not self.stop.is_set():
            raise RuntimeError(f"FFN {victim.index} did not rejoin the pool in "
                               f"{FFN_RESTART_TIMEOUT_S:.0f} s; log tail:\n"
                               f"{victim.server.log_tail()}")


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
    """Nearest-rank percentile: the smallest value with at least p % of the
    values at or below it (rank ceil(p n / 100); round(x + 0.5) was not a
    ceiling: it rounds half to even, so p99 of 100 values took the 100th)."""
    if not values:
        return None
    s = sorted(values)
    return s[min(len(s) - 1, max(0, math.ceil(p * len(s) / 100) - 1))]


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
    return series_verdict([(s["t"], s[key]["mib"]) for s in samples], warm_t, duration_s)


def series_verdict(series: list[tuple[float, float]], warm_t: float,
                   duration_s: float) -> dict:
    """rss_verdict of (seconds, MiB) points."""
    after = [(t, mib) for t, mib in series if t >= warm_t] or series[-1:]
    warm, end = statistics.median(m for _, m in after[:3]), statistics.median(
        m for _, m in after[-3:])
    slope, limit = slope_mib_per_min(after), rss_limit(duration_s)
    return {"first_mib": series[0][1], "warm_mib": warm, "end_mib": end,
            "max_mib": max(m for _, m in series), "growth_mib": round(end - warm, 1),
            "slope_mib_per_min": round(slope, 2), "limit_mib_per_min": round(limit, 1),
            "samples": len(after), "flat": slope <= limit}


def incarnation_rss(samples: list[dict], key: str,
                    min_life_s: float = FFN_RSS_MIN_LIFE_S) -> list[dict]:
    """--kill-ffn-every: an FFN slot's RSS per incarnation (a restart starts
    anew), over its samples as a ready pool member: the steady rule on that span
    (warm-up: its first WARMUP_FRACTION), judged ("flat" true/false) only when
    the span is at least min_life_s, else "flat" is None (reported only)."""
    out = []
    for n in sorted({s[key]["incarnation"] for s in samples if key in s}):
        points = [(s["t"], s[key]["mib"]) for s in samples
                  if key in s and s[key]["incarnation"] == n and s[key]["ready"]]
        if not points:
            out.append({"incarnation": n, "samples": 0, "life_s": 0.0, "flat": None})
            continue
        first_t, life = points[0][0], points[-1][0] - points[0][0]
        v = series_verdict(points, first_t + WARMUP_FRACTION * life, life)
        v.update(incarnation=n, from_t=first_t, life_s=round(life, 1),
                 judged=life >= min_life_s)
        if not v["judged"]:
            v["flat"] = None
        out.append(v)
    return out


def classify_kill(before: dict, after: dict, noticed: bool) -> str:
    """How the attention server noticed a killed FFN, from the member's
    /afd/status documents before the kill and once it was no longer ready:
    "mid_step" (a step lost it and moved on: its failed_over grew), "idle" (its
    thread saw the connection closed between steps), "unnoticed" (still ready)."""
    if after["failed_over"] > before["failed_over"]:
        return "mid_step"
    return "idle" if noticed else "unnoticed"


def kill_accounting(kills: list[dict], failovers: int) -> dict:
    """Kills against the attention's failovers (the link's counter, grown over
    the load). Every kill is noticed either mid-step (a failover) or idle (no
    step to move), so: mid_step + idle == kills and failovers == mid_step."""
    how = [k["how"] for k in kills]
    acc = {"kills": len(kills), "mid_step": how.count("mid_step"), "idle": how.count("idle"),
           "unnoticed": how.count("unnoticed"), "failovers": failovers}
    acc["ok"] = (acc["mid_step"] + acc["idle"] == acc["kills"]
                 and acc["failovers"] == acc["mid_step"])
    return acc


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
    kills = run.get("kills")  # --kill-ffn-every
    keys = ["ffn0", "ffn1", "attention"] if kills else ["ffn", "attention"]
    if kills:
        rss = {"attention": rss_verdict(samples, "attention", warm_t, duration_s)}
        ffn_rss = {key: incarnation_rss(samples, key) for key in ("ffn0", "ffn1")}
        link = []
    else:
        rss = {key: rss_verdict(samples, key, warm_t, duration_s) for key in keys}
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
    died = sorted({k for smp in samples for k in keys if "exited" in smp.get(k, {})})
    checks = {"errors_zero": not errors, "rss_flat": all(v["flat"] for v in rss.values()),
              "servers_stayed_up": not died,
              "ffn_steps_grew": bool(link) and all(w["delta"]["steps"] > 0 for w in link),
              "requests_served": bool(ok)}
    extra = {}
    if kills:
        extra = pool_summary(run, ffn_rss, duration_s)
        checks["rss_flat"] = checks["rss_flat"] and all(
            v["flat"] is not False for inc in ffn_rss.values() for v in inc)
        del checks["ffn_steps_grew"]
        checks.update(extra.pop("checks"))
    return {
        "benchmark": NAME,
        "settings": {"minutes": args.minutes, "clients": args.clients,
                     "kill_ffn_every_s": args.kill_ffn_every, "ffn_down_s": args.ffn_down_s,
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
        "rss": rss, "ffn_link": link, **extra, "attention_metrics": metrics,
        "server_exit_codes": run["exit_codes"], "checks": checks, "passed": all(checks.values()),
        "rss_samples": samples, "request_samples": records,
    }


def pool_summary(run: dict, ffn_rss: dict, duration_s: float) -> dict:
    """--kill-ffn-every: the kills, their accounting, failover times and the
    pool members' counters (attention side), with their checks."""
    kills, times = run["kills"], run["failover_times"]
    start, end = run["link_start"], run["link_end"]
    failovers = (failover_counts(end)["failovers"] - failover_counts(start)["failovers"]
                 if end else None)
    acc = kill_accounting(kills, failovers if failovers is not None else -1)
    members = {}
    for i, endpoint in enumerate(run["endpoints"]):
        a = pool_member(start, endpoint)
        b = pool_member(end, endpoint) if end else {}
        members[f"ffn{i}"] = {"start": a, "end": b, "delta": {
            k: b.get(k, 0) - a[k] for k in ("connects", "steps", "layer_calls", "failed_over")}}
    ms = [round(t * 1e3, 2) for t in times]
    return {
        "ffn_kills": {
            "rule": "a kill is noticed mid_step (the killed member's failed_over grew: the "
                    "step resumed on the other member, one failover) or idle (it went down "
                    "between steps: no step to move); passes when mid_step + idle == kills "
                    "and the link's failovers == mid_step",
            **acc, "per_kill": kills, "killer_error": run.get("killer_error"),
            "failover_ms": {"count": len(ms), "p50": percentile(ms, 50),
                            "p99": percentile(ms, 99), "max": max(ms, default=None),
                            "values": ms, "rolled_out_unseen": run["failover_times_lost"]},
            "incarnation_status": run["incarnations"]},
        "ffn_rss_incarnations": {
            "rule": f"per FFN incarnation, its samples as a ready pool member; the slope "
                    f"after its first {WARMUP_FRACTION:.0%} is judged against max(8, 40 / "
                    f"minutes of the span) MiB/min only when the span is >= "
                    f"{FFN_RSS_MIN_LIFE_S:.0f} s (flat: null = too short, reported only)",
            **ffn_rss},
        "ffn_pool": members,
        "dev_shm_vllm_afd_files": run["dev_shm"],
        "checks": {
            "kills_accounted": acc["ok"] and acc["kills"] > 0 and not run.get("killer_error"),
            "all_killed_processes_died": all(k["all_processes_died"] for k in kills),
            "rejoined": all(k.get("rejoined_s") is not None for k in kills
                            if "restart_ready_s" in k and not k["restart_cut_by_the_end"]),
            "members_served": bool(end) and all(m["delta"]["steps"] > 0
                                                for m in members.values())}}


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
    if "ffn_kills" in res:
        print_kills(res)
    m = res["attention_metrics"]
    print(f"attention /metrics during the load: requests +{m['requests_delta']} (the "
          f"clients: {res['ok']} answered), generation tokens +{m['generation_tokens_delta']}"
          f", vllm_afd_ series: {len(m['end']['vllm_afd']) or 'none'}")
    if res["scrape_error"] or res["servers_died"]:
        print(f"servers died: {res['servers_died']}; {res['scrape_error'] or ''}")
    print("\nchecks: " + ", ".join(f"{k} {'ok' if v else 'FAILED'}"
                                     for k, v in res["checks"].items()))


def print_kills(res: dict) -> None:
    k, f = res["ffn_kills"], res["ffn_kills"]["failover_ms"]
    print(f"\nFFN kills (every {res['settings']['kill_ffn_every_s']:g} s, down "
          f"{res['settings']['ffn_down_s']:g} s):")
    for r in k["per_kill"]:
        print(f"  t={r['t']:6.1f} s FFN {r['ffn']} incarnation {r['incarnation']}: {r['how']}"
              f", noticed in {r['noticed_s']} s, failovers +{r['link_failovers']}, resent "
              f"+{r['resent_layer_calls']}, all processes died {r['all_processes_died']}, "
              f"restart ready {r.get('restart_ready_s')} s, rejoined {r.get('rejoined_s')} s"
              f"{', delayed %.0f s' % r['delayed_s'] if r['delayed_s'] >= 1 else ''}")
    print(f"  {k['kills']} kills = {k['mid_step']} mid-step + {k['idle']} idle (+ "
          f"{k['unnoticed']} unnoticed); link failovers {k['failovers']}; failover ms: p50 "
          f"{f['p50']}, p99 {f['p99']}, max {f['max']} ({f['count']} timed)")
    if k["killer_error"]:
        print(f"  killer stopped: {k['killer_error']}")
    print(f"  {'FFN RSS, MiB':<14}{'from s':>8}{'life s':>8}{'warm':>8}{'end':>8}"
          f"{'MiB/min':>9}{'limit':>7}  flat")
    for key, incs in res["ffn_rss_incarnations"].items():
        if key == "rule":
            continue
        for v in incs:
            if not v["samples"]:
                print(f"  {key} #{v['incarnation']:<8} never a ready member")
                continue
            flat = {True: "yes", False: "NO", None: "(too short)"}[v["flat"]]
            print(f"  {key + ' #' + str(v['incarnation']):<14}{v['from_t']:>8.0f}"
                  f"{v['life_s']:>8.0f}{v['warm_mib']:>8.0f}{v['end_mib']:>8.0f}"
                  f"{v['slope_mib_per_min']:>9.1f}{v['limit_mib_per_min']:>7.0f}  {flat}")
    for key, m in res["ffn_pool"].items():
        d = m["delta"]
        print(f"  pool member {key}: steps +{d['steps']}, layer_calls +{d['layer_calls']}, "
              f"connects +{d['connects']}, failed_over +{d['failed_over']}")


def summary_line(res: dict) -> str:
    """One line for logs and CI: the numbers the --kill-ffn-every acceptance reads."""
    line = (f"[soak] {res['requests']} requests, {res['errors']} failed, "
            f"attention RSS {res['rss']['attention']['slope_mib_per_min']:+.1f} MiB/min")
    if "ffn_kills" in res:
        k, f = res["ffn_kills"], res["ffn_kills"]["failover_ms"]
        judged = [v for key, incs in res["ffn_rss_incarnations"].items() if key != "rule"
                  for v in incs if v.get("judged")]
        line += (f"; {k['kills']} FFN kills ({k['mid_step']} mid-step, {k['idle']} idle), "
                 f"{k['failovers']} failovers, failover p50 {f['p50']} ms p99 {f['p99']} ms; "
                 f"FFN incarnations judged flat {sum(bool(v['flat']) for v in judged)}/"
                 f"{len(judged)}")
    else:
        line += f", FFN RSS {res['rss']['ffn']['slope_mib_per_min']:+.1f} MiB/min"
    return line + f": {'PASSED' if res['passed'] else 'FAILED'}"


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
    for key in ("ffn0", "ffn1") if "ffn_kills" in res else ():
        # One line per FFN, broken while it is not a ready pool member.
        points = [(s["t"], s[key]["mib"] if s[key]["ready"] else float("nan"))
                  for s in res["rss_samples"] if key in s]
        top.plot([t for t, _ in points], [m for _, m in points],
                 label=f"FFN server {key[-1]} (ready incarnations)")
    for i, k in enumerate(res.get("ffn_kills", {}).get("per_kill", [])):
        top.axvline(k["t"], color="red", alpha=0.4, linewidth=0.8,
                    label="FFN kill -9" if i == 0 else None)
        bottom.axvline(k["t"], color="red", alpha=0.4, linewidth=0.8)
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
    kills = res.get("ffn_kills")
    fig.suptitle(f"AFD soak: {s['clients']} clients, {res['duration_s']:.0f} s, "
                 f"{s['connector']} connector, {res['requests']} requests, "
                 f"{res['errors']} errors" + (f"; 2 FFNs, {kills['kills']} kills, "
                                              f"{kills['failovers']} failovers"
                                              if kills else ""), fontsize=10)
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)
    print(f"[soak] wrote {path}")


# ====================================================================== main
def plain_canary(model: str, logs: Path) -> str:
    """The canary's greedy text from plain vLLM (tools/models/oracle.py, AFD off)."""
    import subprocess

    out = logs / "canary-plain.json"
    proc = subprocess.run([sys.executable, str(REPO / "tools" / "models" / "oracle.py"), model,
                           "--out", str(out), "--prompt", CANARY["prompt"], "--max-tokens",
                           str(CANARY["max_tokens"])], capture_output=True, text=True,
                          timeout=600, env=dict(os.environ, VLLM_CPU_OMP_THREADS_BIND=cpu(0)))
    if proc.returncode != 0:
        raise RuntimeError(f"plain vLLM canary run failed: {proc.stderr[-2000:]}")
    return json.loads(out.read_text())["results"][0]["text"]


def dev_shm_afd_files() -> int | None:
    """Segments of the shm connector left in /dev/shm (names vllm-afd-*)."""
    try:
        return sum(1 for p in Path("/dev/shm").iterdir() if p.name.startswith("vllm-afd-"))
    except OSError:
        return None


def run(args: argparse.Namespace) -> dict:
    logs = args.out / "logs"
    kill_mode = args.kill_ffn_every > 0
    if kill_mode:
        slots, attn = start_pool_servers(args, logs)
        ffns: list = slots
        servers = {"ffn0": slots[0], "ffn1": slots[1], "attention": attn}
    else:
        ffn, attn = start_servers(args, logs)
        ffns = [ffn]
        servers = {"ffn": ffn, "attention": attn}
    stop = threading.Event()
    clients: list[Client] = []
    samples: list[dict] = []
    killer = None
    info = {"load_at_start": os.getloadavg()[0]}
    try:
        t_start = time.monotonic()
        for server in servers.values():
            server.start()
        print(f"[soak] starting {len(ffns)} FFN and an attention server (logs in "
              f"{logs / 'ffn-kills' if kill_mode else logs})", flush=True)
        # The canary's reference answer is plain vLLM's (in-process, AFD off),
        # computed while the servers start.
        canary = concurrent.futures.ThreadPoolExecutor(1).submit(plain_canary,
                                                                  str(args.model), logs)
        for server in servers.values():
            server.wait_ready(300)
        info["startup_s"] = round(time.monotonic() - t_start, 1)
        print(f"[soak] all ready after {info['startup_s']:.0f} s", flush=True)
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
        if kill_mode:
            # Both members ready before the load: the first kills need the other one.
            deadline = time.monotonic() + 120
            while not all(pool_member(attention_links(attn), s.endpoint)["state"] == "ready"
                          for s in slots):
                if time.monotonic() > deadline:
                    raise TimeoutError(f"the attention's pool is not ready: "
                                       f"{attention_links(attn)}")
                time.sleep(0.5)
            for slot in slots:
                slot.ready = True
            info["endpoints"] = [s.endpoint for s in slots]
            info["link_start"] = attention_links(attn)
            info["dev_shm"] = {"start": dev_shm_afd_files()}
        else:
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
        if kill_mode:
            killer = FfnKiller(slots, attn, t0, args.kill_ffn_every, args.ffn_down_s, stop)
            killer.start()
        print(f"[soak] {args.clients} clients for {args.minutes * 60:.0f} s"
              + (f", an FFN killed every {args.kill_ffn_every:g} s" if kill_mode else ""),
              flush=True)
        stop.wait(args.minutes * 60)
        stop.set()
        for c in clients:
            c.join(REQUEST_TIMEOUT_S + 10)
        info["duration_s"] = time.monotonic() - t0
        sampler.join(10)
        if killer is not None:
            killer.join(60)
        # A server that died during the load must still give a report, not a traceback.
        try:
            if kill_mode:
                killer.collect_failover_times()  # the last ones (the killer stopped)
                info["link_end"] = attention_links(attn)
            else:
                info["link_end"] = ffn_status(ffn)
        except Exception as e:
            info["link_end"], info["scrape_error"] = [], f"/afd/status: {e}"
        try:
            metrics_end = scrape_metrics(attn, logs / "attention-metrics-end.prom")
        except Exception as e:
            metrics_end = {"http_status": None, "vllm": {}, "vllm_afd": {}}
            info["scrape_error"] = f"attention /metrics: {e}"
        info["metrics"] = {"start": metrics_start, "end": metrics_end}
    finally:
        stop.set()
        for server in (attn, *ffns):  # attention first: it says goodbye on the link
            server.stop()
    info["exit_codes"] = {key: s.proc.returncode for key, s in servers.items()}
    if killer is not None:
        info.update(kills=killer.kills, failover_times=killer.failover_times,
                    failover_times_lost=killer.failover_times_lost,
                    incarnations=killer.incarnations, killer_error=killer.error)
        info["dev_shm"]["end"] = dev_shm_afd_files()
    return summarize(args, clients, samples, info)


def main(argv=None) -> int:
    args = parse_args(argv)
    # SIGTERM/SIGHUP unwind like Ctrl-C, so the finally clause stops both servers.
    for sig in (signal.SIGTERM, signal.SIGHUP):
        signal.signal(sig, lambda signum, _: sys.exit(128 + signum))
    args.out, args.model = args.out.resolve(), args.model.resolve()
    args.out.mkdir(parents=True, exist_ok=True)
    res = run(args)
    name = KILLS_NAME if args.kill_ffn_every > 0 else NAME
    path = args.out / f"{name}.json"
    path.write_text(json.dumps(res, indent=1) + "\n")
    print_table(res)
    plot(res, args.out / f"{name}.png")
    print(f"\n[soak] wrote {path}: {'PASSED' if res['passed'] else 'FAILED'}")
    print(summary_line(res))
    return 0 if res["passed"] else 1


if __name__ == "__main__":
    sys.exit(main())
