// SPDX-License-Identifier: Apache-2.0
// SPDX-FileCopyrightText: Copyright contributors to the vllm-afd project
//
// The single schema of the `afd` op library. Backends register their kernels
// with TORCH_LIBRARY_IMPL(afd, <dispatch key>) in csrc/{cpu,cuda,npu}.
#include <Python.h>
#include <torch/library.h>

#include <algorithm>

#include "ops.h"

namespace afd {

int64_t check_rows_args(const at::Tensor& src, const at::Tensor& index,
                        const at::Tensor& out, bool gather) {
  const char* op = gather ? "afd::gather_rows" : "afd::scatter_rows";
  TORCH_CHECK(src.dim() >= 1 && src.dim() == out.dim(), op,
              ": src and out must have the same rank >= 1, got ", src.sizes(),
              " and ", out.sizes());
  for (int64_t d = 1; d < src.dim(); ++d) {
    TORCH_CHECK(src.size(d) == out.size(d), op,
                ": src and out rows differ in shape: ", src.sizes(), " vs ",
                out.sizes());
  }
  TORCH_CHECK(src.scalar_type() == out.scalar_type(), op,
              ": dtype mismatch, src ", src.scalar_type(), " out ",
              out.scalar_type());
  TORCH_CHECK(index.dim() == 1, op, ": index must be 1-D, got ", index.sizes());
  TORCH_CHECK(index.scalar_type() == at::kLong || index.scalar_type() == at::kInt,
              op, ": index must be int64 or int32, got ", index.scalar_type());
  const int64_t rows = gather ? out.size(0) : src.size(0);
  TORCH_CHECK(index.numel() == rows, op, ": index has ", index.numel(),
              " entries for ", rows, " rows");
  TORCH_CHECK(src.device() == out.device() && src.device() == index.device(),
              op, ": src, index and out must be on one device");
  TORCH_CHECK(src.is_contiguous() && out.is_contiguous(), op,
              ": src and out must be contiguous");
  return src.dim() == 1 ? src.element_size()
                        : src.numel() / std::max<int64_t>(src.size(0), 1) *
                              src.element_size();
}

}  // namespace afd

TORCH_LIBRARY(afd, m) {
  m.def("gather_rows(Tensor src, Tensor index, Tensor(a!) out) -> ()");
  m.def("scatter_rows(Tensor src, Tensor index, Tensor(a!) out) -> ()");
}

// `import vllm.afd._C` loads this library (and with it the registrations
// above); the module itself is empty. Limited API, so one build serves every
// CPython >= 3.8 (the wheel is tagged abi3, like upstream's _C).
static struct PyModuleDef afd_module = {PyModuleDef_HEAD_INIT, "_C", nullptr,
                                        0, nullptr};

PyMODINIT_FUNC PyInit__C(void) { return PyModule_Create(&afd_module); }
