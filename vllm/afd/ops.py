# SPDX-License-Identifier: Apache-2.0
# SPDX-FileCopyrightText: Copyright contributors to the vllm-afd project
"""Python face of the `afd` op library (csrc/): row gather/scatter for transfers.

The kernels are registered as torch ops (torch.ops.afd.*) with fake
implementations, so torch.compile traces them as opaque calls.
"""

import torch

import vllm.afd._C  # noqa: F401  (registers torch.ops.afd.*)


@torch.library.register_fake("afd::gather_rows")
def _gather_rows_fake(src: torch.Tensor, index: torch.Tensor, out: torch.Tensor) -> None:
    return None


@torch.library.register_fake("afd::scatter_rows")
def _scatter_rows_fake(src: torch.Tensor, index: torch.Tensor, out: torch.Tensor) -> None:
    return None


def gather_rows(src: torch.Tensor, index: torch.Tensor,
                out: torch.Tensor | None = None) -> torch.Tensor:
    """out[i] = src[index[i]]; rows are moved as raw bytes (any dtype)."""
    if out is None:
        out = src.new_empty((index.numel(), *src.shape[1:]))
    torch.ops.afd.gather_rows(src, index, out)
    return out


def scatter_rows(src: torch.Tensor, index: torch.Tensor, out: torch.Tensor) -> torch.Tensor:
    """out[index[i]] = src[i]; index must not repeat."""
    torch.ops.afd.scatter_rows(src, index, out)
    return out
