// SPDX-License-Identifier: Apache-2.0
// SPDX-FileCopyrightText: Copyright contributors to the vllm-afd project
//
// Row movement between activations and transfer buffers: the attention side
// packs the tokens of a micro-batch into a contiguous send buffer, the FFN side
// gathers the tokens of several attention peers and scatters results back.
// One schema (torch_bindings.cpp), one implementation per backend directory.
#pragma once

#include <ATen/core/Tensor.h>

namespace afd {

// gather_rows:  out[i] = src[index[i]] for every row i of out.
// scatter_rows: out[index[i]] = src[i] for every row i of src (no repeats).
//
// Shape, dtype and device checks shared by every backend. Returns the number
// of bytes in one row.
int64_t check_rows_args(const at::Tensor& src, const at::Tensor& index,
                        const at::Tensor& out, bool gather);

}  // namespace afd
