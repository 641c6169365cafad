# SPDX-License-Identifier: Apache-2.0
# SPDX-FileCopyrightText: Copyright contributors to the vllm-afd project
"""Two real `vllm serve` processes (FFN role, attention role) and the openai client.

The attention server must answer exactly what plain vLLM answers (the oracle's
in-process plain run of the same prompts), and the FFN server must serve only
its own small surface.
"""

import json
import sys
from pathlib import Path

import openai
import pytest

from servers import Server, cpu, free_port, http_get

REPO = Path(__file__).resolve().parents[2]
sys.path.insert(0, str(REPO / "tools"))
from oracle import PROMPTS, engine_cli_args  # noqa: E402
from test_oracle import plain_result  # noqa: E402

pytestmark = pytest.mark.slow
COMMON = ["--max-model-len", "512", "--dtype", "float32", "--enforce-eager",
          "--max-num-batched-tokens", "64", "--max-num-seqs", "16",
          "--no-enable-prefix-caching"]
MAX_TOKENS = 16


# DeepSeek-V3 is DeepSeek-V2 with other routing: the oracle's deepseek-v3 case.
# Qwen3-MoE served by two `vllm serve` processes is test_launch.py's 1A:1F case
# (the same checks, the servers started by `vllm-afd launch`).
@pytest.mark.parametrize("model_name", ["tiny-deepseek-v2"])
def test_two_role_serve_matches_plain(models_dir, tmp_path, model_name):
    model = models_dir / model_name
    # MLA attention is not batch-invariant, and a served engine may start its
    # first step before all 10 prompts arrived: DeepSeek is compared on one
    # prompt here (its 10-prompt comparison is the oracle's, in one process).
    prompts = PROMPTS if "qwen" in model_name else PROMPTS[:1]
    # The oracle's in-process plain run, shared with test_oracle.py's cases.
    plain = plain_result(model, tmp_path, num_prompts=len(prompts))
    afd = json.dumps({"connector": "shm", "port": free_port(), "timeout_s": 60})
    common = [*COMMON, *engine_cli_args(model)]  # DeepSeek: the MLA kernels every CPU runs
    ffn = Server(str(model), [*common, "--afd-role", "ffn", "--afd-config", afd],
                 log_path=tmp_path / "ffn.log", env={"VLLM_CPU_OMP_THREADS_BIND": cpu(1)},
                 name="FFN server")
    attn = Server(str(model), [*common, "--afd-role", "attention", "--afd-config", afd],
                  log_path=tmp_path / "attn.log", env={"VLLM_CPU_OMP_THREADS_BIND": cpu(0)},
                  name="attention server")
    # The attention server starts first: it waits for the FFN server to appear.
    with attn, ffn:
        ffn.wait_ready()
        attn.wait_ready()

        # The FFN server: health, version, metrics, and a clear refusal of API calls.
        assert http_get(ffn.url + "/health")[0] == 200
        status, body = http_get(ffn.url + "/version")
        assert status == 200 and json.loads(body)["role"] == "ffn"
        assert http_get(ffn.url + "/metrics")[0] == 200
        with pytest.raises(openai.NotFoundError, match="This is a vllm-afd FFN server"):
            openai.OpenAI(base_url=ffn.url + "/v1", api_key="x").completions.create(
                model=str(model), prompt="hi", max_tokens=4)

        client = openai.OpenAI(base_url=attn.url + "/v1", api_key="x")
        comp = client.completions.create(
            model=str(model), prompt=prompts, max_tokens=MAX_TOKENS, temperature=0,
            logprobs=1, extra_body={"ignore_eos": True, "return_token_ids": True})
        choices = sorted(comp.choices, key=lambda c: c.index)
        assert len(choices) == len(prompts)
        for ref, got in zip(plain["results"], choices):
            assert got.token_ids == ref["token_ids"], ref["prompt"]
            diff = max(abs(a - b) for a, b in zip(got.logprobs.token_logprobs,
                                                   ref["logprobs"]))
            assert diff <= 1e-5, (ref["prompt"], diff)

        chat = client.chat.completions.create(
            model=str(model), messages=[{"role": "user", "content": "Hello!"}],
            max_tokens=8, temperature=0)
        assert chat.choices[0].finish_reason in ("length", "stop")
    assert attn.proc.returncode == 0, attn.log_tail()
    assert ffn.proc.returncode == 0, ffn.log_tail()
