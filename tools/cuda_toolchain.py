# SPDX-License-Identifier: Apache-2.0
# SPDX-FileCopyrightText: Copyright contributors to the vllm-afd project
"""The pinned CUDA toolchain (tools/cuda_toolchain.toml) that compiles csrc/cuda
without a GPU, a system CUDA or a CUDA build of torch in the venv.

    python tools/cuda_toolchain.py          fetch (once), check, extract; print its directory

The wheels are downloaded with pip into ~/.cache/vllm-afd/cuda (VLLM_AFD_CUDA_CACHE
overrides), each checked against its sha256, and extracted under
build/cuda-toolchain/:

    cuda/    CUDA_HOME: bin/nvcc, nvvm/, include/, lib/ (merged NVIDIA wheels)
    torch/   include/ and lib/ of the CUDA build of torch (headers and link targets only)

setup.py compiles the CUDA kernels into the cuda flavor's _C when
VLLM_AFD_CUDA_TOOLCHAIN names such a directory. The CUDA torch is never
imported: it needs the NVIDIA runtime libraries, and the venv keeps its CPU
torch for everything else.
"""

from __future__ import annotations

import hashlib
import os
import shutil
import subprocess
import sys
import tempfile
import tomllib
import zipfile
from dataclasses import dataclass
from pathlib import Path

REPO_ROOT = Path(__file__).resolve().parent.parent
PINS = Path(__file__).with_suffix(".toml")
STAMP = ".extracted"  # inside the toolchain directory: the sha256 of the pins it holds


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
    """An extracted toolchain directory and the paths a build needs from it."""

    root: Path
    cuda_version: str
    archs: tuple[str, ...]

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
    def torch_include(self) -> list[Path]:
        inc = self.root / "torch" / "include"
        return [inc, inc / "torch" / "csrc" / "api" / "include"]

    @property
    def torch_lib(self) -> Path:
        return self.root / "torch" / "lib"

    def gencode_flags(self) -> list[str]:
        """nvcc -gencode flags for `archs` ("9.0+PTX": SASS and PTX for 9.0)."""
        flags = []
        for arch in self.archs:
            num = arch.split("+")[0].replace(".", "")
            codes = [f"sm_{num}"] + ([f"compute_{num}"] if arch.endswith("+PTX") else [])
            flags.append(f"-gencode=arch=compute_{num},code=[{','.join(codes)}]")
        return flags


def load_pins(path: Path = PINS) -> tuple[dict, list[Wheel]]:
    data = tomllib.loads(path.read_text())
    wheels = [Wheel(name=w["name"], version=w["version"], file=w["file"],
                    sha256=w["sha256"].lower(), strip=w["strip"], into=w["into"],
                    keep=tuple(w.get("keep", ())))
              for w in data["wheel"]]
    return data["toolchain"], wheels


def pins_digest(path: Path = PINS) -> str:
    return hashlib.sha256(path.read_bytes()).hexdigest()


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
                             f"(tools/cuda_toolchain.toml)\n  got      {digest}\n"
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


def ensure(dest: Path | None = None, quiet: bool = False) -> Toolchain:
    """The extracted toolchain, fetched and extracted when missing or stale."""
    dest = dest or default_dir()
    meta, wheels = load_pins()
    tc = Toolchain(root=dest, cuda_version=meta["cuda"], archs=tuple(meta["archs"]))
    digest = pins_digest()
    stamp = dest / STAMP
    if stamp.exists() and stamp.read_text().strip() == digest:
        return tc
    paths = [fetch(w, quiet=quiet) for w in wheels]  # every download before any change
    shutil.rmtree(dest, ignore_errors=True)
    for path, wheel in zip(paths, wheels):
        _extract(path, wheel, dest)
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
    stamp.write_text(digest + "\n")
    return tc


def load(root: Path) -> Toolchain:
    """An already extracted toolchain (setup.py's view); raises if it is not there."""
    meta, _ = load_pins()
    tc = Toolchain(root=Path(root).resolve(), cuda_version=meta["cuda"],
                   archs=tuple(meta["archs"]))
    missing = [p for p in (tc.nvcc, *tc.torch_include, tc.torch_lib / "libc10_cuda.so")
               if not p.exists()]
    if missing:
        raise ToolchainError(f"{root} is not an extracted CUDA toolchain (missing "
                             f"{', '.join(map(str, missing))}); run tools/cuda_toolchain.py")
    return tc


def main() -> int:
    try:
        tc = ensure()
    except (ToolchainError, OSError) as e:
        print(f"[vllm-afd] CUDA toolchain unavailable: {e}", file=sys.stderr)
        return 1
    print(tc.root)
    return 0


if __name__ == "__main__":
    sys.exit(main())
