# SPDX-License-Identifier: Apache-2.0
# SPDX-FileCopyrightText: Copyright contributors to the vllm-afd project
"""The pinned CUDA toolchain (tools/build/cuda_toolchain.toml) that compiles csrc/cuda
without a GPU, a system CUDA or a CUDA build of torch in the venv.

    python tools/build/cuda_toolchain.py [--torch X]
        fetch (once), check, extract; print its directory

The wheels are downloaded with pip into ~/.cache/vllm-afd/cuda (VLLM_AFD_CUDA_CACHE
overrides), each checked against its sha256, and extracted under
build/cuda-toolchain/:

    cuda/         CUDA_HOME: bin/nvcc, nvvm/, include/, lib/ (merged NVIDIA wheels)
    torch-<X>/    include/ and lib/ of the CUDA build of torch X (headers and link
                  targets only), one per pinned torch release

setup.py compiles the CUDA kernels into the cuda flavor's _C when
VLLM_AFD_CUDA_TOOLCHAIN names such a directory, against the torch its base wheel
requires. The CUDA torch is never imported: it needs the NVIDIA runtime
libraries, and the venv keeps its CPU torch for everything else.
"""

from __future__ import annotations

import hashlib
import os
import re
import shutil
import subprocess
import sys
import tempfile
import tomllib
import zipfile
from dataclasses import dataclass
from pathlib import Path

REPO_ROOT = Path(__file__).resolve().parents[2]
PINS = Path(__file__).with_suffix(".toml")
STAMP = ".extracted"  # inside each extracted part: the sha256 of what it holds
# What a build needs from a CUDA torch wheel (under its torch/ folder).
TORCH_KEEP = ("include/", "lib/libc10.so", "lib/libc10_cuda.so", "lib/libtorch.so",
              "lib/libtorch_cpu.so", "lib/libtorch_cuda.so")


class ToolchainError(RuntimeError):
    pass


@dataclass(frozen=True)
class Wheel:
    name: str
    version: str
    file: str
    sha256: str
    strip: str
    into: str
    keep: tuple[str, ...]


@dataclass(frozen=True)
class Toolchain:
    """An extracted toolchain directory and the paths a build against one torch
    release needs from it."""

    root: Path
    cuda_version: str
    archs: tuple[str, ...]
    torch_version: str

    @property
    def cuda_home(self) -> Path:
        return self.root / "cuda"

    @property
    def nvcc(self) -> Path:
        return self.cuda_home / "bin" / "nvcc"

    @property
    def cuobjdump(self) -> Path:
        return self.cuda_home / "bin" / "cuobjdump"

    @property
    def torch_dir(self) -> Path:
        return self.root / f"torch-{self.torch_version}"

    @property
    def torch_include(self) -> list[Path]:
        inc = self.torch_dir / "include"
        return [inc, inc / "torch" / "csrc" / "api" / "include"]

    @property
    def torch_lib(self) -> Path:
        return self.torch_dir / "lib"

    def gencode_flags(self) -> list[str]:
        """nvcc -gencode flags for `archs` ("9.0+PTX": SASS and PTX for 9.0)."""
        flags = []
        for arch in self.archs:
            num = arch.split("+")[0].replace(".", "")
            codes = [f"sm_{num}"] + ([f"compute_{num}"] if arch.endswith("+PTX") else [])
            flags.append(f"-gencode=arch=compute_{num},code=[{','.join(codes)}]")
        return flags


@dataclass(frozen=True)
class Pins:
    cuda: str
    archs: tuple[str, ...]
    torches: dict[str, Wheel]  # by torch version
    nvidia: list[Wheel]

    def torch(self, version: str) -> Wheel:
        if version not in self.torches:
            raise ToolchainError(
                f"no CUDA build of torch {version} is pinned in {PINS.name} (pinned: "
                f"{', '.join(self.torches) or 'none'}): add a [[torch]] entry for it "
                "(its default Linux x86_64 wheel, its CUDA release and sha256)")
        return self.torches[version]


def load_pins(path: Path = PINS) -> Pins:
    data = tomllib.loads(path.read_text())
    meta = data["toolchain"]
    torches = {}
    for t in data.get("torch", []):
        if t["cuda"] != meta["cuda"]:
            raise ToolchainError(
                f"{path.name}: torch {t['version']} is built for CUDA {t['cuda']}, the "
                f"toolchain's nvcc and headers are CUDA {meta['cuda']}")
        torches[t["version"]] = Wheel(name="torch", version=t["version"], file=t["file"],
                                      sha256=t["sha256"].lower(), strip="torch/",
                                      into=f"torch-{t['version']}", keep=TORCH_KEEP)
    nvidia = [Wheel(name=w["name"], version=w["version"], file=w["file"],
                    sha256=w["sha256"].lower(), strip=w["strip"], into=w["into"],
                    keep=tuple(w.get("keep", ())))
              for w in data["wheel"]]
    return Pins(cuda=meta["cuda"], archs=tuple(meta["archs"]), torches=torches,
                nvidia=nvidia)


def _digest(*wheels: Wheel, extra: str = "") -> str:
    """What an extracted part holds: its wheels' hashes (and what else decides it)."""
    return hashlib.sha256(" ".join([extra, *(w.sha256 for w in wheels)]).encode()).hexdigest()


def cache_dir() -> Path:
    d = os.environ.get("VLLM_AFD_CUDA_CACHE")
    return Path(d) if d else Path.home() / ".cache" / "vllm-afd" / "cuda"


def default_dir(root: Path = REPO_ROOT) -> Path:
    return root / "build" / "cuda-toolchain"


def _sha256(path: Path) -> str:
    h = hashlib.sha256()
    with open(path, "rb") as f:
        for chunk in iter(lambda: f.read(1 << 20), b""):
            h.update(chunk)
    return h.hexdigest()


def _pip_target(file: str) -> list[str]:
    """pip download options that select exactly this wheel file on any host.

    pip does not widen an explicit --platform to older manylinux tags, so every
    platform tag of the file name is passed; a cpXY tag fixes the Python version.
    """
    python, abi, platforms = file[: -len(".whl")].split("-")[-3:]
    opts = ["--only-binary", ":all:"]
    for p in platforms.split("."):
        opts += ["--platform", p]
    if python.startswith("cp"):
        opts += ["--python-version", python[2:], "--implementation", "cp", "--abi", abi]
    return opts


def fetch(wheel: Wheel, quiet: bool = False) -> Path:
    """The verified wheel in the cache, downloaded once."""
    cached = cache_dir() / wheel.file
    if not cached.exists():
        cache_dir().mkdir(parents=True, exist_ok=True)
        with tempfile.TemporaryDirectory(dir=cache_dir()) as tmp:
            cmd = [sys.executable, "-m", "pip", "download", "--no-deps", "--dest", tmp,
                   *_pip_target(wheel.file), f"{wheel.name}=={wheel.version}"]
            if quiet:
                cmd.insert(4, "--quiet")
            print(f"[vllm-afd] downloading {wheel.file}", file=sys.stderr)
            proc = subprocess.run(cmd, stdout=sys.stderr)
            got = Path(tmp) / wheel.file
            if proc.returncode != 0 or not got.exists():
                raise ToolchainError(f"download of {wheel.name}=={wheel.version} "
                                     f"({wheel.file}) failed")
            shutil.move(str(got), cached)
    digest = _sha256(cached)
    if digest != wheel.sha256:
        raise ToolchainError(f"sha256 mismatch for {cached}:\n  expected {wheel.sha256} "
                             f"(tools/build/cuda_toolchain.toml)\n  got      {digest}\n"
                             "Refusing to use this file.")
    return cached


def _extract(path: Path, wheel: Wheel, dest: Path) -> None:
    with zipfile.ZipFile(path) as zf:
        for info in zf.infolist():
            if info.is_dir() or not info.filename.startswith(wheel.strip):
                continue
            rel = info.filename[len(wheel.strip):]
            if wheel.keep and not any(rel == k or (k.endswith("/") and rel.startswith(k))
                                      for k in wheel.keep):
                continue
            out = dest / wheel.into / rel
            out.parent.mkdir(parents=True, exist_ok=True)
            with zf.open(info) as src, open(out, "wb") as dst:
                shutil.copyfileobj(src, dst, 1 << 20)
            # zipfile drops the mode bits; nvcc, cicc, ptxas, ... must stay executable.
            mode = (info.external_attr >> 16) & 0o777
            if mode:
                out.chmod(mode)


def not_downloaded(wheels: list[Wheel]) -> list[str]:
    """The files of `wheels` not yet in the download cache."""
    return [w.file for w in wheels if not (cache_dir() / w.file).exists()]


def needed(torch_version: str) -> list[Wheel]:
    """Every wheel a build against torch `torch_version` needs (raises if unpinned)."""
    pins = load_pins()
    return [pins.torch(torch_version), *pins.nvidia]


def _extract_part(dest: Path, wheels: list[Wheel], digest: str, into: str,
                  quiet: bool) -> None:
    """dest/into from `wheels`, unless its stamp says it already holds them."""
    stamp = dest / into / STAMP
    if stamp.exists() and stamp.read_text().strip() == digest:
        return
    paths = [fetch(w, quiet=quiet) for w in wheels]  # every download before any change
    shutil.rmtree(dest / into, ignore_errors=True)
    for path, wheel in zip(paths, wheels):
        _extract(path, wheel, dest)
    stamp.write_text(digest + "\n")


def ensure(torch_version: str, dest: Path | None = None, quiet: bool = False) -> Toolchain:
    """The extracted toolchain for a build against torch `torch_version`; each part
    (cuda/, torch-<X>/) is fetched and extracted when missing or stale."""
    dest = dest or default_dir()
    pins = load_pins()
    torch = pins.torch(torch_version)
    tc = Toolchain(root=dest, cuda_version=pins.cuda, archs=pins.archs,
                   torch_version=torch_version)
    _extract_part(dest, pins.nvidia, _digest(*pins.nvidia, extra=pins.cuda), "cuda", quiet)
    # The runtime wheel ships only the versioned libcudart.so.13; the linker's
    # -lcudart looks for the unversioned name.
    lib = tc.cuda_home / "lib"
    for so in lib.glob("libcudart.so.*"):
        link = lib / "libcudart.so"
        if not link.exists():
            link.symlink_to(so.name)
    for tool in (tc.nvcc, tc.cuobjdump):
        if not os.access(tool, os.X_OK):
            raise ToolchainError(f"{tool} missing or not executable after extraction")
    _extract_part(dest, [torch], _digest(torch), torch.into, quiet)
    return tc


def load(root: Path, torch_version: str) -> Toolchain:
    """An already extracted toolchain (setup.py's view) for a build against torch
    `torch_version`; raises if that is not there."""
    pins = load_pins()
    pins.torch(torch_version)
    tc = Toolchain(root=Path(root).resolve(), cuda_version=pins.cuda, archs=pins.archs,
                   torch_version=torch_version)
    missing = [p for p in (tc.nvcc, *tc.torch_include, tc.torch_lib / "libc10_cuda.so")
               if not p.exists()]
    if missing:
        raise ToolchainError(f"{root} is not an extracted CUDA toolchain for torch "
                             f"{torch_version} (missing {', '.join(map(str, missing))}); "
                             f"run tools/build/cuda_toolchain.py --torch {torch_version}")
    return tc


def main() -> int:
    import argparse

    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--torch", default=None,
                    help="the torch release to build against (default: the pinned vLLM's)")
    args = ap.parse_args()
    try:
        tc = ensure(args.torch or pinned_torch())
    except (ToolchainError, OSError) as e:
        print(f"[vllm-afd] CUDA toolchain unavailable: {e}", file=sys.stderr)
        return 1
    print(tc.root)
    return 0


def required_torch(metadata: str, what: str = "the base wheel") -> str:
    """The torch release a vLLM wheel's METADATA requires (Requires-Dist: torch==X)."""
    m = re.search(r"^Requires-Dist: torch==([\w.]+)\s*$", metadata, re.M)
    if m is None:
        raise ToolchainError(f"{what} pins no torch release (Requires-Dist: torch==X)")
    return m.group(1)


def base_torch(base_wheel: Path) -> str:
    """The torch release a vLLM base wheel requires."""
    with zipfile.ZipFile(base_wheel) as zf:
        meta = next(n for n in zf.namelist() if n.endswith(".dist-info/METADATA"))
        return required_torch(zf.read(meta).decode(), base_wheel.name)


def pinned_torch() -> str:
    """The torch of the pinned vLLM's cuda wheel (downloaded once)."""
    from upstream import fetch_base_wheel, load_pin

    return base_torch(fetch_base_wheel(load_pin(REPO_ROOT), "cuda", quiet=True))


if __name__ == "__main__":
    sys.exit(main())
