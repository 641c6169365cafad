// SPDX-License-Identifier: Apache-2.0
// SPDX-FileCopyrightText: Copyright contributors to the vllm-afd project
//
// The single schema of the `afd` op library. Backends register their kernels
// with TORCH_LIBRARY_IMPL(afd, <dispatch key>): csrc/cpu, csrc/cuda; Ascend NPUs
// (PrivateUse1) get torch-op implementations from vllm/afd/kernels/composite.py
// (csrc/npu/README.md).
#include <Python.h>
#include <torch/library.h>

#include "pack.h"

namespace afd {

PackLayout check_pack_args(const at::Tensor& hidden,
                           const c10::optional<at::Tensor>& topk_ids,
                           const c10::optional<at::Tensor>& topk_weights,
                           int64_t group_size, const at::Tensor& slot, bool pack) {
  const char* op = pack ? "afd::pack" : "afd::unpack";
  TORCH_CHECK(hidden.dim() == 2, op, ": hidden must be [tokens, hidden], got ",
              hidden.sizes());
  TORCH_CHECK(hidden.scalar_type() == at::kFloat || hidden.scalar_type() == at::kBFloat16 ||
                  hidden.scalar_type() == at::kHalf,
              op, ": hidden must be float32, bfloat16 or float16, got ",
              hidden.scalar_type());
  TORCH_CHECK(hidden.is_contiguous(), op, ": hidden must be contiguous");
  TORCH_CHECK(group_size >= 0, op, ": group_size must be >= 0 (0: exact), got ",
              group_size);
  TORCH_CHECK(topk_ids.has_value() == topk_weights.has_value(), op,
              ": topk_ids and topk_weights come together");
  TORCH_CHECK(slot.dim() == 1 && slot.scalar_type() == at::kByte && slot.is_contiguous(),
              op, ": slot must be a contiguous 1-D uint8 tensor, got ", slot.scalar_type(),
              " ", slot.sizes());
  TORCH_CHECK(slot.device() == hidden.device(), op, ": slot is on ", slot.device(),
              ", hidden on ", hidden.device());
  const int64_t tokens = hidden.size(0);
  int64_t topk = 0;
  if (topk_ids.has_value()) {
    const at::Tensor& ids = *topk_ids;
    const at::Tensor& w = *topk_weights;
    TORCH_CHECK(ids.dim() == 2 && ids.size(0) == tokens, op,
                ": topk_ids must be [", tokens, ", topk], got ", ids.sizes());
    TORCH_CHECK(w.sizes() == ids.sizes(), op, ": topk_weights ", w.sizes(),
                " and topk_ids ", ids.sizes(), " differ in shape");
    TORCH_CHECK(ids.scalar_type() == at::kInt || ids.scalar_type() == at::kLong, op,
                ": topk_ids must be int32 or int64, got ", ids.scalar_type());
    TORCH_CHECK(w.scalar_type() == at::kFloat, op, ": topk_weights must be float32, got ",
                w.scalar_type());
    TORCH_CHECK(ids.is_contiguous() && w.is_contiguous(), op,
                ": topk_ids and topk_weights must be contiguous");
    TORCH_CHECK(ids.device() == hidden.device() && w.device() == hidden.device(), op,
                ": topk_ids and topk_weights must be on hidden's device ", hidden.device());
    topk = ids.size(1);
  }
  const PackLayout layout =
      pack_layout(tokens, hidden.size(1), hidden.element_size(), group_size, topk);
  TORCH_CHECK(slot.numel() == layout.total, op, ": slot has ", slot.numel(),
              " bytes, the layout of ", tokens, " tokens x ", hidden.size(1), " ",
              hidden.scalar_type(), (group_size > 0 ? " as fp8" : " exact"), ", topk ", topk,
              " needs ", layout.total);
  return layout;
}

}  // namespace afd

TORCH_LIBRARY(afd, m) {
  // group_size 0: exact; > 0: fp8 e4m3 with one fp32 scale per group_size
  // elements of a token (csrc/pack.h has the slot layout and the error bound).
  m.def(
      "pack(Tensor hidden, Tensor? topk_ids, Tensor? topk_weights, int group_size, "
      "Tensor(a!) slot) -> ()");
  m.def(
      "unpack(Tensor slot, int group_size, Tensor(a!) hidden, Tensor(b!)? topk_ids, "
      "Tensor(c!)? topk_weights) -> ()");
  // The CPU pack/unpack kernels' instruction set (scalar, avx2, avx512),
  // chosen on first use: the one in use, the ones this CPU runs (widest
  // first), and a switch for tests and benchmarks (returns the previous one).
  // VLLM_AFD_CPU_ISA forces the first choice.
  m.def("cpu_isa() -> str");
  m.def("cpu_isas() -> str[]");
  m.def("set_cpu_isa(str isa) -> str");
}

// `import vllm.afd._C` loads this library (and with it the registrations
// above); the module holds the shm message lane's functions (csrc/cpu/lane.cpp).
// Limited API, so one build serves every CPython >= 3.8 (the wheel is tagged
// abi3, like upstream's _C).
extern PyMethodDef afd_lane_methods[];
static struct PyModuleDef afd_module = {PyModuleDef_HEAD_INIT, "_C", nullptr, 0,
                                        afd_lane_methods};

PyMODINIT_FUNC PyInit__C(void) { return PyModule_Create(&afd_module); }
