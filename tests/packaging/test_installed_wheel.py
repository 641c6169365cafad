# SPDX-License-Identifier: Apache-2.0
# SPDX-FileCopyrightText: Copyright contributors to the vllm-afd project
"""The installed cpu wheel: CLI, version, platform, requirements, and `vllm serve`."""

import json
import subprocess
import sys
from importlib.metadata import distribution
from pathlib import Path

import pytest

from servers import Server, vllm_bin


def run_py(code: str) -> str:
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True,
                         cwd="/", timeout=120)
    assert out.returncode == 0, out.stderr[-3000:]
    return out.stdout.strip()


def test_vllm_version_cli():
    out = subprocess.run([vllm_bin(), "--version"], capture_output=True, text=True,
                         timeout=120, cwd="/")
    assert out.returncode == 0, out.stderr[-3000:]
    assert out.stdout.strip().splitlines()[-1] == "0.32.0+afd1.cpu"


def test_afd_version_and_platform():
    out = run_py("import vllm, vllm.afd as a; from vllm.platforms import current_platform as p;"
                 "print(a.__version__, a.UPSTREAM_VERSION, a.FLAVOR, vllm.__version__,"
                 " type(p).__name__, p.is_cpu())")
    assert out.splitlines()[-1] == "0.32.0+afd1.cpu 0.32.0 cpu 0.32.0 CpuPlatform True"


def test_distribution_metadata():
    dist = distribution("vllm-afd")
    assert dist.version == "0.32.0+afd1.cpu"
    reqs = dist.requires or []
    names = {r.split(";")[0].split("=")[0].split("<")[0].split(">")[0].strip().lower()
             for r in reqs}
    # CUDA builds of these break the cpu flavor (they pull libc10_cuda, libnvrtc).
    assert not names & {"torchvision", "torchaudio", "torchcodec"}
    assert any(r.startswith("torch==2.13.0+cpu") for r in reqs)
    files = {str(f) for f in dist.files}
    assert "vllm/afd/_C.abi3.so" in files
    assert "vllm/_C_AVX512.abi3.so" in files
    assert not any(f.startswith(".pc") or "/.pc/" in f for f in files)
    info = json.loads(Path(dist.locate_file("vllm/_afd_vendor.json")).read_text())
    assert info["flavor"] == "cpu" and len(info["series_digest"]) == 64
    eps = {ep.name for ep in dist.entry_points}
    assert "vllm" in eps and "vllm-afd" in eps
    assert any(r.startswith("ray==2.55.1") and 'extra == "ray"' in r for r in reqs)


def test_vllm_afd_command():
    """The wheel's `vllm-afd` script: its launch command answers --help."""
    import subprocess
    import sys

    script = Path(sys.executable).with_name("vllm-afd")
    out = subprocess.run([str(script), "launch", "--help"], capture_output=True, text=True,
                         timeout=60)
    assert out.returncode == 0, out.stderr
    assert "--dry-run" in out.stdout and "deployment spec" in out.stdout


def test_patched_sources_installed():
    main = Path(distribution("vllm-afd").locate_file("vllm/entrypoints/cli/main.py"))
    assert "version=distribution_version()," in main.read_text()


@pytest.mark.slow
def test_vllm_serve_answers_completions(models_dir, tmp_path):
    """`vllm serve` from the wheel answers /v1/completions with plain greedy tokens."""
    import openai

    model = str(models_dir / "tiny-qwen3-moe")
    prompts = ["Hello, my name is", "The capital of France is"]
    # Offline greedy reference, in a separate in-process engine.
    ref = run_py(
        "import json, os; os.environ['VLLM_ENABLE_V1_MULTIPROCESSING']='0'\n"
        "from vllm import LLM, SamplingParams\n"
        f"llm = LLM(model={model!r}, max_model_len=512, enforce_eager=True, dtype='float32')\n"
        f"outs = llm.generate({prompts!r}, SamplingParams(temperature=0, max_tokens=12,"
        " ignore_eos=True), use_tqdm=False)\n"
        "print(json.dumps([o.outputs[0].text for o in outs]))")
    expected = json.loads(ref.splitlines()[-1])

    # The installed `vllm` command as a user starts it: a fresh process that
    # spawns its engine core (tests/conftest.py: not forked from a preloader).
    server = Server(model, ["--max-model-len", "512", "--enforce-eager", "--dtype", "float32"],
                    log_path=tmp_path / "serve.log", env={"VLLM_AFD_TEST_PRELOAD": "0"})
    with server:
        server.wait_ready()
        client = openai.OpenAI(base_url=server.url + "/v1", api_key="test")
        comp = client.completions.create(model=model, prompt=prompts, max_tokens=12,
                                         temperature=0, extra_body={"ignore_eos": True})
        got = [c.text for c in sorted(comp.choices, key=lambda c: c.index)]
        assert comp.usage.completion_tokens == 24
        models = client.models.list()
        assert [m.id for m in models.data] == [model]
    assert got == expected
    assert server.proc.returncode == 0, server.log_tail()
