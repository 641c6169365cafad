// SPDX-License-Identifier: Apache-2.0
// SPDX-FileCopyrightText: Copyright contributors to the vllm-afd project
#include <ATen/Parallel.h>
#include <torch/library.h>

#include <cstring>
#include <vector>

#include "../ops.h"

namespace afd {
namespace {

// Indices are validated before any byte moves, so a bad index never leaves a
// half-written buffer behind.
template <typename index_t>
std::vector<int64_t> checked_indices(const at::Tensor& index, int64_t limit,
                                     bool unique, const char* op) {
  const index_t* idx = index.data_ptr<index_t>();
  const int64_t n = index.numel();
  std::vector<int64_t> out(n);
  std::vector<char> seen(unique ? limit : 0, 0);
  for (int64_t i = 0; i < n; ++i) {
    const int64_t v = static_cast<int64_t>(idx[i]);
    TORCH_CHECK(v >= 0 && v < limit, op, ": index[", i, "] = ", v,
                " is out of range for ", limit, " rows");
    if (unique) {
      TORCH_CHECK(!seen[v], op, ": index[", i, "] = ", v, " repeats");
      seen[v] = 1;
    }
    out[i] = v;
  }
  return out;
}

std::vector<int64_t> indices(const at::Tensor& index, int64_t limit,
                             bool unique, const char* op) {
  const at::Tensor idx = index.contiguous();
  return idx.scalar_type() == at::kLong
             ? checked_indices<int64_t>(idx, limit, unique, op)
             : checked_indices<int32_t>(idx, limit, unique, op);
}

// Rows are at least a few hundred bytes (a hidden state), so a grain of 16 rows
// keeps thread start-up cost small next to the copies.
constexpr int64_t kGrainRows = 16;

}  // namespace

void gather_rows_cpu(const at::Tensor& src, const at::Tensor& index,
                     at::Tensor& out) {
  const int64_t row_bytes = check_rows_args(src, index, out, /*gather=*/true);
  const auto idx = indices(index, src.size(0), false, "afd::gather_rows");
  const char* s = static_cast<const char*>(src.data_ptr());
  char* o = static_cast<char*>(out.data_ptr());
  at::parallel_for(0, out.size(0), kGrainRows, [&](int64_t begin, int64_t end) {
    for (int64_t i = begin; i < end; ++i) {
      std::memcpy(o + i * row_bytes, s + idx[i] * row_bytes, row_bytes);
    }
  });
}

void scatter_rows_cpu(const at::Tensor& src, const at::Tensor& index,
                      at::Tensor& out) {
  const int64_t row_bytes = check_rows_args(src, index, out, /*gather=*/false);
  const auto idx = indices(index, out.size(0), true, "afd::scatter_rows");
  const char* s = static_cast<const char*>(src.data_ptr());
  char* o = static_cast<char*>(out.data_ptr());
  at::parallel_for(0, src.size(0), kGrainRows, [&](int64_t begin, int64_t end) {
    for (int64_t i = begin; i < end; ++i) {
      std::memcpy(o + idx[i] * row_bytes, s + i * row_bytes, row_bytes);
    }
  });
}

}  // namespace afd

TORCH_LIBRARY_IMPL(afd, CPU, m) {
  m.impl("gather_rows", &afd::gather_rows_cpu);
  m.impl("scatter_rows", &afd::scatter_rows_cpu);
}
