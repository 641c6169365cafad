# SPDX-License-Identifier: Apache-2.0
# SPDX-FileCopyrightText: Copyright contributors to the vllm-afd project
"""Tests for tools/models/make_tiny_models.py: determinism, tokenizer, vLLM loading."""

import hashlib
import importlib.util
import json
import os
import sys
from pathlib import Path

import pytest

import preload

REPO = Path(__file__).resolve().parents[2]
TINY = ["tiny-qwen3-moe", "tiny-deepseek-v2", "tiny-deepseek-v3"]
N_TOKENS = 8


def _load_generator():
    # tools/models/ is not a package; load the script by path.
    spec = importlib.util.spec_from_file_location(
        "make_tiny_models", REPO / "tools" / "models" / "make_tiny_models.py")
    mod = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(mod)
    return mod


gen = _load_generator()


def _hashes(root: Path) -> dict[str, str]:
    return {
        str(p.relative_to(root)): hashlib.sha256(p.read_bytes()).hexdigest()
        for p in sorted(root.rglob("*")) if p.is_file()
    }


@pytest.fixture(scope="module")
def models(tmp_path_factory) -> dict[str, Path]:
    return gen.make_models(tmp_path_factory.mktemp("tiny"), TINY, seed=0)


def test_deterministic(models, tmp_path):
    base = next(iter(models.values())).parent
    again = gen.make_models(tmp_path / "a", TINY, seed=0)
    assert set(again) == set(TINY)
    assert _hashes(tmp_path / "a") == _hashes(base)

    # A matching stamp means the directory is reused, not rewritten.
    st = again["tiny-qwen3-moe"] / "model.safetensors"
    mtime = st.stat().st_mtime_ns
    gen.make_models(tmp_path / "a", ["tiny-qwen3-moe"], seed=0)
    assert st.stat().st_mtime_ns == mtime

    other = gen.make_models(tmp_path / "b", TINY, seed=1)
    for name in TINY:
        h0, h1 = _hashes(models[name]), _hashes(other[name])
        assert h0["model.safetensors"] != h1["model.safetensors"]
        assert h0["tokenizer.json"] == h1["tokenizer.json"]
        assert h0["config.json"] == h1["config.json"]


def test_tokenizer_and_chat_template(models):
    from transformers import AutoTokenizer

    path = models["tiny-qwen3-moe"]
    tok = AutoTokenizer.from_pretrained(path)
    assert len(tok) == 1024
    assert tok.eos_token_id == tok.bos_token_id == tok.pad_token_id == 0
    assert tok.convert_tokens_to_ids(["<|im_start|>", "<|im_end|>"]) == [1, 2]
    text = "Hello world, ünïcode 12345!"
    assert tok.decode(tok(text)["input_ids"]) == text

    rendered = tok.apply_chat_template(
        [{"role": "user", "content": "hi"}], tokenize=False,
        add_generation_prompt=True)
    assert rendered == "<|im_start|>user\nhi<|im_end|>\n<|im_start|>assistant\n"
    for name in TINY:
        assert (models[name] / "chat_template.jinja").read_bytes() == (
            path / "chat_template.jinja").read_bytes()

    cfg = json.loads((models["tiny-deepseek-v3"] / "config.json").read_text())
    assert cfg["topk_method"] == "noaux_tc"
    assert cfg["scoring_func"] == "sigmoid"
    assert cfg["vocab_size"] == 1024


# Runs in a child process so vLLM's process-global state (distributed
# groups, torch thread settings, RNG seeding) cannot leak into other tests.
# Its cwd is a scratch dir so the repo root's vllm/ folder is not importable
# via sys.path[0]; an explicit PYTHONPATH (make dev-test) still applies.
_CHILD = r"""
import gc, json, sys, traceback
from vllm import LLM, SamplingParams
from vllm.distributed.parallel_state import cleanup_dist_env_and_memory

paths, n = json.loads(sys.argv[1]), int(sys.argv[2])
sp = SamplingParams(temperature=0.0, max_tokens=n, ignore_eos=True)
out = {}
for name, path in paths.items():
    try:
        llm = LLM(model=path, max_model_len=512, enforce_eager=True,
                  dtype="bfloat16", seed=0)
        res = llm.generate(["Hello world, the model", "def f(x):"], sp,
                           use_tqdm=False)
        out[name] = [list(r.outputs[0].token_ids) for r in res]
        del llm
    except Exception:
        out[name] = traceback.format_exc()
    gc.collect()
    cleanup_dist_env_and_memory()
print("RESULT " + json.dumps(out))
"""


@pytest.fixture(scope="module")
def vllm_outputs(models, tmp_path_factory) -> dict:
    pytest.importorskip("vllm")
    # A persistent cache root matters: on a cold one vLLM inspects each model
    # architecture in a fresh subprocess that re-imports vllm (~10 s apiece).
    cache = os.environ.get("VLLM_CACHE_ROOT", str(REPO / "build" / "vllm-cache"))
    env = dict(
        os.environ, HF_HUB_OFFLINE="1", VLLM_CPU_KVCACHE_SPACE="1",
        VLLM_ENABLE_V1_MULTIPROCESSING="0", VLLM_CACHE_ROOT=cache)
    paths = json.dumps({k: str(v) for k, v in models.items()})
    proc = preload.run(
        [sys.executable, "-c", _CHILD, paths, str(N_TOKENS)],
        cwd=tmp_path_factory.mktemp("cwd"), env=env, capture_output=True,
        text=True, timeout=300)
    lines = [x for x in proc.stdout.splitlines() if x.startswith("RESULT ")]
    assert proc.returncode == 0 and lines, proc.stderr[-4000:]
    return json.loads(lines[-1][len("RESULT "):])


@pytest.mark.parametrize("name", TINY)
def test_vllm_generates(vllm_outputs, name):
    toks = vllm_outputs[name]
    assert isinstance(toks, list), toks  # else: the child's traceback
    assert len(toks) == 2
    for seq in toks:
        assert len(seq) == N_TOKENS
        assert all(0 <= t < 1024 for t in seq)
