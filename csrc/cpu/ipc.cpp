// SPDX-License-Identifier: Apache-2.0
// SPDX-FileCopyrightText: Copyright contributors to the vllm-afd project
//
// The device-resident exchange on the CPU (../ipc.h, vllm/afd/transport/ipc/):
// the CPU is the device and the calling thread its stream, so each operation
// runs at once; the regions are shared memory two processes map. A post's
// payload and record are plain stores, its flag a release store; a take's
// wait is an acquire load of the flag that spins briefly, then yields (two
// roles may share a core), and reads the abort mirror on every round, so a
// host thread's signal() ends it at once. Here the mirror is the control's
// own abort word (memory.py), which the same code serves.
#include <sched.h>
#include <torch/library.h>

#include <cstring>

#include "../ipc.h"
#include "spin.h"

namespace afd {
namespace {

// Spin this long before yielding the core between polls.
constexpr int64_t kSpinNs = 20000;

int32_t load_acquire(const int32_t* word) { return __atomic_load_n(word, __ATOMIC_ACQUIRE); }
void store_release(int32_t* word, int32_t v) { __atomic_store_n(word, v, __ATOMIC_RELEASE); }

bool stopped(const int32_t* control) {
  return load_acquire(control + ipc::kMode) != ipc::kRun ||
         load_acquire(control + ipc::kAbort) != ipc::kNotAborted;
}

void ipc_post_cpu(const at::Tensor& control, const at::Tensor& src, const at::Tensor& dst,
                  const at::Tensor& record, const at::Tensor& flag, int64_t layer,
                  int64_t rows, int64_t topk) {
  ipc::check_post_args(control, src, dst, record, flag, rows, topk);
  int32_t* c = control.data_ptr<int32_t>();
  if (stopped(c)) return;
  if (dst.data_ptr() != src.data_ptr()) {  // packed into the peer's slot already
    std::memcpy(dst.data_ptr(), src.data_ptr(), src.nbytes());
  }
  int32_t* r = record.data_ptr<int32_t>();
  r[ipc::kRecordStep] = load_acquire(c + ipc::kStep);
  r[ipc::kRecordLayer] = static_cast<int32_t>(layer);
  r[ipc::kRecordRows] = static_cast<int32_t>(rows);
  r[ipc::kRecordTopk] = static_cast<int32_t>(topk);
  store_release(flag.data_ptr<int32_t>(), ipc::kReady);  // the payload and record first
}

// Marks the step aborted for `why` in the control and its mirror, unless
// something (the host's release) came first.
void abort_step(int32_t* control, int32_t* mirror, int32_t why) {
  int32_t expected = ipc::kNotAborted;
  __atomic_compare_exchange_n(mirror, &expected, why, false, __ATOMIC_ACQ_REL,
                              __ATOMIC_ACQUIRE);
  __atomic_store_n(control + ipc::kAbort, load_acquire(mirror), __ATOMIC_RELEASE);
}

void ipc_take_cpu(const at::Tensor& control, const at::Tensor& mirror, const at::Tensor& flag,
                  const at::Tensor& record, int64_t layer, int64_t rows, double deadline_s) {
  ipc::check_take_args(control, mirror, flag, record, rows, deadline_s);
  int32_t* c = control.data_ptr<int32_t>();
  int32_t* m = mirror.data_ptr<int32_t>();
  int32_t* f = flag.data_ptr<int32_t>();
  if (stopped(c)) return;
  const int64_t start = afd_now_ns();
  const int64_t deadline = start + static_cast<int64_t>(deadline_s * 1e9);
  while (load_acquire(f) != ipc::kReady) {
    const int32_t released = load_acquire(m);
    if (released != ipc::kNotAborted) {  // the host's release
      abort_step(c, m, released);
      return;
    }
    const int64_t now = afd_now_ns();
    if (now > deadline) {
      abort_step(c, m, ipc::kTimeout);
      return;
    }
    if (now - start < kSpinNs) {
      afd_cpu_relax();
    } else {
      sched_yield();
    }
  }
  const int32_t* r = record.data_ptr<int32_t>();
  if (r[ipc::kRecordStep] != load_acquire(c + ipc::kStep) || r[ipc::kRecordLayer] != layer ||
      r[ipc::kRecordRows] != rows) {
    abort_step(c, m, ipc::kMismatch);
    return;
  }
  store_release(f, ipc::kClear);
}

}  // namespace
}  // namespace afd

TORCH_LIBRARY_IMPL(afd, CPU, m) {
  m.impl("ipc_post", &afd::ipc_post_cpu);
  m.impl("ipc_take", &afd::ipc_take_cpu);
}
