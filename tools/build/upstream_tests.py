# SPDX-License-Identifier: Apache-2.0
# SPDX-FileCopyrightText: Copyright contributors to the vllm-afd project
"""Upstream vLLM's own tests, stock wheel vs our wheel: the patches must not
change what passes with AFD off.

    python tools/build/upstream_tests.py [FILE ...]        (make upstream-test)

Runs the selected test files of the pinned sdist (tests of the modules our patch
series touches that run on a CPU without a model hub) once in `.venv-upstream`
(the stock cpu base wheel) and once in `.venv` (vllm-afd), and compares every
test's outcome. Tests that fail in both (e.g. they need a hub model) are
reported, not held against us; any test whose outcome differs fails the run.
"""

import argparse
import os
import re
import subprocess
import sys
import tarfile
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))
from upstream import REPO_ROOT, fetch_base_wheel, fetch_sdist, load_pin  # noqa: E402

# Upstream tests of the modules patches/ touches (engine args and config, the
# serve CLI, platform detection through the CLI, micro-batch slicing) that run here.
DEFAULT_FILES = [
    "tests/engine/test_arg_utils.py",
    "tests/config/test_config_utils.py",
    "tests/entrypoints/cli/test_serve.py",
    "tests/entrypoints/launchers/test_cli_args.py",
    "tests/v1/worker/test_gpu_ubatch_slicing.py",
    "tests/v1/attention/test_attention_splitting.py",
]
TEST_DEPS = ["tblib==3.2.2", "pytest==9.2.0", "pytest-asyncio==1.5.0", "pytest-mock==3.17.0"]
_OUTCOME = re.compile(r"^(PASSED|FAILED|ERROR|SKIPPED|XFAIL|XPASS) (\S+)")


def ensure_base_venv(venv: Path) -> Path:
    py = venv / "bin" / "python"
    if not (venv / ".stamp").exists():
        pin = load_pin()
        subprocess.run([sys.executable, "-m", "venv", str(venv)], check=True)
        pip = [str(py), "-m", "pip", "install", "-q"]
        subprocess.run(pip + ["torch==2.13.0", str(fetch_base_wheel(pin, "cpu"))], check=True)
        subprocess.run([str(py), "-m", "pip", "uninstall", "-q", "-y", "torchvision",
                        "torchaudio", "torchcodec"], check=True)
        (venv / ".stamp").touch()
    return py


def run(py: Path, tests_root: Path, files: list[str], cache: Path) -> dict[str, str]:
    subprocess.run([str(py), "-m", "pip", "install", "-q", *TEST_DEPS], check=True)
    env = dict(os.environ, HF_HUB_OFFLINE="1", VLLM_CPU_KVCACHE_SPACE="1",
               VLLM_CACHE_ROOT=str(cache))
    proc = subprocess.run(
        [str(py), "-m", "pytest", "-q", "-rA", "-p", "no:cacheprovider",
         "--continue-on-collection-errors", *files],
        cwd=tests_root, env=env, capture_output=True, text=True, timeout=3600)
    outcomes = {}
    for line in proc.stdout.splitlines():
        m = _OUTCOME.match(line)
        if m:
            outcomes[m.group(2)] = m.group(1)
    return outcomes


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("files", nargs="*", default=DEFAULT_FILES)
    ap.add_argument("--ours", type=Path, default=REPO_ROOT / ".venv" / "bin" / "python")
    ap.add_argument("--base-venv", type=Path, default=REPO_ROOT / ".venv-upstream")
    args = ap.parse_args()

    pin = load_pin()
    work = REPO_ROOT / "build" / "upstream-tests"
    src = work / f"vllm-{pin.version}"
    if not (src / "tests").exists():
        with tarfile.open(fetch_sdist(pin)) as tar:
            members = [m for m in tar.getmembers()
                       if m.name.startswith(f"vllm-{pin.version}/tests/")]
            tar.extractall(work, members=members, filter="data")
    base = ensure_base_venv(args.base_venv)
    results = {}
    for name, py in (("stock", base), ("vllm-afd", args.ours)):
        print(f"running {len(args.files)} upstream test files with {name} ...", flush=True)
        results[name] = run(py, src, args.files, work / f"cache-{name}")
    stock, ours = results["stock"], results["vllm-afd"]
    differ = sorted(t for t in set(stock) | set(ours) if stock.get(t) != ours.get(t))
    passed = sum(1 for t in stock if stock[t] == "PASSED" and ours.get(t) == "PASSED")
    both_failed = sum(1 for t in stock if stock[t] in ("FAILED", "ERROR") and
                      ours.get(t) == stock[t])
    print(f"upstream tests: {len(stock)} outcomes; {passed} pass on both, {both_failed} fail "
          f"on both (hub models, GPUs), {len(differ)} differ")
    for t in differ:
        print(f"  DIFFERS {t}: stock {stock.get(t)}, vllm-afd {ours.get(t)}")
    if not stock:
        print("no outcomes parsed: the run did not happen")
        return 1
    return 1 if differ else 0


if __name__ == "__main__":
    sys.exit(main())
