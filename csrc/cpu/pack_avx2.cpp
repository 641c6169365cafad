// SPDX-License-Identifier: Apache-2.0
// SPDX-FileCopyrightText: Copyright contributors to the vllm-afd project
//
// AVX2 (+F16C) row kernels for the CPU pack/unpack: 8 elements per step; a
// group's last elements that do not fill a step go through the scalar code
// of pack_isa.h. Each step is that scalar definition lane by lane (the same
// amax, IEEE division, integer rounding to e4m3fn, and on unpack the same
// fp32 product rounded as c10 rounds), so the bytes are the scalar kernels'.
//
// Only these functions carry the target attribute (see pack_avx512.cpp).
#include "pack_isa.h"

#if defined(__x86_64__) && (defined(__GNUC__) || defined(__clang__))

#include <immintrin.h>

#define AFD_AVX2 __attribute__((target("avx2,f16c")))

namespace afd {
namespace cpu {
namespace {

constexpr int64_t kLanes = 8;

// 8 elements as fp32, exactly.
AFD_AVX2 inline __m256 load(const float* p) { return _mm256_loadu_ps(p); }
AFD_AVX2 inline __m256 load(const c10::BFloat16* p) {
  const __m256i h = _mm256_cvtepu16_epi32(_mm_loadu_si128(reinterpret_cast<const __m128i*>(p)));
  return _mm256_castsi256_ps(_mm256_slli_epi32(h, 16));
}
AFD_AVX2 inline __m256 load(const c10::Half* p) {
  return _mm256_cvtph_ps(_mm_loadu_si128(reinterpret_cast<const __m128i*>(p)));
}

AFD_AVX2 inline __m256i splat(uint32_t v) { return _mm256_set1_epi32(static_cast<int>(v)); }

// Lanes hold values < 2^31 here (sign cleared), so the signed compares of
// AVX2 order them as the scalar code's unsigned ones do.
AFD_AVX2 inline __m256i select(__m256i mask, __m256i if_false, __m256i if_true) {
  return _mm256_blendv_epi8(if_false, if_true, mask);
}

// fp8_e4m3fn_bits() of 8 lanes, step for step.
AFD_AVX2 inline __m256i fp8_bits(__m256 y) {
  const __m256i bits = _mm256_castps_si256(y);
  const __m256i sign = _mm256_and_si256(bits, splat(0x80000000u));
  const __m256i a = _mm256_xor_si256(bits, sign);
  const __m256i odd = _mm256_and_si256(_mm256_srli_epi32(a, 20), splat(1u));
  __m256i normal = _mm256_add_epi32(a, splat((uint32_t(7 - 127) << 23) + 0x7FFFFu));
  normal = _mm256_srli_epi32(_mm256_add_epi32(normal, odd), 20);
  normal = select(_mm256_cmpeq_epi32(normal, splat(0x7Fu)), normal, splat(0x7Eu));
  const __m256i magic = splat(141u << 23);
  const __m256 sum = _mm256_add_ps(_mm256_castsi256_ps(a), _mm256_castsi256_ps(magic));
  const __m256i subnormal = _mm256_sub_epi32(_mm256_castps_si256(sum), magic);
  __m256i r = select(_mm256_cmpgt_epi32(splat(121u << 23), a), normal, subnormal);
  const __m256i big =
      select(_mm256_cmpgt_epi32(a, splat(0x7F800000u)), splat(0x7Eu), splat(0x7Fu));
  r = select(_mm256_cmpgt_epi32(a, splat((1087u << 20) - 1u)), r, big);
  return _mm256_or_si256(_mm256_and_si256(r, splat(0xFFu)), _mm256_srli_epi32(sign, 24));
}

// The low 16 bits of 8 lanes (each < 2^16), in order.
AFD_AVX2 inline __m128i narrow16(__m256i v) {
  return _mm_packus_epi32(_mm256_castsi256_si128(v), _mm256_extracti128_si256(v, 1));
}

template <typename scalar_t>
AFD_AVX2 void quantize_row(const scalar_t* x, int64_t hidden, int64_t group, uint8_t* q,
                           float* scales) {
  for (int64_t g0 = 0, gi = 0; g0 < hidden; g0 += group, ++gi) {
    const int64_t n = std::min(hidden, g0 + group) - g0;
    const int64_t body = n / kLanes * kLanes;
    const scalar_t* xg = x + g0;
    // Per-lane maxima (vmaxps keeps its second operand, the running max,
    // when the element is NaN, as the scalar code does), then across lanes
    // and the tail: max of values >= +0 is exact and order-free.
    const __m256 abs_mask = _mm256_castsi256_ps(splat(0x7FFFFFFFu));
    __m256 vmax = _mm256_setzero_ps();
    for (int64_t i = 0; i < body; i += kLanes) {
      vmax = _mm256_max_ps(_mm256_and_ps(load(xg + i), abs_mask), vmax);
    }
    alignas(32) float lane_max[kLanes];
    _mm256_store_ps(lane_max, vmax);
    float amax = 0.f;
    for (float a : lane_max) amax = a > amax ? a : amax;
    for (int64_t i = body; i < n; ++i) {
      const float a = std::fabs(static_cast<float>(xg[i]));
      amax = a > amax ? a : amax;
    }
    const float scale = group_scale(amax);
    scales[gi] = scale;
    const __m256 vscale = _mm256_set1_ps(scale);
    for (int64_t i = 0; i < body; i += kLanes) {
      const __m128i w = narrow16(fp8_bits(_mm256_div_ps(load(xg + i), vscale)));
      _mm_storel_epi64(reinterpret_cast<__m128i*>(q + g0 + i), _mm_packus_epi16(w, w));
    }
    for (int64_t i = body; i < n; ++i) {
      q[g0 + i] = fp8_e4m3fn_bits(static_cast<float>(xg[i]) / scale);
    }
  }
}

// kFp8Table.value[q] for 8 bytes (see pack_avx512.cpp fp8_values).
AFD_AVX2 inline __m256 fp8_values(const uint8_t* p) {
  const __m256i b = _mm256_cvtepu8_epi32(_mm_loadl_epi64(reinterpret_cast<const __m128i*>(p)));
  const __m256i mag = _mm256_and_si256(b, splat(0x7Fu));
  const __m256i normal = _mm256_add_epi32(_mm256_slli_epi32(mag, 20), splat(120u << 23));
  const __m256 tiny = _mm256_mul_ps(_mm256_cvtepi32_ps(mag), _mm256_set1_ps(1.f / 512.f));
  __m256i v = select(_mm256_cmpgt_epi32(splat(8u), mag), normal, _mm256_castps_si256(tiny));
  v = select(_mm256_cmpeq_epi32(mag, splat(0x7Fu)), v, splat(0x7FF00000u));
  return _mm256_castsi256_ps(
      _mm256_or_si256(v, _mm256_slli_epi32(_mm256_and_si256(b, splat(0x80u)), 24)));
}

// fp32 -> the compute dtype for 8 lanes, as c10 rounds it (pack_avx512.cpp).
AFD_AVX2 inline void store(float* p, __m256 y) { _mm256_storeu_ps(p, y); }
AFD_AVX2 inline void store(c10::BFloat16* p, __m256 y) {
  const __m256i u = _mm256_castps_si256(y);
  const __m256i odd = _mm256_and_si256(_mm256_srli_epi32(u, 16), splat(1u));
  __m256i h = _mm256_srli_epi32(_mm256_add_epi32(u, _mm256_add_epi32(odd, splat(0x7FFFu))), 16);
  const __m256i nan = _mm256_castps_si256(_mm256_cmp_ps(y, y, _CMP_UNORD_Q));
  h = select(nan, h, splat(0x7FC0u));
  _mm_storeu_si128(reinterpret_cast<__m128i*>(p), narrow16(h));
}
AFD_AVX2 inline void store(c10::Half* p, __m256 y) {
  const __m128i h = _mm256_cvtps_ph(y, _MM_FROUND_TO_NEAREST_INT | _MM_FROUND_NO_EXC);
  const __m256i sign = _mm256_and_si256(_mm256_srli_epi32(_mm256_castps_si256(y), 16),
                                        splat(0x8000u));
  const __m128i nan_bits = narrow16(_mm256_or_si256(sign, splat(0x7E00u)));
  const __m256i nan = _mm256_castps_si256(_mm256_cmp_ps(y, y, _CMP_UNORD_Q));
  const __m128i nan16 = _mm_packs_epi32(_mm256_castsi256_si128(nan),
                                        _mm256_extracti128_si256(nan, 1));
  _mm_storeu_si128(reinterpret_cast<__m128i*>(p), _mm_blendv_epi8(h, nan_bits, nan16));
}

template <typename scalar_t>
AFD_AVX2 void dequantize_row(const uint8_t* q, const float* scales, int64_t hidden,
                             int64_t group, scalar_t* out) {
  const float* table = kFp8Table.value;
  for (int64_t g0 = 0, gi = 0; g0 < hidden; g0 += group, ++gi) {
    const int64_t n = std::min(hidden, g0 + group) - g0;
    const int64_t body = n / kLanes * kLanes;
    const float scale = scales[gi];
    const __m256 vscale = _mm256_set1_ps(scale);
    for (int64_t i = 0; i < body; i += kLanes) {
      store(out + g0 + i, _mm256_mul_ps(fp8_values(q + g0 + i), vscale));
    }
    for (int64_t i = body; i < n; ++i) {
      out[g0 + i] = static_cast<scalar_t>(table[q[g0 + i]] * scale);
    }
  }
}

template <typename scalar_t>
void quantize(const void* x, int64_t hidden, int64_t group, uint8_t* q, float* scales) {
  quantize_row(static_cast<const scalar_t*>(x), hidden, group, q, scales);
}

template <typename scalar_t>
void dequantize(const uint8_t* q, const float* scales, int64_t hidden, int64_t group,
                void* out) {
  dequantize_row(q, scales, hidden, group, static_cast<scalar_t*>(out));
}

const PackKernels kAvx2 = {
    "avx2",
    {quantize<float>, quantize<c10::BFloat16>, quantize<c10::Half>},
    {dequantize<float>, dequantize<c10::BFloat16>, dequantize<c10::Half>},
};

}  // namespace

const PackKernels* avx2_pack_kernels() { return &kAvx2; }

}  // namespace cpu
}  // namespace afd

#else  // not x86-64: no AVX2 table

namespace afd {
namespace cpu {
const PackKernels* avx2_pack_kernels() { return nullptr; }
}  // namespace cpu
}  // namespace afd

#endif
