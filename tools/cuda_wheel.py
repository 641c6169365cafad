# SPDX-License-Identifier: Apache-2.0
# SPDX-FileCopyrightText: Copyright contributors to the vllm-afd project
"""The cuda flavor's wheel with its CUDA kernels, built on a machine without a GPU.

    python tools/cuda_wheel.py [--stamp FILE]

`make test` runs this first (target cuda-wheel, rebuilt only when the sources or
the toolchain pins change), so tests/packaging/test_cuda_wheel.py inspects a
finished wheel instead of compiling inside pytest's time.

The build runs in a scratch copy of the checkout (build/cuda-wheel/src), so the
repository's vendored vllm/ tree keeps its flavor. The CUDA kernels are compiled
with the pinned toolchain (tools/cuda_toolchain.py); when it cannot be fetched
(no network, say) the wheel is built without them and the reason is recorded.
Results: dist/cuda/<wheel> and build/cuda-wheel/report.json. --stamp FILE is
touched only when the kernels were built, so a missing toolchain is tried again.
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

REPO_ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(Path(__file__).resolve().parent))
from cuda_toolchain import ToolchainError, ensure  # noqa: E402

WORK = REPO_ROOT / "build" / "cuda-wheel"
REPORT = WORK / "report.json"
DIST = REPO_ROOT / "dist" / "cuda"


def project_files(repo: Path) -> list[str]:
    """Tracked and untracked-but-not-ignored files: what a fresh checkout would hold."""
    out = subprocess.run(["git", "ls-files", "-co", "--exclude-standard"], cwd=repo,
                         capture_output=True, text=True, check=True)
    return [f for f in out.stdout.splitlines() if (repo / f).is_file()]


def read_report() -> dict | None:
    return json.loads(REPORT.read_text()) if REPORT.exists() else None


def build(repo: Path = REPO_ROOT) -> dict:
    started = time.monotonic()
    reason = None
    try:
        toolchain = ensure(quiet=True)
    except (ToolchainError, OSError) as e:
        toolchain, reason = None, f"CUDA toolchain unavailable: {e}"
        print(f"[vllm-afd] {reason}; building the cuda wheel without CUDA kernels",
              file=sys.stderr)
    fetched = time.monotonic()

    src = WORK / "src"
    shutil.rmtree(src, ignore_errors=True)
    for rel in project_files(repo):
        (src / rel).parent.mkdir(parents=True, exist_ok=True)
        shutil.copy2(repo / rel, src / rel)
    out = WORK / "out"
    shutil.rmtree(out, ignore_errors=True)
    env = dict(os.environ, VLLM_AFD_FLAVOR="cuda")
    if toolchain is not None:
        env["VLLM_AFD_CUDA_TOOLCHAIN"] = str(toolchain.root)
    else:
        env["VLLM_AFD_BUILD_CUDA"] = "0"
    proc = subprocess.run(
        [sys.executable, "-m", "build", "--wheel", "--no-isolation", "--outdir", str(out)],
        cwd=src, env=env, capture_output=True, text=True)
    (WORK / "build.log").write_text(proc.stdout + proc.stderr)
    if proc.returncode != 0:
        sys.stderr.write(proc.stdout[-3000:] + proc.stderr[-6000:])
        raise SystemExit(f"cuda wheel build failed (log: {WORK / 'build.log'})")
    wheels = sorted(out.glob("*.whl"))
    DIST.mkdir(parents=True, exist_ok=True)
    for old in DIST.glob("*.whl"):
        old.unlink()
    for w in wheels:
        shutil.move(str(w), DIST / w.name)
    report = {
        "wheels": [str(DIST / w.name) for w in wheels],
        "cuda_kernels": toolchain is not None,
        "reason": reason,
        "toolchain": str(toolchain.root) if toolchain else None,
        "cuobjdump": str(toolchain.cuobjdump) if toolchain else None,
        "gencode": toolchain.gencode_flags() if toolchain else [],
        "fetch_seconds": round(fetched - started, 1),
        "build_seconds": round(time.monotonic() - fetched, 1),
    }
    REPORT.write_text(json.dumps(report, indent=2) + "\n")
    return report


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--stamp", type=Path, help="touched when the CUDA kernels were built")
    args = ap.parse_args()
    report = build()
    print(json.dumps(report, indent=2))
    if args.stamp and report["cuda_kernels"]:
        args.stamp.parent.mkdir(parents=True, exist_ok=True)
        args.stamp.touch()
    return 0


if __name__ == "__main__":
    sys.exit(main())
