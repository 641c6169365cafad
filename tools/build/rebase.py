# SPDX-License-Identifier: Apache-2.0
# SPDX-FileCopyrightText: Copyright contributors to the vllm-afd project
"""Carry the patch series to a new vLLM release in one command.

    python tools/build/rebase.py VERSION [--flavor cpu|cuda ...] [--write]
    python tools/build/rebase.py --continue [--drop REASON] | --abort
    (make rebase VERSION=0.33.0 [FLAVOR=cuda] [WRITE=1], CONTINUE=1 [DROP=REASON])

Per flavor: the pinned base wheel and the new release of the same distribution are
unpacked side by side (build/rebase/<flavor>/{old,new}); every patch of the series
is carried over in series order (tools/build/forward_port.py: clean, offset, merged,
droppable or conflict; fuzz is never used). A flavor whose new release does not
exist is reported, not failed. The common patches are ported once, on the first
flavor, and must then apply exactly to the other flavors.

On a conflict the run stops at that patch: the conflicting files, with markers,
are in build/rebase/<flavor>/new; fix them and run --continue (or drop the patch
with --continue --drop REASON, or give up with --abort). --continue records the
resolution or the drop in patches/resolutions/<version>/ (tools/build/resolutions.py),
and a later run to the same release reuses it instead of stopping.
At the end, build/rebase/report.{md,json} hold the per-patch report and the
burden before and after. Nothing else outside build/rebase changes unless --write
is given: then, if every flavor of the pin has the release, the refreshed series
is written over patches/ and upstream.toml moves; otherwise the pin stays and the
series goes to patches/next/<version>/.
"""

from __future__ import annotations

import argparse
import datetime
import json
import re
import shutil
import subprocess
import sys
import tempfile
import zipfile
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))
from forward_port import (  # noqa: E402
    CONFLICT, DROPPABLE, DROPPED, Conflict, PortResult, finish_by_hand, port_patch,
    restore, syntax_errors,
)
from rebase_report import (  # noqa: E402
    moved_pin, render_report, summarize, update_pin, write_in_place, write_next,
)
from resolutions import (  # noqa: E402
    conflict_signature, load_record, record_path, record_stop, save_record,
)
from series import (  # noqa: E402
    Patch, SeriesError, apply_patch, load_patch, parse_fields, read_series, series_files,
    split_patch,
)
from upstream import (  # noqa: E402
    REPO_ROOT, PinError, _wheel_tags, cache_dir, fetch_base_wheel, load_pin, sha256_file,
)

WORKDIR = "build/rebase"
STATE = "state.json"


class RebaseError(RuntimeError):
    pass


def missing_symbols(tree: Path, result: PortResult) -> list[str]:
    """Upstream-Symbols entries of the ported patch (its header as carried: a file
    left out takes its symbols along) that the new tree does not have."""
    from check_series import _symbol_found

    fields = parse_fields(split_patch(result.text or "")[0])
    symbols = fields.get("Upstream-Symbols", "").replace(",", " ").split()
    return [s for s in symbols if not _symbol_found(tree, s)]


def find_release(distribution: str, version: str, platform: str,
                 find_links: Path | None) -> Path | None:
    """The new release's wheel (cached, or downloaded into the cache); None if the
    index has no such release."""
    stem = f"{distribution.replace('-', '_')}-{version}-"
    cached = sorted(cache_dir().glob(f"{stem}*-{platform}.whl"))
    if cached:
        return cached[0]
    cache_dir().mkdir(parents=True, exist_ok=True)
    with tempfile.TemporaryDirectory(dir=cache_dir()) as tmp:
        cmd = [sys.executable, "-m", "pip", "download", "--no-deps", "--quiet",
               "--only-binary", ":all:", "--dest", tmp, "--platform", platform,
               f"{distribution}=={version}"]
        if find_links is not None:
            cmd += ["--no-index", "--find-links", str(find_links)]
        print(f"[rebase] looking for {distribution}=={version}", file=sys.stderr)
        proc = subprocess.run(cmd, capture_output=True, text=True)
        if proc.returncode != 0:
            if "No matching distribution" in proc.stderr:
                return None
            raise RebaseError(f"pip download {distribution}=={version} failed:\n{proc.stderr}")
        got = sorted(Path(tmp).glob("*.whl"))
        if len(got) != 1:
            raise RebaseError(f"pip download {distribution}=={version} gave {got}")
        dest = cache_dir() / got[0].name
        shutil.move(str(got[0]), dest)
    return dest


def unpack_sources(wheel: Path, dest: Path, also: set[str]) -> None:
    """The wheel's Python sources (plus any other file a patch touches) into dest."""
    if dest.exists():
        shutil.rmtree(dest)
    dest.mkdir(parents=True)
    with zipfile.ZipFile(wheel) as zf:
        for info in zf.infolist():
            n = info.filename
            if n.startswith("vllm/") and (n.endswith(".py") or n in also):
                zf.extract(info, dest)


class Rebase:
    """One rebase run; its state lives in build/rebase/state.json between --continue's."""

    def __init__(self, root: Path, state: dict):
        self.root = root
        self.work = root / WORKDIR
        self.state = state

    # -- state -------------------------------------------------------------
    @classmethod
    def start(cls, root: Path, version: str, flavors: list[str] | None,
              find_links: Path | None) -> Rebase:
        work = root / WORKDIR
        if (work / STATE).exists():
            s = json.loads((work / STATE).read_text())
            raise RebaseError(
                f"a rebase to {s['version']} is in progress (stopped at "
                f"{s.get('stopped_at', '?')}): run with --continue or --abort")
        pin = load_pin(root)
        if version == pin.version:
            raise RebaseError(f"the pin is already {version}")
        if work.exists():
            shutil.rmtree(work)
        work.mkdir(parents=True)
        patches_dir = root / "patches"
        state = {"version": version, "old_version": pin.version, "flavors": {},
                 "results": {}, "ported": {}, "find_links": str(find_links or "")}
        for name in flavors or list(pin.flavors):
            fl = pin.flavor(name)
            platform = _wheel_tags(fl.wheel)[2]
            new = find_release(fl.distribution, version, platform, find_links)
            entry = {"distribution": fl.distribution, "old_wheel": fl.wheel,
                     "series": [n for sf in series_files(patches_dir, name)
                                for n in read_series(sf)],
                     "next": 0, "done": False}
            if new is None:
                entry.update(missing=True, done=True)
                print(f"[rebase] {name}: {fl.distribution} {version} has no release yet "
                      f"(reported, not failed)", file=sys.stderr)
            else:
                entry.update(missing=False, new_wheel=new.name, new_sha256=sha256_file(new))
            state["flavors"][name] = entry
        self = cls(root, state)
        for name, entry in state["flavors"].items():
            if not entry["missing"]:
                self._prepare(name)
        self.save()
        return self

    @classmethod
    def resume(cls, root: Path) -> Rebase:
        path = root / WORKDIR / STATE
        if not path.exists():
            raise RebaseError("no rebase in progress")
        return cls(root, json.loads(path.read_text()))

    def save(self) -> None:
        (self.work / STATE).write_text(json.dumps(self.state, indent=1))

    def abort(self) -> None:
        shutil.rmtree(self.work)

    # -- trees -------------------------------------------------------------
    def _patch(self, name: str) -> Patch:
        return load_patch(self.root / "patches", name)

    def _prepare(self, flavor: str) -> None:
        entry = self.state["flavors"][flavor]
        pin = load_pin(self.root)
        touched = {f for n in entry["series"] for f in self._patch(n).files}
        fdir = self.work / flavor
        unpack_sources(fetch_base_wheel(pin, flavor, quiet=True), fdir / "old", touched)
        unpack_sources(cache_dir() / entry["new_wheel"], fdir / "new", touched)

    # -- the loop ----------------------------------------------------------
    def run(self) -> bool:
        """Port every remaining patch; False when stopped at a conflict."""
        for flavor, entry in self.state["flavors"].items():
            fdir = self.work / flavor
            while not entry["done"]:
                idx = entry["next"]
                if idx == len(entry["series"]):
                    entry["done"] = True
                    break
                name = entry["series"][idx]
                result = self._port_one(flavor, idx, name)
                self.state["results"].setdefault(flavor, {})[name] = result.to_json()
                if result.status == CONFLICT:
                    self.state["stopped_at"] = f"{flavor}: {name}"
                    self.save()
                    self._print_stop(flavor, idx, result, fdir / "new")
                    return False
                if result.text is not None:
                    (fdir / "ported").mkdir(exist_ok=True)
                    (fdir / "ported" / name.replace("/", "__")).write_text(result.text)
                    if self._is_common(name):
                        self.state["ported"].setdefault(name, flavor)
                entry["next"] = idx + 1
                self.save()
        self.state.pop("stopped_at", None)
        self.save()
        return True

    def _is_common(self, name: str) -> bool:
        return name in read_series(self.root / "patches" / "series")

    def _port_one(self, flavor: str, idx: int, name: str) -> PortResult:
        fdir = self.work / flavor
        patch = self._patch(name)
        scratch = fdir / "snap" / f"{idx:03d}"
        if scratch.exists():
            shutil.rmtree(scratch)
        first = self.state["ported"].get(name)
        if first is not None and first != flavor:
            return self._reuse(patch, flavor, first, scratch)
        gone = self._dropped_elsewhere(name, flavor)
        if gone is not None:
            apply_patch(fdir / "old", patch)
            return PortResult(name, gone["status"], sorted(set(patch.files)),
                              detail=f"{gone['status']} on {gone['flavor']}: {gone['detail']}")
        result = port_patch(patch, fdir / "old", fdir / "new", scratch,
                            load_record(self._record_path(name), name))
        if result.status not in (CONFLICT, DROPPABLE, DROPPED):
            result.missing_symbols = missing_symbols(fdir / "new", result)
            result.syntax_errors = syntax_errors(fdir / "new", result.files)
        print(f"[rebase] {flavor}: {name}: {result.status}"
              + (f" ({result.detail})" if result.detail else ""), file=sys.stderr)
        return result

    def _dropped_elsewhere(self, name: str, flavor: str) -> dict | None:
        """A common patch's result on the flavor that dropped it (or found it
        upstream), with that flavor's name; None if no flavor did."""
        if not self._is_common(name):
            return None
        for f, results in self.state["results"].items():
            r = results.get(name, {})
            if f != flavor and r.get("status") in (DROPPABLE, DROPPED):
                return dict(r, flavor=f)
        return None

    def _record_path(self, name: str) -> Path:
        return record_path(self.root, self.state["version"], name)

    def _reuse(self, patch: Patch, flavor: str, first: str, scratch: Path) -> PortResult:
        """A common patch already ported on another flavor must apply here exactly."""
        fdir = self.work / flavor
        text = (self.work / first / "ported" / patch.name.replace("/", "__")).read_text()
        ported = scratch / "ported.patch"
        ported.parent.mkdir(parents=True, exist_ok=True)
        ported.write_text(text)
        apply_patch(fdir / "old", patch)
        copy = Patch(patch.name, ported, patch.header_text, patch.fields, patch.files)
        try:
            apply_patch(fdir / "new", copy)
        except SeriesError as e:
            raise RebaseError(f"{patch.name} as ported on {first} does not apply to the "
                              f"{flavor} tree; the common files differ between flavors:\n{e}")
        base = self.state["results"][first][patch.name]
        return PortResult(patch.name, base["status"], base["files"], text=text,
                          detail=f"as ported on {first}", reused=base["reused"])

    def _print_stop(self, flavor: str, idx: int, result: PortResult, tree: Path) -> None:
        n = len(self.state["flavors"][flavor]["series"])
        print(f"\n[rebase] STOPPED at patch {idx + 1}/{n} of {flavor}: {result.name}")
        print(f"[rebase] the tree {tree} holds the new upstream with patches 1..{idx} "
              f"applied and this one half-applied, with conflict markers:")
        for c in result.conflicts:
            print(f"  {c.file}:{c.line}: {c.reason}")
            if c.hunk:
                print("    " + c.hunk.replace("\n", "\n    "))
        if result.reused:
            print(f"[rebase] recorded resolution(s) already in place: {', '.join(result.reused)}")
        print("[rebase] fix those files (remove every marker), then run "
              "`make rebase CONTINUE=1` (tools/build/rebase.py --continue); or drop the patch "
              "from the new series with `make rebase CONTINUE=1 DROP=\"why\"` "
              "(--continue --drop WHY); or give up with `make rebase ABORT=1` (--abort).")

    def continue_(self, drop: str | None = None, why: str | None = None) -> None:
        """Finish the stopped patch: regenerate it from the hand edit, or drop it
        (reason `drop`); either way recorded in patches/resolutions at once."""
        stopped = self.state.get("stopped_at")
        if not stopped:
            if drop is not None:
                raise RebaseError("the rebase is not stopped at a patch: nothing to drop")
            return
        flavor, name = stopped.split(": ", 1)
        entry = self.state["flavors"][flavor]
        idx = entry["next"]
        fdir, snap = self.work / flavor, self.work / flavor / "snap" / f"{idx:03d}"
        raw = self.state["results"][flavor][name]
        result = PortResult(name, raw["status"], raw["files"], raw["detail"],
                            reused=raw.get("reused", []))
        result.conflicts = [Conflict(**c) for c in raw["conflicts"]]
        path = self._record_path(name)
        record = load_record(path, name)
        if drop is None:
            finish_by_hand(self._patch(name), result, fdir / "new", snap / "new-before")
            notes = record_stop(record, result.files, result.conflicts, snap, fdir / "new",
                                why)
            result.missing_symbols = missing_symbols(fdir / "new", result)
            result.syntax_errors = syntax_errors(fdir / "new", result.files)
            (fdir / "ported").mkdir(exist_ok=True)
            (fdir / "ported" / name.replace("/", "__")).write_text(result.text)
            if self._is_common(name):
                self.state["ported"].setdefault(name, flavor)
        else:
            # The old tree keeps the patch (later patches were written on top of
            # it); the new tree goes back to where it was before this patch.
            restore(fdir / "new", result.files, snap / "new-before")
            record["drop"] = {"reason": drop,
                              "conflicts": conflict_signature(result.conflicts)}
            result.status, result.by_hand = DROPPED, True
            result.detail = f"dropped by hand: {drop}"
            notes = ["recorded the drop"]
        save_record(path, record)
        rel = path.relative_to(self.root)
        self.state.setdefault("recorded", []).append(str(rel))
        print(f"[rebase] {flavor}: {name}: {result.detail}", file=sys.stderr)
        for note in notes:
            print(f"[rebase]   {rel}: {note}", file=sys.stderr)
        self.state["results"][flavor][name] = result.to_json()
        entry["next"] = idx + 1
        self.state.pop("stopped_at")
        self.save()

    # -- the end -----------------------------------------------------------
    def finish(self, write: bool) -> dict:
        report = self.summary()
        md = render_report(report)
        (self.work / "report.md").write_text(md)
        (self.work / "report.json").write_text(json.dumps(report, indent=1) + "\n")
        if write:
            report["written"] = self.write()
            (self.work / "report.json").write_text(json.dumps(report, indent=1) + "\n")
        (self.work / STATE).unlink()
        return report

    def summary(self) -> dict:
        return summarize(self.state, self.root / "patches", self._ported_text)

    def _ported_text(self, flavor: str, name: str) -> str:
        p = self.work / flavor / "ported" / name.replace("/", "__")
        return p.read_text() if p.exists() else ""

    def write(self) -> dict:
        """Write the refreshed series: over patches/ when every flavor of the pin has
        the release (and move the pin), else to patches/next/<version>/ (the pin
        cannot move, and the pinned build must keep its series)."""
        patches_dir = self.root / "patches"
        today = datetime.date.today().isoformat()
        texts, gone = {}, []
        for flavor, entry in self.state["flavors"].items():
            if entry["missing"]:
                continue
            for name in entry["series"]:
                r = self.state["results"][flavor][name]
                if r["status"] in (DROPPABLE, DROPPED):
                    if name not in gone:
                        gone.append(name)
                    continue
                text = self._ported_text(flavor, name)
                if r["status"] not in ("clean", "offset"):  # content changed
                    text = re.sub(r"^Last-Update: .*$", f"Last-Update: {today}", text,
                                  count=1, flags=re.M)
                texts[name] = text
        pin = load_pin(self.root)
        missing = [f for f in pin.flavors
                   if f not in self.state["flavors"] or self.state["flavors"][f]["missing"]]
        out = {"dropped": gone, "pin_moved": not missing, "pin_missing_flavors": missing}
        if missing:
            flavors = [f for f, e in self.state["flavors"].items() if not e["missing"]]
            pin_text = moved_pin((self.root / "upstream.toml").read_text(),
                                 self.state["version"], {
                f: (e["new_wheel"], e["new_sha256"])
                for f, e in self.state["flavors"].items() if not e["missing"]})
            dest = write_next(patches_dir, self.state["version"], texts, flavors, pin_text)
            return dict(out, patches=list(texts), series_dir=str(dest.relative_to(self.root)))
        written = write_in_place(patches_dir, texts, gone, list(self.state["flavors"]))
        update_pin(self.root / "upstream.toml", self.state["version"], {
            f: (e["new_wheel"], e["new_sha256"]) for f, e in self.state["flavors"].items()})
        return dict(out, patches=written, series_dir="patches")


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("version", nargs="?", help="the new upstream release, e.g. 0.33.0")
    ap.add_argument("--flavor", action="append", choices=("cpu", "cuda"),
                    help="flavors to rebase (default: every flavor of the pin)")
    ap.add_argument("--write", action="store_true",
                    help="write the refreshed series (and the pin, when every flavor "
                         "has the release) at the end")
    ap.add_argument("--continue", dest="cont", action="store_true",
                    help="resume after fixing a conflict by hand")
    ap.add_argument("--drop", metavar="REASON",
                    help="with --continue: drop the stopped patch from the new series "
                         "(recorded, with the reason, for later runs to the same release)")
    ap.add_argument("--why", metavar="REASON",
                    help="with --continue: why a file gone upstream was left out of the "
                         "patch (recorded with the resolution)")
    ap.add_argument("--abort", action="store_true", help="drop the rebase in progress")
    ap.add_argument("--find-links", type=Path,
                    help="look for new releases only in this directory (no index)")
    ap.add_argument("--root", type=Path, default=REPO_ROOT)
    args = ap.parse_args(argv)
    root = args.root.resolve()
    if args.drop is not None and (not args.cont or not args.drop.strip()):
        ap.error("--drop REASON goes with --continue, and needs a reason")
    try:
        if args.abort:
            Rebase.resume(root).abort()
            print("[rebase] aborted; nothing outside build/rebase was changed")
            return 0
        if args.cont:
            rb = Rebase.resume(root)
            rb.continue_(args.drop, args.why)
            write = args.write or rb.state.get("write", False)
        else:
            if not args.version:
                ap.error("VERSION is required (or --continue / --abort)")
            rb = Rebase.start(root, args.version, args.flavor, args.find_links)
            rb.state["write"] = args.write
            write = args.write
        if not rb.run():
            return 1
        report = rb.finish(write)
    except (RebaseError, SeriesError, PinError) as e:
        print(f"[rebase] error: {e}", file=sys.stderr)
        return 2
    print((root / WORKDIR / "report.md").read_text())
    if write:
        w = report["written"]
        print(f"[rebase] wrote {len(w['patches'])} patch(es) to {w['series_dir']}/, "
              f"dropped {len(w['dropped'])}; "
              + ("upstream.toml moved to " + report["version"] if w["pin_moved"] else
                 f"upstream.toml NOT moved: no {report['version']} release for "
                 f"{', '.join(w['pin_missing_flavors'])}; patches/ is unchanged, the "
                 f"series for {report['version']} waits in {w['series_dir']}/"))
    return 0


if __name__ == "__main__":
    sys.exit(main())
