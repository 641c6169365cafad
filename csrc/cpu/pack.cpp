// SPDX-License-Identifier: Apache-2.0
// SPDX-FileCopyrightText: Copyright contributors to the vllm-afd project
//
// CPU kernels for afd::pack / afd::unpack (layout and error bound: ../pack.h).
// One pass over each token: its groups' amax, scales and fp8 bytes are
// produced while the token's row is in cache. Tokens run in parallel.
#include <ATen/Dispatch.h>
#include <ATen/Parallel.h>
#include <c10/util/Float8_e4m3fn.h>
#include <torch/library.h>

#include <algorithm>
#include <cmath>
#include <cstring>
#include <cstdint>
#include <limits>

#include "../pack.h"

namespace afd {
namespace {

// A token's row is a few KiB; a handful per task keeps thread start-up small.
constexpr int64_t kGrainTokens = 8;

// fp32 -> e4m3fn bits, round to nearest even, saturating at +-448 (NaN stays
// NaN): the same bits as c10::Float8_e4m3fn(float), computed without branches
// so the compiler vectorizes the loop that calls it (both candidate results
// are computed and one is selected).
inline uint8_t fp8_e4m3fn_bits(float f) {
  uint32_t bits;
  std::memcpy(&bits, &f, 4);
  const uint32_t sign = bits & 0x80000000u;
  const uint32_t a = bits ^ sign;
  // Normal range: rebias the exponent, round the 20 dropped mantissa bits to
  // nearest even, keep the top 8 bits. Carrying into 0x7f (NaN) saturates.
  uint32_t normal = (a + (uint32_t(7 - 127) << 23) + 0x7FFFFu + ((a >> 20) & 1u)) >> 20;
  normal = normal == 0x7Fu ? 0x7Eu : normal;
  // Below 2^-6 (fp8 subnormals): let an fp32 addition do the rounding.
  constexpr uint32_t kDenormMagic = 141u << 23;
  float af, magic;
  std::memcpy(&af, &a, 4);
  std::memcpy(&magic, &kDenormMagic, 4);
  const float sum = af + magic;
  uint32_t sum_bits;
  std::memcpy(&sum_bits, &sum, 4);
  const uint32_t subnormal = sum_bits - kDenormMagic;
  uint32_t r = a < (121u << 23) ? subnormal : normal;
  const uint32_t big = a > 0x7F800000u ? 0x7Fu : 0x7Eu;  // NaN, or finite overflow / inf
  r = a >= (1087u << 20) ? big : r;
  return static_cast<uint8_t>((r & 0xFFu) | (sign >> 24));
}

// fp8 bits -> fp32, all 256 of them (exact, from c10's conversion).
struct Fp8Table {
  float value[256];
  Fp8Table() {
    for (int i = 0; i < 256; ++i) {
      value[i] = static_cast<float>(
          c10::Float8_e4m3fn(static_cast<uint8_t>(i), c10::Float8_e4m3fn::from_bits()));
    }
  }
};
const Fp8Table kFp8Table;

template <typename scalar_t>
void quantize_row(const scalar_t* x, int64_t hidden, int64_t group, uint8_t* q,
                  float* scales) {
  for (int64_t g0 = 0, gi = 0; g0 < hidden; g0 += group, ++gi) {
    const int64_t g1 = std::min(hidden, g0 + group);
    float amax = 0.f;
    for (int64_t i = g0; i < g1; ++i) {
      const float a = std::fabs(static_cast<float>(x[i]));
      amax = a > amax ? a : amax;
    }
    const float scale = amax > 0.f ? amax / kFp8E4m3Max : 1.f;
    scales[gi] = scale;
    for (int64_t i = g0; i < g1; ++i) {
      q[i] = fp8_e4m3fn_bits(static_cast<float>(x[i]) / scale);
    }
  }
}

template <typename scalar_t>
void dequantize_row(const uint8_t* q, const float* scales, int64_t hidden, int64_t group,
                    scalar_t* out) {
  const float* table = kFp8Table.value;
  for (int64_t g0 = 0, gi = 0; g0 < hidden; g0 += group, ++gi) {
    const int64_t g1 = std::min(hidden, g0 + group);
    const float scale = scales[gi];
    for (int64_t i = g0; i < g1; ++i) {
      out[i] = static_cast<scalar_t>(table[q[i]] * scale);
    }
  }
}

void pack_routing(const at::Tensor& ids, const at::Tensor& weights, char* slot,
                  const PackLayout& l) {
  std::memcpy(slot + l.weights_offset, weights.data_ptr(), weights.numel() * 4);
  int32_t* out = reinterpret_cast<int32_t*>(slot + l.ids_offset);
  if (ids.scalar_type() == at::kInt) {
    std::memcpy(out, ids.data_ptr(), ids.numel() * 4);
    return;
  }
  const int64_t* in = ids.data_ptr<int64_t>();
  for (int64_t i = 0; i < ids.numel(); ++i) {
    TORCH_CHECK(in[i] >= std::numeric_limits<int32_t>::min() &&
                    in[i] <= std::numeric_limits<int32_t>::max(),
                "afd::pack: topk_ids[", i / ids.size(1), ", ", i % ids.size(1), "] = ", in[i],
                " does not fit the wire's int32");
    out[i] = static_cast<int32_t>(in[i]);
  }
}

void unpack_routing(const char* slot, const PackLayout& l, at::Tensor& ids,
                    at::Tensor& weights) {
  std::memcpy(weights.data_ptr(), slot + l.weights_offset, weights.numel() * 4);
  const int32_t* in = reinterpret_cast<const int32_t*>(slot + l.ids_offset);
  if (ids.scalar_type() == at::kInt) {
    std::memcpy(ids.data_ptr(), in, ids.numel() * 4);
    return;
  }
  int64_t* out = ids.data_ptr<int64_t>();
  for (int64_t i = 0; i < ids.numel(); ++i) out[i] = in[i];
}

}  // namespace

void pack_cpu(const at::Tensor& hidden, const c10::optional<at::Tensor>& topk_ids,
              const c10::optional<at::Tensor>& topk_weights, int64_t group_size,
              at::Tensor& slot) {
  const PackLayout l = check_pack_args(hidden, topk_ids, topk_weights, group_size, slot, true);
  char* s = static_cast<char*>(slot.data_ptr());
  const int64_t tokens = hidden.size(0), width = hidden.size(1);
  if (group_size == 0) {
    std::memcpy(s, hidden.data_ptr(), l.hidden_nbytes);
  } else {
    AT_DISPATCH_FLOATING_TYPES_AND2(at::kBFloat16, at::kHalf, hidden.scalar_type(),
                                    "afd::pack", [&] {
      const scalar_t* x = hidden.data_ptr<scalar_t>();
      uint8_t* q = reinterpret_cast<uint8_t*>(s);
      float* scales = reinterpret_cast<float*>(s + l.scales_offset);
      at::parallel_for(0, tokens, kGrainTokens, [&](int64_t begin, int64_t end) {
        for (int64_t t = begin; t < end; ++t) {
          quantize_row(x + t * width, width, group_size, q + t * width,
                       scales + t * l.groups);
        }
      });
    });
  }
  // Padding is zeroed: the same tensors always give the same bytes.
  const int64_t tail = l.scales_offset - l.hidden_nbytes;
  if (tail > 0) std::memset(s + l.hidden_nbytes, 0, tail);
  if (topk_ids.has_value()) pack_routing(*topk_ids, *topk_weights, s, l);
}

void unpack_cpu(const at::Tensor& slot, int64_t group_size, at::Tensor& hidden,
                const c10::optional<at::Tensor>& topk_ids,
                const c10::optional<at::Tensor>& topk_weights) {
  const PackLayout l = check_pack_args(hidden, topk_ids, topk_weights, group_size, slot, false);
  const char* s = static_cast<const char*>(slot.data_ptr());
  const int64_t tokens = hidden.size(0), width = hidden.size(1);
  if (group_size == 0) {
    std::memcpy(hidden.data_ptr(), s, l.hidden_nbytes);
  } else {
    AT_DISPATCH_FLOATING_TYPES_AND2(at::kBFloat16, at::kHalf, hidden.scalar_type(),
                                    "afd::unpack", [&] {
      scalar_t* out = hidden.data_ptr<scalar_t>();
      const uint8_t* q = reinterpret_cast<const uint8_t*>(s);
      const float* scales = reinterpret_cast<const float*>(s + l.scales_offset);
      at::parallel_for(0, tokens, kGrainTokens, [&](int64_t begin, int64_t end) {
        for (int64_t t = begin; t < end; ++t) {
          dequantize_row(q + t * width, scales + t * l.groups, width, group_size,
                         out + t * width);
        }
      });
    });
  }
  if (topk_ids.has_value()) {
    at::Tensor ids = *topk_ids, weights = *topk_weights;
    unpack_routing(s, l, ids, weights);
  }
}

}  // namespace afd

TORCH_LIBRARY_IMPL(afd, CPU, m) {
  m.impl("pack", &afd::pack_cpu);
  m.impl("unpack", &afd::unpack_cpu);
}
