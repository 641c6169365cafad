// SPDX-License-Identifier: Apache-2.0
// SPDX-FileCopyrightText: Copyright contributors to the vllm-afd project
//
// AVX-512 (F, BW, VL) row kernels for the CPU pack/unpack: 16 elements per
// step, the group's last partial step under a lane mask. Each step is the
// scalar definition of pack_isa.h lane by lane, so the bytes are the scalar
// kernels' (and torch's): the same amax (max ignores NaN the same way), the
// same IEEE division x / scale, the same integer rounding to e4m3fn, and on
// unpack the same fp32 product rounded to the compute dtype as c10 rounds.
//
// Not used on purpose: VCVTNEPS2BF16 (AVX512_BF16) flushes subnormal inputs
// and outputs to zero, unlike c10::BFloat16(float); there is no fp8
// conversion instruction before AVX10.2.
//
// Only these functions carry the target attribute; the file's includes and
// anything inline from them compile with the baseline flags, so no wider
// instruction can leak into code the loader might share with other files.
#include "pack_isa.h"

#if defined(__x86_64__) && (defined(__GNUC__) || defined(__clang__))

#include <immintrin.h>

#include <type_traits>

// GCC 12's AVX-512 intrinsics start from _mm512_undefined_*(), which -Wall
// reports as "may be used uninitialized" wherever they inline (a known false
// positive of those headers, not of this code).
#if defined(__GNUC__) && !defined(__clang__)
#pragma GCC diagnostic ignored "-Wmaybe-uninitialized"
#endif

#define AFD_AVX512 __attribute__((target("avx512f,avx512bw,avx512vl")))

namespace afd {
namespace cpu {
namespace {

constexpr int64_t kLanes = 16;

AFD_AVX512 inline __mmask16 lanes(int64_t n) {
  return n >= kLanes ? __mmask16(0xFFFF) : __mmask16((1u << n) - 1u);
}

// Up to 16 elements as fp32 (exactly: bf16 is the top half of an fp32,
// fp16 -> fp32 is exact); masked-off lanes read as +0.
AFD_AVX512 inline __m512 load(const float* p, __mmask16 m) {
  return _mm512_maskz_loadu_ps(m, p);
}
AFD_AVX512 inline __m512 load(const c10::BFloat16* p, __mmask16 m) {
  const __m512i h = _mm512_cvtepu16_epi32(_mm256_maskz_loadu_epi16(m, p));
  return _mm512_castsi512_ps(_mm512_slli_epi32(h, 16));
}
AFD_AVX512 inline __m512 load(const c10::Half* p, __mmask16 m) {
  return _mm512_cvtph_ps(_mm256_maskz_loadu_epi16(m, p));
}

AFD_AVX512 inline __m512i splat(uint32_t v) { return _mm512_set1_epi32(static_cast<int>(v)); }

// fp8_e4m3fn_bits() of 16 lanes: the same integer rounding in the normal
// range and the same fp32 addition below it. Two steps are cheaper forms
// that hold for |y| < 480 (1087 << 20), which x / scale always is when the
// group is finite and its scale normal: min(normal, 0x7e) for "0x7f -> 0x7e"
// (normal <= 0x7f there), and no NaN / overflow select. Lanes outside that
// range (NaN, inf, a subnormal or zero scale) take the exact selects.
AFD_AVX512 inline __m512i fp8_bits(__m512 y) {
  const __m512i bits = _mm512_castps_si512(y);
  const __m512i a = _mm512_and_si512(bits, splat(0x7FFFFFFFu));
  const __m512i odd = _mm512_and_si512(_mm512_srli_epi32(a, 20), splat(1u));
  __m512i normal = _mm512_add_epi32(a, splat((uint32_t(7 - 127) << 23) + 0x7FFFFu));
  normal = _mm512_srli_epi32(_mm512_add_epi32(normal, odd), 20);
  const __mmask16 rare = _mm512_cmpge_epu32_mask(a, splat(1087u << 20));
  normal = _mm512_min_epu32(normal, splat(0x7Eu));
  const __m512i magic = splat(141u << 23);
  const __m512 sum = _mm512_add_ps(_mm512_castsi512_ps(a), _mm512_castsi512_ps(magic));
  const __m512i subnormal = _mm512_sub_epi32(_mm512_castps_si512(sum), magic);
  __m512i r = _mm512_mask_mov_epi32(normal, _mm512_cmplt_epu32_mask(a, splat(121u << 23)),
                                    subnormal);
  if (__builtin_expect(rare != 0, 0)) {
    const __m512i big = _mm512_mask_mov_epi32(
        splat(0x7Eu), _mm512_cmpgt_epu32_mask(a, splat(0x7F800000u)), splat(0x7Fu));
    r = _mm512_mask_mov_epi32(r, rare, big);
  }
  // r | (sign >> 24): the sign bit lands on bit 7, the byte's sign.
  return _mm512_ternarylogic_epi32(r, _mm512_srli_epi32(bits, 24), splat(0x80u), 0xF8);
}

// |x| maximum of a group as fp32, or -1 when the group holds a NaN.
AFD_AVX512 inline float group_amax(const float* x, int64_t n) {
  __m512 vmax = _mm512_setzero_ps();
  int64_t i = 0;
  for (; i + kLanes <= n; i += kLanes) {
    vmax = _mm512_max_ps(_mm512_abs_ps(_mm512_loadu_ps(x + i)), vmax);
  }
  if (i < n) vmax = _mm512_max_ps(_mm512_abs_ps(load(x + i, lanes(n - i))), vmax);
  // vmaxps returns its second operand, the running max, for a NaN element,
  // as the scalar `a > amax ? a : amax` keeps amax; so no NaN check here.
  // Max of values >= +0 that are never NaN is exact and order-free.
  return _mm512_reduce_max_ps(vmax);
}

// bf16 and fp16 are sign-magnitude: with the sign cleared, their bits order
// as their values, so 32 lanes of 16-bit unsigned max find the amax (then
// converted exactly). A NaN's bits exceed infinity's: the caller's scalar
// code handles such a group (NaN must be skipped, not picked).
template <typename half_t>
AFD_AVX512 inline uint32_t group_amax_bits(const half_t* x, int64_t n) {
  const __m512i magnitude = _mm512_set1_epi16(0x7FFF);
  __m512i vmax = _mm512_setzero_si512();
  int64_t i = 0;
  for (; i + 32 <= n; i += 32) {
    vmax = _mm512_max_epu16(_mm512_and_si512(_mm512_loadu_si512(x + i), magnitude), vmax);
  }
  if (i < n) {
    const __mmask32 m = n - i >= 32 ? ~__mmask32(0) : __mmask32((1u << (n - i)) - 1u);
    vmax = _mm512_max_epu16(_mm512_and_si512(_mm512_maskz_loadu_epi16(m, x + i), magnitude),
                            vmax);
  }
  // Fold 32 lanes to one: 512 -> 256 -> 128 bits, then within 128 bits.
  __m256i v = _mm256_max_epu16(_mm512_castsi512_si256(vmax), _mm512_extracti64x4_epi64(vmax, 1));
  __m128i w = _mm_max_epu16(_mm256_castsi256_si128(v), _mm256_extracti128_si256(v, 1));
  w = _mm_max_epu16(w, _mm_srli_si128(w, 8));
  w = _mm_max_epu16(w, _mm_srli_si128(w, 4));
  w = _mm_max_epu16(w, _mm_srli_si128(w, 2));
  return static_cast<uint32_t>(_mm_extract_epi16(w, 0));
}

template <typename scalar_t>
AFD_AVX512 void quantize_row(const scalar_t* x, int64_t hidden, int64_t group, uint8_t* q,
                             float* scales) {
  for (int64_t g0 = 0, gi = 0; g0 < hidden; g0 += group, ++gi) {
    const int64_t n = std::min(hidden, g0 + group) - g0;
    const scalar_t* xg = x + g0;
    uint8_t* qg = q + g0;
    float amax;
    if constexpr (std::is_same_v<scalar_t, float>) {
      amax = group_amax(xg, n);
    } else {
      const uint32_t top = group_amax_bits(xg, n);
      constexpr uint32_t kInf = std::is_same_v<scalar_t, c10::BFloat16> ? 0x7F80u : 0x7C00u;
      if (__builtin_expect(top > kInf, 0)) {  // a NaN: the scalar code skips it
        quantize_row_scalar(xg, n, n, qg, scales + gi);
        continue;
      }
      amax = static_cast<float>(scalar_t(static_cast<uint16_t>(top), scalar_t::from_bits()));
    }
    const float scale = group_scale(amax);
    scales[gi] = scale;
    const __m512 vscale = _mm512_set1_ps(scale);
    int64_t i = 0;
    for (; i + kLanes <= n; i += kLanes) {
      const __m512 y = _mm512_div_ps(load(xg + i, __mmask16(0xFFFF)), vscale);
      _mm_storeu_si128(reinterpret_cast<__m128i*>(qg + i), _mm512_cvtepi32_epi8(fp8_bits(y)));
    }
    if (i < n) {
      const __mmask16 m = lanes(n - i);
      const __m512 y = _mm512_div_ps(load(xg + i, m), vscale);
      _mm_mask_storeu_epi8(qg + i, m, _mm512_cvtepi32_epi8(fp8_bits(y)));
    }
  }
}

// kFp8Table.value[q] * scale for 16 bytes, rounded once as the scalar code
// rounds it. The byte's exponent and mantissa fields, moved to bits 23-26 and
// 20-22 of an fp32, are that fp8 value times 2^-120 exactly, for fp8
// subnormals too (they land on fp32 subnormals); times 2^120 * scale is then
// one rounding of value * scale (scale * 2^120 is exact while scale < 2^7;
// larger scales multiply by 2^120 first, also exact). The sign is applied
// after the product (rounding is symmetric). 0x7f / 0xff are NaN: a step
// holding one uses the table's NaN bits. Needs denormal inputs honoured
// (MXCSR.DAZ clear): dequantize() checks and runs the scalar code otherwise.
AFD_AVX512 inline __m512 fp8_times(__m128i bytes, __m512 factor, bool split, __m512 scale) {
  const __m512i b = _mm512_cvtepu8_epi32(bytes);
  const __m512i mag = _mm512_and_si512(_mm512_slli_epi32(b, 20), splat(0x07F00000u));
  __m512 v = _mm512_castsi512_ps(mag);
  const __mmask16 nan = _mm512_cmpeq_epi32_mask(mag, splat(0x07F00000u));
  if (__builtin_expect(nan != 0, 0)) {
    v = _mm512_mask_mov_ps(v, nan, _mm512_castsi512_ps(splat(0x7FF00000u)));
  }
  __m512 y = _mm512_mul_ps(v, factor);
  if (split) y = _mm512_mul_ps(y, scale);
  // y ^ (b << 24 & 0x80000000): the fp8 sign onto the product's.
  return _mm512_castsi512_ps(_mm512_ternarylogic_epi32(
      _mm512_castps_si512(y), _mm512_slli_epi32(b, 24), splat(0x80000000u), 0x78));
}

// fp32 -> the compute dtype, as c10 rounds it, for 16 lanes under a mask.
AFD_AVX512 inline __m512i bf16_bits(__m512 y) {
  // c10::BFloat16(float): NaN -> 0x7fc0, else round the low 16 bits to
  // nearest even by an integer addition.
  const __m512i u = _mm512_castps_si512(y);
  const __m512i odd = _mm512_and_si512(_mm512_srli_epi32(u, 16), splat(1u));
  __m512i h = _mm512_srli_epi32(_mm512_add_epi32(u, _mm512_add_epi32(odd, splat(0x7FFFu))), 16);
  return _mm512_mask_mov_epi32(h, _mm512_cmp_ps_mask(y, y, _CMP_UNORD_Q), splat(0x7FC0u));
}
AFD_AVX512 inline __m256i fp16_bits(__m512 y) {
  // c10::Half(float) rounds to nearest even (vcvtps2ph with RNE gives the
  // same bits for every non-NaN value) and writes NaN as sign | 0x7e00.
  __m256i h = _mm512_cvtps_ph(y, _MM_FROUND_TO_NEAREST_INT | _MM_FROUND_NO_EXC);
  const __mmask16 nan = _mm512_cmp_ps_mask(y, y, _CMP_UNORD_Q);
  if (__builtin_expect(nan != 0, 0)) {
    const __m512i sign = _mm512_srli_epi32(_mm512_castps_si512(y), 16);
    const __m256i bits = _mm512_cvtepi32_epi16(
        _mm512_or_si512(_mm512_and_si512(sign, splat(0x8000u)), splat(0x7E00u)));
    h = _mm256_mask_mov_epi16(h, nan, bits);
  }
  return h;
}
AFD_AVX512 inline void store(float* p, __mmask16 m, __m512 y) { _mm512_mask_storeu_ps(p, m, y); }
AFD_AVX512 inline void store(float* p, __m512 y) { _mm512_storeu_ps(p, y); }
AFD_AVX512 inline void store(c10::BFloat16* p, __mmask16 m, __m512 y) {
  _mm256_mask_storeu_epi16(p, m, _mm512_cvtepi32_epi16(bf16_bits(y)));
}
AFD_AVX512 inline void store(c10::BFloat16* p, __m512 y) {
  _mm256_storeu_si256(reinterpret_cast<__m256i*>(p), _mm512_cvtepi32_epi16(bf16_bits(y)));
}
AFD_AVX512 inline void store(c10::Half* p, __mmask16 m, __m512 y) {
  _mm256_mask_storeu_epi16(p, m, fp16_bits(y));
}
AFD_AVX512 inline void store(c10::Half* p, __m512 y) {
  _mm256_storeu_si256(reinterpret_cast<__m256i*>(p), fp16_bits(y));
}

template <typename scalar_t>
AFD_AVX512 void dequantize_row(const uint8_t* q, const float* scales, int64_t hidden,
                               int64_t group, scalar_t* out) {
  const float two_120 = 0x1p120f;
  for (int64_t g0 = 0, gi = 0; g0 < hidden; g0 += group, ++gi) {
    const int64_t n = std::min(hidden, g0 + group) - g0;
    const float scale = scales[gi];
    const bool split = !(std::fabs(scale) < 0x1p7f);  // NaN too
    const __m512 factor = _mm512_set1_ps(split ? two_120 : scale * two_120);
    const __m512 vscale = _mm512_set1_ps(scale);
    int64_t i = 0;
    for (; i + kLanes <= n; i += kLanes) {
      const __m128i b = _mm_loadu_si128(reinterpret_cast<const __m128i*>(q + g0 + i));
      store(out + g0 + i, fp8_times(b, factor, split, vscale));
    }
    if (i < n) {
      const __mmask16 m = lanes(n - i);
      store(out + g0 + i, m, fp8_times(_mm_maskz_loadu_epi8(m, q + g0 + i), factor, split, vscale));
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
  // fp8_times relies on fp32 subnormal inputs (MXCSR.DAZ, bit 6, clear), the
  // default; torch.set_flush_denormal(True) sets it, and then the scalar code
  // runs (its own results change under that mode as well).
  if (__builtin_expect((_mm_getcsr() & 0x40u) != 0, 0)) {
    dequantize_row_scalar(q, scales, hidden, group, static_cast<scalar_t*>(out));
    return;
  }
  dequantize_row(q, scales, hidden, group, static_cast<scalar_t*>(out));
}

const PackKernels kAvx512 = {
    "avx512",
    {quantize<float>, quantize<c10::BFloat16>, quantize<c10::Half>},
    {dequantize<float>, dequantize<c10::BFloat16>, dequantize<c10::Half>},
};

}  // namespace

const PackKernels* avx512_pack_kernels() { return &kAvx512; }

}  // namespace cpu
}  // namespace afd

#else  // not x86-64: no AVX-512 table

namespace afd {
namespace cpu {
const PackKernels* avx512_pack_kernels() { return nullptr; }
}  // namespace cpu
}  // namespace afd

#endif
