// SPDX-License-Identifier: Apache-2.0
// SPDX-FileCopyrightText: Copyright contributors to the vllm-afd project
//
// CPU kernels for afd::pack / afd::unpack (layout and error bound: ../pack.h).
// One pass over each token: its groups' amax, scales and fp8 bytes are
// produced while the token's row is in cache. Tokens run in parallel; each
// row goes through the row kernels of the ISA chosen at run time
// (pack_isa.h: scalar, AVX2 or AVX-512, the same bits from each).
#include <ATen/Parallel.h>
#include <torch/library.h>

#include <algorithm>
#include <cstring>
#include <cstdint>
#include <limits>

#include "../pack.h"
#include "pack_isa.h"

namespace afd {
namespace {

// A token's row is a few KiB; a handful per task keeps thread start-up small.
constexpr int64_t kGrainTokens = 8;

cpu::PackDtype pack_dtype(const at::Tensor& hidden) {
  switch (hidden.scalar_type()) {
    case at::kFloat: return cpu::kPackF32;
    case at::kBFloat16: return cpu::kPackBF16;
    case at::kHalf: return cpu::kPackF16;
    default: TORCH_CHECK(false, "afd: unsupported hidden dtype ", hidden.scalar_type());
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
    const cpu::QuantizeRow quantize = cpu::pack_kernels().quantize[pack_dtype(hidden)];
    const char* x = static_cast<const char*>(hidden.data_ptr());
    const int64_t row_bytes = width * hidden.element_size();
    uint8_t* q = reinterpret_cast<uint8_t*>(s);
    float* scales = reinterpret_cast<float*>(s + l.scales_offset);
    at::parallel_for(0, tokens, kGrainTokens, [&](int64_t begin, int64_t end) {
      for (int64_t t = begin; t < end; ++t) {
        quantize(x + t * row_bytes, width, group_size, q + t * width, scales + t * l.groups);
      }
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
    const cpu::DequantizeRow dequantize = cpu::pack_kernels().dequantize[pack_dtype(hidden)];
    char* out = static_cast<char*>(hidden.data_ptr());
    const int64_t row_bytes = width * hidden.element_size();
    const uint8_t* q = reinterpret_cast<const uint8_t*>(s);
    const float* scales = reinterpret_cast<const float*>(s + l.scales_offset);
    at::parallel_for(0, tokens, kGrainTokens, [&](int64_t begin, int64_t end) {
      for (int64_t t = begin; t < end; ++t) {
        dequantize(q + t * width, scales + t * l.groups, width, group_size,
                   out + t * row_bytes);
      }
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
