# SPDX-License-Identifier: Apache-2.0
# SPDX-FileCopyrightText: Copyright contributors to the vllm-afd project
"""The cuda flavor's wheel with its CUDA kernels, built on a machine without a GPU.

    python tools/build/cuda_wheel.py [--stamp FILE]                          the pinned vLLM
    python tools/build/cuda_wheel.py --next 0.34.0 [--cached-only] [--stamp FILE]

`make test` runs this first (targets cuda-wheel and cuda-wheel-next, rebuilt only
when the sources or the pins change), so tests/packaging/test_cuda_wheel.py
inspects finished wheels instead of compiling inside pytest's time.

The build runs in a scratch copy of the checkout, so the repository's vendored
vllm/ tree keeps its flavor. --next VERSION builds on the release a carried series
waits for: the copy takes patches/next/VERSION/ as its patches/ and that
directory's upstream.toml as its pin (the cuda flavor has the release, the cpu one
not yet). The CUDA kernels are compiled with the pinned toolchain
(tools/build/cuda_toolchain.py) against the torch the base wheel requires; when it cannot
be fetched (no network, say) the wheel is built without them and the reason is
recorded. --cached-only builds nothing unless the base wheel and every toolchain
file are already downloaded, and records which are not.

Results: dist/cuda/<wheel> and build/cuda-wheel/report.json (--next VERSION:
dist/cuda-next/VERSION/ and build/cuda-wheel-next/VERSION/report.json). --stamp
FILE is touched only when the kernels were built, so a missing download is tried
again.
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import subprocess
import sys
import time
from pathlib import Path

REPO_ROOT = Path(__file__).resolve().parents[2]
sys.path.insert(0, str(Path(__file__).resolve().parent))
from cuda_toolchain import (  # noqa: E402
    ToolchainError, base_torch, cache_dir as toolchain_cache, ensure, needed, not_downloaded)
from upstream import PinError, fetch_base_wheel, load_pin  # noqa: E402
from upstream import cache_dir as wheel_cache  # noqa: E402


def work_dir(next_version: str | None = None) -> Path:
    build = REPO_ROOT / "build"
    return build / "cuda-wheel" if next_version is None else \
        build / "cuda-wheel-next" / next_version


def dist_dir(next_version: str | None = None) -> Path:
    dist = REPO_ROOT / "dist"
    return dist / "cuda" if next_version is None else dist / "cuda-next" / next_version


def next_versions(repo: Path = REPO_ROOT) -> list[str]:
    """The releases a carried series waits for (patches/next/<version>/upstream.toml)."""
    return sorted(p.parent.name for p in (repo / "patches" / "next").glob("*/upstream.toml"))


def project_files(repo: Path) -> list[str]:
    """Tracked and untracked-but-not-ignored files: what a fresh checkout would hold."""
    out = subprocess.run(["git", "ls-files", "-co", "--exclude-standard"], cwd=repo,
                         capture_output=True, text=True, check=True)
    return [f for f in out.stdout.splitlines() if (repo / f).is_file()]


def read_report(next_version: str | None = None) -> dict | None:
    report = work_dir(next_version) / "report.json"
    return json.loads(report.read_text()) if report.exists() else None


def _not_cached(pin_root: Path) -> str | None:
    """Why a --cached-only build cannot run (None: every download is cached)."""
    pin = load_pin(pin_root)
    base = wheel_cache() / pin.flavor("cuda").wheel
    if not base.exists():
        return f"the vllm {pin.version} base wheel is not downloaded ({base})"
    missing = not_downloaded(needed(base_torch(base)))
    if missing:
        return f"toolchain wheels not downloaded to {toolchain_cache()}: {', '.join(missing)}"
    return None


def _scratch_copy(repo: Path, src: Path, next_version: str | None) -> None:
    shutil.rmtree(src, ignore_errors=True)
    for rel in project_files(repo):
        (src / rel).parent.mkdir(parents=True, exist_ok=True)
        shutil.copy2(repo / rel, src / rel)
    if next_version is not None:  # the waiting series and its pin replace the pinned ones
        waiting = repo / "patches" / "next" / next_version
        shutil.rmtree(src / "patches")
        shutil.copytree(waiting, src / "patches")
        shutil.move(src / "patches" / "upstream.toml", src / "upstream.toml")


def build(repo: Path = REPO_ROOT, next_version: str | None = None,
          cached_only: bool = False) -> dict:
    started = time.monotonic()
    work, dist = work_dir(next_version), dist_dir(next_version)
    pin_root = repo if next_version is None else repo / "patches" / "next" / next_version
    if not (pin_root / "upstream.toml").exists():
        raise SystemExit(f"no series waits for {next_version}: {pin_root}/upstream.toml "
                         "is missing (make rebase VERSION=... WRITE=1 writes it)")
    report = {"upstream": load_pin(pin_root).version, "wheels": [], "cuda_kernels": False,
              "reason": None, "torch": None, "toolchain": None, "cuobjdump": None,
              "gencode": [], "log": str(work / "build.log")}
    reason = _not_cached(pin_root) if cached_only else None
    if reason is not None:
        report["reason"] = f"not built ({reason})"
        _write_report(work, report)
        return report

    toolchain = None
    try:
        report["torch"] = base_torch(fetch_base_wheel(load_pin(pin_root), "cuda", quiet=True))
        toolchain = ensure(report["torch"], quiet=True)
    except (ToolchainError, PinError, OSError) as e:
        report["reason"] = f"CUDA toolchain unavailable: {e}"
        print(f"[vllm-afd] {report['reason']}; building the cuda wheel without CUDA kernels",
              file=sys.stderr)
    fetched = time.monotonic()

    src = work / "src"
    _scratch_copy(repo, src, next_version)
    out = work / "out"
    shutil.rmtree(out, ignore_errors=True)
    env = dict(os.environ, VLLM_AFD_FLAVOR="cuda")
    if toolchain is not None:
        env["VLLM_AFD_CUDA_TOOLCHAIN"] = str(toolchain.root)
    else:
        env["VLLM_AFD_BUILD_CUDA"] = "0"
    proc = subprocess.run(
        [sys.executable, "-m", "build", "--wheel", "--no-isolation", "--outdir", str(out)],
        cwd=src, env=env, capture_output=True, text=True)
    (work / "build.log").write_text(proc.stdout + proc.stderr)
    if proc.returncode != 0:
        sys.stderr.write(proc.stdout[-3000:] + proc.stderr[-6000:])
        raise SystemExit(f"cuda wheel build failed (log: {work / 'build.log'})")
    wheels = sorted(out.glob("*.whl"))
    dist.mkdir(parents=True, exist_ok=True)
    for old in dist.glob("*.whl"):
        old.unlink()
    for w in wheels:
        shutil.move(str(w), dist / w.name)
    report.update({
        "wheels": [str(dist / w.name) for w in wheels],
        "cuda_kernels": toolchain is not None,
        "toolchain": str(toolchain.root) if toolchain else None,
        "cuobjdump": str(toolchain.cuobjdump) if toolchain else None,
        "gencode": toolchain.gencode_flags() if toolchain else [],
        "fetch_seconds": round(fetched - started, 1),
        "build_seconds": round(time.monotonic() - fetched, 1),
    })
    _write_report(work, report)
    return report


def _write_report(work: Path, report: dict) -> None:
    work.mkdir(parents=True, exist_ok=True)
    (work / "report.json").write_text(json.dumps(report, indent=2) + "\n")


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--next", metavar="VERSION", dest="next_version",
                    help="build on the release patches/next/VERSION/ waits for")
    ap.add_argument("--all-next", action="store_true",
                    help="--next for every release in patches/next/")
    ap.add_argument("--cached-only", action="store_true",
                    help="build only when every download is already cached")
    ap.add_argument("--stamp", type=Path, help="touched when the CUDA kernels were built")
    args = ap.parse_args()
    versions = next_versions() if args.all_next else [args.next_version]
    reports = [build(next_version=v, cached_only=args.cached_only) for v in versions]
    print(json.dumps(reports if args.all_next else reports[0], indent=2))
    if args.stamp and all(r["cuda_kernels"] for r in reports):
        args.stamp.parent.mkdir(parents=True, exist_ok=True)
        args.stamp.touch()
    return 0


if __name__ == "__main__":
    sys.exit(main())
