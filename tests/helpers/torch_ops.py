# SPDX-License-Identifier: Apache-2.0
# SPDX-FileCopyrightText: Copyright contributors to the vllm-afd project
"""The aten ops a piece of code dispatches (what a CUDA graph would capture)."""

from torch.utils._python_dispatch import TorchDispatchMode


ALLOCATING = {"empty", "empty_like", "new_empty", "clone", "zeros", "zeros_like", "ones",
              "full", "_to_copy", "empty_strided", "new_zeros", "cat"}


class AtenOps(TorchDispatchMode):
    """Records the aten ops run inside the block."""

    def __init__(self) -> None:
        super().__init__()
        self.names: list[str] = []

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        self.names.append(func.__name__.split(".")[0])
        return func(*args, **(kwargs or {}))
