# SPDX-License-Identifier: Apache-2.0
# SPDX-FileCopyrightText: Copyright contributors to the vllm-afd project
"""Conflict resolutions that are kept, like git's rerere.

A hand resolution made at a rebase stop is recorded in
patches/resolutions/<new-version>/<patch>.json (committed with the series) so a
later rebase to the same release reuses it instead of stopping again:

  hunks  per conflict block of the three-way merge (`git merge-file --diff3`):
         key = sha256 over the file path and the block's three sides (upstream,
         base, patch), marker lines excluded so their labels never matter;
         value = the lines the human put in place of the block;
  files  a file in which the human also changed lines outside every block, whole,
         keyed by the merge output it was made from (reused only when that recurs);
  drop   the patch was dropped from the series: the reason, and the conflicts it
         was dropped at (reused only when the same conflicts recur).
"""

from __future__ import annotations

import difflib
import hashlib
import json
import re
from dataclasses import dataclass
from pathlib import Path

RESOLUTIONS_DIR = "patches/resolutions"
_MARK = {k: re.compile(rf"^{re.escape(k * 7)}( |$)") for k in "<|=>"}


@dataclass
class Block:
    """One conflict block: lines [start, end) of the merged file, markers included."""
    start: int
    end: int
    upstream: list[str]  # the new upstream's side (lines without their endings)
    base: list[str]      # the old upstream
    patch: list[str]     # the old upstream with the patch

    def key(self, path: str) -> str:
        return hunk_key(path, self.upstream, self.base, self.patch)


def hunk_key(path: str, upstream: list[str], base: list[str], patch: list[str]) -> str:
    """The block's identity: its file and its three sides, never the marker labels."""
    return _sha256([path, upstream, base, patch])


def file_key(path: str, merged: str) -> str:
    return _sha256([path, merged.splitlines()])


def _sha256(parts: list) -> str:
    return hashlib.sha256(json.dumps(parts).encode()).hexdigest()


def parse_blocks(text: str) -> list[Block]:
    """The diff3 conflict blocks of a merged text, in order."""
    lines, blocks = text.splitlines(), []
    i = 0
    while i < len(lines):
        found = _block_at(lines, i)
        if found is None:
            i += 1
            continue
        blocks.append(found)
        i = found.end
    return blocks


def _block_at(lines: list[str], start: int) -> Block | None:
    """The block opening at line `start`, if a whole one does (all four markers)."""
    if not _MARK["<"].match(lines[start]):
        return None
    sides: list[list[str]] = [[]]
    expect = "|=>"
    for i in range(start + 1, len(lines)):
        if _MARK[expect[0]].match(lines[i]):
            if expect == ">":
                return Block(start, i + 1, *sides)
            sides.append([])
            expect = expect[1:]
        elif _MARK["<"].match(lines[i]):
            return None
        else:
            sides[-1].append(lines[i])
    return None


def short(key: str) -> str:
    return key[:12]


# -- the record file -----------------------------------------------------------
def record_path(root: Path, version: str, patch_name: str) -> Path:
    return root / RESOLUTIONS_DIR / version / (patch_name.removesuffix(".patch") + ".json")


def load_record(path: Path, patch_name: str) -> dict:
    if path.exists():
        return json.loads(path.read_text())
    return {"patch": patch_name, "hunks": {}, "files": {}, "left_out": {}}


def save_record(path: Path, record: dict) -> None:
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(json.dumps(record, indent=1, sort_keys=True, ensure_ascii=False) + "\n")


# -- reuse ---------------------------------------------------------------------
def reuse(rel: str, merged: str, record: dict | None) -> tuple[str, list[str]]:
    """Substitute what the record holds for this merge output of file rel: the whole
    file if this exact output was recorded, else every block whose key is recorded.
    Returns (text, one 'id (file:line)' per resolution reused)."""
    if record is None:
        return merged, []
    whole = file_key(rel, merged)
    if whole in record["files"]:
        return _joined(record["files"][whole]["text"]), [f"{short(whole)} ({rel}, whole file)"]
    lines = merged.splitlines(keepends=True)
    out: list[str] = []
    used, at = [], 0
    for b in parse_blocks(merged):
        out += lines[at:b.start]
        hit = record["hunks"].get(b.key(rel))
        if hit is None:
            out += lines[b.start:b.end]
        else:
            used.append(f"{short(b.key(rel))} ({rel}:{len(out) + 1})")
            out += [line + "\n" for line in hit["resolution"]]
        at = b.end
    return "".join(out + lines[at:]), used


def _joined(lines: list[str]) -> str:
    return "".join(line + "\n" for line in lines)


def conflict_signature(conflicts: list) -> list[str]:
    """What a recorded drop is keyed by: each conflict's file and kind (a block's key)."""
    return sorted(f"{c.file}: {c.kind}" + (f" {c.key}" if c.key else "") for c in conflicts)


def left_out_files(record: dict | None, conflicts: list) -> dict[str, str]:
    """The files gone upstream that a recorded resolution left out of the patch
    (file -> why), among these conflicts."""
    gone = (record or {}).get("left_out", {})
    return {c.file: gone[c.file]["reason"] for c in conflicts
            if c.kind == "gone" and c.file in gone}


def recorded_drop(record: dict | None, conflicts: list) -> str | None:
    """The recorded drop's reason, if the patch was dropped at these very conflicts."""
    drop = (record or {}).get("drop")
    if drop and conflicts and drop["conflicts"] == conflict_signature(conflicts):
        return drop["reason"]
    return None


# -- recording -----------------------------------------------------------------
def record_stop(record: dict, files: list[str], conflicts: list, snap: Path,
                new: Path, why: str | None = None) -> list[str]:
    """Record the hand edit of every file a stop wrote (its merge output and the
    preimage are in snap/merged and snap/preimage), and each file gone upstream
    that the human left out of the patch (why: the reason given). Other conflicts
    that wrote no file (created on both sides, a file gone and written anew) have
    no hunk to key: only a drop records them. Returns notes to print."""
    notes = []
    for c in conflicts:
        if c.kind == "gone" and not (new / c.file).exists():
            record.setdefault("left_out", {})[c.file] = {
                "reason": why or "gone from the new upstream"}
            notes.append(f"{c.file}: gone upstream, left out of the patch: recorded")
    conflicts = [c for c in conflicts if c.file not in record.get("left_out", {})]
    for rel in files:
        pre = snap / "preimage" / rel
        if pre.exists():
            post = (new / rel).read_text() if (new / rel).exists() else ""
            notes += record_hand_edit(record, rel, (snap / "merged" / rel).read_text(),
                                      pre.read_text(), post)
    notes += [f"{c.file}: {c.kind}: not recorded (no hunk to key; only a drop is)"
              for c in conflicts if c.kind != "hunk"]
    return notes


def record_hand_edit(record: dict, rel: str, merged: str, preimage: str,
                     postimage: str) -> list[str]:
    """Record how the human turned preimage (the file as the stop left it) into
    postimage; merged is the merge output it came from. Returns notes to print."""
    if preimage == postimage:
        return []
    pre, post = preimage.splitlines(), postimage.splitlines()
    blocks = parse_blocks(preimage)
    kept, outside = _align(pre, post, blocks)
    kept.update({-1: -1, len(pre): len(post)})  # the file's ends: unchanged context
    notes = []
    for b in blocks:
        if b.start - 1 not in kept or b.end not in kept:
            notes.append(f"{rel}:{b.start + 1}: the lines around this conflict changed; "
                         f"its own resolution is not recorded")
            continue
        record["hunks"][b.key(rel)] = {
            "file": rel, "upstream": b.upstream, "base": b.base, "patch": b.patch,
            "resolution": post[kept[b.start - 1] + 1:kept[b.end]]}
        notes.append(f"{rel}:{b.start + 1}: recorded {short(b.key(rel))}")
    if outside:
        key = file_key(rel, merged)
        record["files"][key] = {"file": rel, "text": post}
        notes.append(f"{rel}: lines outside the conflicts changed too: recorded the whole "
                     f"file as {short(key)} (reused only for an identical merge)")
    return notes


def _align(pre: list[str], post: list[str], blocks: list[Block]) -> tuple[dict[int, int], bool]:
    """Line alignment of preimage to postimage: {pre line: post line} for the lines the
    human kept, and whether anything changed outside every block."""
    kept: dict[int, int] = {}
    outside = False
    matcher = difflib.SequenceMatcher(None, pre, post, autojunk=False)
    for tag, i1, i2, j1, j2 in matcher.get_opcodes():
        if tag == "equal":
            kept.update(zip(range(i1, i2), range(j1, j2)))
        elif not any(b.start <= i1 and i2 <= b.end for b in blocks):
            outside = True
    return kept, outside
