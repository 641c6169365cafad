# SPDX-License-Identifier: Apache-2.0
# SPDX-FileCopyrightText: Copyright contributors to the vllm-afd project
"""`vllm-afd plan --plot FILE.png`: tokens/s per device of every feasible deployment
against its A:F ratio, one series per micro-batch count, the best marked."""

from __future__ import annotations

from pathlib import Path

from vllm.afd.deploy.planner.search import Estimate


def write_plot(results: list[Estimate], path: str | Path, title: str) -> Path:
    try:
        import matplotlib

        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except ImportError as e:
        raise RuntimeError("--plot needs matplotlib: pip install 'vllm-afd[bench]' (it pins "
                           "the version)") from e
    fig, ax = plt.subplots(figsize=(8, 5))
    for m in sorted({e.microbatches for e in results}):
        pts = [e for e in results if e.microbatches == m]
        ax.scatter([e.attention_devices / e.ffn_devices for e in pts],
                   [e.tokens_per_s_per_device for e in pts], s=12, alpha=0.7, label=f"m = {m}")
    if results:
        best = results[0]
        ax.scatter([best.attention_devices / best.ffn_devices], [best.tokens_per_s_per_device],
                   s=120, facecolors="none", edgecolors="black",
                   label=f"best: {best.attention_devices}A:{best.ffn_devices}F m={best.microbatches}"
                         f" ({best.regime})")
    ax.set_xscale("log")
    ax.set_xlabel("A : F (attention devices per FFN device)")
    ax.set_ylabel("decode tokens/s per device (at the best batch)")
    ax.set_title(title, fontsize=9)
    ax.grid(alpha=0.3)
    ax.legend(fontsize=8)
    fig.tight_layout()
    path = Path(path)
    fig.savefig(path, dpi=110)
    plt.close(fig)
    return path
