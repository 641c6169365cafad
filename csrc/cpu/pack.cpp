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
#include <limits>

#include "../pack.h"

namespace afd {
namespace {

// A token's row is a few KiB; a handful per task keeps thread start-up small.
constexpr int64_t kGrainTokens = 8;

template <typename scalar_t>
void quantize_row(const scalar_t* x, int64_t hidden, int64_t group, uint8_t* q,
                  float* scales) {
  for (int64_t g0 = 0, gi = 0; g0 < hidden; g0 += group, ++gi) {
    const int64_t g1 = std::min(hidden, g0 + group);
    float amax = 0.f;
    for (int64_t i = g0; i < g1; ++i) {
      amax = std::max(amax, std::fabs(static_cast<float>(x[i])));
    }
    const float scale = amax > 0.f ? amax / kFp8E4m3Max : 1.f;
    scales[gi] = scale;
    for (int64_t i = g0; i < g1; ++i) {
      q[i] = c10::Float8_e4m3fn(static_cast<float>(x[i]) / scale).x;
    }
  }
}

template <typename scalar_t>
void dequantize_row(const uint8_t* q, const float* scales, int64_t hidden, int64_t group,
                    scalar_t* out) {
  for (int64_t g0 = 0, gi = 0; g0 < hidden; g0 += group, ++gi) {
    const int64_t g1 = std::min(hidden, g0 + group);
    const float scale = scales[gi];
    for (int64_t i = g0; i < g1; ++i) {
      const float v =
          static_cast<float>(c10::Float8_e4m3fn(q[i], c10::Float8_e4m3fn::from_bits()));
      out[i] = static_cast<scalar_t>(v * scale);
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
