# SPDX-License-Identifier: Apache-2.0
# SPDX-FileCopyrightText: Copyright contributors to the vllm-afd project
"""Build the vllm-afd wheel: patched upstream vLLM + vllm/afd + the afd op library.

    VLLM_AFD_FLAVOR=cpu|cuda pip wheel .        (or python -m build --wheel, pip install .)

The flavor (default cpu) picks the pinned base wheel in upstream.toml. The build
vendors vllm/ first (tools/build/vendor.py, strict: hand edits that no patch records
stop the build), ships every upstream file including the base's native libraries
(each one checked against the pinned wheel), and compiles vllm/afd/_C from csrc/:
CPU kernels always, CUDA kernels where nvcc and a CUDA torch exist
(VLLM_AFD_BUILD_CUDA=0 turns them off) or, for the cuda flavor, with the pinned
toolchain that VLLM_AFD_CUDA_TOOLCHAIN names (tools/build/cuda_toolchain.py prints it),
Ascend kernels where CANN and torch_npu exist.
"""

import configparser
import glob
import os
import re
import shutil
import sys
import zipfile
from pathlib import Path

from setuptools import setup

ROOT = Path(__file__).resolve().parent
sys.path.insert(0, str(ROOT / "tools" / "build"))
from upstream import fetch_base_wheel, load_pin  # noqa: E402
from vendor import STATE_DIR, vendor  # noqa: E402

FLAVOR = os.environ.get("VLLM_AFD_FLAVOR", "cpu")
SKIP_DIRS = {"__pycache__"}
OUR_EXT_GLOB = "_C*.so"
# Pins added to upstream's `bench` extra (pip install 'vllm-afd[bench]') for
# benchmarks/; `make bench` reads this line.
BENCH_REQUIREMENTS = ["matplotlib==3.10.9"]
# The `ray` extra (pip install 'vllm-afd[ray]'): `vllm-afd launch` and the Ray
# executors; requirements/dev.txt pins the same for the tests.
RAY_REQUIREMENTS = ["ray==2.55.1"]
# Our command beside upstream's `vllm` (vllm/afd/deploy/commands.py).
AFD_CONSOLE_SCRIPTS = ["vllm-afd = vllm.afd.deploy.commands:main"]


def base_requirements(pin, flavor: str) -> tuple[list[str], dict[str, list[str]], str]:
    """install_requires, extras and python_requires, taken from the base wheel."""
    meta = (ROOT / STATE_DIR / "base.METADATA").read_text()
    drop = {d.lower().replace("_", "-") for d in pin.flavor(flavor).drop_requirements}
    install, extras, python_requires = [], {}, ""
    for line in meta.splitlines():
        if line.startswith("Requires-Python:"):
            python_requires = line.split(":", 1)[1].strip()
        if not line.startswith("Requires-Dist:"):
            continue
        req = line.split(":", 1)[1].strip()
        name = re.split(r"[\s;<>=!~\[(]", req, maxsplit=1)[0].lower().replace("_", "-")
        if name in drop:
            continue
        spec, _, marker = req.partition(";")
        m = re.search(r'extra == "([^"]+)"', marker)
        if m is None:
            install.append(req)
            continue
        rest = marker.replace(m.group(0), "").strip()
        if rest:
            raise RuntimeError(f"unsupported requirement marker in base METADATA: {req!r}")
        extras.setdefault(m.group(1), []).append(spec.strip())
    return install, extras, python_requires


def with_bench_pins(extras: dict[str, list[str]]) -> dict[str, list[str]]:
    """extras with BENCH_REQUIREMENTS replacing their packages in the `bench` extra,
    and the `ray` extra."""
    name = lambda req: re.split(r"[\s;<>=!~\[(]", req, maxsplit=1)[0].lower()  # noqa: E731
    pinned = {name(r) for r in BENCH_REQUIREMENTS}
    kept = [r for r in extras.get("bench", []) if name(r) not in pinned]
    return {**extras, "bench": kept + BENCH_REQUIREMENTS, "ray": RAY_REQUIREMENTS}


def base_entry_points() -> dict[str, list[str]]:
    cp = configparser.ConfigParser(delimiters=("=",))
    cp.optionxform = str
    cp.read_string((ROOT / STATE_DIR / "base.entry_points.txt").read_text())
    points = {g: [f"{k} = {v}" for k, v in cp[g].items()] for g in cp.sections()}
    points.setdefault("console_scripts", []).extend(AFD_CONSOLE_SCRIPTS)
    return points


def packages_and_data() -> tuple[list[str], dict[str, list[str]]]:
    """Every directory of vllm/ as a package; every non-Python file as its data."""
    packages, data = [], {}
    for d in sorted(p for p in [ROOT / "vllm", *(ROOT / "vllm").rglob("*")] if p.is_dir()):
        rel = d.relative_to(ROOT)
        if SKIP_DIRS & set(rel.parts):
            continue
        pkg = ".".join(rel.parts)
        files = [f.name for f in d.iterdir() if f.is_file() and f.suffix not in (".py", ".pyc")]
        if pkg == "vllm.afd":  # our extension comes from build_ext, not a stale local build
            files = [f for f in files if not Path(f).match(OUR_EXT_GLOB)]
        if any(f.is_file() for f in d.iterdir()):
            packages.append(pkg)
        if files:
            data[pkg] = sorted(glob.escape(f) for f in files)
    return packages, data


def check_native_libraries(wheel: Path) -> None:
    """Every native library of the pinned base wheel must ship (explicit allow-list)."""
    with zipfile.ZipFile(wheel) as zf:
        natives = [n for n in zf.namelist() if n.startswith("vllm/") and ".so" in Path(n).name]
    missing = [n for n in natives if not (ROOT / n).is_file()]
    if missing:
        raise RuntimeError(f"native libraries of the base wheel are missing: {missing}")


def extensions():
    import torch
    from torch.utils.cpp_extension import CUDA_HOME, CppExtension, CUDAExtension

    sources = ["csrc/torch_bindings.cpp", *sorted(glob.glob("csrc/cpu/*.cpp"))]
    kwargs = dict(
        py_limited_api=True,
        define_macros=[("Py_LIMITED_API", "0x03080000")],
        extra_compile_args={"cxx": ["-O3", "-std=c++17"]},
        # An edited header rebuilds what includes it (an incremental build_ext).
        depends=sorted(glob.glob("csrc/*.h") + glob.glob("csrc/cpu/*.h")
                       + glob.glob("csrc/cuda/*.cuh")),
    )
    build_cuda = os.environ.get("VLLM_AFD_BUILD_CUDA", "1") != "0"
    toolchain = os.environ.get("VLLM_AFD_CUDA_TOOLCHAIN")
    if build_cuda and toolchain and FLAVOR != "cuda":
        print(f"[vllm-afd] VLLM_AFD_CUDA_TOOLCHAIN ignored: flavor {FLAVOR}", file=sys.stderr)
    elif build_cuda and toolchain:
        # tools/build/cuda_toolchain.py: nvcc from NVIDIA's wheels and the headers and
        # libraries of the CUDA torch, while the venv (which runs this script)
        # keeps its CPU torch. cpp_extension found no CUDA_HOME for a CPU torch;
        # it is the one global it reads to find nvcc and the CUDA headers.
        import torch.utils.cpp_extension as cpp_extension
        from cuda_toolchain import load as load_toolchain
        from cuda_toolchain import required_torch

        # The CUDA torch the base wheel requires (2.13.0 for vLLM 0.32.0).
        torch_version = required_torch((ROOT / STATE_DIR / "base.METADATA").read_text())
        tc = load_toolchain(Path(toolchain), torch_version)
        cpp_extension.CUDA_HOME = str(tc.cuda_home)
        sources += sorted(glob.glob("csrc/cuda/*.cu"))
        # Ahead of the CPU torch's own directories, which CUDAExtension appends.
        kwargs.update(include_dirs=[str(p) for p in tc.torch_include],
                      library_dirs=[str(tc.torch_lib), str(tc.cuda_home / "lib")])
        # torch 2.14's headers need C++20 in host code too (std::strong_ordering,
        # requires-clauses); 2.13's build either way.
        kwargs["extra_compile_args"] = {"cxx": ["-O3", "-std=c++20"],
                                        "nvcc": ["-O3", "-std=c++20", *tc.gencode_flags()]}
        print(f"[vllm-afd] building CUDA kernels with {tc.root}, torch {torch_version} "
              f"({' '.join(tc.gencode_flags())})", file=sys.stderr)
        return [CUDAExtension("vllm.afd._C", sources, **kwargs)]
    elif build_cuda and torch.version.cuda is not None and CUDA_HOME is not None:
        sources += sorted(glob.glob("csrc/cuda/*.cu"))
        # C++20, as above (torch 2.13's headers warn under C++17 in nvcc; 2.14's fail).
        kwargs["extra_compile_args"] = {"cxx": ["-O3", "-std=c++20"],
                                        "nvcc": ["-O3", "-std=c++20"]}
        print("[vllm-afd] building CUDA kernels", file=sys.stderr)
        return [CUDAExtension("vllm.afd._C", sources, **kwargs)]
    # Ascend kernels, once there are any (csrc/npu/README.md: today NPUs run the
    # torch-op implementations of vllm/afd/kernels/composite.py).
    npu_sources = sorted(glob.glob("csrc/npu/*.cpp"))
    if npu_sources and os.environ.get("ASCEND_HOME_PATH"):
        try:
            import torch_npu
        except ImportError:
            torch_npu = None
        if torch_npu is not None:
            npu_root = Path(torch_npu.__file__).parent
            sources += npu_sources
            kwargs.update(include_dirs=[str(npu_root / "include")],
                          library_dirs=[str(npu_root / "lib")], libraries=["torch_npu"])
            print("[vllm-afd] building Ascend kernels", file=sys.stderr)
    return [CppExtension("vllm.afd._C", sources, **kwargs)]


def main() -> None:
    pin = load_pin(ROOT)
    # setuptools packs whatever sits in its build dir: start each flavor's build
    # from an empty one, so nothing of another flavor or an older tree can ship.
    build_base = ROOT / "build" / f"wheel-{FLAVOR}"
    if {"bdist_wheel", "build", "build_py"} & set(sys.argv):
        shutil.rmtree(build_base, ignore_errors=True)
    vendor(FLAVOR, ROOT, strict=True, quiet=True)
    check_native_libraries(fetch_base_wheel(pin, FLAVOR, quiet=True))
    install, extras, python_requires = base_requirements(pin, FLAVOR)
    packages, package_data = packages_and_data()

    from torch.utils.cpp_extension import BuildExtension

    setup(
        name="vllm-afd",
        version=pin.afd_version(FLAVOR),
        description="vLLM with Attention-FFN Disaggregation (AFD) for MoE serving",
        long_description=(ROOT / "README.md").read_text(),
        long_description_content_type="text/markdown",
        license="Apache-2.0",
        python_requires=python_requires,
        install_requires=install,
        extras_require=with_bench_pins(extras),
        packages=packages,
        package_data=package_data,
        include_package_data=False,
        entry_points=base_entry_points(),
        ext_modules=extensions(),
        cmdclass={"build_ext": BuildExtension},
        options={"bdist_wheel": {"py_limited_api": "cp38"},
                 "build": {"build_base": str(build_base)}},
        zip_safe=False,
    )


main()
