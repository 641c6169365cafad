# SPDX-License-Identifier: Apache-2.0
# SPDX-FileCopyrightText: Copyright contributors to the vllm-afd project
"""Check the patch series: completeness, DEP-3 headers, zero-fuzz apply, drift.

    python tools/build/check_series.py [--flavor cpu --flavor cuda] [--no-apply] [--write-docs]

Fails (exit 1, every problem listed) when:
  - a series names a missing patch, a patch file is in no series, or one is listed twice;
  - a patch lacks a required header field (Description, Forwarded, Last-Update,
    Upstream-Symbols, Removal) or has an invalid value;
  - the common series touches a flavor-only file, or a flavor series touches any other;
  - a patch does not apply at zero fuzz to the pristine base wheel of a flavor;
  - re-exporting a patch (quilt refresh -p ab --no-timestamps --no-index) would change it;
  - an Upstream-Symbols entry is not found in the patched file;
  - a patch calls a vllm.afd.seams name that seams.__all__ lacks, or a seam is
    called by no patch;
  - docs/patches.md is not what --write-docs generates.
Applies to a scratch copy of only the touched files, read straight from the verified
base wheels, so it never touches vllm/.
"""

from __future__ import annotations

import argparse
import re
import shutil
import sys
import tempfile
import zipfile
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))
from series import (  # noqa: E402
    Patch, SeriesError, apply_patch, export_patch, header_problems, load_patch,
    read_series, series_files,
)
from upstream import FLAVOR_FILES, FLAVORS, REPO_ROOT, fetch_base_wheel, load_pin  # noqa: E402

DOCS_FILE = "docs/patches.md"


def structure_problems(patches_dir: Path) -> list[str]:
    problems = []
    listed: dict[str, str] = {}
    for sf in [patches_dir / "series"] + [patches_dir / f"series.{f}" for f in FLAVORS]:
        for name in read_series(sf):
            if name in listed:
                problems.append(f"{name} is listed twice ({listed[name]} and {sf.name})")
            listed[name] = sf.name
            if not (patches_dir / name).is_file():
                problems.append(f"{sf.name} lists {name}, which does not exist")
    for p in sorted(patches_dir.rglob("*.patch")):
        rel = str(p.relative_to(patches_dir))
        if rel.startswith("next/"):
            continue  # a carried series waiting for its pin (docs/rebase.md)
        if rel not in listed:
            problems.append(f"{rel} is not listed in any series file")
    for name, sf in listed.items():
        if not (patches_dir / name).is_file():
            continue
        patch = load_patch(patches_dir, name)
        problems += header_problems(patch)
        flavor_only = sf != "series"
        for f in patch.files:
            if f.startswith("vllm/afd/"):
                problems.append(f"{name}: touches {f}; vllm/afd/ is ours and lives in git")
            elif not flavor_only and f in FLAVOR_FILES:
                problems.append(f"{name}: the common series must not touch flavor file {f} "
                                f"(use patches/series.<flavor>)")
            elif flavor_only and f not in FLAVOR_FILES:
                problems.append(f"{name}: {sf} may only touch {', '.join(FLAVOR_FILES)}, not {f}")
    return problems


def _symbol_found(tree: Path, symbol: str) -> bool:
    parts = symbol.split(".")
    for i in range(len(parts), 0, -1):
        mod = Path(*parts[:i])
        for cand in (tree / mod.with_suffix(".py"), tree / mod / "__init__.py"):
            if cand.exists():
                text = cand.read_text()
                return all(
                    re.search(rf"^\s*(?:async\s+)?(?:def|class)\s+{re.escape(n)}\b"
                              rf"|^\s*{re.escape(n)}\s*[:=]", text, re.M)
                    for n in parts[i:]
                )
    return False


def apply_problems(root: Path, flavor: str) -> list[str]:
    """Apply the flavor's full series to pristine files; check fuzz, drift, symbols."""
    patches_dir = root / "patches"
    pin = load_pin(root)
    wheel = fetch_base_wheel(pin, flavor, quiet=True)
    names = [n for sf in series_files(patches_dir, flavor) for n in read_series(sf)]
    patches = [load_patch(patches_dir, n) for n in names if (patches_dir / n).is_file()]
    touched = sorted({f for p in patches for f in p.files})
    problems: list[str] = []
    with tempfile.TemporaryDirectory() as tmp:
        tree, snap = Path(tmp) / "tree", Path(tmp) / "before"
        tree.mkdir()
        with zipfile.ZipFile(wheel) as zf:
            members = set(zf.namelist())
            for rel in touched:
                if rel in members:
                    (tree / rel).parent.mkdir(parents=True, exist_ok=True)
                    (tree / rel).write_bytes(zf.read(rel))
        for patch in patches:
            before: dict[str, Path | None] = {}
            for rel in patch.files:
                if (tree / rel).exists():
                    (snap / rel).parent.mkdir(parents=True, exist_ok=True)
                    shutil.copy2(tree / rel, snap / rel)
                    before[rel] = snap / rel
                else:
                    before[rel] = None
            try:
                apply_patch(tree, patch)
            except SeriesError as e:
                problems.append(f"[{flavor}] {e}")
                break  # later patches build on this one
            if export_patch(patch, before, tree) != patch.path.read_text():
                problems.append(
                    f"[{flavor}] {patch.name}: re-exporting it changes the patch (drift: "
                    f"offset hunks or a hand edit); refresh it with quilt "
                    f"(docs/patches.md)")
            for sym in patch.symbols:
                if not _symbol_found(tree, sym):
                    problems.append(f"[{flavor}] {patch.name}: Upstream-Symbols entry {sym} "
                                    f"not found in the patched tree")
    return problems


def _seams_called(body: str) -> list[str]:
    """The vllm/afd/seams.py names a patch's added lines use (`afd_seams.X`,
    `from vllm.afd.seams import X`), sorted."""
    names: set[str] = set()
    for line in body.splitlines():
        if line.startswith("+") and not line.startswith("+++"):
            names.update(re.findall(r"\bafd_seams\.([A-Za-z_]\w*)", line))
            m = re.search(r"from vllm\.afd\.seams import \(?([\w, ]+)", line)
            if m:
                names.update(n.split(" as ")[0].strip() for n in m.group(1).split(",")
                             if n.strip())
    return sorted(names)


def seam_problems(root: Path) -> list[str]:
    """vllm/afd/seams.py's __all__ against what the series calls: a seam no
    patch calls is dead, a call to a name it does not export is a broken patch
    (docs/patches.md lists the calls, so it stays the seams' one inventory)."""
    seams_py = root / "vllm" / "afd" / "seams.py"
    if not seams_py.is_file():  # a scratch root with the patches only
        return []
    import ast

    tree = ast.parse(seams_py.read_text())
    exported = next((set(ast.literal_eval(n.value)) for n in tree.body
                     if isinstance(n, ast.Assign) and any(
                         isinstance(t, ast.Name) and t.id == "__all__" for t in n.targets)),
                    set())
    called: dict[str, list[str]] = {}
    patches_dir = root / "patches"
    for sf in [patches_dir / "series"] + [patches_dir / f"series.{f}" for f in FLAVORS]:
        for name in read_series(sf):
            if (patches_dir / name).is_file():
                p = load_patch(patches_dir, name)
                for seam in _seams_called(p.path.read_text()[len(p.header_text):]):
                    called.setdefault(seam, []).append(name)
    problems = [f"{', '.join(names)} call(s) vllm.afd.seams.{seam}, which seams.__all__ "
                f"does not export" for seam, names in sorted(called.items())
                if seam not in exported]
    problems += [f"vllm.afd.seams.{seam} is exported but no patch calls it"
                 for seam in sorted(exported - set(called))]
    return problems


def render_docs(root: Path) -> str:
    patches_dir = root / "patches"
    out = [
        "# Patch inventory",
        "",
        "Generated by `python tools/build/check_series.py --write-docs` from the DEP-3 headers",
        "and the patches' own lines; do not edit by hand. This is the one inventory of",
        "the seams: each patch's upstream files and symbols, and the functions of",
        "`vllm/afd/seams.py` it calls. The workflow for adding and editing patches is in",
        "[patch-workflow.md](patch-workflow.md).",
        "",
    ]
    groups = [("Common series (`patches/series`)", patches_dir / "series")] + [
        (f"Flavor `{f}` (`patches/series.{f}`)", patches_dir / f"series.{f}") for f in FLAVORS]
    for title, sf in groups:
        names = read_series(sf)
        out += [f"## {title}", ""]
        if not names:
            out += ["(empty)", ""]
            continue
        for name in names:
            p: Patch = load_patch(patches_dir, name)
            added = removed = 0
            body = p.path.read_text()[len(p.header_text):]
            for line in body.splitlines():
                if line.startswith("+") and not line.startswith("+++"):
                    added += 1
                elif line.startswith("-") and not line.startswith("---"):
                    removed += 1
            seams = _seams_called(body)
            desc = p.fields.get("Description", "").split("\n")
            out += [
                f"### `{name}`",
                "",
                f"**{desc[0]}**",
                "",
                " ".join(desc[1:]),
                "",
                f"- Files: {', '.join(f'`{f}`' for f in p.files)} (+{added} −{removed} lines)",
                f"- Upstream symbols: {', '.join(f'`{s}`' for s in p.symbols)}",
                f"- Seams called: {', '.join(f'`{s}`' for s in seams) or 'none'}",
                f"- Forwarded: {p.fields.get('Forwarded', '')}",
                f"- Removal: {' '.join(p.fields.get('Removal', '').split())}",
                f"- Test: {' '.join(p.fields.get('Test', 'tests/packaging/test_installed_wheel.py').split())}",
                f"- Last update: {p.fields.get('Last-Update', '')}",
                "",
            ]
    return "\n".join(out).rstrip() + "\n"


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--root", type=Path, default=REPO_ROOT)
    ap.add_argument("--flavor", action="append", choices=FLAVORS,
                    help="flavors to apply to (default: all)")
    ap.add_argument("--no-apply", action="store_true", help="structure and headers only")
    ap.add_argument("--write-docs", action="store_true", help=f"regenerate {DOCS_FILE}")
    args = ap.parse_args(argv)
    root = args.root
    problems = structure_problems(root / "patches") + seam_problems(root)
    if not args.no_apply and not problems:
        for flavor in args.flavor or FLAVORS:
            problems += apply_problems(root, flavor)
    docs = render_docs(root) if not problems else None
    if docs is not None:
        if args.write_docs:
            (root / DOCS_FILE).write_text(docs)
        elif not (root / DOCS_FILE).exists() or (root / DOCS_FILE).read_text() != docs:
            problems.append(f"{DOCS_FILE} is out of date: run python tools/build/check_series.py "
                            f"--write-docs")
    if problems:
        print(f"patch series check: {len(problems)} problem(s)")
        for p in problems:
            print(f"  - {p}")
        return 1
    n = sum(len(read_series(sf)) for sf in series_files(root / "patches", None))
    print(f"patch series check: OK ({n} common patches; flavors: "
          f"{', '.join(args.flavor or FLAVORS) if not args.no_apply else 'not applied'})")
    return 0


if __name__ == "__main__":
    sys.exit(main())
