# SPDX-License-Identifier: Apache-2.0
# SPDX-FileCopyrightText: Copyright contributors to the vllm-afd project
"""Python face of the `afd` op library (csrc/): row gather/scatter. Data plane.

The kernels are torch ops (torch.ops.afd.*) with fake implementations, so
torch.compile traces them as opaque calls. The library is the wheel's
vllm/afd/_C; a machine without the wheel (the GPU check) builds it from csrc/
and hands the built file to load().
"""

import importlib

import torch

_loaded = False


def load(path: str | None = None) -> None:
    """Register torch.ops.afd.*: from the wheel's vllm/afd/_C, or from a
    library built elsewhere (path)."""
    global _loaded
    if _loaded:
        return
    if path is not None:
        torch.ops.load_library(path)
    else:
        importlib.import_module("vllm.afd._C")
    _register_fakes()
    _loaded = True


def _register_fakes() -> None:
    @torch.library.register_fake("afd::gather_rows")
    def _gather_rows_fake(src: torch.Tensor, index: torch.Tensor, out: torch.Tensor) -> None:
        return None

    @torch.library.register_fake("afd::scatter_rows")
    def _scatter_rows_fake(src: torch.Tensor, index: torch.Tensor, out: torch.Tensor) -> None:
        return None


def gather_rows(src: torch.Tensor, index: torch.Tensor,
                out: torch.Tensor | None = None) -> torch.Tensor:
    """out[i] = src[index[i]]; rows are moved as raw bytes (any dtype)."""
    load()
    if out is None:
        out = src.new_empty((index.numel(), *src.shape[1:]))
    torch.ops.afd.gather_rows(src, index, out)
    return out


def scatter_rows(src: torch.Tensor, index: torch.Tensor, out: torch.Tensor) -> torch.Tensor:
    """out[index[i]] = src[i]; index must not repeat."""
    load()
    torch.ops.afd.scatter_rows(src, index, out)
    return out
