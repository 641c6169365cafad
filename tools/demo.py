# SPDX-License-Identifier: Apache-2.0
# SPDX-FileCopyrightText: Copyright contributors to the vllm-afd project
"""`make demo`: serve the embedded tiny MoE model and answer a real request.

    python tools/demo.py [--models build/models] [--model tiny-qwen3-moe]

Starts `vllm serve` from the installed vllm-afd wheel, waits for /health, sends
an OpenAI completion and a chat request with the `openai` client, prints the
answers and stops the server cleanly.
"""

from __future__ import annotations

import argparse
import sys
import tempfile
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))
from servers import Server  # noqa: E402

SERVE_ARGS = ["--max-model-len", "512", "--enforce-eager", "--dtype", "float32"]


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--models", type=Path, default=Path("build/models"))
    ap.add_argument("--model", default="tiny-qwen3-moe")
    ap.add_argument("--prompt", default="The quick brown fox")
    ap.add_argument("--max-tokens", type=int, default=24)
    args = ap.parse_args()

    import openai
    import vllm.afd

    model = str((args.models / args.model).resolve())
    log = Path(tempfile.gettempdir()) / "vllm-afd-demo-serve.log"
    print(f"vllm-afd {vllm.afd.__version__} (upstream vLLM {vllm.afd.UPSTREAM_VERSION}, "
          f"flavor {vllm.afd.FLAVOR})")
    print(f"serving {args.model} (log: {log}) ...", flush=True)
    t0 = time.monotonic()
    with Server(model, SERVE_ARGS, log_path=log, name="vllm serve") as server:
        ready = server.wait_ready()
        print(f"ready after {ready:.1f}s at {server.url}")
        client = openai.OpenAI(base_url=server.url + "/v1", api_key="demo")
        comp = client.completions.create(model=model, prompt=args.prompt,
                                         max_tokens=args.max_tokens, temperature=0)
        print(f"\ncompletion  prompt: {args.prompt!r}\n            answer: "
              f"{comp.choices[0].text!r}  ({comp.usage.completion_tokens} tokens, "
              f"finish_reason={comp.choices[0].finish_reason})")
        chat = client.chat.completions.create(
            model=model, messages=[{"role": "user", "content": "Hello, who are you?"}],
            max_tokens=args.max_tokens, temperature=0)
        print(f"chat        answer: {chat.choices[0].message.content!r}")
    print(f"\nserver stopped (exit code {server.proc.returncode}); "
          f"total {time.monotonic() - t0:.1f}s")
    return 0


if __name__ == "__main__":
    sys.exit(main())
