// SPDX-License-Identifier: Apache-2.0
// SPDX-FileCopyrightText: Copyright contributors to the vllm-afd project
//
// What every spin-wait of the shm path uses: the CPU's spin hint and the
// monotonic clock in nanoseconds (doorbell.cpp, the lane, copy_floor.cpp).
#pragma once

#include <stdint.h>
#include <time.h>

#if defined(__x86_64__) || defined(__i386__)
#include <immintrin.h>
static inline void afd_cpu_relax() { _mm_pause(); }
#elif defined(__aarch64__)
static inline void afd_cpu_relax() { asm volatile("yield" ::: "memory"); }
#else
static inline void afd_cpu_relax() {}
#endif

static inline int64_t afd_now_ns() {
  timespec ts;
  clock_gettime(CLOCK_MONOTONIC, &ts);
  return static_cast<int64_t>(ts.tv_sec) * 1000000000 + ts.tv_nsec;
}
