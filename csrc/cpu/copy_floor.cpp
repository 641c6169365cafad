// SPDX-License-Identifier: Apache-2.0
// SPDX-FileCopyrightText: Copyright contributors to the vllm-afd project
//
// The physical floor of an shm layer call's round trip on this host, for
// benchmarks/link_latency.py to print beside the connector's own round trip.
//
// The shm connector moves a layer call's payload with three copies: the
// attention side copies its hidden states into a ring slot, the FFN computes
// from a view of that slot and copies its output into a slot of the other
// ring, the attention side copies that slot into its output tensor. Two of
// the copies read what the other core just wrote, so on a VM whose two vCPUs
// sit on different core complexes (or sockets) the cache lines cross the
// interconnect, and that, not Python or the protocol, can be most of a round
// trip at 64 KiB. Here the same three copies and the same two hand-overs (a
// release store of a sequence word, a spin with PAUSE on it) run between two
// threads pinned to the two cores, with nothing else: no Python, no headers,
// no checks, no compute. No connector can be faster on these cores.
//
// copy_floor(nbytes, iters, core_a, core_b, streamed=False) -> list of round
// trips in ns (the first tenth of iters are warm-up and not returned).
// streamed: the two copies into slots use non-temporal stores, as the lane's
// copier may (slot_copy.h); the copy out to the caller's tensor stays cached.
#include <Python.h>
#include <pthread.h>
#include <sched.h>
#include <stdint.h>
#include <stdlib.h>
#include <string.h>

#include <atomic>
#include <thread>
#include <vector>

#include "slot_copy.h"
#include "spin.h"

namespace {

bool pin_to(int core) {
  if (core >= CPU_SETSIZE) return false;
  cpu_set_t set;
  CPU_ZERO(&set);
  CPU_SET(core, &set);
  return pthread_setaffinity_np(pthread_self(), sizeof(set), &set) == 0;
}

// Each sequence word on a cache line of its own: a shared line would make
// the two waits contend with each other's stores.
struct alignas(64) Word {
  std::atomic<uint32_t> value{0};
};

// Stored by the attention thread when it gives up: the FFN thread ends.
constexpr uint32_t kStop = 0xffffffffu;

// Spin until word holds want; gives up (false) on kStop or after ~2 s (the
// other thread could not be pinned or never ran: an oversubscribed host).
bool spin_until(const Word& word, uint32_t want) {
  int64_t start = afd_now_ns();
  for (uint32_t i = 1;; ++i) {
    uint32_t seen = word.value.load(std::memory_order_acquire);
    if (seen == want) return true;
    if (seen == kStop) return false;
    afd_cpu_relax();
    if ((i & 0xffff) == 0 && afd_now_ns() - start > 2000000000LL) return false;
  }
}

struct Buffers {
  std::vector<uint8_t*> all;
  ~Buffers() {
    for (uint8_t* p : all) free(p);
  }
  uint8_t* make(size_t nbytes) {
    void* p = nullptr;
    if (posix_memalign(&p, 4096, nbytes) != 0) return nullptr;
    memset(p, static_cast<int>(all.size() + 1), nbytes);  // fault the pages in
    all.push_back(static_cast<uint8_t*>(p));
    return all.back();
  }
};

// 0 on success, else an error message (the GIL is not held).
void into_slot(uint8_t* slot, const uint8_t* src, size_t nbytes, bool streamed) {
  if (streamed)
    afd_lane::stream_copy(slot, src, nbytes);
  else
    memcpy(slot, src, nbytes);
}

const char* run_floor(size_t nbytes, int iters, int core_a, int core_b, bool streamed,
                      std::vector<int64_t>& out) {
  Buffers buffers;
  uint8_t* src = buffers.make(nbytes);   // the attention side's hidden states
  uint8_t* fwd = buffers.make(nbytes);   // the slot toward the FFN
  uint8_t* back = buffers.make(nbytes);  // the slot toward attention
  uint8_t* dst = buffers.make(nbytes);   // the attention side's output tensor
  if (src == nullptr || fwd == nullptr || back == nullptr || dst == nullptr)
    return "copy_floor: out of memory";
  Word to_ffn, to_attention;
  std::atomic<bool> pinned_b{false}, failed_b{false};
  std::thread ffn([&] {
    if (!pin_to(core_b)) {
      failed_b.store(true);
      return;
    }
    pinned_b.store(true);
    for (int i = 1; i <= iters; ++i) {
      if (!spin_until(to_ffn, static_cast<uint32_t>(i))) {
        failed_b.store(true);
        return;
      }
      into_slot(back, fwd, nbytes, streamed);  // the FFN's output, read from the slot's view
      to_attention.value.store(static_cast<uint32_t>(i), std::memory_order_release);
    }
  });
  cpu_set_t saved;
  bool restore = pthread_getaffinity_np(pthread_self(), sizeof(saved), &saved) == 0;
  const char* error = nullptr;
  if (!pin_to(core_a)) error = "copy_floor: cannot pin to core_a";
  while (error == nullptr && !pinned_b.load() && !failed_b.load()) afd_cpu_relax();
  if (failed_b.load()) error = "copy_floor: cannot pin to core_b";
  int warmup = iters / 10;
  for (int i = 1; error == nullptr && i <= iters; ++i) {
    int64_t t0 = afd_now_ns();
    into_slot(fwd, src, nbytes, streamed);
    to_ffn.value.store(static_cast<uint32_t>(i), std::memory_order_release);
    if (!spin_until(to_attention, static_cast<uint32_t>(i))) {
      error = "copy_floor: the other core did not answer within 2 s";
      break;
    }
    memcpy(dst, back, nbytes);
    int64_t t1 = afd_now_ns();
    if (i > warmup) out.push_back(t1 - t0);
  }
  if (error != nullptr) to_ffn.value.store(kStop);
  ffn.join();
  if (restore) pthread_setaffinity_np(pthread_self(), sizeof(saved), &saved);
  return error;
}

}  // namespace

namespace afd_lane {

PyObject* copy_floor(PyObject*, PyObject* args) {
  unsigned long long nbytes;
  int iters, core_a, core_b, streamed = 0;
  if (!PyArg_ParseTuple(args, "Kiii|p", &nbytes, &iters, &core_a, &core_b, &streamed))
    return nullptr;
  if (nbytes == 0 || iters <= 0 || core_a < 0 || core_b < 0 || core_a == core_b) {
    PyErr_SetString(PyExc_ValueError,
                    "copy_floor: nbytes and iters > 0, two different cores >= 0");
    return nullptr;
  }
  std::vector<int64_t> times;
  const char* error;
  Py_BEGIN_ALLOW_THREADS error = run_floor(nbytes, iters, core_a, core_b, streamed != 0, times);
  Py_END_ALLOW_THREADS if (error != nullptr) {
    PyErr_SetString(PyExc_RuntimeError, error);
    return nullptr;
  }
  PyObject* list = PyList_New(static_cast<Py_ssize_t>(times.size()));
  if (list == nullptr) return nullptr;
  for (size_t i = 0; i < times.size(); ++i)
    PyList_SetItem(list, static_cast<Py_ssize_t>(i), PyLong_FromLongLong(times[i]));
  return list;
}

}  // namespace afd_lane
