// SPDX-License-Identifier: Apache-2.0
// SPDX-FileCopyrightText: Copyright contributors to the vllm-afd project
//
// FrameCodec (frame_codec.h): afd::pack / afd::unpack (pack.cpp) on raw
// addresses, for the prepared calls' one C call per message end.
#include "frame_codec.h"

#include <ATen/Parallel.h>

#include <cstring>

#include "../pack.h"
#include "pack_isa.h"

namespace afd_lane {
namespace {

constexpr int64_t kGrainTokens = 8;  // pack.cpp's

int64_t element_size(int dtype) {
  switch (dtype) {
    case afd::cpu::kPackF32: return 4;
    case afd::cpu::kPackBF16:
    case afd::cpu::kPackF16: return 2;
    default: return 0;
  }
}

}  // namespace

bool FrameCodec::load(PyObject* spec, uint64_t nbytes) {
  packs = false;
  if (spec == nullptr || spec == Py_None) return true;
  long long r, h, g, k = 0;
  int d;
  unsigned long long address;
  if (!PyArg_ParseTuple(spec, "LLiLK|L", &r, &h, &d, &g, &address, &k)) return false;
  const int64_t size = element_size(d);
  if (r < 0 || h <= 0 || g < 0 || k < 0 || size == 0) {
    PyErr_SetString(PyExc_ValueError,
                    "frame codec: bad rows, hidden, dtype, scale group or topk");
    return false;
  }
  const afd::PackLayout l = afd::pack_layout(r, h, size, g, k);
  if (static_cast<uint64_t>(l.total) != nbytes) {
    PyErr_Format(PyExc_ValueError, "frame codec: a payload of %lld x %lld (group %lld, topk "
                 "%lld) is %lld bytes, the frame says %llu", r, h, g, k,
                 static_cast<long long>(l.total), nbytes);
    return false;
  }
  packs = g > 0 || k > 0;
  rows = r;
  hidden = h;
  group = g;
  topk = k;
  dtype = d;
  elem_size = size;
  buffer = address;
  hidden_nbytes = l.hidden_nbytes;
  scales_offset = l.scales_offset;
  weights_offset = l.weights_offset;
  ids_offset = l.ids_offset;
  groups = l.groups;
  return true;
}

void FrameCodec::encode(const uint8_t* src, uint8_t* dst, const uint8_t* weights,
                        const uint8_t* ids) const {
  if (group > 0) {
    const afd::cpu::QuantizeRow quantize = afd::cpu::pack_kernels().quantize[dtype];
    const int64_t row_bytes = hidden * elem_size, width = hidden;
    float* scales = reinterpret_cast<float*>(dst + scales_offset);
    at::parallel_for(0, rows, kGrainTokens, [&](int64_t begin, int64_t end) {
      for (int64_t t = begin; t < end; ++t)
        quantize(src + t * row_bytes, width, group, dst + t * width, scales + t * groups);
    });
  } else {
    memcpy(dst, src, hidden_nbytes);
  }
  // Padding zeroed, as afd::pack does: the same tensors always give the same bytes.
  const int64_t tail = scales_offset - hidden_nbytes;
  if (tail > 0) memset(dst + hidden_nbytes, 0, tail);
  if (topk > 0) {  // float32 weights, int32 ids: the wire's dtypes, copied as they are
    const int64_t n = rows * topk * 4;
    memcpy(dst + weights_offset, weights, n);
    memcpy(dst + ids_offset, ids, n);
  }
}

void FrameCodec::decode(const uint8_t* src, uint8_t* dst) const {
  if (group == 0) {
    if (dst != src) memcpy(dst, src, hidden_nbytes);
    return;
  }
  const afd::cpu::DequantizeRow dequantize = afd::cpu::pack_kernels().dequantize[dtype];
  const int64_t row_bytes = hidden * elem_size, width = hidden;
  const float* scales = reinterpret_cast<const float*>(src + scales_offset);
  at::parallel_for(0, rows, kGrainTokens, [&](int64_t begin, int64_t end) {
    for (int64_t t = begin; t < end; ++t)
      dequantize(src + t * width, scales + t * groups, width, group, dst + t * row_bytes);
  });
}

}  // namespace afd_lane
