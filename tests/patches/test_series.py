# SPDX-License-Identifier: Apache-2.0
# SPDX-FileCopyrightText: Copyright contributors to the vllm-afd project
"""The series checker passes on our series and fails on each kind of breakage."""

import re
import shutil
from pathlib import Path


import check_series

COMMON = "fix_cli_version_from_vllm_afd_distribution.patch"


def run_check(root: Path, capsys, *args: str) -> tuple[int, str]:
    rc = check_series.main(["--root", str(root), *args])
    return rc, capsys.readouterr().out


def test_series_applies_to_both_flavors(repo, capsys):
    rc, out = run_check(repo, capsys)
    assert rc == 0, out
    assert "flavors: cpu, cuda" in out


def test_hand_edited_context_does_not_apply(scratch, capsys):
    p = scratch / "patches" / COMMON
    text = p.read_text()
    # Change a context line: the patch no longer matches upstream at fuzz 0.
    p.write_text(text.replace(" import sys\n", " import sys  # edited\n", 1))
    rc, out = run_check(scratch, capsys, "--flavor", "cpu")
    assert rc == 1
    assert f"{COMMON} does not apply cleanly (fuzz 0)" in out


def test_hand_edited_hunk_offset_is_drift(scratch, capsys):
    p = scratch / "patches" / COMMON
    text = p.read_text()
    # Shift the first hunk's line numbers: GNU patch still applies it (offset),
    # but re-exporting gives different bytes, which we call drift.
    edited = re.sub(r"^@@ -9,6 \+9,7 @@", "@@ -12,6 +12,7 @@", text, count=1, flags=re.M)
    assert edited != text
    p.write_text(edited)
    rc, out = run_check(scratch, capsys, "--flavor", "cpu")
    assert rc == 1
    assert f"{COMMON}: re-exporting it changes the patch" in out


def test_missing_header_field(scratch, capsys):
    p = scratch / "patches" / COMMON
    p.write_text(re.sub(r"^Forwarded:.*\n", "", p.read_text(), flags=re.M))
    rc, out = run_check(scratch, capsys, "--no-apply")
    assert rc == 1
    assert f"{COMMON}: missing DEP-3 header field 'Forwarded:'" in out


def test_missing_header_entirely(scratch, capsys):
    p = scratch / "patches" / COMMON
    text = p.read_text()
    p.write_text(text[text.index("--- a/"):])
    rc, out = run_check(scratch, capsys, "--no-apply")
    assert rc == 1
    for field in ("Description", "Forwarded", "Last-Update"):
        assert f"missing DEP-3 header field '{field}:'" in out


def test_unlisted_patch(scratch, capsys):
    shutil.copy(scratch / "patches" / COMMON, scratch / "patches" / "feat_unlisted.patch")
    rc, out = run_check(scratch, capsys, "--no-apply")
    assert rc == 1
    assert "feat_unlisted.patch is not listed in any series file" in out


def test_listed_but_missing_patch(scratch, capsys):
    with open(scratch / "patches" / "series", "a") as f:
        f.write("feat_missing.patch\n")
    rc, out = run_check(scratch, capsys, "--no-apply")
    assert rc == 1
    assert "series lists feat_missing.patch, which does not exist" in out


def test_common_series_may_not_touch_flavor_files(scratch, capsys):
    src = scratch / "patches" / "cpu" / "fix_platforms_detect_cpu_from_vllm_afd.patch"
    shutil.move(src, scratch / "patches" / "moved.patch")
    (scratch / "patches" / "series.cpu").write_text("")
    with open(scratch / "patches" / "series", "a") as f:
        f.write("moved.patch\n")
    rc, out = run_check(scratch, capsys, "--no-apply")
    assert rc == 1
    assert "moved.patch: the common series must not touch flavor file vllm/platforms/__init__.py" in out


def test_bad_header_values(scratch, capsys):
    p = scratch / "patches" / COMMON
    text = p.read_text().replace("Forwarded: not-needed", "Forwarded: maybe")
    p.write_text(re.sub(r"^Last-Update:.*$", "Last-Update: yesterday", text, flags=re.M))
    rc, out = run_check(scratch, capsys, "--no-apply")
    assert rc == 1
    assert "Forwarded must be a URL, 'no' or 'not-needed'" in out
    assert "Last-Update must be YYYY-MM-DD" in out


def test_stale_docs(scratch, capsys):
    (scratch / "docs" / "patches.md").write_text("stale\n")
    rc, out = run_check(scratch, capsys, "--no-apply")
    assert rc == 1
    assert "docs/patches.md is out of date" in out
