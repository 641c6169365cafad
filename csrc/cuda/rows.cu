// SPDX-License-Identifier: Apache-2.0
// SPDX-FileCopyrightText: Copyright contributors to the vllm-afd project
//
// CUDA kernels for afd::gather_rows / afd::scatter_rows. Built only where a
// CUDA toolchain and a CUDA build of torch exist; checked on a lent GPU.
#include <ATen/Dispatch.h>
#include <ATen/ops/zeros.h>
#include <c10/cuda/CUDAException.h>
#include <c10/cuda/CUDAGuard.h>
#include <c10/cuda/CUDAStream.h>
#include <torch/library.h>

#include <cstdint>

#include "../ops.h"

namespace afd {
namespace {

// One block per row; 16-byte words when the row and both pointers allow.
// Scatter: `claimed` (one int per output row, zeroed) catches a repeated
// index on the device, as the CPU kernel does on the host, without a sync.
template <typename word_t, typename index_t, bool kGather>
__global__ void move_rows_kernel(const char* __restrict__ src,
                                 const index_t* __restrict__ index,
                                 char* __restrict__ out, int64_t row_bytes,
                                 int64_t limit, int* __restrict__ claimed) {
  const int64_t row = blockIdx.x;
  const int64_t other = static_cast<int64_t>(index[row]);
  CUDA_KERNEL_ASSERT(other >= 0 && other < limit);
  if (!kGather && threadIdx.x == 0) {
    CUDA_KERNEL_ASSERT(atomicExch(claimed + other, 1) == 0 && "scatter index repeats");
  }
  const int64_t src_row = kGather ? other : row;
  const int64_t out_row = kGather ? row : other;
  const word_t* s = reinterpret_cast<const word_t*>(src + src_row * row_bytes);
  word_t* o = reinterpret_cast<word_t*>(out + out_row * row_bytes);
  const int64_t words = row_bytes / sizeof(word_t);
  for (int64_t w = threadIdx.x; w < words; w += blockDim.x) o[w] = s[w];
}

template <bool kGather>
void move_rows_cuda(const at::Tensor& src, const at::Tensor& index,
                    at::Tensor& out) {
  const int64_t row_bytes = check_rows_args(src, index, out, kGather);
  const int64_t rows = index.numel();
  if (rows == 0 || row_bytes == 0) return;
  const c10::cuda::OptionalCUDAGuard guard(src.device());
  const at::Tensor idx = index.contiguous();
  const int64_t limit = kGather ? src.size(0) : out.size(0);
  const char* s = static_cast<const char*>(src.data_ptr());
  char* o = static_cast<char*>(out.data_ptr());
  const bool wide = row_bytes % 16 == 0 &&
                    reinterpret_cast<uintptr_t>(s) % 16 == 0 &&
                    reinterpret_cast<uintptr_t>(o) % 16 == 0;
  const dim3 grid(static_cast<unsigned>(rows));
  const dim3 block(256);
  // c10::cuda's current stream is what at::cuda::getCurrentCUDAStream returns;
  // ATen/cuda/CUDAContext.h would pull in the cuBLAS/cuSPARSE/cuSOLVER headers.
  const cudaStream_t stream = c10::cuda::getCurrentCUDAStream(src.device().index());
  at::Tensor claimed;
  if (!kGather) claimed = at::zeros({limit}, src.options().dtype(at::kInt));
  int* claimed_ptr = kGather ? nullptr : claimed.data_ptr<int>();
  AT_DISPATCH_INDEX_TYPES(idx.scalar_type(), "afd_move_rows", [&] {
    if (wide) {
      move_rows_kernel<uint4, index_t, kGather><<<grid, block, 0, stream>>>(
          s, idx.data_ptr<index_t>(), o, row_bytes, limit, claimed_ptr);
    } else {
      move_rows_kernel<uint8_t, index_t, kGather><<<grid, block, 0, stream>>>(
          s, idx.data_ptr<index_t>(), o, row_bytes, limit, claimed_ptr);
    }
  });
  C10_CUDA_KERNEL_LAUNCH_CHECK();
}

void gather_rows_cuda(const at::Tensor& src, const at::Tensor& index,
                      at::Tensor& out) {
  move_rows_cuda<true>(src, index, out);
}

void scatter_rows_cuda(const at::Tensor& src, const at::Tensor& index,
                       at::Tensor& out) {
  move_rows_cuda<false>(src, index, out);
}

}  // namespace
}  // namespace afd

TORCH_LIBRARY_IMPL(afd, CUDA, m) {
  m.impl("gather_rows", &afd::gather_rows_cuda);
  m.impl("scatter_rows", &afd::scatter_rows_cuda);
}
