# SPDX-License-Identifier: Apache-2.0
# SPDX-FileCopyrightText: Copyright contributors to the vllm-afd project
"""Carry one patch from an old upstream tree to a new one.

Two trees advance side by side, patch by patch: `old` (the pinned upstream with the
series applied so far) and `new` (the new upstream with the forward-ported patches
so far). For each patch:

  clean      it applies to `new` at fuzz 0 and re-exports to the same bytes;
  offset     it applies at fuzz 0 but its line numbers moved: regenerated;
  merged     it does not apply at fuzz 0; a three-way merge per file (base = old
             before the patch, ours = old after it, theirs = new before it) has no
             conflict: regenerated from the merge;
  droppable  the new upstream already contains its change (it reverse-applies, or
             the merge changes nothing): the series can drop it;
  reused     the merge conflicts, and every conflict has a resolution recorded
             for this release (tools/build/resolutions.py): regenerated with them;
  dropped    a drop was recorded for this release at these very conflicts;
  conflict   the merge conflicts, or a file it touches is gone upstream: the
             conflicting files are left in `new` with git-style markers (and the
             recorded resolutions of some of the conflicts in place).

Fuzz is never used: a patch either applies exactly or goes through the merge.
"""

from __future__ import annotations

import re
import shutil
import subprocess
from dataclasses import dataclass, field
from pathlib import Path

from resolutions import left_out_files, parse_blocks, recorded_drop, reuse
from series import Patch, SeriesError, apply_patch, export_patch, split_patch, without_files

CLEAN, OFFSET, MERGED, DROPPABLE, CONFLICT, RESOLVED, REUSED, DROPPED = (
    "clean", "offset", "merged", "droppable", "conflict", "resolved", "reused", "dropped")
# Statuses a patch can reach without a hand edit (a drop only when it was recorded
# before: one made at --continue is marked by_hand).
AUTOMATIC = (CLEAN, OFFSET, MERGED, DROPPABLE, REUSED, DROPPED)
_MARKER_RE = re.compile(r"^(<<<<<<<|=======|>>>>>>>|\|\|\|\|\|\|\|)( |$)")


@dataclass
class Conflict:
    file: str
    line: int  # 1-based line of the `<<<<<<<` marker in the prepared file
    hunk: str  # the marked region, markers included
    reason: str = "both upstream and the patch changed these lines"
    kind: str = "hunk"  # or: gone, created, deleted (no hunk: nothing to key)
    key: str = ""  # a hunk's key (tools/build/resolutions.py)


@dataclass
class PortResult:
    name: str
    status: str
    files: list[str]
    detail: str = ""
    text: str | None = None  # the patch as it applies to the new tree
    conflicts: list[Conflict] = field(default_factory=list)
    missing_symbols: list[str] = field(default_factory=list)
    syntax_errors: list[str] = field(default_factory=list)
    reused: list[str] = field(default_factory=list)  # 'id (file:line)' per resolution
    by_hand: bool = False

    def to_json(self) -> dict:
        return {
            "name": self.name, "status": self.status, "files": self.files,
            "detail": self.detail, "missing_symbols": self.missing_symbols,
            "syntax_errors": self.syntax_errors, "reused": self.reused,
            "by_hand": self.by_hand, "conflicts": [vars(c) for c in self.conflicts],
        }


def changed_lines(patch_text: str) -> int:
    """Upstream lines a patch touches: its added plus removed lines."""
    _, body = split_patch(patch_text)
    return sum(1 for line in body.splitlines()
               if (line.startswith("+") and not line.startswith("+++"))
               or (line.startswith("-") and not line.startswith("---")))


def snapshot(tree: Path, files: list[str], dest: Path) -> dict[str, Path | None]:
    """Copy the given files of tree into dest; None for those that do not exist."""
    out: dict[str, Path | None] = {}
    for rel in files:
        src = tree / rel
        if src.exists():
            (dest / rel).parent.mkdir(parents=True, exist_ok=True)
            shutil.copy2(src, dest / rel)
            out[rel] = dest / rel
        else:
            out[rel] = None
    return out


def restore(tree: Path, files: list[str], snap: Path) -> None:
    """Undo a patch in tree: each file back to its snapshot, or gone if it had none."""
    for rel in files:
        if (snap / rel).exists():
            shutil.copy2(snap / rel, tree / rel)
        else:
            (tree / rel).unlink(missing_ok=True)


def _reverse_applies(tree: Path, patch: Patch) -> bool:
    cmd = ["patch", "-p1", "-R", "--fuzz=0", "--force", "--batch", "--dry-run",
           "-i", str(patch.path.resolve())]
    return subprocess.run(cmd, cwd=tree, capture_output=True).returncode == 0


def _merge_file(theirs: Path, base: Path, ours: Path, name: str) -> tuple[str, int]:
    """git merge-file: apply base→ours (the patch) onto theirs (new upstream)."""
    cmd = ["git", "merge-file", "-p", "--diff3",
           "-L", "new upstream", "-L", "old upstream", "-L", name,
           str(theirs), str(base), str(ours)]
    proc = subprocess.run(cmd, capture_output=True, text=True)
    if proc.returncode < 0 or proc.returncode > 127:
        raise SeriesError(f"git merge-file failed for {name}: {proc.stderr}")
    return proc.stdout, proc.returncode


_BLOCK_RE = re.compile(
    r"^<<<<<<< new upstream\n(?P<theirs>(?:.*\n)*?)\|\|\|\|\|\|\| old upstream\n"
    r"(?P<base>(?:.*\n)*?)=======\n(?P<ours>(?:.*\n)*?)>>>>>>> .*\n", re.M)


def _around(inner: list[str], outer: list[str]) -> tuple[list[str], list[str]] | None:
    """If outer == prefix + inner + suffix for exactly one split, (prefix, suffix)."""
    n = len(inner)
    hits = [i for i in range(len(outer) - n + 1) if outer[i:i + n] == inner]
    return (outer[:hits[0]], outer[hits[0] + n:]) if n and len(hits) == 1 else None


def resolve_adjacent(text: str) -> tuple[str, int]:
    """Settle the conflicts git reports only because two edits touch adjacent lines:
    one side kept the base lines and inserted lines next to them (an import added
    above an import upstream rewrote): keep both, the insertion around the other
    side's change. Overlapping edits stay conflicts. Returns (text, blocks settled)."""
    settled = 0

    def settle(m: re.Match) -> str:
        nonlocal settled
        theirs, base, ours = (m.group(k).splitlines(keepends=True)
                              for k in ("theirs", "base", "ours"))
        for inserted, changed in ((ours, theirs), (theirs, ours)):
            split = _around(base, inserted)
            if split is not None:
                settled += 1
                return "".join(split[0] + changed + split[1])
        return m.group(0)

    return _BLOCK_RE.sub(settle, text), settled


def find_conflicts(rel: str, text: str) -> list[Conflict]:
    lines = text.splitlines()
    return [Conflict(rel, b.start + 1, "\n".join(lines[b.start:b.end]), key=b.key(rel))
            for b in parse_blocks(text)]


def syntax_errors(tree: Path, files: list[str]) -> list[str]:
    """file:line: message for each touched Python file that no longer parses."""
    out = []
    for rel in files:
        p = tree / rel
        if rel.endswith(".py") and p.exists():
            try:
                compile(p.read_text(), rel, "exec", dont_inherit=True)
            except SyntaxError as e:
                out.append(f"{rel}:{e.lineno}: {e.msg}")
    return out


def leftover_markers(tree: Path, files: list[str]) -> list[str]:
    """file:line of every conflict marker still in the given files."""
    found = []
    for rel in files:
        p = tree / rel
        if p.exists():
            for n, line in enumerate(p.read_text().splitlines(), 1):
                if _MARKER_RE.match(line):
                    found.append(f"{rel}:{n}: {line}")
    return found


def port_patch(patch: Patch, old: Path, new: Path, scratch: Path,
               record: dict | None = None) -> PortResult:
    """Advance both trees by one patch (see the module docstring); record: the
    resolutions recorded for this patch and release, if any."""
    files = sorted(set(patch.files))
    old_before = snapshot(old, files, scratch / "old-before")
    new_before = snapshot(new, files, scratch / "new-before")
    try:
        apply_patch(old, patch)
    except SeriesError as e:
        raise SeriesError(f"{patch.name} does not apply to the old pin it was written for; "
                          f"run tools/build/check_series.py first:\n{e}") from None

    try:
        apply_patch(new, patch, dry_run=True)
    except SeriesError:
        pass
    else:
        apply_patch(new, patch)
        text = export_patch(patch, new_before, new)
        same = text == patch.path.read_text()
        return PortResult(patch.name, CLEAN if same else OFFSET, files, text=text)

    if _reverse_applies(new, patch) or patch.fields.get("Applied-Upstream"):
        why = patch.fields.get("Applied-Upstream") or "its change reverse-applies"
        return PortResult(patch.name, DROPPABLE, files,
                          detail=f"already in the new upstream ({why})")

    merged, conflicts, adjacent = _merge_files(patch.name, files, old, old_before, new_before)
    resolved, reused = {}, []
    for rel, text in merged.items():
        resolved[rel], hits = reuse(rel, text, record)
        reused += hits
        conflicts += find_conflicts(rel, resolved[rel])
    conflicts.sort(key=lambda c: (c.file, c.line))
    left_out = left_out_files(record, conflicts)
    if left_out:  # files gone upstream that a human left out of the patch before
        conflicts = [c for c in conflicts if not (c.kind == "gone" and c.file in left_out)]
        reused += [f"{rel} left out ({why})" for rel, why in sorted(left_out.items())]
        patch = without_files(patch, set(left_out))
    dropped = recorded_drop(record, conflicts)
    if dropped is not None:  # decided before `new` is touched: it stays as it was
        return PortResult(patch.name, DROPPED, files, detail=f"recorded drop: {dropped}",
                          conflicts=conflicts)

    _write_texts(new, resolved)
    if conflicts:
        # What --continue records the hand resolution against (tools/build/resolutions.py).
        _write_texts(scratch / "merged", merged)
        _write_texts(scratch / "preimage", resolved)
        where = ", ".join(f"{c.file}:{c.line}" for c in conflicts)
        return PortResult(patch.name, CONFLICT, files, conflicts=conflicts, reused=reused,
                          detail=f"{len(conflicts)} conflict(s) at {where}")
    if all(new_before[rel] is not None and resolved[rel] == new_before[rel].read_text()
           for rel in patch.files):
        return PortResult(patch.name, DROPPABLE, files,
                          detail="the three-way merge changes nothing: already upstream")
    text = export_patch(patch, new_before, new)
    notes = [f"reused resolution(s) {', '.join(reused)}"] if reused else []
    if adjacent:
        notes.append(f"{adjacent} adjacent edit(s) kept side by side")
    return PortResult(patch.name, REUSED if reused else MERGED, files, text=text,
                      reused=reused, detail="; ".join(notes))


def _merge_files(name: str, files: list[str], old: Path, old_before: dict[str, Path | None],
                 new_before: dict[str, Path | None]) -> tuple[dict[str, str], list[Conflict], int]:
    """Three-way merge each file: (merged texts, the conflicts that have no merged
    text, adjacent edits settled)."""
    merged: dict[str, str] = {}
    conflicts: list[Conflict] = []
    adjacent = 0
    for rel in files:
        ours = old / rel
        base, theirs = old_before[rel], new_before[rel]
        if base is None:  # the patch creates this file
            if theirs is not None:
                conflicts.append(Conflict(rel, 1, "", "the patch creates this file, and the "
                                          "new upstream has it too", kind="created"))
            else:
                merged[rel] = ours.read_text()
            continue
        if theirs is None:
            conflicts.append(Conflict(rel, 0, "", "the file is gone from the new upstream "
                                      "(moved or deleted): port the patch by hand, or drop "
                                      "it", kind="gone"))
            continue
        if not ours.exists():
            conflicts.append(Conflict(rel, 0, "", "the patch deletes this file",
                                      kind="deleted"))
            continue
        text, n = _merge_file(theirs, base, ours, name)
        if n:
            text, settled = resolve_adjacent(text)
            adjacent += settled
        merged[rel] = text
    return merged, conflicts, adjacent


def _write_texts(tree: Path, texts: dict[str, str]) -> None:
    for rel, text in texts.items():
        (tree / rel).parent.mkdir(parents=True, exist_ok=True)
        (tree / rel).write_text(text)


def finish_by_hand(patch: Patch, result: PortResult, new: Path, new_before_dir: Path) -> None:
    """After the conflicting files were fixed in `new`: regenerate the patch."""
    left = leftover_markers(new, result.files)
    if left:
        raise SeriesError("conflict markers are still in the tree:\n  " + "\n  ".join(left))
    before = {rel: (new_before_dir / rel if (new_before_dir / rel).exists() else None)
              for rel in result.files}
    # A file gone upstream and still absent was left out of the patch.
    left_out = {c.file for c in result.conflicts
                if c.kind == "gone" and not (new / c.file).exists()}
    result.text = export_patch(without_files(patch, left_out), before, new)
    result.status, result.by_hand = RESOLVED, True
    where = ", ".join(f"{c.file}:{c.line}" for c in result.conflicts)
    result.detail = f"conflict resolved by hand ({where})" + (
        f"; reused resolution(s) {', '.join(result.reused)}" if result.reused else "")
