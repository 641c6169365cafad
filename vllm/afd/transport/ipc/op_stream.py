# SPDX-License-Identifier: Apache-2.0
# SPDX-FileCopyrightText: Copyright contributors to the vllm-afd project
"""stream.py's operations on the `afd` op library: csrc/cpu/ipc.cpp (the CPU
as the device: each operation runs on the calling thread, at once) or
csrc/cuda/ipc.cu (enqueued on the current CUDA stream; never run on a GPU yet).
"""

import torch

from vllm.afd.kernels import ops


class OpStream:
    """The exchange's device operations for tensors on `device`."""

    def __init__(self, device: torch.device) -> None:
        ops.load()
        self.device = device

    def post(self, control: torch.Tensor, src: torch.Tensor, dst: torch.Tensor,
             record: torch.Tensor, flag: torch.Tensor, layer: int, rows: int,
             topk: int = 0) -> None:
        torch.ops.afd.ipc_post(control, src, dst, record, flag, layer, rows, topk)

    def take(self, control: torch.Tensor, mirror: torch.Tensor, flag: torch.Tensor,
             record: torch.Tensor, layer: int, rows: int, deadline_s: float) -> None:
        torch.ops.afd.ipc_take(control, mirror, flag, record, layer, rows, deadline_s)

    def copy(self, dst: torch.Tensor, src: torch.Tensor) -> None:
        dst.copy_(src)

    def set_word(self, control: torch.Tensor, index: int, value: int) -> None:
        # CUDA: a fill on the current stream (ordered with the step's
        # kernels; the mirror through its mapping); CPU: a store, the thread
        # being the stream.
        control[index] = value

    def signal(self, control: torch.Tensor, index: int, value: int) -> None:
        control[index] = value  # the host's view: lands while a take waits

    def read_word(self, control: torch.Tensor, index: int) -> int:
        if self.device.type == "cuda":
            torch.cuda.current_stream(self.device).synchronize()
        return int(control[index])
