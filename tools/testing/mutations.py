# SPDX-License-Identifier: Apache-2.0
# SPDX-FileCopyrightText: Copyright contributors to the vllm-afd project
"""Deliberate breakages, and the tests that must catch them.

    python tools/testing/mutations.py [--list] [--only NAME ...]     (make test-mutations)

Each mutation edits one file (the installed wheel's vllm/afd module, the vendored
upstream tree the tests read, a committed result, the README), runs the tests
that guard what it breaks, and puts the file back. A mutation is caught when
those tests fail; the report (build/mutations/report.md and .json) names, for
each, the tests that failed. First the same tests run unmutated and must pass,
so a failure is the mutation's. The edits must match their files exactly
(tests/test_mutations.py checks that in `make test`), so a list that no longer
fits the code fails instead of going quiet.

It edits the installed package in place: run it alone, not beside another test
run of the same environment. Every file is restored (and checked by sha256)
however the run ends.
"""

from __future__ import annotations

import argparse
import hashlib
import json
import re
import subprocess
import sys
import sysconfig
import time
from dataclasses import dataclass, field
from pathlib import Path

REPO_ROOT = Path(__file__).resolve().parents[2]
OUT = REPO_ROOT / "build" / "mutations"


@dataclass(frozen=True)
class Edit:
    old: str
    new: str
    # Which occurrence of `old` to replace: 0 means it must be the only one;
    # n >= 1 the n-th; -1 every one (at least one).
    nth: int = 0


@dataclass(frozen=True)
class Mutation:
    name: str
    breaks: str  # the claim it breaks, in words
    root: str  # "installed" (site-packages) or "repo"
    path: str
    edits: tuple[Edit, ...]
    tests: tuple[str, ...]  # pytest node ids (or files)
    extra_args: tuple[str, ...] = field(default=())


MUTATIONS = [
    Mutation(
        "ffn-output-not-copied-back",
        "the remote-FFN op writes the FFN's output into the layer's output tensor",
        "installed", "vllm/afd/adapter/model/remote_ffn.py",
        (Edit("    _exchange(hidden_states, output, layer_idx)\n",
              "    _exchange(hidden_states, None, layer_idx)\n"),),
        ("tests/afd/adapter/test_graph_rules.py::"
         "test_remote_ffn_op_mutates_its_output_and_allocates_nothing",)),
    Mutation(
        "micro-batch-rows-swapped",
        "micro-batches' hidden states come back in their rows' order",
        "installed", "vllm/afd/adapter/attention/runner.py",
        (Edit("    return torch.cat(results, dim=0)\n",
              "    return torch.cat(results[::-1], dim=0)\n"),),
        ("tests/afd/e2e/test_oracle.py::test_micro_batches_match_plain",)),
    Mutation(
        "pool-failover-skipped",
        "a step that loses its FFN pool member finishes on another one",
        "installed", "vllm/afd/attention/resume.py",
        (Edit("                member = self.pool.next_member(exclude=failed)\n",
              "                member = None\n"),),
        ("tests/afd/attention/test_pool.py::test_a_killed_member_mid_step_changes_no_output",)),
    Mutation(
        "fp8-scale-one-ulp-off",
        "the composite (Ascend) fp8 pack writes the C++ kernels' bytes, scales included",
        "installed", "vllm/afd/kernels/composite.py",
        (Edit("scale = torch.where(amax > 0, amax / torch.full_like(amax, FP8_MAX),",
              "scale = torch.where(amax > 0, torch.nextafter(amax / torch.full_like(amax, "
              "FP8_MAX), amax),"),),
        ("tests/afd/kernels/test_pack_ops.py::test_composite_pack_is_the_kernels_bytes",)),
    Mutation(
        "fp8-scale-group-not-the-stated-one",
        "fp8 transfer is the format docs/fp8.md states (a scale per 128 elements)",
        "installed", "vllm/afd/transport/wire.py",
        (Edit("FP8_SCALE_GROUP = 128\n", "FP8_SCALE_GROUP = 64\n"),),
        ("tests/afd/kernels/test_fp8.py::test_each_side_receives_the_reference_round_trip",)),
    Mutation(
        "wrong-hmac-accepted",
        "an FFN server admits only a peer that proves the shared secret",
        "installed", "vllm/afd/transport/auth.py",
        (Edit("    return hmac.compare_digest(expected, received)\n", "    return True\n"),),
        ("tests/afd/transport/test_handshake.py::test_unauthenticated_peer_is_dropped_then_a_good_"
         "peer_served", "tests/afd/transport/test_handshake.py::test_forged_proofs_are_refused")),
    Mutation(
        "ffn-secret-not-demanded",
        "an FFN server with a secret refuses a peer without one",
        "installed", "vllm/afd/transport/handshake.py",
        (Edit("        if self.secret is not None:\n            self._authenticate(",
              "        if self.secret is not None and hello.auth_nonce:\n"
              "            self._authenticate("),),
        ("tests/afd/transport/test_handshake.py::test_unauthenticated_peer_is_dropped_then_a_good_"
         "peer_served",)),
    Mutation(
        "link-prediction-5x-slower",
        "the planner's same-host link prediction is bounded against make bench",
        "repo", "benchmarks/results/cpu-profile.toml",
        (Edit("latency = 1.743e-06  # one way", "latency = 8.715e-06  # one way"),
         Edit("step_header = 5.869e-06  # sending", "step_header = 2.9345e-05  # sending")),
        ("tests/afd/deploy/test_planner.py::"
         "test_cpu_profile_predicts_make_bench_within_its_bound",)),
    Mutation(
        "cpu-kernels-not-loaded",
        "on the CPU flavor, calibration times vLLM's own MoE kernel",
        "installed", "vllm/afd/deploy/planner/calibrate.py",
        (Edit("            current_platform.import_kernels()\n            return True\n",
              "            return False\n"),),
        ("tests/afd/deploy/test_planner.py::test_calibration_times_vllms_own_moe_kernel",)),
    Mutation(
        "ffn-construction-unmarked-on-a-branch",
        "every FFN assignment of a supported family lies inside begin_mlp()/close()",
        "repo", "vllm/model_executor/models/lfm2_moe.py",
        (Edit("        afd_scope = afd_seams.begin_mlp()\n", "", nth=2),
         Edit("        afd_scope.close()\n", "", nth=2)),
        ("tests/afd/e2e/test_families.py::test_the_patch_marks_the_ffn_construction",)),
    Mutation(
        "metrics-count-nothing",
        "the attention server's metrics count the failovers /afd/status reports",
        "installed", "vllm/afd/observability/metrics.py",
        (Edit("                    family.add_metric(values, float(d[key]))\n",
              "                    family.add_metric(values, 0.0)\n"),),
        ("tests/afd/attention/test_pool.py::test_pool_of_ffn_servers_under_kills",)),
    Mutation(
        "readme-topologies-unreadable",
        "the README's topology commands are all checked (none found is an error)",
        "repo", "README.md",
        (Edit("\nvllm serve MODEL --afd-role", "\n$ serve MODEL --afd-role", nth=-1),),
        ("tests/test_readme.py",)),
    Mutation(
        "data-plane-imports-vllm",
        "the data plane imports nothing from vLLM (from vllm import ... included)",
        "repo", "vllm/afd/attention/pingpong.py",
        (Edit("import queue\n", "import queue\n\nfrom vllm import logger as _logger\n"),),
        ("tests/afd/test_import_graph.py::test_the_data_plane_imports_nothing_from_vllm_the_"
         "adapter_or_the_tools",)),
    Mutation(
        "ipc-dead-peer-not-released",
        "the ipc connector's wait for a dead FFN ends when its socket hangs up, not at the "
        "step timeout",
        "installed", "vllm/afd/transport/connectors/ipc.py",
        (Edit("            if self.peer_closed():\n                break\n",
              "            pass\n"),),
        ("tests/afd/transport/test_ipc_connector.py::test_a_dead_ffn_never_holds_the_wait",)),
    Mutation(
        "ipc-step-word-not-set",
        "every layer call's record names its step, checked against the consumer's",
        "installed", "vllm/afd/transport/ipc/calls.py",
        (Edit("        self.stream.set_word(self.control.device, STEP, step_word(step_id))\n",
              ""),),
        ("tests/afd/transport/test_ipc_ops.py::test_a_record_of_another_step_or_size_aborts",
         "tests/afd/transport/test_ipc_calls.py::test_a_record_of_another_step_aborts_the_step")),
    Mutation(
        "ipc-step-end-unchecked",
        "a step on a connector that checks once per step is checked at its end, and one that "
        "lost its member runs again whole",
        "installed", "vllm/afd/attention/link.py",
        (Edit("        if ok and lead.checks_per_step:\n", "        if False:\n"),),
        ("tests/afd/attention/test_pool.py::test_a_killed_member_mid_step_changes_no_output"
         "[2-ipc]",)),
    Mutation(
        "gate-handshakes-one-at-a-time",
        "the FFN's gate handshakes incoming connections concurrently, so silent ones cannot "
        "keep a real attention peer out",
        "installed", "vllm/afd/transport/gate.py",
        (Edit("        threading.Thread(target=self._handshake, args=(entry, source), "
              "daemon=True,\n                         name=f\"afd-handshake-{source}\")"
              ".start()\n",
              "        self._handshake(entry, source)\n"),),
        ("tests/afd/transport/test_gate.py::test_idle_slow_and_stormy_connections_never_hold_"
         "the_gate",)),
]


def site_root() -> Path:
    return Path(sysconfig.get_paths()["purelib"])


def target(m: Mutation) -> Path:
    return (site_root() if m.root == "installed" else REPO_ROOT) / m.path


def mutated(text: str, m: Mutation) -> str:
    """`text` with the mutation's edits; raises ValueError where an edit does not fit."""
    for e in m.edits:
        count = text.count(e.old)
        if e.nth == 0 and count != 1:
            raise ValueError(f"{m.name}: {e.old!r} occurs {count} times in {m.path} (once "
                             "expected)")
        if e.nth > 0 and count < e.nth:
            raise ValueError(f"{m.name}: {e.old!r} occurs {count} times in {m.path} "
                             f"(occurrence {e.nth} expected)")
        if e.nth == -1 and count == 0:
            raise ValueError(f"{m.name}: {e.old!r} not in {m.path}")
        if e.nth == -1:
            text = text.replace(e.old, e.new)
        else:
            at = -1
            for _ in range(max(e.nth, 1)):
                at = text.index(e.old, at + 1)
            text = text[:at] + e.new + text[at + len(e.old):]
    return text


def _sha(path: Path) -> str:
    return hashlib.sha256(path.read_bytes()).hexdigest()


def _drop_bytecode(path: Path) -> None:
    """Python trusts a .pyc whose source has the same mtime and size: a same-size
    edit within a second would run the old code."""
    for pyc in (path.parent / "__pycache__").glob(f"{path.stem}.*.pyc"):
        pyc.unlink()


def run_tests(tests: tuple[str, ...], extra: tuple[str, ...] = ()) -> tuple[int, list[str], str]:
    """pytest on `tests`: its exit status, the failed or erroring node ids, its output."""
    # -P: `python -m` would put the checkout (and its vllm/ tree) first on sys.path.
    cmd = [sys.executable, "-P", "-m", "pytest", "-q", "-x", "-rfE", "-p", "no:cacheprovider",
           *extra, *tests]
    proc = subprocess.run(cmd, cwd=REPO_ROOT, capture_output=True, text=True, timeout=1800)
    out = proc.stdout + proc.stderr
    failed = re.findall(r"^(?:FAILED|ERROR) (\S+)", out, re.M)
    return proc.returncode, failed, out


def run(mutations: list[Mutation]) -> list[dict]:
    # Unmutated first, every mutation's tests in one run: they must pass, so that
    # a failure below is the mutation's.
    tests = tuple(dict.fromkeys(t for m in mutations for t in m.tests))
    rc, failed, out = run_tests(tests)
    if rc != 0:
        raise SystemExit(f"the mutations' tests fail unmutated (exit {rc}): "
                         f"{failed or out[-3000:]}")
    rows = []
    for m in mutations:
        path = target(m)
        original = path.read_text()
        before = _sha(path)
        t0 = time.monotonic()
        try:
            path.write_text(mutated(original, m))
            _drop_bytecode(path)
            rc, failed, out = run_tests(m.tests, m.extra_args)
        finally:
            path.write_text(original)
            _drop_bytecode(path)
        assert _sha(path) == before, f"{path} not restored"
        caught = rc in (1, 2) and bool(failed)
        rows.append({"name": m.name, "breaks": m.breaks, "caught": caught, "by": failed,
                     "exit": rc, "seconds": round(time.monotonic() - t0, 1),
                     "file": f"{'<site-packages>/' if m.root == 'installed' else ''}{m.path}"})
        word = "caught by " + ", ".join(failed) if caught else f"NOT caught (exit {rc})"
        print(f"[mutations] {m.name}: {word}", file=sys.stderr)
        if not caught:
            OUT.mkdir(parents=True, exist_ok=True)
            (OUT / f"{m.name}.log").write_text(out)
    return rows


def report(rows: list[dict]) -> str:
    lines = ["| mutation | what it breaks | file | caught by | s |", "|---|---|---|---|---|"]
    for r in rows:
        by = "<br>".join(f"`{t}`" for t in r["by"]) if r["caught"] else "**not caught**"
        lines.append(f"| `{r['name']}` | {r['breaks']} | `{r.get('file', '')}` | {by} | "
                     f"{r.get('seconds', '')} |")
    caught = sum(r["caught"] for r in rows)
    return "\n".join(lines) + f"\n\n{caught} of {len(rows)} mutations caught.\n"


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--list", action="store_true", help="list the mutations and exit")
    ap.add_argument("--only", nargs="+", metavar="NAME", help="run only these")
    args = ap.parse_args()
    chosen = [m for m in MUTATIONS if not args.only or m.name in args.only]
    if args.list or not chosen:
        for m in MUTATIONS:
            print(f"{m.name}: {m.breaks} ({m.path}; {', '.join(m.tests)})")
        return 0 if args.list else 2
    for m in chosen:  # every edit fits before anything is touched
        mutated(target(m).read_text(), m)
    rows = run(chosen)
    OUT.mkdir(parents=True, exist_ok=True)
    (OUT / "report.json").write_text(json.dumps(rows, indent=2) + "\n")
    text = report(rows)
    (OUT / "report.md").write_text(text)
    print(text)
    return 0 if all(r["caught"] for r in rows) else 1


if __name__ == "__main__":
    sys.exit(main())
