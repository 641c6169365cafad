// SPDX-License-Identifier: Apache-2.0
// SPDX-FileCopyrightText: Copyright contributors to the vllm-afd project
//
// FrameCodec (frame_codec.h): afd::pack / afd::unpack's fp8 path (pack.cpp)
// on raw addresses, for the prepared calls' one C call per message end.
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
  fp8 = false;
  if (spec == nullptr || spec == Py_None) return true;
  long long r, h, g;
  int d;
  unsigned long long address;
  if (!PyArg_ParseTuple(spec, "LLiLK", &r, &h, &d, &g, &address)) return false;
  const int64_t size = element_size(d);
  if (r < 0 || h <= 0 || g <= 0 || size == 0) {
    PyErr_SetString(PyExc_ValueError, "frame codec: bad rows, hidden, dtype or scale group");
    return false;
  }
  const afd::PackLayout l = afd::pack_layout(r, h, size, g, 0);
  if (static_cast<uint64_t>(l.total) != nbytes) {
    PyErr_Format(PyExc_ValueError, "frame codec: an fp8 payload of %lld x %lld is %lld bytes, "
                 "the frame says %llu", r, h, static_cast<long long>(l.total), nbytes);
    return false;
  }
  fp8 = true;
  rows = r;
  hidden = h;
  group = g;
  dtype = d;
  elem_size = size;
  buffer = address;
  hidden_nbytes = l.hidden_nbytes;
  scales_offset = l.scales_offset;
  groups = l.groups;
  return true;
}

void FrameCodec::encode(const uint8_t* src, uint8_t* dst) const {
  const afd::cpu::QuantizeRow quantize = afd::cpu::pack_kernels().quantize[dtype];
  const int64_t row_bytes = hidden * elem_size, width = hidden;
  float* scales = reinterpret_cast<float*>(dst + scales_offset);
  at::parallel_for(0, rows, kGrainTokens, [&](int64_t begin, int64_t end) {
    for (int64_t t = begin; t < end; ++t)
      quantize(src + t * row_bytes, width, group, dst + t * width, scales + t * groups);
  });
  // Padding zeroed, as afd::pack does: the same tensor always gives the same bytes.
  const int64_t tail = scales_offset - hidden_nbytes;
  if (tail > 0) memset(dst + hidden_nbytes, 0, tail);
}

void FrameCodec::decode(const uint8_t* src, uint8_t* dst) const {
  const afd::cpu::DequantizeRow dequantize = afd::cpu::pack_kernels().dequantize[dtype];
  const int64_t row_bytes = hidden * elem_size, width = hidden;
  const float* scales = reinterpret_cast<const float*>(src + scales_offset);
  at::parallel_for(0, rows, kGrainTokens, [&](int64_t begin, int64_t end) {
    for (int64_t t = begin; t < end; ++t)
      dequantize(src + t * width, scales + t * groups, width, group, dst + t * row_bytes);
  });
}

}  // namespace afd_lane
