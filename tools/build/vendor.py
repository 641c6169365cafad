# SPDX-License-Identifier: Apache-2.0
# SPDX-FileCopyrightText: Copyright contributors to the vllm-afd project
"""Materialize the pinned upstream vLLM into vllm/ and apply the patch series.

    python tools/build/vendor.py [--flavor cpu|cuda] [--force] [--check]

The tree is built in a staging directory (extract the verified base wheel, apply
patches/series then patches/series.<flavor> at zero fuzz) and swapped into vllm/
without touching vllm/afd/. What was applied is recorded in .vendor/state.json
(version, flavor, base wheel hash, series digest, a hash of every file), so a run
with nothing changed is a no-op, a stale tree is rebuilt, and a vendored file that
was edited by hand but is not in a patch stops the run instead of being lost.
"""

from __future__ import annotations

import argparse
import hashlib
import json
import shutil
import sys
import time
import zipfile
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))
from series import (  # noqa: E402
    SeriesError, apply_patch, apply_with_quilt, have_quilt, load_patch, load_series,
    read_series, series_digest, series_files,
)
from upstream import REPO_ROOT, Pin, PinError, fetch_base_wheel, load_pin  # noqa: E402

VENDOR_FORMAT = 1
STATE_DIR = ".vendor"
INFO_FILE = "vllm/_afd_vendor.json"  # shipped in the wheel, read by vllm.afd
OURS = "vllm/afd/"
SKIP_PARTS = ("__pycache__",)


class VendorError(RuntimeError):
    pass


def _hash(path: Path) -> str:
    return hashlib.sha256(path.read_bytes()).hexdigest()


def extract_upstream(wheel: Path, dest: Path) -> list[str]:
    """Extract the wheel's vllm/ package (not its dist-info) into dest."""
    names = []
    with zipfile.ZipFile(wheel) as zf:
        for info in zf.infolist():
            n = info.filename
            if not n.startswith("vllm/") or n.endswith("/"):
                continue
            if n.startswith(OURS):
                raise VendorError(f"base wheel unexpectedly contains {n}")
            zf.extract(info, dest)
            mode = (info.external_attr >> 16) & 0o777
            if mode:
                (dest / n).chmod(mode | 0o200)
            names.append(n)
    return names


def read_base_metadata(wheel: Path) -> dict[str, str]:
    """METADATA and entry_points.txt of the base wheel (setup.py derives ours from them)."""
    out = {}
    with zipfile.ZipFile(wheel) as zf:
        for n in zf.namelist():
            if ".dist-info/" in n and n.rsplit("/", 1)[1] in ("METADATA", "entry_points.txt"):
                out[n.rsplit("/", 1)[1]] = zf.read(n).decode()
    return out


def build_staging(root: Path, pin: Pin, flavor: str, wheel: Path, staging: Path) -> list[str]:
    if staging.exists():
        shutil.rmtree(staging)
    staging.mkdir(parents=True)
    extract_upstream(wheel, staging)
    patches_dir = root / "patches"
    use_quilt = have_quilt()
    for sf, pc in zip(series_files(patches_dir, flavor), (".pc", f".pc-{flavor}")):
        names = read_series(sf)
        if not names:
            continue
        if use_quilt:
            apply_with_quilt(staging, patches_dir, sf, pc)
        else:
            for name in names:
                apply_patch(staging, load_patch(patches_dir, name))
    if not use_quilt:
        print("[vllm-afd] quilt not found: tree patched with GNU patch; install quilt "
              "to edit patches in place (docs/patches.md)", file=sys.stderr)
    return sorted(
        str(p.relative_to(staging)) for p in (staging / "vllm").rglob("*")
        if p.is_file() and not any(s in p.parts for s in SKIP_PARTS)
    )


def read_state(root: Path) -> dict | None:
    path = root / STATE_DIR / "state.json"
    return json.loads(path.read_text()) if path.exists() else None


def hand_edits(root: Path, state: dict | None) -> list[str]:
    """Vendored files whose content differs from what the last vendor run wrote."""
    if not state:
        return []
    edited = []
    for rel, digest in state["files"].items():
        p = root / rel
        if p.exists() and _hash(p) != digest:
            edited.append(rel)
    return edited


def _remove_tree(root: Path, files: list[str]) -> None:
    for rel in files:
        (root / rel).unlink(missing_ok=True)
    # Drop directories left empty (and their bytecode caches), never vllm/afd.
    vdir = root / "vllm"
    for d in sorted((p for p in vdir.rglob("*") if p.is_dir()), key=lambda p: -len(p.parts)):
        rel = str(d.relative_to(root)) + "/"
        if rel.startswith(OURS):
            continue
        if d.name == "__pycache__":
            shutil.rmtree(d, ignore_errors=True)
        elif not any(d.iterdir()):
            d.rmdir()
    for pc in root.glob(".pc*"):
        if pc.is_dir():
            shutil.rmtree(pc)


def vendor(flavor: str = "cpu", root: Path = REPO_ROOT, force: bool = False,
           strict: bool = False, quiet: bool = False) -> dict:
    """Make root/vllm the patched upstream tree of `flavor`; return the state.

    strict: also refuse when an up-to-date tree carries edits no patch holds
    (the wheel build uses this, so hand edits never ship unrecorded).
    """
    pin = load_pin(root)
    pin.flavor(flavor)
    wheel = fetch_base_wheel(pin, flavor, quiet=quiet)
    patches_dir = root / "patches"
    want = {
        "format": VENDOR_FORMAT,
        "upstream_version": pin.version,
        "afd_version": pin.afd_version(flavor),
        "flavor": flavor,
        "base_wheel": pin.flavor(flavor).wheel,
        "base_sha256": pin.flavor(flavor).sha256,
        "series_digest": series_digest(patches_dir, flavor),
    }
    state = read_state(root)
    edited = hand_edits(root, state)
    if state and all(state.get(k) == v for k, v in want.items()) and not force:
        if edited and strict:
            raise VendorError(
                "the vendored tree has edits that are in no patch:\n  " + "\n  ".join(edited)
                + "\nRecord them with `quilt --quiltrc=.quiltrc refresh` (docs/patches.md) "
                "or discard them with `make vendor FORCE=1`.")
        if not quiet:
            print(f"[vllm-afd] vllm/ is up to date ({flavor}, series {want['series_digest'][:12]})")
        return state

    t0 = time.monotonic()
    staging = root / STATE_DIR / "staging"
    files = build_staging(root, pin, flavor, wheel, staging)
    if not force:
        # An edit is safe to replace only if the new series produces the same content
        # (the usual quilt flow: edit in place, refresh, re-vendor).
        lost = [rel for rel in edited
                if not (staging / rel).exists() or _hash(staging / rel) != _hash(root / rel)]
        if state is None and (root / "vllm").exists():
            present = [str(p.relative_to(root)) for p in (root / "vllm").rglob("*.py")
                       if not str(p.relative_to(root)).startswith(OURS)
                       and "__pycache__" not in p.parts]
            lost = [rel for rel in present
                    if not (staging / rel).exists() or _hash(staging / rel) != _hash(root / rel)]
        if lost:
            shutil.rmtree(staging)
            raise VendorError(
                "refusing to overwrite vendored files edited by hand (not in any patch):\n  "
                + "\n  ".join(lost[:20]) + ("\n  ..." if len(lost) > 20 else "")
                + "\nRefresh them into a patch first (docs/patches.md), or rerun with --force "
                "(make vendor FORCE=1) to discard them.")

    _remove_tree(root, state["files"] if state else [])
    for rel in files:
        dst = root / rel
        dst.parent.mkdir(parents=True, exist_ok=True)
        (staging / rel).replace(dst)
    for pc in staging.glob(".pc*"):
        pc.replace(root / pc.name)
    shutil.rmtree(staging)

    meta = read_base_metadata(wheel)
    info = {k: want[k] for k in ("upstream_version", "afd_version", "flavor", "series_digest")}
    info["patches"] = [p.name for p in load_series(patches_dir, flavor)]
    (root / INFO_FILE).write_text(json.dumps(info, indent=1, sort_keys=True) + "\n")
    files.append(INFO_FILE)
    new_state = dict(want, files={rel: _hash(root / rel) for rel in files})
    sdir = root / STATE_DIR
    for name, text in meta.items():
        (sdir / f"base.{name}").write_text(text)
    (sdir / "state.json").write_text(json.dumps(new_state, indent=0, sort_keys=True))
    if not quiet:
        print(f"[vllm-afd] vendored vLLM {pin.version} ({flavor}): {len(files)} files, "
              f"{len(info['patches'])} patches, {time.monotonic() - t0:.1f}s")
    return new_state


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--flavor", default="cpu", choices=("cpu", "cuda"))
    ap.add_argument("--force", action="store_true", help="discard hand edits in vllm/")
    ap.add_argument("--strict", action="store_true",
                    help="fail if the tree carries edits that no patch records")
    ap.add_argument("--root", type=Path, default=REPO_ROOT)
    args = ap.parse_args(argv)
    try:
        vendor(args.flavor, args.root, force=args.force, strict=args.strict)
    except (VendorError, PinError, SeriesError) as e:
        print(f"[vllm-afd] error: {e}", file=sys.stderr)
        return 1
    return 0


if __name__ == "__main__":
    sys.exit(main())
