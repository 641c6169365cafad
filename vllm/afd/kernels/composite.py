# SPDX-License-Identifier: Apache-2.0
# SPDX-FileCopyrightText: Copyright contributors to the vllm-afd project
"""afd::pack / afd::unpack out of plain torch ops, for devices without our kernels.

Ascend NPUs (PrivateUse1, torch_npu) have no pack kernels in csrc/npu: AscendC
needs CANN and hardware this project has not had. These implementations use
only aten ops that torch_npu provides (views, copy_, abs, amax, div, casts to
and from float8_e4m3fn), so the one op schema works there too; ops.load()
registers them for PrivateUse1 where the library has no kernel of its own. On
the CPU they give byte for byte the C++ kernels' slot (test_pack_ops.py), which
is what makes them trustworthy where they cannot be run here.

Slower than a kernel (several passes, temporaries), but with no host
synchronization: every step is an op queued on the device.
"""

import torch

from vllm.afd.transport.wire import (FP8_SCALE_DTYPE, ROUTING_ID_DTYPE, ROUTING_WEIGHT_DTYPE,
                                     PayloadLayout)

FP8 = torch.float8_e4m3fn
FP8_MAX = torch.finfo(FP8).max


def _layout(hidden: torch.Tensor, topk_ids: torch.Tensor | None, group_size: int,
            slot: torch.Tensor, op: str) -> PayloadLayout:
    if hidden.dim() != 2 or not hidden.is_contiguous():
        raise ValueError(f"{op}: hidden must be a contiguous [tokens, hidden], got "
                         f"{list(hidden.shape)}")
    topk = 0 if topk_ids is None else topk_ids.shape[1]
    layout = PayloadLayout.of(hidden.shape[0], hidden.shape[1], hidden.dtype, group_size, topk)
    if slot.dtype != torch.uint8 or slot.dim() != 1 or slot.numel() != layout.total:
        raise ValueError(f"{op}: slot must be {layout.total} uint8 bytes, got "
                         f"{slot.numel()} {slot.dtype}")
    return layout


def _groups(x: torch.Tensor, group_size: int) -> torch.Tensor:
    """x [T, H] as float32 [T, G, group_size], zero-padded at the end of a row."""
    tokens, hidden = x.shape
    groups = -(-hidden // group_size)
    xf = torch.nn.functional.pad(x.float(), (0, groups * group_size - hidden))
    return xf.view(tokens, groups, group_size)


def pack(hidden: torch.Tensor, topk_ids: torch.Tensor | None,
         topk_weights: torch.Tensor | None, group_size: int, slot: torch.Tensor) -> None:
    layout = _layout(hidden, topk_ids, group_size, slot, "afd::pack")
    tokens, width = hidden.shape
    if group_size == 0:
        slot[:layout.hidden_nbytes].copy_(hidden.reshape(-1).view(torch.uint8))
    elif tokens:
        xg = _groups(hidden, group_size)
        amax = xg.abs().amax(-1, keepdim=True)
        # A tensor divisor: CUDA's kernel divides by a Python number as a times
        # 1 / b, one rounding more than pack.h's IEEE division (the GPU check
        # caught it); a tensor by a tensor divides IEEE-rounded on every device.
        scale = torch.where(amax > 0, amax / torch.full_like(amax, FP8_MAX),
                            torch.ones_like(amax))
        q = (xg / scale).to(FP8).view(torch.uint8).view(tokens, -1)[:, :width]
        slot[:layout.hidden_nbytes].view(tokens, width).copy_(q)
        slot[layout.scales_offset:layout.weights_offset].view(FP8_SCALE_DTYPE).copy_(
            scale.reshape(-1))
    slot[layout.hidden_nbytes:layout.scales_offset].zero_()
    if topk_ids is not None and tokens:
        slot[layout.weights_offset:layout.ids_offset].view(ROUTING_WEIGHT_DTYPE).copy_(
            topk_weights.reshape(-1))
        slot[layout.ids_offset:layout.total].view(ROUTING_ID_DTYPE).copy_(
            topk_ids.reshape(-1))


def unpack(slot: torch.Tensor, group_size: int, hidden: torch.Tensor,
           topk_ids: torch.Tensor | None, topk_weights: torch.Tensor | None) -> None:
    layout = _layout(hidden, topk_ids, group_size, slot, "afd::unpack")
    tokens, width = hidden.shape
    if not tokens:
        return
    if group_size == 0:
        hidden.copy_(slot[:layout.hidden_nbytes].view(hidden.dtype).view(tokens, width))
    else:
        q = slot[:layout.hidden_nbytes].view(FP8).view(tokens, width).float()
        scales = slot[layout.scales_offset:layout.weights_offset].view(FP8_SCALE_DTYPE)
        full = scales.view(tokens, -1).repeat_interleave(group_size, dim=1)[:, :width]
        hidden.copy_((q * full).to(hidden.dtype))
    if topk_ids is not None:
        topk_weights.copy_(slot[layout.weights_offset:layout.ids_offset]
                           .view(ROUTING_WEIGHT_DTYPE).view(topk_weights.shape))
        topk_ids.copy_(slot[layout.ids_offset:layout.total].view(ROUTING_ID_DTYPE)
                       .view(topk_ids.shape))
