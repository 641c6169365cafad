# SPDX-License-Identifier: Apache-2.0
# SPDX-FileCopyrightText: Copyright contributors to the vllm-afd project
"""`make demo`: the embedded tiny MoE model served by plain vLLM and by AFD.

    python tools/serving/demo.py [--models build/models] [--model tiny-qwen3-moe]

1. plain `vllm serve`, one completion and one chat request, stop;
2. `vllm serve --afd-role ffn` and `vllm serve --afd-role attention` (FFN and
   MoE layers in one process, API and attention in the other, shared memory
   between them), the same requests, stop both;
3. print both answers side by side, start-up times and resident memory, and
   three recipes to try next (the README's deploy sections).
"""

from __future__ import annotations

import argparse
import json
import os
import sys
import tempfile
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))
from servers import Server, cpu, free_port, tree_rss_mib  # noqa: E402

COMMON = ["--max-model-len", "512", "--enforce-eager", "--dtype", "float32"]
CHAT = [{"role": "user", "content": "Hello, who are you?"}]
# What to try next: the README's deploy recipes (tests/test_readme.py checks the anchors).
NEXT_STEPS = (
    "next: your model on one host: vllm serve MODEL --afd-role ffn --port 8100, then "
    "vllm serve MODEL --afd-role attention --port 8000 "
    "(README.md#one-host-shared-memory-the-default)",
    "next: two hosts over tcp, with a shared secret in VLLM_AFD_TOKEN "
    "(README.md#two-hosts-over-tcp-with-a-secret)",
    "next: a whole deployment on a Ray cluster: vllm-afd launch SPEC "
    "(README.md#many-machines-vllm-afd-launch-on-ray)",
)


def ask(url: str, model: str, prompt: str, max_tokens: int) -> tuple[str, str]:
    import openai

    client = openai.OpenAI(base_url=url + "/v1", api_key="demo")
    comp = client.completions.create(model=model, prompt=prompt, max_tokens=max_tokens,
                                     temperature=0, extra_body={"ignore_eos": True})
    chat = client.chat.completions.create(model=model, messages=CHAT,
                                          max_tokens=max_tokens, temperature=0)
    return comp.choices[0].text, chat.choices[0].message.content


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--models", type=Path, default=Path("build/models"))
    ap.add_argument("--model", default="tiny-qwen3-moe")
    ap.add_argument("--prompt", default="The quick brown fox")
    ap.add_argument("--max-tokens", type=int, default=24)
    ap.add_argument("--connector", default="shm", choices=["shm", "tcp"])
    args = ap.parse_args()

    import vllm.afd

    model = str((args.models / args.model).resolve())
    logs = Path(tempfile.mkdtemp(prefix="vllm-afd-demo-"))
    print(f"vllm-afd {vllm.afd.__version__} (upstream vLLM {vllm.afd.UPSTREAM_VERSION}, "
          f"flavor {vllm.afd.FLAVOR}); model {args.model}; logs in {logs}", flush=True)

    print("\n[1/2] plain vLLM: vllm serve ...", flush=True)
    with Server(model, COMMON, log_path=logs / "plain.log", name="plain vllm serve") as plain:
        t_plain = plain.wait_ready()
        rss_plain = tree_rss_mib(plain.proc.pid)
        plain_answers = ask(plain.url, model, args.prompt, args.max_tokens)
    print(f"      ready after {t_plain:.1f}s, stopped (exit code {plain.proc.returncode})")

    afd = json.dumps({"connector": args.connector, "port": free_port()})
    print(f"\n[2/2] AFD: vllm serve --afd-role ffn  +  vllm serve --afd-role attention "
          f"(--afd-config '{afd}')", flush=True)
    t0 = time.monotonic()
    ffn = Server(model, [*COMMON, "--afd-role", "ffn", "--afd-config", afd],
                 log_path=logs / "ffn.log", env={"VLLM_CPU_OMP_THREADS_BIND": cpu(1)},
                 name="FFN server")
    attn = Server(model, [*COMMON, "--afd-role", "attention", "--afd-config", afd],
                  log_path=logs / "attention.log", env={"VLLM_CPU_OMP_THREADS_BIND": cpu(0)},
                  name="attention server")
    with ffn, attn:
        ffn.wait_ready()
        attn.wait_ready()
        t_afd = time.monotonic() - t0
        rss_ffn, rss_attn = tree_rss_mib(ffn.proc.pid), tree_rss_mib(attn.proc.pid)
        afd_answers = ask(attn.url, model, args.prompt, args.max_tokens)
    print(f"      both ready after {t_afd:.1f}s, stopped (exit codes FFN "
          f"{ffn.proc.returncode}, attention {attn.proc.returncode})")

    print(f"\ncompletion of {args.prompt!r} ({args.max_tokens} tokens, greedy):")
    print(f"  plain vLLM: {plain_answers[0]!r}")
    print(f"  AFD:        {afd_answers[0]!r}")
    print("chat 'Hello, who are you?':")
    print(f"  plain vLLM: {plain_answers[1]!r}")
    print(f"  AFD:        {afd_answers[1]!r}")
    same = plain_answers == afd_answers
    print(f"\nidentical answers: {'yes' if same else 'NO'}")
    print(f"start-up to /health 200: plain {t_plain:.1f}s, two-role AFD {t_afd:.1f}s "
          f"(x{t_afd / t_plain:.2f}); RSS: plain {rss_plain:.0f} MiB, "
          f"FFN role {rss_ffn:.0f} MiB, attention role {rss_attn:.0f} MiB")
    print("(random weights: the text is noise; what matters is that it is the same)")
    print()
    for line in NEXT_STEPS:
        print(line)
    return 0 if same else 1


if __name__ == "__main__":
    os.environ.setdefault("HF_HUB_OFFLINE", "1")
    sys.exit(main())
