# SPDX-License-Identifier: Apache-2.0
# SPDX-FileCopyrightText: Copyright contributors to the vllm-afd project
"""The rebase report (markdown) and the pin update that --write makes."""

from __future__ import annotations

import re
from pathlib import Path

_STATUS_WORDS = {
    "clean": "applies as-is",
    "offset": "applies at fuzz 0 with moved line numbers; regenerated",
    "merged": "three-way merged without conflict; regenerated",
    "droppable": "now upstream: drop it",
    "resolved": "conflicted; resolved by hand",
    "conflict": "conflict (unresolved)",
}


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
            f"{c['merged']} three-way merged, {c['resolved']} resolved by hand, "
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
            out.append(f"| {i} | `{r['name']}` | {_STATUS_WORDS[r['status']]} | "
                       f"{r['lines_before']} → {r['lines_after']} | {notes} |")
        out.append("")
    return "\n".join(out)


def _set_in_section(text: str, section: str, key: str, value: str) -> str:
    """Replace `key = "..."` inside [section] of a TOML file, keeping its comments."""
    pat = re.compile(rf"(^\[{re.escape(section)}\]\n(?:(?!^\[).*\n)*?){re.escape(key)} = "
                     rf"\"[^\"]*\"", re.M)
    new, n = pat.subn(lambda m: f'{m.group(1)}{key} = "{value}"', text, count=1)
    if n != 1:
        raise ValueError(f"upstream.toml: no {key} in [{section}]")
    return new


def update_pin(path: Path, version: str, wheels: dict[str, tuple[str, str]]) -> None:
    """Move upstream.toml to `version`: the version, each flavor's wheel and sha256,
    afd_release back to 1. The sdist entries are emptied (the upstream-test tool
    then says so) until someone records the new sdist."""
    text = path.read_text()
    old = re.search(r'^version = "([^"]*)"', text, re.M).group(1)
    text = _set_in_section(text, "upstream", "version", version)
    text = re.sub(r"^afd_release = \d+", "afd_release = 1", text, count=1, flags=re.M)
    if re.search(r'^sdist = "', text, re.M):
        text = _set_in_section(text, "upstream", "sdist", "")
        text = _set_in_section(text, "upstream", "sdist_sha256", "")
    for flavor, (wheel, sha) in wheels.items():
        text = _set_in_section(text, f"flavor.{flavor}", "wheel", wheel)
        text = _set_in_section(text, f"flavor.{flavor}", "sha256", sha)
    text = text.replace(f"release {old}", f"release {version}")
    path.write_text(text)
