# SPDX-License-Identifier: Apache-2.0
# SPDX-FileCopyrightText: Copyright contributors to the vllm-afd project
"""The soak benchmark's CI version: benchmarks/soak.py for one minute, 3 clients.

A two-role deployment (FFN server, attention server, shm connector) under
steady load must answer every request well-formed, keep answering the canary
with plain vLLM's greedy text, keep both servers' resident memory flat (its
slope after the warm-up within the stated MiB/min) and move the FFN's link
counters; the script's exit status and its JSON say so.
"""

import json
import subprocess
import sys
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parents[3]
SOAK = REPO / "benchmarks" / "soak.py"
MINUTES, CLIENTS = 1, 3
# ~5 requests/s on an idle 2-core machine; a loaded CI runner may be far slower.
MIN_REQUESTS = 60
# Start-up (86-105 s on a busy 2-core VM), the load, stopping both servers (~15 s).
TIMEOUT_S = 420

pytestmark = pytest.mark.slow


# Alone (`make test` runs it after the others): with the other xdist worker
# busy, the attention server's RSS once rose 30 MiB after the run's warm-up
# window and failed the slope rule; alone it has always passed. Why it rises
# under load is not known (left for a longer soak under load).
@pytest.mark.solo
def test_soak_one_minute(models_dir, tmp_path):
    cmd = [sys.executable, str(SOAK), "--minutes", str(MINUTES), "--clients", str(CLIENTS),
           "--model", str(models_dir / "tiny-qwen3-moe"), "--out", str(tmp_path)]
    log_path = tmp_path / "soak.log"
    with open(log_path, "wb") as log:
        proc = subprocess.Popen(cmd, stdout=log, stderr=subprocess.STDOUT,
                                stdin=subprocess.DEVNULL)
    try:
        rc = proc.wait(TIMEOUT_S)
    except subprocess.TimeoutExpired:
        proc.terminate()  # soak.py stops both servers on SIGTERM
        proc.wait(120)
        pytest.fail(f"soak.py did not finish in {TIMEOUT_S} s:\n{log_path.read_text()[-4000:]}")
    output = log_path.read_text(errors="replace")
    result_path = tmp_path / "soak.json"
    assert result_path.is_file(), f"soak.py exited {rc} without results:\n{output[-4000:]}"
    res = json.loads(result_path.read_text())

    assert res["errors"] == 0, res["error_texts"]
    assert res["requests"] >= MIN_REQUESTS, output[-2000:]
    for role, verdict in res["rss"].items():
        assert verdict["flat"], (role, verdict)
        assert verdict["limit_mib_per_min"] <= 40 and verdict["samples"] >= 30, verdict
    assert res["ffn_link"] and all(w["delta"]["steps"] > 0 for w in res["ffn_link"])
    assert res["ffn_link"][0]["delta"]["layer_calls"] > 0
    assert res["server_exit_codes"] == {"ffn": 0, "attention": 0}, (
        res["server_exit_codes"], *(server_log_tail(tmp_path / "logs" / f"{role}.log")
                                    for role, code in res["server_exit_codes"].items() if code))
    assert rc == 0 and res["passed"], output[-2000:]


def server_log_tail(path: Path, n: int = 60) -> str:
    """The end of a server's log without the interpreter's exit noise (nanobind's
    leak report from triton's bindings, the resource tracker's warnings), so a
    stop that did not exit 0 shows why."""
    noise = ("nanobind:", " - leaked ", " - ... skipped", "See https://nanobind",
             "resource_tracker", "  warnings.warn(")
    lines = [line for line in path.read_text(errors="replace").splitlines()
             if not line.startswith(noise)]
    return f"{path.name}, last {n} lines:\n" + "\n".join(lines[-n:])


def test_the_rss_rule_sees_a_leak():
    """One minute of samples at 1 s with allocator noise (+-6 MiB): flat
    servers pass, a 45 MiB/min leak (well under the old 10 %-of-RSS band,
    which let a 160 MiB/min leak through on the FFN) fails."""
    import random

    sys.path.insert(0, str(REPO / "benchmarks"))
    import soak

    rng = random.Random(0)

    def samples(leak_per_min: float) -> list[dict]:
        return [{"t": float(t), "ffn": {"mib": 1600 + leak_per_min * t / 60 + rng.uniform(-6, 6)},
                 "attention": {"mib": 2900 + rng.uniform(-6, 6)}} for t in range(60)]

    flat = soak.rss_verdict(samples(0), "ffn", warm_t=12, duration_s=60)
    leaking = soak.rss_verdict(samples(45), "ffn", warm_t=12, duration_s=60)
    assert flat["flat"] and abs(flat["slope_mib_per_min"]) < 10, flat
    assert not leaking["flat"] and 35 < leaking["slope_mib_per_min"] < 55, leaking
    # The rule it replaced (end - warm < max(10 % of warm, 64 MiB)) let it pass.
    assert leaking["end_mib"] - leaking["warm_mib"] < max(0.10 * leaking["warm_mib"], 64)
    assert soak.rss_limit(600) == 8 and soak.rss_limit(60) == 40


def _soak():
    sys.path.insert(0, str(REPO / "benchmarks"))
    import soak

    return soak


def test_percentile_is_nearest_rank():
    soak = _soak()
    assert soak.percentile([], 50) is None
    assert soak.percentile([7.0], 99) == 7.0
    values = [float(v) for v in range(1, 101)]
    assert soak.percentile(values, 50) == 50 and soak.percentile(values, 99) == 99
    assert soak.percentile(values, 100) == 100 and soak.percentile([3, 1, 2], 50) == 2


def test_kill_accounting():
    """--kill-ffn-every: each kill is noticed mid-step (the member's failed_over
    grew: one failover) or idle (down between steps: none); the accounting
    passes only when the link's failovers match the mid-step kills."""
    soak = _soak()
    ready = {"state": "ready", "failed_over": 2, "connects": 3}
    assert soak.classify_kill(ready, {**ready, "state": "down", "failed_over": 3},
                              True) == "mid_step"
    assert soak.classify_kill(ready, {**ready, "state": "down"}, True) == "idle"
    assert soak.classify_kill(ready, ready, False) == "unnoticed"
    kills = [{"how": h} for h in ("mid_step", "idle", "mid_step")]
    acc = soak.kill_accounting(kills, failovers=2)
    assert acc == {"kills": 3, "mid_step": 2, "idle": 1, "unnoticed": 0, "failovers": 2,
                   "ok": True}
    assert not soak.kill_accounting(kills, failovers=3)["ok"]  # a failover with no kill
    assert not soak.kill_accounting(kills + [{"how": "unnoticed"}], failovers=2)["ok"]


def test_new_failover_times_reads_only_the_new_ones():
    """The attention keeps its last 64 failover times: the new ones between two
    readings are the newest (timed-count growth) entries; rolled-out ones are
    counted, never invented."""
    soak = _soak()
    first = {"timed": [2], "last": [[0.1, 0.2]]}
    assert soak.new_failover_times(None, first) == ([0.1, 0.2], 0)
    second = {"timed": [3], "last": [[0.1, 0.2, 0.3]]}
    assert soak.new_failover_times(first, second) == ([0.3], 0)
    assert soak.new_failover_times(second, second) == ([], 0)
    rolled = {"timed": [70], "last": [[float(i) for i in range(6, 70)]]}
    times, lost = soak.new_failover_times(second, rolled)
    assert len(times) == 64 and times[-1] == 69.0 and lost == 3


def test_incarnation_rss_judges_each_long_enough_life():
    """An FFN's RSS restarts with each incarnation: each is judged over its
    ready samples, a short one only reported, a leaking one fails."""
    import random

    soak = _soak()
    rng = random.Random(0)
    samples = []
    for t in range(0, 300):
        inc, ready = (1, True) if t < 100 else (2, t >= 110) if t < 160 else (3, t >= 170)
        leak = 60 * (t - 170) / 60 if inc == 3 else 0  # incarnation 3 leaks 60 MiB/min
        samples.append({"t": float(t), "ffn0": {"mib": 1600 + leak + rng.uniform(-6, 6),
                                                "incarnation": inc, "ready": ready}})
    v1, v2, v3 = soak.incarnation_rss(samples, "ffn0", min_life_s=60)
    assert v1["judged"] and v1["flat"] and v1["life_s"] == 99, v1
    assert not v2["judged"] and v2["flat"] is None and v2["from_t"] == 110, v2
    assert v3["judged"] and v3["flat"] is False and 50 < v3["slope_mib_per_min"] < 70, v3
