// SPDX-License-Identifier: Apache-2.0
// SPDX-FileCopyrightText: Copyright contributors to the vllm-afd project
//
// The row kernels behind the CPU afd::pack / afd::unpack (pack.cpp), one
// table per instruction set, and the scalar definitions that every table
// must reproduce bit for bit (layout and fp8 rules: ../pack.h).
//
// One table is chosen when the library first packs (pack_isa.cpp): the
// widest the CPU runs, unless VLLM_AFD_CPU_ISA=scalar|avx2|avx512 forces one.
// The vector tables live in their own files and are compiled with
// function-level target attributes, so the library keeps the baseline x86-64
// flags and loads on any x86-64; elsewhere they are absent (nullptr).
#pragma once

#include <c10/util/BFloat16.h>
#include <c10/util/Float8_e4m3fn.h>
#include <c10/util/Half.h>

#include <cmath>
#include <cstdint>
#include <cstring>
#include <string>
#include <vector>

#include "../pack.h"

namespace afd {
namespace cpu {

// Index of a compute dtype in the tables.
enum PackDtype : int { kPackF32 = 0, kPackBF16 = 1, kPackF16 = 2, kNumPackDtypes = 3 };

// One token: hidden elements, a scale per group of `group` elements.
using QuantizeRow = void (*)(const void* x, int64_t hidden, int64_t group, uint8_t* q,
                             float* scales);
using DequantizeRow = void (*)(const uint8_t* q, const float* scales, int64_t hidden,
                               int64_t group, void* out);

struct PackKernels {
  const char* isa;  // "scalar", "avx2", "avx512"
  QuantizeRow quantize[kNumPackDtypes];
  DequantizeRow dequantize[kNumPackDtypes];
};

const PackKernels* scalar_pack_kernels();
const PackKernels* avx2_pack_kernels();    // nullptr off x86-64
const PackKernels* avx512_pack_kernels();  // nullptr off x86-64

// The table pack and unpack use now (chosen on first use, see above).
const PackKernels& pack_kernels();
// ISAs this CPU runs, widest first ("scalar" always last).
std::vector<std::string> supported_isas();

// fp32 -> e4m3fn bits, round to nearest even, saturating at +-448 (NaN stays
// NaN): the same bits as c10::Float8_e4m3fn(float), without branches (both
// candidate results are computed and one is selected). The vector kernels
// are this function lane by lane, step for step.
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
inline const Fp8Table kFp8Table;

// The group's scale from its amax: amax / 448, 1 for an all-zero group.
inline float group_scale(float amax) { return amax > 0.f ? amax / kFp8E4m3Max : 1.f; }

// The scalar kernels, element by element; the vector kernels also run them
// on the elements left over after their last full vector.
template <typename scalar_t>
void quantize_row_scalar(const scalar_t* x, int64_t hidden, int64_t group, uint8_t* q,
                         float* scales) {
  for (int64_t g0 = 0, gi = 0; g0 < hidden; g0 += group, ++gi) {
    const int64_t g1 = std::min(hidden, g0 + group);
    float amax = 0.f;
    for (int64_t i = g0; i < g1; ++i) {
      const float a = std::fabs(static_cast<float>(x[i]));
      amax = a > amax ? a : amax;  // a NaN element is skipped
    }
    const float scale = group_scale(amax);
    scales[gi] = scale;
    for (int64_t i = g0; i < g1; ++i) {
      q[i] = fp8_e4m3fn_bits(static_cast<float>(x[i]) / scale);
    }
  }
}

template <typename scalar_t>
void dequantize_row_scalar(const uint8_t* q, const float* scales, int64_t hidden,
                           int64_t group, scalar_t* out) {
  const float* table = kFp8Table.value;
  for (int64_t g0 = 0, gi = 0; g0 < hidden; g0 += group, ++gi) {
    const int64_t g1 = std::min(hidden, g0 + group);
    const float scale = scales[gi];
    for (int64_t i = g0; i < g1; ++i) {
      out[i] = static_cast<scalar_t>(table[q[i]] * scale);
    }
  }
}

}  // namespace cpu
}  // namespace afd
