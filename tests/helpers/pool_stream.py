# SPDX-License-Identifier: Apache-2.0
# SPDX-FileCopyrightText: Copyright contributors to the vllm-afd project
"""A greedy stream through an attention server whose pool of two FFN servers
loses one mid-stream (frozen with SIGSTOP, then killed): what the pool tests
of each runner and connector compare with plain vLLM."""

import json
import os
import signal
import time
from pathlib import Path

from oracle import engine_cli_args
from servers import Server, cpu, free_port

from helpers.oracle import COMMON, run_oracle


def stream_losing_a_member(model: Path, tmp_path: Path, connector: str, tokens: int = 32,
                           env: dict[str, str] | None = None) -> dict:
    """plain vLLM's greedy token ids (env: its environment too, e.g. a runner),
    then the same prompt streamed through an AFD attention server with a pool
    of FFN servers A and B (connector, pool file); at the 5th chunk A is
    frozen, then killed a second later (a step is surely waiting on it).
    Returns plain, ids (what the stream gave), link (/afd/status's first link)
    and metrics (/metrics text)."""
    import openai

    env = dict(env or {})
    plain = run_oracle(model, tmp_path / "plain.json", num_prompts=1, env=env or None,
                       extra=("--max-tokens", str(tokens)))["results"][0]
    pool_file, base = tmp_path / "ffn-pool.txt", {"connector": connector, "timeout_s": 30}
    servers, ffns = [], []
    try:
        for name in ("ffn-a", "ffn-b"):
            port = free_port()
            server = Server(str(model), [*COMMON, "--afd-role", "ffn", "--afd-config",
                                         json.dumps({**base, "port": port})],
                            log_path=tmp_path / f"{name}.log", name=name,
                            env={"VLLM_CPU_OMP_THREADS_BIND": cpu(1), **env}).start()
            server.afd_port = port
            servers.append(server)
            ffns.append(server)
        pool_file.write_text("".join(f"127.0.0.1:{f.afd_port}\n" for f in ffns))
        attention = Server(str(model), [
            *COMMON, *engine_cli_args(model), "--afd-role", "attention", "--afd-config",
            json.dumps({**base, "ffn_pool_file": str(pool_file)})],
            log_path=tmp_path / "attention.log", name="attention",
            env={"VLLM_CPU_OMP_THREADS_BIND": cpu(0), **env}).start()
        servers.append(attention)
        for server in servers:
            server.wait_ready()
        client = openai.OpenAI(base_url=attention.url + "/v1", api_key="x", max_retries=0,
                               timeout=300)
        ids = []
        for i, chunk in enumerate(client.completions.create(
                model=str(model), prompt=plain["prompt"], max_tokens=tokens, temperature=0,
                stream=True, extra_body={"ignore_eos": True, "return_token_ids": True})):
            ids += chunk.choices[0].token_ids or []
            if i == 4:
                os.killpg(ffns[0].proc.pid, signal.SIGSTOP)
                time.sleep(1.0)
                ffns[0].kill()
        link = json.loads(attention.get("/afd/status")[1])["links"][0]
        metrics = attention.get("/metrics")[1]
    finally:
        for server in servers:
            server.stop()
    return {"plain": plain, "ids": ids, "link": link, "metrics": metrics}
