// SPDX-License-Identifier: Apache-2.0
// SPDX-FileCopyrightText: Copyright contributors to the vllm-afd project
//
// A grid-strided byte copy for the CUDA kernels (pack.cu's slot copies,
// ipc.cu's post into the peer's slot).
#pragma once

#include <cstdint>

namespace afd {

// n bytes from src to dst, thread tid of stride; 16-byte words when both are
// 16-byte aligned (kWide), the tail byte by byte.
template <bool kWide>
__device__ __forceinline__ void copy_bytes(uint8_t* __restrict__ dst,
                                           const uint8_t* __restrict__ src, int64_t n,
                                           int64_t tid, int64_t stride) {
  int64_t done = 0;
  if (kWide) {
    const int64_t words = n / 16;
    const uint4* s = reinterpret_cast<const uint4*>(src);
    uint4* d = reinterpret_cast<uint4*>(dst);
    for (int64_t i = tid; i < words; i += stride) d[i] = s[i];
    done = words * 16;
  }
  for (int64_t i = done + tid; i < n; i += stride) dst[i] = src[i];
}

}  // namespace afd
