# SPDX-License-Identifier: Apache-2.0
# SPDX-FileCopyrightText: Copyright contributors to the vllm-afd project
"""tools/models/oracle.py's runs (plain vLLM, AFD over loopback, AFD against a real FFN
server) and the checks of their results."""

import json
import os
import sys
from pathlib import Path

from safetensors import safe_open

import preload
from oracle import engine_cli_args
from servers import Server, cpu, free_port


# Results shared between tests (one run per model and configuration).
_plain_cache: dict[tuple, dict] = {}
_loopback_cache: dict[str, dict] = {}


REPO = Path(__file__).resolve().parents[2]


ORACLE = REPO / "tools" / "models" / "oracle.py"


LOGPROB_TOL = 1e-5


def run_oracle(model: Path, out: Path, afd_config: dict | None = None,
               compile_model: bool = False, num_prompts: int = 10,
               extra: tuple[str, ...] = (), dtype: str = "float32",
               env: dict[str, str] | None = None) -> dict:
    cmd = [sys.executable, str(ORACLE), str(model), "--out", str(out), "--dtype", dtype,
           "--num-prompts", str(num_prompts), *engine_cli_args(model, dtype), *extra]
    if afd_config is not None:
        cmd += ["--afd-config", json.dumps(afd_config)]
    if compile_model:
        cmd.append("--compile")
    env = dict(os.environ, VLLM_CPU_OMP_THREADS_BIND=cpu(0), **(env or {}))
    proc = preload.run(cmd, capture_output=True, text=True, timeout=600, env=env,
                       cwd=out.parent)
    assert proc.returncode == 0, proc.stdout[-2000:] + proc.stderr[-4000:]
    return json.loads(out.read_text())


def plain_result(model: Path, tmp_path: Path, compile_model: bool = False,
                 num_prompts: int = 10) -> dict:
    key = (str(model), compile_model, num_prompts)
    if key not in _plain_cache:
        _plain_cache[key] = run_oracle(model, tmp_path / "plain.json",
                                       compile_model=compile_model, num_prompts=num_prompts)
    return _plain_cache[key]


def loopback_result(model: Path, tmp_path: Path) -> dict:
    """AFD with both roles in one process (loopback, m = 1, gate on the FFN),
    on the 10 prompts; shared by the tests of a session that need it."""
    key = str(model)
    if key not in _loopback_cache:
        _loopback_cache[key] = run_oracle(model, tmp_path / "afd-loopback.json", {
            "connector": "loopback", "port": free_port(), "timeout_s": 60,
            "role": "attention"})
    return _loopback_cache[key]


def ffn_server(model: Path, afd_config: dict, log: Path, *, extra: list[str] = (),
               cpus: str | None = None, env: dict[str, str] | None = None,
               dtype: str = "float32") -> Server:
    args = ["--max-model-len", "512", "--dtype", dtype, "--enforce-eager",
            "--max-num-batched-tokens", "64", "--max-num-seqs", "16",
            "--afd-role", "ffn", "--afd-config", json.dumps(afd_config),
            *engine_cli_args(model, dtype), *extra]
    return Server(str(model), args, log_path=log,
                  env={"VLLM_CPU_OMP_THREADS_BIND": cpus or cpu(1), **(env or {})},
                  name=f"FFN server {afd_config.get('ffn_rank', 0)}")


def assert_same(plain: dict, afd: dict, logprob_tol: float = LOGPROB_TOL) -> None:
    assert len(plain["results"]) == len(afd["results"])
    for p, a in zip(plain["results"], afd["results"]):
        assert a["token_ids"] == p["token_ids"], (p["prompt"], p["token_ids"], a["token_ids"])
        diff = max(abs(x - y) for x, y in zip(p["logprobs"], a["logprobs"]))
        assert diff <= logprob_tol, (p["prompt"], diff)


def assert_micro_batched(afd: dict, model: Path, num_ubatches: int) -> None:
    """The run really split its steps: more layer calls than one per layer and
    step (a test that passed without micro-batching would prove nothing)."""
    layers = json.loads((model / "config.json").read_text())["num_hidden_layers"]
    stats = afd["link_stats"]
    assert stats["steps"] > 0
    calls_per_step = stats["layer_calls"] / stats["steps"]
    if num_ubatches == 1:
        assert calls_per_step == layers, stats
    else:
        # Mostly m per layer; one-token steps (the warm-up) are not split.
        assert calls_per_step > layers * (num_ubatches - 0.5), stats


def moe_layers(model: Path) -> list[int]:
    """The decoder layers with a MoE router gate in the checkpoint."""
    with safe_open(str(model / "model.safetensors"), "pt") as f:
        return sorted({int(name.split(".layers.")[1].split(".")[0]) for name in f.keys()
                       if ".mlp.gate.weight" in name})


def assert_routing(model: Path, gate_on: str, stats: dict) -> None:
    """With gate_on "attention" exactly the MoE layers' calls carried routing
    (stats of either role); with "ffn" none did."""
    layers = json.loads((model / "config.json").read_text())["num_hidden_layers"]
    assert stats["layer_calls"] > 0, stats
    if gate_on == "ffn":
        assert stats["routed_calls"] == 0, stats
    else:
        assert stats["routed_calls"] == stats["layer_calls"] * len(moe_layers(model)) // layers
        assert stats["routed_calls"] > 0, stats


def ffn_stats(ffn: Server) -> dict:
    code, body = ffn.get("/afd/status")
    assert code == 200, body
    return json.loads(body)["workers"][0]["stats"]


# ------------------------------------------------------------ real servers
COMMON = ["--max-model-len", "512", "--dtype", "float32", "--enforce-eager",
          "--max-num-batched-tokens", "64", "--max-num-seqs", "16",
          "--no-enable-prefix-caching"]
