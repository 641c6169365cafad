# SPDX-License-Identifier: Apache-2.0
# SPDX-FileCopyrightText: Copyright contributors to the vllm-afd project
"""fp8 e4m3 with a float32 scale per group, in plain torch: the reference the
kernels and the wire are compared with."""

import torch

from vllm.afd.kernels import ops


def reference_quantize(x: torch.Tensor, group: int) -> tuple[torch.Tensor, torch.Tensor]:
    """(fp8 bytes [T, H] as uint8, fp32 scales [T, G]) in plain torch."""
    tokens, hidden = x.shape
    groups = -(-hidden // group)
    xf = torch.nn.functional.pad(x.float(), (0, groups * group - hidden)).view(
        tokens, groups, group)
    amax = xf.abs().amax(-1)
    scale = torch.where(amax > 0, amax / ops.FP8_E4M3_MAX, torch.ones_like(amax))
    q = (xf / scale[..., None]).to(torch.float8_e4m3fn).view(tokens, groups * group)
    return q[:, :hidden].contiguous().view(torch.uint8), scale


def reference_dequantize(q: torch.Tensor, scale: torch.Tensor, group: int,
                         dtype: torch.dtype) -> torch.Tensor:
    hidden = q.shape[1]
    full = scale.repeat_interleave(group, dim=1)[:, :hidden]
    return (q.view(torch.float8_e4m3fn).float() * full).to(dtype)
