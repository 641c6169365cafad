# SPDX-License-Identifier: Apache-2.0
# SPDX-FileCopyrightText: Copyright contributors to the vllm-afd project
"""The CUDA toolchain's pins (tools/build/cuda_toolchain.toml): a CUDA torch for each
vLLM we build on, built for the toolchain's CUDA release, and a build that names
what is missing instead of compiling against the wrong torch."""

import pytest

import cuda_toolchain
from cuda_toolchain import ToolchainError, base_torch, load_pins, required_torch
from cuda_wheel import next_versions
from upstream import cache_dir, fetch_base_wheel, load_pin


def test_a_torch_nobody_pinned_is_named():
    with pytest.raises(ToolchainError) as e:
        load_pins().torch("9.9.9")
    assert "no CUDA build of torch 9.9.9 is pinned in cuda_toolchain.toml" in str(e.value)
    assert "pinned: 2.13.0, 2.14.0" in str(e.value)


def test_a_torch_for_another_cuda_release_is_refused(tmp_path, monkeypatch):
    text = cuda_toolchain.PINS.read_text()
    assert text.count('cuda = "13.0"') == 3  # the toolchain's and each torch's
    bad = tmp_path / "cuda_toolchain.toml"
    bad.write_text(text.replace('version = "2.14.0"\ncuda = "13.0"',
                                'version = "2.14.0"\ncuda = "12.9"'))
    with pytest.raises(ToolchainError, match="torch 2.14.0 is built for CUDA 12.9, the "
                                             "toolchain's nvcc and headers are CUDA 13.0"):
        load_pins(bad)


def test_required_torch_reads_the_exact_pin():
    assert required_torch("Name: vllm\nRequires-Dist: torch==2.14.0\n"
                          "Requires-Dist: torchvision==0.29.0\n") == "2.14.0"
    with pytest.raises(ToolchainError, match="pins no torch release"):
        required_torch("Name: vllm\nRequires-Dist: torch>=2.13\n")


@pytest.mark.parametrize("release", ["pinned", *next_versions()])
def test_every_base_wheel_has_its_torch_pinned(repo, release):
    """The pinned vLLM's and each waiting release's cuda base wheel require a torch
    the toolchain pins (a new release with a new torch fails here first)."""
    pin = load_pin(repo if release == "pinned" else repo / "patches" / "next" / release)
    base = cache_dir() / pin.flavor("cuda").wheel
    if release != "pinned" and not base.exists():
        pytest.skip(f"the vllm {pin.version} base wheel is not downloaded ({base})")
    torch = base_torch(fetch_base_wheel(pin, "cuda", quiet=True))
    assert load_pins().torch(torch).version == torch
