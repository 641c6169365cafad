// SPDX-License-Identifier: Apache-2.0
// SPDX-FileCopyrightText: Copyright contributors to the vllm-afd project
//
// Which row kernels the CPU pack/unpack run (pack_isa.h): the scalar table,
// the choice among the ISA tables, and the ops that report and switch it
// (afd::cpu_isa, afd::cpu_isas, afd::set_cpu_isa).
//
// The choice is made once, on first use, not per call: the widest ISA this
// CPU (and its OS, which must save the wider registers) runs, or the one
// VLLM_AFD_CPU_ISA names. A forced ISA the CPU lacks is an error, not a
// crash on an illegal instruction.
#include <ATen/core/Tensor.h>
#include <c10/util/Exception.h>
#include <torch/library.h>

#include <atomic>
#include <cstdlib>
#include <mutex>

#include "pack_isa.h"

namespace afd {
namespace cpu {
namespace {

template <typename scalar_t>
void quantize_scalar(const void* x, int64_t hidden, int64_t group, uint8_t* q,
                     float* scales) {
  quantize_row_scalar(static_cast<const scalar_t*>(x), hidden, group, q, scales);
}

template <typename scalar_t>
void dequantize_scalar(const uint8_t* q, const float* scales, int64_t hidden, int64_t group,
                       void* out) {
  dequantize_row_scalar(q, scales, hidden, group, static_cast<scalar_t*>(out));
}

const PackKernels kScalar = {
    "scalar",
    {quantize_scalar<float>, quantize_scalar<c10::BFloat16>, quantize_scalar<c10::Half>},
    {dequantize_scalar<float>, dequantize_scalar<c10::BFloat16>,
     dequantize_scalar<c10::Half>},
};

// The ISA tables this CPU runs, widest first.
std::vector<const PackKernels*> runnable() {
  std::vector<const PackKernels*> out;
#if defined(__x86_64__) && (defined(__GNUC__) || defined(__clang__))
  __builtin_cpu_init();  // may run before libgcc's own constructor
  // AVX-512 kernels use F (arithmetic, conversions), BW and VL (16-bit and
  // byte lanes, masked narrow loads and stores); the AVX2 ones need F16C for
  // fp16. __builtin_cpu_supports also checks the OS enabled the registers.
  if (__builtin_cpu_supports("avx512f") && __builtin_cpu_supports("avx512bw") &&
      __builtin_cpu_supports("avx512vl") && avx512_pack_kernels() != nullptr) {
    out.push_back(avx512_pack_kernels());
  }
  if (__builtin_cpu_supports("avx2") && __builtin_cpu_supports("f16c") &&
      avx2_pack_kernels() != nullptr) {
    out.push_back(avx2_pack_kernels());
  }
#endif
  out.push_back(&kScalar);
  return out;
}

const std::vector<const PackKernels*>& runnable_cached() {
  static const std::vector<const PackKernels*> tables = runnable();
  return tables;
}

std::string isa_list() {
  std::string names;
  for (const PackKernels* k : runnable_cached()) {
    names += (names.empty() ? "" : ", ") + std::string(k->isa);
  }
  return names;
}

const PackKernels* find(const std::string& isa, const char* who) {
  for (const PackKernels* k : runnable_cached()) {
    if (isa == k->isa) return k;
  }
  TORCH_CHECK(false, who, ": ISA '", isa, "' is not one this CPU runs (", isa_list(),
              "; scalar, avx2 and avx512 exist)");
  return nullptr;  // not reached
}

std::atomic<const PackKernels*> g_active{nullptr};
std::mutex g_choose;

const PackKernels* choose() {
  const char* forced = std::getenv("VLLM_AFD_CPU_ISA");
  if (forced != nullptr && forced[0] != '\0') return find(forced, "VLLM_AFD_CPU_ISA");
  return runnable_cached().front();
}

}  // namespace

const PackKernels* scalar_pack_kernels() { return &kScalar; }

std::vector<std::string> supported_isas() {
  std::vector<std::string> names;
  for (const PackKernels* k : runnable_cached()) names.emplace_back(k->isa);
  return names;
}

const PackKernels& pack_kernels() {
  const PackKernels* k = g_active.load(std::memory_order_acquire);
  if (k != nullptr) return *k;
  std::lock_guard<std::mutex> lock(g_choose);
  k = g_active.load(std::memory_order_relaxed);
  if (k == nullptr) {
    k = choose();  // throws on a bad VLLM_AFD_CPU_ISA; the next call tries again
    g_active.store(k, std::memory_order_release);
  }
  return *k;
}

}  // namespace cpu

std::string cpu_isa() { return cpu::pack_kernels().isa; }

std::vector<std::string> cpu_isas() { return cpu::supported_isas(); }

// For tests and benchmarks: the kernels of every ISA in one process. Calls
// already running finish on the table they started with.
std::string set_cpu_isa(const std::string& isa) {
  const cpu::PackKernels* next = cpu::find(isa, "afd::set_cpu_isa");
  const std::string previous = cpu_isa();
  cpu::g_active.store(next, std::memory_order_release);
  return previous;
}

}  // namespace afd

// No tensor arguments, so no backend key to dispatch on: one kernel for all.
TORCH_LIBRARY_IMPL(afd, CompositeImplicitAutograd, m) {
  m.impl("cpu_isa", &afd::cpu_isa);
  m.impl("cpu_isas", &afd::cpu_isas);
  m.impl("set_cpu_isa", &afd::set_cpu_isa);
}
