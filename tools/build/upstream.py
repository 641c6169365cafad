# SPDX-License-Identifier: Apache-2.0
# SPDX-FileCopyrightText: Copyright contributors to the vllm-afd project
"""The upstream pin (upstream.toml) and the verified, cached base wheels."""

from __future__ import annotations

import hashlib
import os
import shutil
import subprocess
import sys
import tempfile
import tomllib
from dataclasses import dataclass
from pathlib import Path

REPO_ROOT = Path(__file__).resolve().parents[2]
FLAVORS = ("cpu", "cuda")
# The only upstream files whose contents differ between the two base wheels;
# only the flavor series (patches/series.<flavor>) may touch them.
FLAVOR_FILES = (
    "vllm/_version.py",
    "vllm/platforms/__init__.py",
    "vllm/utils/cpu_triton_utils.py",
)


class PinError(RuntimeError):
    pass


@dataclass(frozen=True)
class Flavor:
    name: str
    distribution: str
    wheel: str
    sha256: str
    drop_requirements: tuple[str, ...]


@dataclass(frozen=True)
class Pin:
    version: str
    afd_release: int
    flavors: dict[str, Flavor]
    sdist: str = ""
    sdist_sha256: str = ""

    def flavor(self, name: str) -> Flavor:
        if name not in self.flavors:
            raise PinError(
                f"unknown flavor {name!r}; valid flavors: {', '.join(self.flavors)}"
            )
        return self.flavors[name]

    def afd_version(self, flavor: str) -> str:
        """The version of the vllm-afd wheel of this flavor, e.g. 0.32.0+afd1.cpu."""
        self.flavor(flavor)
        return f"{self.version}+afd{self.afd_release}.{flavor}"


def load_pin(root: Path = REPO_ROOT) -> Pin:
    path = root / "upstream.toml"
    data = tomllib.loads(path.read_text())
    up = data["upstream"]
    flavors = {}
    for name, f in data.get("flavor", {}).items():
        if name not in FLAVORS:
            raise PinError(f"{path}: unknown flavor {name!r}; valid: {FLAVORS}")
        flavors[name] = Flavor(
            name=name,
            distribution=f["distribution"],
            wheel=f["wheel"],
            sha256=f["sha256"].lower(),
            drop_requirements=tuple(f.get("drop_requirements", ())),
        )
    return Pin(version=up["version"], afd_release=int(up["afd_release"]), flavors=flavors,
               sdist=up.get("sdist", ""), sdist_sha256=up.get("sdist_sha256", "").lower())


def sha256_file(path: Path) -> str:
    h = hashlib.sha256()
    with open(path, "rb") as f:
        for chunk in iter(lambda: f.read(1 << 20), b""):
            h.update(chunk)
    return h.hexdigest()


def cache_dir() -> Path:
    d = os.environ.get("VLLM_AFD_CACHE")
    return Path(d) if d else Path.home() / ".cache" / "vllm-afd" / "wheels"


def verify(path: Path, flavor: Flavor) -> Path:
    got = sha256_file(path)
    if got != flavor.sha256:
        raise PinError(
            f"sha256 mismatch for {path}:\n  expected {flavor.sha256} (upstream.toml, "
            f"flavor {flavor.name})\n  got      {got}\nRefusing to use this file."
        )
    return path


def _wheel_tags(wheel: str) -> tuple[str, str, str]:
    # name-version-python-abi-platform.whl
    python, abi, platform = wheel[: -len(".whl")].split("-")[-3:]
    return python, abi, platform


def fetch_base_wheel(pin: Pin, flavor_name: str, quiet: bool = False) -> Path:
    """Return the verified base wheel of a flavor, downloading it once.

    VLLM_AFD_BASE_WHEEL_<FLAVOR> (or VLLM_AFD_BASE_WHEEL for the cpu flavor) names a
    local file to use instead, for offline builds; its hash is checked all the same.
    """
    flavor = pin.flavor(flavor_name)
    override = os.environ.get(f"VLLM_AFD_BASE_WHEEL_{flavor_name.upper()}")
    if override is None and flavor_name == "cpu":
        override = os.environ.get("VLLM_AFD_BASE_WHEEL")
    if override:
        return verify(Path(override), flavor)

    cached = cache_dir() / flavor.wheel
    if cached.exists():
        return verify(cached, flavor)

    cache_dir().mkdir(parents=True, exist_ok=True)
    platform = _wheel_tags(flavor.wheel)[2]
    with tempfile.TemporaryDirectory(dir=cache_dir()) as tmp:
        # pip uses the machine's configured index and draws its own progress bar.
        cmd = [
            sys.executable, "-m", "pip", "download", "--no-deps",
            "--only-binary", ":all:", "--dest", tmp,
            "--platform", platform,
            f"{flavor.distribution}=={pin.version}",
        ]
        if quiet:
            cmd.insert(4, "--quiet")
        print(f"[vllm-afd] downloading {flavor.wheel}", file=sys.stderr)
        proc = subprocess.run(cmd)
        if proc.returncode != 0:
            raise PinError(f"download of {flavor.distribution}=={pin.version} failed")
        got = Path(tmp) / flavor.wheel
        if not got.exists():
            raise PinError(
                f"pip did not produce {flavor.wheel} (got: "
                f"{sorted(p.name for p in Path(tmp).iterdir())})"
            )
        verify(got, flavor)
        shutil.move(str(got), cached)
    return cached


def fetch_sdist(pin: Pin) -> Path:
    """The verified upstream source distribution (for upstream's own tests).

    `pip download` of an sdist builds its metadata, which for vLLM needs its whole
    build toolchain; pip's own index lookup and session fetch the file instead.
    """
    if not pin.sdist:
        raise PinError("upstream.toml has no [upstream] sdist entry")
    cached = cache_dir() / pin.sdist
    if not cached.exists():
        from pip._internal.commands.download import DownloadCommand

        cmd = DownloadCommand("download", "fetch the vLLM sdist")
        options, _ = cmd.parse_args(["--no-deps", "--no-binary", ":all:", "vllm"])
        with cmd.main_context():
            session = cmd.get_default_session(options)
            finder = cmd._build_package_finder(options=options, session=session)
            links = [c.link for c in finder.find_all_candidates("vllm")
                     if c.link.filename == pin.sdist]
            if not links:
                raise PinError(f"{pin.sdist} not found on the package index")
            print(f"[vllm-afd] downloading {pin.sdist}", file=sys.stderr)
            resp = session.get(links[0].url_without_fragment, stream=True)
            resp.raise_for_status()
            cache_dir().mkdir(parents=True, exist_ok=True)
            tmp = cached.with_suffix(".part")
            with open(tmp, "wb") as f:
                for chunk in resp.iter_content(1 << 20):
                    f.write(chunk)
            tmp.replace(cached)
    got = sha256_file(cached)
    if got != pin.sdist_sha256:
        raise PinError(f"sha256 mismatch for {cached}: expected {pin.sdist_sha256}, got {got}")
    return cached
