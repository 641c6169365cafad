// SPDX-License-Identifier: Apache-2.0
// SPDX-FileCopyrightText: Copyright contributors to the vllm-afd project
//
// The single schema of the `afd` op library. Backends register their kernels
// with TORCH_LIBRARY_IMPL(afd, <dispatch key>): csrc/cpu, csrc/cuda; Ascend NPUs
// (PrivateUse1) get torch-op implementations from vllm/afd/kernels/composite.py
// (csrc/npu/README.md).
#include <Python.h>
#include <torch/library.h>

#include "ipc.h"
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

namespace ipc {
namespace {

void check_words(const char* op, const char* name, const at::Tensor& t, int64_t n,
                 const at::Tensor& like) {
  TORCH_CHECK(t.scalar_type() == at::kInt && t.dim() == 1 && t.numel() == n && t.is_contiguous(),
              op, ": ", name, " must be ", n, " contiguous int32 words, got ", t.scalar_type(),
              " ", t.sizes());
  TORCH_CHECK(t.device() == like.device(), op, ": ", name, " is on ", t.device(),
              ", expected ", like.device());
}

}  // namespace

void check_post_args(const at::Tensor& control, const at::Tensor& src, const at::Tensor& dst,
                     const at::Tensor& record, const at::Tensor& flag, int64_t rows,
                     int64_t topk) {
  const char* op = "afd::ipc_post";
  TORCH_CHECK(rows >= 0 && topk >= 0, op, ": rows and topk must be >= 0, got ", rows, ", ",
              topk);
  TORCH_CHECK(src.is_contiguous(), op, ": src must be contiguous, got strides ",
              src.strides());
  TORCH_CHECK(dst.is_contiguous() && dst.scalar_type() == src.scalar_type() &&
                  dst.numel() == src.numel(),
              op, ": dst (", dst.scalar_type(), " ", dst.sizes(),
              ") must be a contiguous tensor of src's dtype and size (", src.scalar_type(), " ",
              src.sizes(), ")");
  TORCH_CHECK(dst.device() == src.device(), op, ": dst is on ", dst.device(), ", src on ",
              src.device());
  check_words(op, "control", control, kControlWords, src);
  check_words(op, "record", record, kRecordWords, src);
  check_words(op, "flag", flag, 1, src);
}

void check_take_args(const at::Tensor& control, const at::Tensor& mirror,
                     const at::Tensor& flag, const at::Tensor& record, int64_t rows,
                     double deadline_s) {
  const char* op = "afd::ipc_take";
  check_words(op, "flag", flag, 1, flag);
  check_words(op, "control", control, kControlWords, flag);
  check_words(op, "mirror", mirror, 1, flag);
  check_words(op, "record", record, kRecordWords, flag);
  TORCH_CHECK(rows >= 0, op, ": rows must be >= 0, got ", rows);
  TORCH_CHECK(deadline_s > 0, op, ": deadline_s must be > 0, got ", deadline_s);
}

}  // namespace ipc
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
  // The device-resident exchange (ipc.h, vllm/afd/transport/ipc/stream.py):
  // a layer call's two stream operations, each a no-op once control says IDLE
  // or aborted. control: this side's 3 words (mode, abort, step); mirror: the
  // abort word's mirror that the host writes while a take waits (only a take
  // polls it; an abort goes to both); dst, record
  // and flag of a post are the peer's, flag and record of a take this side's;
  // rows: the call's token rows (the record's size check; a packed payload's
  // bytes are not rows x hidden); topk: the routing width packed with it (0:
  // none), which the consumer reads from the record after the take.
  m.def(
      "ipc_post(Tensor(a!) control, Tensor src, Tensor(b!) dst, Tensor(c!) record, "
      "Tensor(d!) flag, int layer, int rows, int topk) -> ()");
  m.def(
      "ipc_take(Tensor(a!) control, Tensor(b!) mirror, Tensor(c!) flag, Tensor record, "
      "int layer, int rows, float deadline_s) -> ()");
  // CUDA only: the exchange's memory. ipc_alloc: nbytes of zeroed device memory
  // on like's device, outside torch's caching allocator; ipc_handle: its CUDA
  // IPC handle (uint8 bytes, on the CPU); ipc_open: a peer's memory from its
  // handle, mapped on like's device; ipc_mapped: a pinned host tensor as a
  // tensor on like's device (the same memory: the host writes it while a
  // kernel waits).
  m.def("ipc_alloc(Tensor like, int nbytes) -> Tensor");
  m.def("ipc_handle(Tensor memory) -> Tensor");
  m.def("ipc_open(Tensor handle, Tensor like, int nbytes) -> Tensor");
  m.def("ipc_mapped(Tensor host, Tensor like) -> Tensor");
}

// `import vllm.afd._C` loads this library (and with it the registrations
// above); the module holds the shm message lane's functions (csrc/cpu/lane.cpp).
// Limited API, so one build serves every CPython >= 3.8 (the wheel is tagged
// abi3, like upstream's _C).
extern PyMethodDef afd_lane_methods[];
static struct PyModuleDef afd_module = {PyModuleDef_HEAD_INIT, "_C", nullptr, 0,
                                        afd_lane_methods};

PyMODINIT_FUNC PyInit__C(void) { return PyModule_Create(&afd_module); }
