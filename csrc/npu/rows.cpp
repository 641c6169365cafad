// SPDX-License-Identifier: Apache-2.0
// SPDX-FileCopyrightText: Copyright contributors to the vllm-afd project
//
// Ascend NPU implementation of afd::gather_rows / afd::scatter_rows through
// torch_npu's ATen kernels (index_select / index_copy run as NPU ops). Built
// only where CANN and torch_npu are installed (setup.py); untested here.
#include <ATen/ATen.h>
#include <torch/library.h>

#include "../ops.h"

namespace afd {
namespace {

void gather_rows_npu(const at::Tensor& src, const at::Tensor& index,
                     at::Tensor& out) {
  check_rows_args(src, index, out, /*gather=*/true);
  at::index_select_out(out, src, 0, index);
}

void scatter_rows_npu(const at::Tensor& src, const at::Tensor& index,
                      at::Tensor& out) {
  check_rows_args(src, index, out, /*gather=*/false);
  out.index_copy_(0, index, src);
}

}  // namespace
}  // namespace afd

TORCH_LIBRARY_IMPL(afd, PrivateUse1, m) {
  m.impl("gather_rows", &afd::gather_rows_npu);
  m.impl("scatter_rows", &afd::scatter_rows_npu);
}
