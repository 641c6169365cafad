// SPDX-License-Identifier: Apache-2.0
// SPDX-FileCopyrightText: Copyright contributors to the vllm-afd project
//
// One micro-batch's hidden states (and, with `gate_on: attention`, its
// routing) in one transport slot, exact or as fp8 e4m3 with per-group scales.
//
// Slot layout (bytes, little-endian, one definition: vllm/afd/kernels/ops.py
// PackLayout mirrors it and a test holds the two together):
//
//   [hidden]   T x H elements of the compute dtype (exact), or T x H fp8 e4m3
//   [pad]      zeros up to a multiple of kPackAlign
//   [scales]   fp8 only: T x G fp32, G = ceil(H / group_size); token t's
//              group g covers elements [g * group_size, (g + 1) * group_size)
//   [weights]  routing only: T x K fp32
//   [ids]      routing only: T x K int32
//
// Exact and unrouted, the slot is the hidden states' bytes; exact and routed,
// it is the LayerFrame payload of protocol v4 (transport/wire.py
// routed_parts), so the ops change no byte on the wire for `auto`.
//
// fp8: scale = amax(|x| over the group) / 448 (1 when the group is all zero),
// q = fp8_e4m3fn(x / scale) rounded to nearest even, saturating at +-448;
// x' = float(q) * scale. Per element |x - x'| <= |x| / 16 + scale / 1024
// (3 mantissa bits: half an ulp is 1/16 of the value for normal fp8 numbers;
// below 2^-6 the subnormal step is 2^-9, half of it 2^-10, times scale), plus
// the rounding of x' to the compute dtype.
#pragma once

#include <ATen/core/Tensor.h>

#include <cstdint>

namespace afd {

constexpr int64_t kPackAlign = 8;  // transport/wire.py ROUTING_ALIGN
constexpr float kFp8E4m3Max = 448.0f;

struct PackLayout {
  int64_t hidden_nbytes = 0;
  int64_t groups = 0;  // scales per token (fp8), else 0
  int64_t scales_offset = 0;
  int64_t weights_offset = 0;
  int64_t ids_offset = 0;
  int64_t total = 0;
};

inline int64_t align_up(int64_t n, int64_t a) { return (n + a - 1) / a * a; }

inline PackLayout pack_layout(int64_t tokens, int64_t hidden, int64_t elem_size,
                              int64_t group_size, int64_t topk) {
  PackLayout l;
  const bool fp8 = group_size > 0;
  l.hidden_nbytes = tokens * hidden * (fp8 ? 1 : elem_size);
  l.groups = fp8 ? (hidden + group_size - 1) / group_size : 0;
  const int64_t tail = l.groups * 4 + topk * 8;  // scales, weights, ids
  l.scales_offset = tail > 0 ? align_up(l.hidden_nbytes, kPackAlign) : l.hidden_nbytes;
  l.weights_offset = l.scales_offset + tokens * l.groups * 4;
  l.ids_offset = l.weights_offset + tokens * topk * 4;
  l.total = l.ids_offset + tokens * topk * 4;
  return l;
}

// Checks shared by every backend; returns the slot layout. `pack` writes the
// slot from the tensors, `unpack` the tensors from the slot.
PackLayout check_pack_args(const at::Tensor& hidden,
                           const c10::optional<at::Tensor>& topk_ids,
                           const c10::optional<at::Tensor>& topk_weights,
                           int64_t group_size, const at::Tensor& slot, bool pack);

}  // namespace afd
