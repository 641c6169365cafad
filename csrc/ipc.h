// SPDX-License-Identifier: Apache-2.0
// SPDX-FileCopyrightText: Copyright contributors to the vllm-afd project
//
// The device-resident exchange's words (vllm/afd/transport/ipc/layout.py holds
// the same numbers; tests/afd/transport/test_ipc_ops.py compares them), shared
// by the CPU kernels (cpu/ipc.cpp) and the CUDA ones (cuda/ipc.cu), and the
// argument checks of afd::ipc_post / afd::ipc_take (torch_bindings.cpp).
#pragma once

#include <ATen/core/Tensor.h>

#include <cstdint>

namespace afd {
namespace ipc {

// A flag: set by the producer after its payload and record, cleared by the consumer.
constexpr int32_t kClear = 0, kReady = 1;
// The control word MODE: kRun lets the operations act, kIdle makes them no-ops.
constexpr int32_t kIdle = 0, kRun = 1;
// The control word ABORT: why the step stopped (0: it goes on).
constexpr int32_t kNotAborted = 0, kReleased = 1, kTimeout = 2, kMismatch = 3;
// The control words' indices, and a record's.
constexpr int kMode = 0, kAbort = 1, kStep = 2, kControlWords = 3;
constexpr int kRecordStep = 0, kRecordLayer = 1, kRecordRows = 2, kRecordTopk = 3,
              kRecordWords = 4;

// The shapes and dtypes both backends need; raise naming the op and the argument.
void check_post_args(const at::Tensor& control, const at::Tensor& src, const at::Tensor& dst,
                     const at::Tensor& record, const at::Tensor& flag, int64_t rows,
                     int64_t topk);
void check_take_args(const at::Tensor& control, const at::Tensor& mirror,
                     const at::Tensor& flag, const at::Tensor& record, int64_t rows,
                     double deadline_s);

}  // namespace ipc
}  // namespace afd
