// SPDX-License-Identifier: Apache-2.0
// SPDX-FileCopyrightText: Copyright contributors to the vllm-afd project
//
// The shm message lane (lane.cpp has the why): both rings of one connection,
// the message path each way, and the frame templates. Shared by lane.cpp (one
// message per call) and step_calls.cpp (a step's layer calls, prepared once).
#pragma once

#include <Python.h>
#include <stdint.h>
#include <string.h>

#include "slot_copy.h"
#include "spin.h"

extern "C" int afd_doorbell_wait(const uint32_t* word, uint32_t* sleeping, uint32_t seen,
                                 int fd, int64_t spin_ns, int timeout_ms,
                                 const uint32_t* abort);
extern "C" int afd_doorbell_ring(uint32_t* word, const uint32_t* sleeping, uint32_t value,
                                 int fd);

namespace afd_lane {

// Ring layout (shm_ring.py): head, sleeping, tail, the receiver's feedback on
// payload reads (slot_copy.h), then the entries.
constexpr int64_t kHead = 0, kSleeping = 64, kTail = 128, kFeedback = 192, kEntries = 256;
constexpr int kLengthBytes = 4;
// Preempted spins (shm_ring.py, "Preempted spins"): kBackoffPreemptions of the
// last kSpinHistory spins stop spinning for a backoff: kMinBackoffNs, doubled
// for each backoff that follows the last one's end within kMaxBackoffNs, up to
// kMaxBackoffNs. A host's own threads take a spinning core now and then (a few
// times a second on the 2-core VM, a small share of the spins); more runnable
// threads than cores take most spins longer than a time slice.
constexpr int kBackoffPreemptions = 3, kSpinHistory = 8;
constexpr int64_t kMinBackoffNs = 100000000, kMaxBackoffNs = 1000000000;
constexpr const char kCapsule[] = "vllm_afd.lane";

struct Lane {
  uint8_t* tx;  // the ring this side sends on
  uint8_t* rx;  // the ring this side receives from
  int fd;
  uint32_t entries, entry_bytes;
  uint32_t sent = 0, received = 0, peer_tail = 0;
  uint32_t abort = 0;
  uint32_t spins = 0;  // the last kSpinHistory spins, newest in bit 0: 1 = preempted
  int64_t spin_from = 0;  // no spinning before this (a backoff's end)
  int64_t backoff_ns = 0;  // the last backoff's length
  uint64_t preemptions = 0, backoffs = 0;
  SlotCopier copier;  // how this side's payloads go into its slots

  Feedback* feedback(uint8_t* ring) { return reinterpret_cast<Feedback*>(ring + kFeedback); }
  // The payload of the entry posted next, into its slot (slot_copy.h).
  void copy_payload(uint8_t* slot, const uint8_t* src, uint64_t n) {
    copier.fold(feedback(tx));
    copier.copy(slot, src, n, sent);
  }
  // The payload of the entry received next (not consumed yet): copied to dst,
  // or its lines read once when dst is null; the time reported to the sender.
  void read_payload(uint8_t* dst, const uint8_t* slot, uint64_t n) {
    if (n < kMinAdaptiveBytes) {
      if (dst != nullptr) memcpy(dst, slot, n);
      return;
    }
    const int64_t t0 = afd_now_ns();
    if (dst != nullptr)
      memcpy(dst, slot, n);
    else
      touch_lines(slot, n);
    report_read(feedback(rx), received, afd_now_ns() - t0, n);
  }

  uint32_t* word(uint8_t* ring, int64_t offset) {
    return reinterpret_cast<uint32_t*>(ring + offset);
  }
  uint8_t* entry(uint8_t* ring, uint32_t seq) {
    return ring + kEntries + static_cast<int64_t>(seq % entries) * entry_bytes;
  }
  bool may_spin(int64_t now) const { return spin_from == 0 || now >= spin_from; }
  // A spin that began at now ended (cut short by a preemption or not).
  void note_spin(bool preempted, int64_t now) {
    spins = ((spins << 1) | (preempted ? 1u : 0u)) & ((1u << kSpinHistory) - 1);
    if (!preempted) return;
    ++preemptions;
    if (__builtin_popcount(spins) >= kBackoffPreemptions) {
      const bool again = spin_from != 0 && now - spin_from <= kMaxBackoffNs;
      backoff_ns = again ? backoff_ns * 2 : kMinBackoffNs;
      if (backoff_ns > kMaxBackoffNs) backoff_ns = kMaxBackoffNs;
      spin_from = now + backoff_ns;
      ++backoffs;
      spins = 0;
    }
  }
  // Room for one more entry in the send ring?
  bool has_space() {
    if (sent - peer_tail < entries) return true;
    peer_tail = __atomic_load_n(word(tx, kTail), __ATOMIC_ACQUIRE);
    return sent - peer_tail < entries;
  }
  // Write one entry (header bytes) and publish it. 0, 1 (ring full: nothing
  // written) or -errno (published, but the wake-up failed: the peer is gone).
  int post(const uint8_t* header, Py_ssize_t n) {
    if (!has_space()) return 1;
    uint8_t* e = entry(tx, sent);
    const uint32_t len = static_cast<uint32_t>(n);
    memcpy(e, &len, kLengthBytes);
    memcpy(e + kLengthBytes, header, n);
    ++sent;
    return afd_doorbell_ring(word(tx, kHead), word(tx, kSleeping), sent, fd);
  }
  // Wait for the next entry: 1 there, 0 timed out, -1 closed (the peer or this side).
  int wait(int64_t spin_ns, int timeout_ms) {
    // Only a wait for an entry not there yet spins (and counts as a spin).
    const bool there = __atomic_load_n(word(rx, kHead), __ATOMIC_ACQUIRE) != received;
    const int64_t t = there || spin_ns <= 0 ? 0 : afd_now_ns();
    if (t != 0 && !may_spin(t)) spin_ns = 0;
    int status = afd_doorbell_wait(word(rx, kHead), word(rx, kSleeping), received, fd,
                                   spin_ns, timeout_ms, &abort);
    if (__atomic_load_n(&abort, __ATOMIC_SEQ_CST)) return -1;
    if (t != 0 && spin_ns > 0 && status >= 1) note_spin(status == 2, t);
    return status == 2 ? 1 : status;  // 2: arrived, the spin preempted on the way
  }
  // The next entry's header, or nullptr when its length is out of bounds.
  const uint8_t* next_header(uint32_t* n) {
    const uint8_t* e = entry(rx, received);
    memcpy(n, e, kLengthBytes);
    if (*n > entry_bytes - kLengthBytes) return nullptr;
    return e + kLengthBytes;
  }
  void consume() {
    ++received;
    __atomic_store_n(word(rx, kTail), received, __ATOMIC_RELEASE);
  }
};

inline void put_be(uint8_t* p, uint64_t v, int width) {
  for (int i = width - 1; i >= 0; --i, v >>= 8) p[i] = static_cast<uint8_t>(v);
}

// A frame template: the encoded LayerFrame and where its step (8 bytes),
// layer and micro-batch (4 bytes each, big-endian) go.
struct Template {
  PyObject* bytes;  // a bytes object (borrowed)
  const char* buf = nullptr;
  Py_ssize_t len = 0;
  Py_ssize_t step_at, layer_at, ubatch_at;
  bool load() { return PyBytes_AsStringAndSize(bytes, const_cast<char**>(&buf), &len) == 0; }
};

inline bool patch(const Template& t, uint8_t* out, unsigned long long step, unsigned long layer,
           unsigned long ubatch) {
  const Py_ssize_t n = t.len;
  if (t.step_at < 0 || t.step_at + 8 > n || t.layer_at < 0 || t.layer_at + 4 > n ||
      t.ubatch_at < 0 || t.ubatch_at + 4 > n || layer > 0xFFFFFFFFul || ubatch > 0xFFFFFFFFul)
    return false;
  memcpy(out, t.buf, n);
  put_be(out + t.step_at, step, 8);
  put_be(out + t.layer_at, layer, 4);
  put_be(out + t.ubatch_at, ubatch, 4);
  return true;
}

// The lane in a capsule made by lane_new (nullptr and a Python error if not one).
Lane* lane_of(PyObject* capsule);

PyObject* copy_floor(PyObject*, PyObject* args);  // copy_floor.cpp

// A step's layer calls, prepared once per step, on the lane or a socket (step_calls.cpp).
PyObject* step_calls_prepare(PyObject*, PyObject* args);
PyObject* step_calls_post(PyObject*, PyObject* args);
PyObject* step_calls_take(PyObject*, PyObject* args);
PyObject* step_calls_times(PyObject*, PyObject* args);

}  // namespace afd_lane
