# SPDX-License-Identifier: Apache-2.0
# SPDX-FileCopyrightText: Copyright contributors to the vllm-afd project
"""The quilt patch series: reading it, DEP-3 headers, applying and re-exporting.

Patches are applied with GNU patch at zero fuzz, and re-exported the way
`quilt refresh -p ab --no-timestamps --no-index` writes them (GNU `diff -u`,
files in sorted order, `a/` `b/` prefixes, `/dev/null` for created files), so a
refresh of an unchanged patch is byte-identical and drift is detectable.
"""

from __future__ import annotations

import hashlib
import os
import re
import shutil
import subprocess
from dataclasses import dataclass, field
from pathlib import Path

PATCHES_DIR = "patches"
REQUIRED_FIELDS = ("Description", "Forwarded", "Last-Update", "Upstream-Symbols", "Removal")
_FIELD_RE = re.compile(r"^([A-Za-z][A-Za-z0-9-]*):\s?(.*)$")
_DATE_RE = re.compile(r"^\d{4}-\d{2}-\d{2}$")


class SeriesError(RuntimeError):
    pass


@dataclass
class Patch:
    name: str  # path relative to patches/, as listed in a series file
    path: Path
    header_text: str  # everything before the first file diff, verbatim
    fields: dict[str, str] = field(default_factory=dict)
    files: list[str] = field(default_factory=list)  # upstream paths it touches

    @property
    def symbols(self) -> list[str]:
        return self.fields.get("Upstream-Symbols", "").replace(",", " ").split()


def series_files(patches_dir: Path, flavor: str | None) -> list[Path]:
    """The series files that make up a flavor's full series, in application order."""
    files = [patches_dir / "series"]
    if flavor is not None:
        files.append(patches_dir / f"series.{flavor}")
    return files


def read_series(series_file: Path) -> list[str]:
    if not series_file.exists():
        return []
    names = []
    for line in series_file.read_text().splitlines():
        line = line.split("#", 1)[0].strip()
        if line:
            # quilt allows per-patch options after the name (e.g. -p1); we do not.
            names.append(line.split()[0])
    return names


def split_patch(text: str) -> tuple[str, str]:
    """Split a patch into its header text and its diff body."""
    lines = text.splitlines(keepends=True)
    for i, line in enumerate(lines):
        if line.startswith("--- ") and i + 1 < len(lines) and lines[i + 1].startswith("+++ "):
            return "".join(lines[:i]), "".join(lines[i:])
    return text, ""


def parse_fields(header: str) -> dict[str, str]:
    """DEP-3: 'Field: value' lines, continuation lines start with a space."""
    fields: dict[str, str] = {}
    last = None
    for line in header.splitlines():
        if not line.strip():
            break  # the fields end at the first blank line; free text may follow
        if line[0] in " \t" and last is not None:
            fields[last] += "\n" + line.strip()
            continue
        m = _FIELD_RE.match(line)
        if not m:
            break
        last = m.group(1)
        fields[last] = m.group(2).strip()
    return fields


def _strip_prefix(path: str) -> str:
    return path.split("/", 1)[1] if "/" in path else path


def load_patch(patches_dir: Path, name: str) -> Patch:
    path = patches_dir / name
    if not path.exists():
        raise SeriesError(f"series lists {name}, but {path} does not exist")
    header, body = split_patch(path.read_text())
    files = []
    for line in body.splitlines():
        if line.startswith("+++ "):
            target = line[4:].split("\t")[0]
            files.append(_strip_prefix(target))
    return Patch(name=name, path=path, header_text=header, fields=parse_fields(header),
                 files=files)


def load_series(patches_dir: Path, flavor: str | None) -> list[Patch]:
    return [
        load_patch(patches_dir, name)
        for sf in series_files(patches_dir, flavor)
        for name in read_series(sf)
    ]


def series_digest(patches_dir: Path, flavor: str) -> str:
    """A digest of everything the series of a flavor applies, in order."""
    h = hashlib.sha256()
    for sf in series_files(patches_dir, flavor):
        for name in read_series(sf):
            h.update(name.encode() + b"\0")
            h.update((patches_dir / name).read_bytes() + b"\0")
    return h.hexdigest()


def header_problems(patch: Patch) -> list[str]:
    problems = []
    for key in REQUIRED_FIELDS:
        if not patch.fields.get(key):
            problems.append(f"{patch.name}: missing DEP-3 header field '{key}:'")
    fwd = patch.fields.get("Forwarded", "")
    if fwd and fwd not in ("no", "not-needed") and not fwd.startswith("http"):
        problems.append(f"{patch.name}: Forwarded must be a URL, 'no' or 'not-needed', got {fwd!r}")
    date = patch.fields.get("Last-Update", "")
    if date and not _DATE_RE.match(date):
        problems.append(f"{patch.name}: Last-Update must be YYYY-MM-DD, got {date!r}")
    if not patch.files:
        problems.append(f"{patch.name}: contains no file diff")
    return problems


def apply_patch(tree: Path, patch: Patch, dry_run: bool = False) -> None:
    """Apply one patch to tree at zero fuzz; raise SeriesError with patch's output."""
    cmd = ["patch", "-p1", "--fuzz=0", "--forward", "--batch", "--no-backup-if-mismatch",
           "--reject-file=-", "-i", str(patch.path.resolve())]
    if dry_run:
        cmd.append("--dry-run")
    proc = subprocess.run(cmd, cwd=tree, capture_output=True, text=True)
    if proc.returncode != 0:
        raise SeriesError(f"{patch.name} does not apply cleanly (fuzz 0):\n{proc.stdout}{proc.stderr}")


def apply_with_quilt(tree: Path, patches_dir: Path, series_file: Path, pc_dir: str) -> None:
    """Apply a series with quilt, leaving quilt's state in tree/pc_dir for the edit workflow."""
    env = dict(os.environ, QUILT_PATCHES=str(patches_dir.resolve()),
               QUILT_SERIES=str(series_file.resolve()), QUILT_PC=pc_dir)
    # quilt looks for its state upwards from the cwd; anchor it in this tree.
    (tree / pc_dir).mkdir(exist_ok=True)
    (tree / pc_dir / ".version").write_text("2\n")  # quilt's state format
    cmd = ["quilt", "--quiltrc=-", "push", "-a",
           "--fuzz=0", "-q"]
    proc = subprocess.run(cmd, cwd=tree, env=env, capture_output=True, text=True)
    if proc.returncode != 0:
        raise SeriesError(f"quilt push failed for {series_file.name}:\n{proc.stdout}{proc.stderr}")


def have_quilt() -> bool:
    return shutil.which("quilt") is not None


def unified_diff(old: Path | None, new: Path, rel: str) -> str:
    """One file's diff exactly as `quilt refresh -p ab --no-timestamps` writes it."""
    old_label = f"a/{rel}" if old is not None else "/dev/null"
    cmd = ["diff", "-u", "--label", old_label, "--label", f"b/{rel}",
           str(old) if old is not None else "/dev/null", str(new)]
    proc = subprocess.run(cmd, capture_output=True, text=True)
    if proc.returncode not in (0, 1):
        raise SeriesError(f"diff failed for {rel}: {proc.stderr}")
    return proc.stdout


def export_patch(patch: Patch, before: dict[str, Path | None], after: Path) -> str:
    """Re-export a patch: its header plus the diff from the `before` files to tree
    `after` (a file absent from both, left out of a forward port, has none)."""
    body = "".join(
        unified_diff(before[rel], after / rel, rel) for rel in sorted(set(patch.files))
        if before[rel] is not None or (after / rel).exists()
    )
    return patch.header_text + body


def without_files(patch: Patch, left_out: set[str]) -> Patch:
    """The patch without these files: they leave its file list, and the
    Upstream-Symbols entries in their modules leave its header."""
    modules = {rel.removesuffix(".py").replace("/", ".") for rel in left_out}

    def kept(symbol: str) -> bool:
        return not any(symbol == m or symbol.startswith(m + ".") for m in modules)

    lines, out, in_field = patch.header_text.splitlines(keepends=True), [], False
    for line in lines:
        if line.startswith("Upstream-Symbols:"):
            in_field = True
            tokens = [t for t in line.split(":", 1)[1].split() if kept(t)]
            out.append("Upstream-Symbols: " + " ".join(tokens) + "\n")
        elif in_field and line[:1] in (" ", "\t") and line.strip():
            tokens = [t for t in line.split() if kept(t)]
            if tokens and out[-1].rstrip() == "Upstream-Symbols:":
                out[-1] = "Upstream-Symbols: " + " ".join(tokens) + "\n"
            elif tokens:
                out.append(" " + " ".join(tokens) + "\n")
        else:
            in_field = False
            out.append(line)
    header = "".join(out)
    return Patch(patch.name, patch.path, header, parse_fields(header),
                 [f for f in patch.files if f not in left_out])
