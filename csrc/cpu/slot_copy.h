// SPDX-License-Identifier: Apache-2.0
// SPDX-FileCopyrightText: Copyright contributors to the vllm-afd project
//
// How a payload goes into an shm slot that the other core reads next: with
// ordinary (cached) stores or with non-temporal (streamed) ones, chosen per
// sending direction by measuring both.
//
// Why two ways. A cached copy into a slot first takes each cache line from
// the core that read it last (the peer), and the peer then takes every line
// back from this core: two cache-to-cache transfers per line. Streamed stores
// write around the caches to memory, and the peer reads from memory. Which is
// faster depends on where the two cores sit, and on a VM that changes while it
// runs: measured on the 2-core AMD EPYC VM (three copies per round trip, as a
// layer call makes), 64 KiB round trips took 3.6 us cached and 13 us streamed
// when the two vCPUs shared a core's caches, 17-22 us cached and 11-13 us
// streamed in other minutes, and 63-78 us cached and 12 us streamed in others
// (csrc/cpu/copy_floor.cpp measures both; `make bench-link` prints them).
//
// So each direction's sender measures what a payload cost: its own copy's
// time, plus the receiver's time to read it, which the receiver reports in the
// ring's feedback line (its copy out, or a pass that touches every line of
// the slot when the caller computes straight from it: the lines would be read
// then anyway). Per byte, per mode, averaged; the cheaper mode is used and
// the other tried every kExploreEvery payloads, so a change of placement is
// followed within a few hundred layer calls. Payloads under kMinAdaptiveBytes
// are always cached (a few cache lines: the measurement would cost more than
// it could save). "on" and "off" force one mode (connector_extra_config
// stream_copies; tests and benchmarks).
#pragma once

#include <stdint.h>
#include <string.h>

#if defined(__x86_64__) || defined(__i386__)
#include <immintrin.h>
#define AFD_HAVE_STREAM_STORES 1
#else
#define AFD_HAVE_STREAM_STORES 0
#endif

#include "spin.h"

namespace afd_lane {

enum CopyMode : uint8_t { kCached = 0, kStreamed = 1, kUntimed = 255 };
enum CopyPolicy : int { kPolicyAuto = 0, kPolicyCached = 1, kPolicyStreamed = 2 };

constexpr uint64_t kMinAdaptiveBytes = 4096;
constexpr uint32_t kExploreEvery = 32;  // payloads between two tries of the other mode
constexpr uint32_t kFirstSamples = 4;   // tries of each mode before choosing
constexpr double kAlpha = 0.25;         // weight of a new sample in the average
constexpr int kRecords = 64;            // sent payloads awaiting their read time

// Written by the receiver into the ring it receives from (offset kFeedback,
// a cache line of its own), read by that ring's sender.
struct Feedback {
  uint32_t seq;  // 1 + the sequence number of the entry whose payload was timed
  uint32_t reserved;
  int64_t read_ns;
  uint64_t nbytes;
};

// Streamed copy: 16-byte non-temporal stores where dst is aligned (slots are
// 64-byte aligned), ordinary stores for an unaligned head and the tail, then
// a store fence: the entry that publishes the payload must not become visible
// before it.
inline void stream_copy(uint8_t* dst, const uint8_t* src, uint64_t n) {
#if AFD_HAVE_STREAM_STORES
  uint64_t head = (16 - (reinterpret_cast<uintptr_t>(dst) & 15)) & 15;
  if (head > n) head = n;
  if (head) memcpy(dst, src, head);
  uint64_t i = head;
  for (; i + 64 <= n; i += 64) {
    const __m128i a = _mm_loadu_si128(reinterpret_cast<const __m128i*>(src + i));
    const __m128i b = _mm_loadu_si128(reinterpret_cast<const __m128i*>(src + i + 16));
    const __m128i c = _mm_loadu_si128(reinterpret_cast<const __m128i*>(src + i + 32));
    const __m128i d = _mm_loadu_si128(reinterpret_cast<const __m128i*>(src + i + 48));
    _mm_stream_si128(reinterpret_cast<__m128i*>(dst + i), a);
    _mm_stream_si128(reinterpret_cast<__m128i*>(dst + i + 16), b);
    _mm_stream_si128(reinterpret_cast<__m128i*>(dst + i + 32), c);
    _mm_stream_si128(reinterpret_cast<__m128i*>(dst + i + 48), d);
  }
  for (; i + 16 <= n; i += 16)
    _mm_stream_si128(reinterpret_cast<__m128i*>(dst + i),
                     _mm_loadu_si128(reinterpret_cast<const __m128i*>(src + i)));
  if (i < n) memcpy(dst + i, src + i, n - i);
  _mm_sfence();
#else
  memcpy(dst, src, n);
#endif
}

// Read every cache line of [p, p + n) once (the receiver's read, timed, when
// the caller computes from the slot itself).
inline void touch_lines(const uint8_t* p, uint64_t n) {
  uint64_t sum = 0;
  for (uint64_t i = 0; i < n; i += 64) sum += *reinterpret_cast<const volatile uint8_t*>(p + i);
  if (n) sum += *reinterpret_cast<const volatile uint8_t*>(p + n - 1);
  __asm__ __volatile__("" : : "r"(sum) : "memory");
}

struct SlotCopier {
  int policy = kPolicyAuto;
  double cost[2] = {0.0, 0.0};  // ns per byte: sender's copy + receiver's read
  uint32_t samples[2] = {0, 0};
  uint32_t eligible = 0;  // adaptive payloads sent
  uint32_t feedback_seen = 0;
  uint64_t bytes[2] = {0, 0};  // payload bytes sent each way
  struct Record {
    uint32_t seq = 0;
    uint8_t mode = kUntimed;
    int64_t write_ns = 0;
  } records[kRecords];

  int choose(uint64_t n) {
    if (policy == kPolicyCached || !AFD_HAVE_STREAM_STORES) return kCached;
    if (policy == kPolicyStreamed) return kStreamed;
    if (n < kMinAdaptiveBytes) return kCached;
    const uint32_t k = eligible++;
    if (samples[kCached] < kFirstSamples || samples[kStreamed] < kFirstSamples)
      return (k & 1) ? kStreamed : kCached;
    const int best = cost[kStreamed] < cost[kCached] ? kStreamed : kCached;
    return k % kExploreEvery == kExploreEvery - 1 ? 1 - best : best;
  }

  // Copy n bytes into the slot for the entry with sequence number seq.
  void copy(uint8_t* slot, const uint8_t* src, uint64_t n, uint32_t seq) {
    const int mode = choose(n);
    const bool timed = policy == kPolicyAuto && n >= kMinAdaptiveBytes && AFD_HAVE_STREAM_STORES;
    const int64_t t0 = timed ? afd_now_ns() : 0;
    if (mode == kStreamed)
      stream_copy(slot, src, n);
    else
      memcpy(slot, src, n);
    bytes[mode] += n;
    Record& r = records[seq % kRecords];
    r.seq = seq;
    r.mode = timed ? static_cast<uint8_t>(mode) : kUntimed;
    r.write_ns = timed ? afd_now_ns() - t0 : 0;
  }

  // Fold the receiver's latest report (in the ring this side sends on).
  void fold(const Feedback* fb) {
    const uint32_t s1 = __atomic_load_n(&fb->seq, __ATOMIC_ACQUIRE);
    if (s1 == feedback_seen || s1 == 0) return;
    const int64_t read_ns = __atomic_load_n(&fb->read_ns, __ATOMIC_RELAXED);
    const uint64_t n = __atomic_load_n(&fb->nbytes, __ATOMIC_RELAXED);
    __atomic_thread_fence(__ATOMIC_ACQUIRE);
    if (__atomic_load_n(&fb->seq, __ATOMIC_RELAXED) != s1) return;  // being rewritten
    feedback_seen = s1;
    const Record& r = records[(s1 - 1) % kRecords];
    if (r.seq != s1 - 1 || r.mode == kUntimed || n == 0 || read_ns < 0) return;
    const double per_byte = static_cast<double>(r.write_ns + read_ns) / static_cast<double>(n);
    double& c = cost[r.mode];
    c = samples[r.mode]++ == 0 ? per_byte : c + kAlpha * (per_byte - c);
  }
};

// The receiver's report of how long the payload of entry seq took to read.
inline void report_read(Feedback* fb, uint32_t seq, int64_t read_ns, uint64_t n) {
  __atomic_store_n(&fb->seq, 0u, __ATOMIC_RELAXED);
  __atomic_thread_fence(__ATOMIC_RELEASE);
  __atomic_store_n(&fb->read_ns, read_ns, __ATOMIC_RELAXED);
  __atomic_store_n(&fb->nbytes, n, __ATOMIC_RELAXED);
  __atomic_store_n(&fb->seq, seq + 1, __ATOMIC_RELEASE);
}

}  // namespace afd_lane
