# SPDX-License-Identifier: Apache-2.0
# SPDX-FileCopyrightText: Copyright contributors to the vllm-afd project
"""The rebase report (the summary, its markdown) and what --write makes: the
series (over patches/, or in patches/next/<version>/) and the pin update."""

from __future__ import annotations

import re
import shutil
from collections.abc import Callable
from pathlib import Path

from forward_port import AUTOMATIC, DROPPABLE, DROPPED, changed_lines
from series import read_series

_STATUS_WORDS = {
    "clean": "applies as-is",
    "offset": "applies at fuzz 0 with moved line numbers; regenerated",
    "merged": "three-way merged without conflict; regenerated",
    "reused": "conflicted; recorded resolution reused",
    "resolved": "conflicted; resolved by hand",
    "dropped": "dropped from the series",
    "droppable": "now upstream: drop it",
    "conflict": "conflict (unresolved)",
}
# The statuses a finished run counts (a conflict never finishes).
STATUSES = [s for s in _STATUS_WORDS if s != "conflict"]


def summarize(state: dict, patches_dir: Path, ported: Callable[[str, str], str]) -> dict:
    """The report of a finished run (state: tools/build/rebase.py's); ported(flavor, name)
    is the patch as carried over, "" if it was not."""
    flavors = {}
    for flavor, entry in state["flavors"].items():
        if entry["missing"]:
            flavors[flavor] = {"missing": True, "distribution": entry["distribution"]}
            continue
        rows, before, after, kept = [], 0, 0, 0
        for name in entry["series"]:
            r = state["results"][flavor][name]
            old_text, new_text = (patches_dir / name).read_text(), ported(flavor, name)
            before += changed_lines(old_text)
            if r["status"] not in (DROPPABLE, DROPPED):
                kept += 1
                after += changed_lines(new_text)
            rows.append(dict(r, lines_before=changed_lines(old_text),
                             lines_after=changed_lines(new_text) if new_text else 0))
        auto = sum(r["status"] in AUTOMATIC and not r.get("by_hand") for r in rows)
        flavors[flavor] = {
            "missing": False, "distribution": entry["distribution"],
            "old_wheel": entry["old_wheel"], "new_wheel": entry["new_wheel"],
            "new_sha256": entry["new_sha256"], "patches": rows,
            "burden": {"patches_before": len(rows), "patches_after": kept,
                       "lines_before": before, "lines_after": after},
            "counts": {s: sum(r["status"] == s for r in rows) for s in STATUSES},
            "without_hand_edits": auto / len(rows) if rows else 1.0,
        }
    return {"version": state["version"], "old_version": state["old_version"],
            "flavors": flavors, "recorded": state.get("recorded", [])}


def render_report(report: dict) -> str:
    v, old = report["version"], report["old_version"]
    out = [f"# Rebase report: vLLM {old} → {v}", ""]
    for flavor, f in report["flavors"].items():
        if f["missing"]:
            out += [f"## Flavor `{flavor}`: no {f['distribution']} {v} release yet",
                    "", "Reported, not failed: the pin cannot move until it exists.", ""]
            continue
        b, c = f["burden"], f["counts"]
        out += [
            f"## Flavor `{flavor}`: {f['old_wheel']} → {f['new_wheel']}", "",
            f"- new wheel sha256: `{f['new_sha256']}`",
            f"- {c['clean']} applied as-is, {c['offset']} with moved line numbers, "
            f"{c['merged']} three-way merged, {c['reused']} with a recorded resolution, "
            f"{c['resolved']} resolved by hand, {c['dropped']} dropped, "
            f"{c['droppable']} now upstream",
            f"- carried over without hand edits: {f['without_hand_edits']:.0%}",
            f"- burden: {b['patches_before']} patches, {b['lines_before']} upstream lines "
            f"touched before; {b['patches_after']} patches, {b['lines_after']} lines after",
            "",
            "| # | patch | result | lines before → after | notes |",
            "| --- | --- | --- | --- | --- |",
        ]
        for i, r in enumerate(f["patches"], 1):
            notes = r["detail"]
            if r.get("syntax_errors"):
                notes += f"; does not parse: {', '.join(r['syntax_errors'])}"
            if r["missing_symbols"]:
                notes += f"; Upstream-Symbols not found: {', '.join(r['missing_symbols'])}"
            notes = notes.replace("|", "\\|")  # a drop reason may hold one
            out.append(f"| {i} | `{r['name']}` | {_STATUS_WORDS[r['status']]} | "
                       f"{r['lines_before']} → {r['lines_after']} | {notes} |")
        out.append("")
    if report["recorded"]:
        out += ["Recorded at --continue (review them in git with the series): "
                + ", ".join(f"`{p}`" for p in sorted(set(report["recorded"]))), ""]
    return "\n".join(out)


def write_in_place(patches_dir: Path, texts: dict[str, str], gone: list[str],
                   flavors: list[str]) -> list[str]:
    """The refreshed series over patches/: each patch whose bytes changed, and the
    gone ones (dropped, or now upstream) out of their series file and deleted.
    Returns the patches written."""
    written = []
    for name, text in texts.items():
        if (patches_dir / name).read_text() != text:
            (patches_dir / name).write_text(text)
            written.append(name)
    for name in gone:
        for sf in [patches_dir / "series"] + [patches_dir / f"series.{f}" for f in flavors]:
            if sf.exists() and name in read_series(sf):
                sf.write_text("".join(
                    line for line in sf.read_text().splitlines(keepends=True)
                    if line.split("#", 1)[0].strip() != name))
        (patches_dir / name).unlink(missing_ok=True)
    return written


def write_next(patches_dir: Path, version: str, texts: dict[str, str],
               flavors: list[str], pin_text: str) -> Path:
    """The refreshed series in patches/next/<version>/ (the patches under their own
    names, `series` and `series.<flavor>` in order, without the gone ones), with
    `upstream.toml`, the pin as it will be for the flavors that have the release, for
    a pin that cannot move yet: patches/ stays the pinned build's (tools/build/cuda_wheel.py
    --next <version> builds from it). Returns the directory."""
    dest = patches_dir / "next" / version
    if dest.exists():
        shutil.rmtree(dest)
    for name, text in texts.items():
        (dest / name).parent.mkdir(parents=True, exist_ok=True)
        (dest / name).write_text(text)
    for sf in ["series"] + [f"series.{f}" for f in flavors]:
        names = [n for n in read_series(patches_dir / sf) if n in texts]
        (dest / sf).write_text("".join(n + "\n" for n in names))
    (dest / "upstream.toml").write_text(
        f"# patches/next/{version}/: the pin once every flavor has {version}, for the "
        "flavors\n# that have it now (make rebase wrote it; tools/build/cuda_wheel.py --next "
        f"{version}\n# builds the cuda wheel from it and this series).\n" + pin_text)
    return dest


def _set_in_section(text: str, section: str, key: str, value: str) -> str:
    """Replace `key = "..."` inside [section] of a TOML file, keeping its comments."""
    pat = re.compile(rf"(^\[{re.escape(section)}\]\n(?:(?!^\[).*\n)*?){re.escape(key)} = "
                     rf"\"[^\"]*\"", re.M)
    new, n = pat.subn(lambda m: f'{m.group(1)}{key} = "{value}"', text, count=1)
    if n != 1:
        raise ValueError(f"upstream.toml: no {key} in [{section}]")
    return new


def _without_section(text: str, section: str) -> str:
    """TOML text without [section]: its header, the comment lines right above it,
    and its body up to the next header (or the comments right above that one)."""
    lines = text.splitlines(keepends=True)

    def lead(i: int) -> int:  # the first of the comment lines right above line i
        while i > 0 and lines[i - 1].startswith("#"):
            i -= 1
        return i

    headers = [i for i, line in enumerate(lines) if line.startswith("[")]
    start = next(i for i in headers if lines[i].strip() == f"[{section}]")
    later = [i for i in headers if i > start]
    end = lead(later[0]) if later else len(lines)
    return "".join(lines[:lead(start)] + lines[end:])


def moved_pin(text: str, version: str, wheels: dict[str, tuple[str, str]]) -> str:
    """upstream.toml's text moved to `version`: the version, each flavor's wheel and
    sha256, afd_release back to 1. The sdist entries are emptied (the upstream-test
    tool then says so) until someone records the new sdist. A flavor not in `wheels`
    (no such release of it) leaves the pin."""
    old = re.search(r'^version = "([^"]*)"', text, re.M).group(1)
    text = _set_in_section(text, "upstream", "version", version)
    text = re.sub(r"^afd_release = \d+", "afd_release = 1", text, count=1, flags=re.M)
    if re.search(r'^sdist = "', text, re.M):
        text = _set_in_section(text, "upstream", "sdist", "")
        text = _set_in_section(text, "upstream", "sdist_sha256", "")
    for flavor in re.findall(r"^\[flavor\.([\w-]+)\]", text, re.M):
        if flavor in wheels:
            wheel, sha = wheels[flavor]
            text = _set_in_section(text, f"flavor.{flavor}", "wheel", wheel)
            text = _set_in_section(text, f"flavor.{flavor}", "sha256", sha)
        else:
            text = _without_section(text, f"flavor.{flavor}")
    return text.replace(f"release {old}", f"release {version}")


def update_pin(path: Path, version: str, wheels: dict[str, tuple[str, str]]) -> None:
    """Move upstream.toml to `version` (moved_pin), every flavor included."""
    path.write_text(moved_pin(path.read_text(), version, wheels))
