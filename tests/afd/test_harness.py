# SPDX-License-Identifier: Apache-2.0
# SPDX-FileCopyrightText: Copyright contributors to the vllm-afd project
"""The data plane on its own: tools/testing/gpu_check, run here with --device cpu.

The GPU check runs on a machine with torch and no vLLM. Here it runs the same
way: the installed wheel's vllm/afd is copied into a tree whose `vllm` package
is empty, so any import of vLLM proper would fail, and the script runs there
in a fresh interpreter. Its reference MoE decoder, split the AFD way, drives
both roles through the real data plane (loopback in one process; shm and tcp
as two processes), m = 1..4 micro-batches and routing from the attention side,
and must give the bits the model gives run whole. The CUDA-only checks report
themselves skipped with the reason.
"""

import json
import re
import shutil
import subprocess
import sys
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parents[2]
GPU_CHECK = REPO / "tools" / "testing" / "gpu_check"


@pytest.fixture(scope="module")
def data_plane_tree(tmp_path_factory) -> Path:
    """vllm/afd of the installed wheel under an empty `vllm` package."""
    import vllm.afd

    root = tmp_path_factory.mktemp("no-vllm")
    shutil.copytree(Path(vllm.afd.__file__).parent, root / "vllm" / "afd",
                    ignore=shutil.ignore_patterns("__pycache__"))
    (root / "vllm" / "__init__.py").write_text("")
    return root


def run_in(tree: Path, *args: str, timeout: float = 300) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, *args], cwd=tree, capture_output=True, text=True,
                          timeout=timeout, env={"PATH": "/usr/bin:/bin", "PYTHONPATH": str(tree),
                                                "HOME": str(tree)})


def test_data_plane_imports_nothing_from_vllm(data_plane_tree):
    """A fresh interpreter imports every data-plane module: the only vllm.*
    modules loaded are vllm.afd's (and the empty `vllm` package)."""
    code = ("import importlib, json, sys\n"
            "mods = json.loads(sys.argv[1])\n"
            "for m in mods: importlib.import_module(m)\n"
            "print(json.dumps(sorted(k for k in sys.modules if k.split('.')[0] == 'vllm')))\n")
    modules = [
        "vllm.afd.transport.connectors.shm", "vllm.afd.transport.connectors.tcp",
        "vllm.afd.transport.connectors.loopback", "vllm.afd.transport.connectors.nccl",
        "vllm.afd.transport.handshake", "vllm.afd.transport.buffers",
        "vllm.afd.attention.link", "vllm.afd.attention.pingpong", "vllm.afd.ffn.loop",
        "vllm.afd.ffn.batcher", "vllm.afd.kernels.ops"]
    proc = run_in(data_plane_tree, "-c", code, json.dumps(modules))
    assert proc.returncode == 0, proc.stderr[-3000:]
    loaded = json.loads(proc.stdout.splitlines()[-1])
    assert set(modules) <= set(loaded)
    outside = [m for m in loaded if m != "vllm" and not m.startswith("vllm.afd")]
    assert outside == [], outside
    # And the tree really has no vLLM: the adapter cannot be imported there.
    proc = run_in(data_plane_tree, "-c", "import vllm.afd.seams, vllm.afd.adapter.attention.runner")
    assert proc.returncode != 0 and "vllm.forward_context" in proc.stderr, proc.stderr[-500:]


def test_gpu_check_passes_on_cpu(data_plane_tree, kernel_paths):
    report_path = data_plane_tree / "gpu-check.json"
    proc = run_in(data_plane_tree, str(GPU_CHECK), "--device", "cpu", "--out",
                  str(report_path))
    assert proc.returncode == 0, proc.stdout[-4000:] + proc.stderr[-4000:]
    report = json.loads(report_path.read_text())["checks"]
    passed = {name for name, c in report.items() if c["status"] == "pass"}
    assert passed == {"imports", "kernels", "harness-loopback", "harness-shm", "harness-tcp",
                      "harness-shm-routed", "harness-shm-fp8", "harness-tcp-routed-fp8",
                      "harness-tcp-routed",
                      "dummy-runs", "threads",
                      "ffn-errors", "ipc"}, report
    for name in ("kernels-pack", "stream-order", "graphs"):
        assert report[name]["status"] == "skip" and "CUDA" in report[name]["detail"]
    for name in ("harness-loopback", "harness-shm", "harness-tcp"):
        assert "m=4" in report[name]["detail"]
    kernel_paths.add("tools/testing/gpu_check --device cpu: " + ", ".join(
        f"{n} {c['status']}" for n, c in report.items()))


def test_the_device_script_runs_without_vllm(data_plane_tree, tmp_path):
    """tools/testing/gpu_check/device_run.sh, what a lent GPU machine runs (no vLLM
    there, and no time to debug): its shell parses, and its CUDA benchmark
    call, pointed at the CPU and shortened, runs in the tree without vLLM."""
    script = GPU_CHECK / "device_run.sh"
    assert subprocess.run(["bash", "-n", str(script)]).returncode == 0
    text = script.read_text().replace("\\\n", " ")
    calls = re.findall(r"benchmarks/layer_call\.py (.*?) --out", text)
    assert len(calls) == 4 and all("--device cuda" in c for c in calls[:3]), calls
    # The staged path's variants (an A/B on the GPU): both at once, shortened.
    variants = [flag for c in calls[1:3] for flag in re.findall(r"--staged-\S+ \S+", c)]
    assert variants == ["--staged-write events", "--staged-read blocking"], calls
    out = tmp_path / "variants.json"
    proc = run_in(data_plane_tree, str(REPO / "benchmarks" / "layer_call.py"),
                  *" ".join(variants).split(), "--through", "exchange", "--ubatches", "",
                  "--steps", "20", "--tokens", "2", "--out", str(out))
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    settings = json.loads(out.read_text())["settings"]
    assert (settings["staged_write"], settings["staged_read"]) == ("events", "blocking")
    out = tmp_path / "layer_call.json"
    proc = run_in(data_plane_tree, str(REPO / "benchmarks" / "layer_call.py"), *calls[0].split(),
                  "--device", "cpu", "--steps", "20", "--tokens", "2", "--out", str(out))
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    result = json.loads(out.read_text())
    assert [(c["through"], c["regime"]) for c in result["cases"]] == [
        ("exchange", "warm"), ("exchange", "cold")]
    for case in result["cases"]:  # 20 steps of 8 calls: 2 of warm-up, firsts apart
        assert case["layer_calls"] == 18 * 7 and case["tokens"] == 2, case
        assert 0 < case["beyond_compute"]["median_us"] <= case["beyond_compute"]["p90_us"]
    assert [(c["tokens"], c["ubatches"]) for c in result["ubatched"]] == [(2, [1, 1])]


def test_a_built_library_is_named_by_the_environment(data_plane_tree, tmp_path):
    """A machine without the wheel (the GPU check's) builds the op library and
    names it in VLLM_AFD_OP_LIBRARY: every process loads that file, the FFN
    processes the check spawns too, never another one it could find."""
    from vllm.afd.kernels import ops

    tree = tmp_path / "no-library"
    shutil.copytree(data_plane_tree / "vllm", tree / "vllm",
                    ignore=shutil.ignore_patterns("_C*.so", "gpu-check.json"))
    built = tmp_path / "build" / "afd_C.so"  # as gpu_check's build names it
    built.parent.mkdir()
    shutil.copy(ops.library_path(), built)
    code = ("from vllm.afd.kernels import ops\n"
            "ops.load()\n"
            "import torch; assert hasattr(torch.ops.afd, 'pack')\n"
            "print(ops.library_path())")
    proc = subprocess.run([sys.executable, "-c", code], cwd=tree, capture_output=True,
                          text=True, timeout=120,
                          env={"PATH": "/usr/bin:/bin", "PYTHONPATH": str(tree),
                               "HOME": str(tree), "VLLM_AFD_OP_LIBRARY": str(built)})
    assert proc.returncode == 0, proc.stderr[-2000:]
    assert proc.stdout.strip() == str(built), proc.stdout + proc.stderr[-2000:]
