// SPDX-License-Identifier: Apache-2.0
// SPDX-FileCopyrightText: Copyright contributors to the vllm-afd project
//
// The device-resident exchange on CUDA (../ipc.h, vllm/afd/transport/ipc/).
// NEVER RUN ON A GPU YET (compiled only; issue 53): tools/testing/gpu_check's
// `ipc` check is what a lent GPU runs first.
//
// Everything is stream-ordered on the current stream and capturable: no host
// synchronization, no value that changes per step baked into a launch.
//
//  * post: a copy kernel moves src into the peer's slot (mapped through CUDA
//    IPC, so these are stores over NVLink/PCIe), then a one-thread publish
//    kernel writes the record (the step word read from control as it runs)
//    and, after a system-scope fence, the flag with a release store. The copy
//    kernel's writes precede the publish kernel's (stream order) and the
//    release is cumulative, so the peer that sees the flag sees the payload.
//  * take: a one-thread polling kernel on this side's flag (local memory):
//    acquire loads, __nanosleep between them, and every kMirrorEvery rounds
//    the abort mirror (pinned host memory mapped for the kernel: the host's
//    signal() lands while the kernel waits) and the %globaltimer deadline;
//    then the record check, then the flag cleared. The control words (mode,
//    abort, step) are device memory: no other kernel reads across PCIe.
// Each kernel reads mode and abort first and does nothing once the step
// stopped. Not done yet: cuStreamWaitValue32 as the other wait (and a host
// watchdog for its deadline).
#include <ATen/ATen.h>
#include <c10/cuda/CUDAException.h>
#include <c10/cuda/CUDAGuard.h>
#include <c10/cuda/CUDAStream.h>
#include <cuda_runtime.h>
#include <torch/library.h>

#include <cstdint>
#include <cstring>

#include "../ipc.h"
#include "copy_bytes.cuh"

namespace afd {
namespace {

__device__ __forceinline__ int32_t ld_acquire_sys(const int32_t* p) {
  int32_t v;
  asm volatile("ld.acquire.sys.s32 %0, [%1];" : "=r"(v) : "l"(p) : "memory");
  return v;
}

__device__ __forceinline__ void st_release_sys(int32_t* p, int32_t v) {
  asm volatile("st.release.sys.s32 [%0], %1;" ::"l"(p), "r"(v) : "memory");
}

__device__ __forceinline__ uint64_t global_ns() {
  uint64_t t;
  asm volatile("mov.u64 %0, %%globaltimer;" : "=l"(t));
  return t;
}

__device__ __forceinline__ int32_t ld_volatile(const int32_t* p) {
  return *reinterpret_cast<const volatile int32_t*>(p);
}

// The control words are this GPU's memory, written by this stream (fills
// between steps, a take's abort): stream order makes them visible to every
// later kernel, so a plain volatile read serves.
__device__ __forceinline__ bool stopped(const int32_t* control) {
  return ld_volatile(control + ipc::kMode) != ipc::kRun ||
         ld_volatile(control + ipc::kAbort) != ipc::kNotAborted;
}

// Marks the step aborted for `why` in the control and its mirror (host
// memory: the host reads why after the step), unless the host's release came
// first.
__device__ __forceinline__ void abort_step(int32_t* control, int32_t* mirror, int32_t why) {
  const int32_t released = ld_acquire_sys(mirror);
  if (released == ipc::kNotAborted) {
    st_release_sys(mirror, why);
  }
  control[ipc::kAbort] = released == ipc::kNotAborted ? why : released;
  __threadfence();
}

// Rounds of a take's wait between two reads of the abort mirror (a read
// across PCIe costs about a microsecond; the flag is local memory).
constexpr unsigned kMirrorEvery = 16;

constexpr int kCopyThreads = 256;
constexpr int64_t kMaxCopyBlocks = 1024;

template <bool kWide>
__global__ void copy_kernel(const int32_t* control, const uint8_t* src, uint8_t* dst,
                            int64_t nbytes) {
  __shared__ bool skip;
  if (threadIdx.x == 0) skip = stopped(control);
  __syncthreads();
  if (skip) return;
  copy_bytes<kWide>(dst, src, nbytes,
                    static_cast<int64_t>(blockIdx.x) * blockDim.x + threadIdx.x,
                    static_cast<int64_t>(gridDim.x) * blockDim.x);
}

__global__ void publish_kernel(const int32_t* control, int32_t* record, int32_t* flag,
                               int32_t layer, int32_t rows, int32_t topk) {
  if (stopped(control)) return;
  record[ipc::kRecordStep] = ld_volatile(control + ipc::kStep);
  record[ipc::kRecordLayer] = layer;
  record[ipc::kRecordRows] = rows;
  record[ipc::kRecordTopk] = topk;
  __threadfence_system();
  st_release_sys(flag, ipc::kReady);
}

__global__ void take_kernel(int32_t* control, int32_t* mirror, int32_t* flag,
                            const int32_t* record, int32_t layer, int32_t rows,
                            uint64_t deadline_ns) {
  if (stopped(control)) return;
  const uint64_t start = global_ns();
  unsigned sleep_ns = 32, round = 0;
  while (ld_acquire_sys(flag) != ipc::kReady) {
    if (++round % kMirrorEvery == 0) {
      const int32_t released = ld_acquire_sys(mirror);
      if (released != ipc::kNotAborted) {  // the host's release
        abort_step(control, mirror, released);
        return;
      }
      if (global_ns() - start > deadline_ns) {
        abort_step(control, mirror, ipc::kTimeout);
        return;
      }
    }
    __nanosleep(sleep_ns);
    if (sleep_ns < 1024) sleep_ns *= 2;
  }
  if (record[ipc::kRecordStep] != ld_volatile(control + ipc::kStep) ||
      record[ipc::kRecordLayer] != layer || record[ipc::kRecordRows] != rows) {
    abort_step(control, mirror, ipc::kMismatch);
    return;
  }
  st_release_sys(flag, ipc::kClear);
}

void ipc_post_cuda(const at::Tensor& control, const at::Tensor& src, const at::Tensor& dst,
                   const at::Tensor& record, const at::Tensor& flag, int64_t layer,
                   int64_t rows, int64_t topk) {
  ipc::check_post_args(control, src, dst, record, flag, rows, topk);
  const c10::cuda::CUDAGuard guard(src.device());
  cudaStream_t stream = c10::cuda::getCurrentCUDAStream();
  const int64_t nbytes = src.nbytes();
  if (nbytes > 0 && dst.data_ptr() != src.data_ptr()) {
    const bool vec16 = reinterpret_cast<uintptr_t>(src.data_ptr()) % 16 == 0 &&
                       reinterpret_cast<uintptr_t>(dst.data_ptr()) % 16 == 0;
    const int64_t units = vec16 ? nbytes / 16 + 1 : nbytes;
    const int blocks = static_cast<int>(
        std::min<int64_t>(kMaxCopyBlocks, (units + kCopyThreads - 1) / kCopyThreads));
    const auto* c = control.data_ptr<int32_t>();
    const auto* s = static_cast<const uint8_t*>(src.data_ptr());
    auto* d = static_cast<uint8_t*>(dst.data_ptr());
    if (vec16) {
      copy_kernel<true><<<blocks, kCopyThreads, 0, stream>>>(c, s, d, nbytes);
    } else {
      copy_kernel<false><<<blocks, kCopyThreads, 0, stream>>>(c, s, d, nbytes);
    }
    C10_CUDA_KERNEL_LAUNCH_CHECK();
  }
  publish_kernel<<<1, 1, 0, stream>>>(control.data_ptr<int32_t>(), record.data_ptr<int32_t>(),
                                      flag.data_ptr<int32_t>(), static_cast<int32_t>(layer),
                                      static_cast<int32_t>(rows), static_cast<int32_t>(topk));
  C10_CUDA_KERNEL_LAUNCH_CHECK();
}

void ipc_take_cuda(const at::Tensor& control, const at::Tensor& mirror, const at::Tensor& flag,
                   const at::Tensor& record, int64_t layer, int64_t rows, double deadline_s) {
  ipc::check_take_args(control, mirror, flag, record, rows, deadline_s);
  const c10::cuda::CUDAGuard guard(flag.device());
  take_kernel<<<1, 1, 0, c10::cuda::getCurrentCUDAStream()>>>(
      control.data_ptr<int32_t>(), mirror.data_ptr<int32_t>(), flag.data_ptr<int32_t>(),
      record.data_ptr<int32_t>(),
      static_cast<int32_t>(layer), static_cast<int32_t>(rows),
      static_cast<uint64_t>(deadline_s * 1e9));
  C10_CUDA_KERNEL_LAUNCH_CHECK();
}

// nbytes of device memory at ptr as a uint8 tensor on like's device; release(ptr)
// runs (on that device) when the tensor's storage goes.
at::Tensor owned_bytes(void* ptr, int64_t nbytes, const at::Tensor& like,
                       cudaError_t (*release)(void*)) {
  const int device = like.device().index();
  return at::from_blob(
      ptr, {nbytes},
      [device, release](void* p) {
        const c10::cuda::CUDAGuard g(device);
        release(p);
      },
      at::TensorOptions().dtype(at::kByte).device(like.device()));
}

at::Tensor ipc_alloc_cuda(const at::Tensor& like, int64_t nbytes) {
  TORCH_CHECK(nbytes > 0, "afd::ipc_alloc: nbytes must be > 0, got ", nbytes);
  const c10::cuda::CUDAGuard guard(like.device());
  void* ptr = nullptr;
  C10_CUDA_CHECK(cudaMalloc(&ptr, nbytes));
  C10_CUDA_CHECK(cudaMemset(ptr, 0, nbytes));
  return owned_bytes(ptr, nbytes, like, cudaFree);
}

at::Tensor ipc_handle_cuda(const at::Tensor& memory) {
  TORCH_CHECK(memory.storage_offset() == 0 && memory.scalar_type() == at::kByte,
              "afd::ipc_handle: memory must be a whole uint8 allocation of afd::ipc_alloc");
  const c10::cuda::CUDAGuard guard(memory.device());
  cudaIpcMemHandle_t handle;
  C10_CUDA_CHECK(cudaIpcGetMemHandle(&handle, memory.data_ptr()));
  at::Tensor out = at::empty({static_cast<int64_t>(sizeof(handle))}, at::kByte);
  std::memcpy(out.data_ptr(), &handle, sizeof(handle));
  return out;
}

at::Tensor ipc_open_cuda(const at::Tensor& handle, const at::Tensor& like, int64_t nbytes) {
  TORCH_CHECK(handle.device().is_cpu() && handle.scalar_type() == at::kByte &&
                  handle.numel() == static_cast<int64_t>(sizeof(cudaIpcMemHandle_t)),
              "afd::ipc_open: handle must be the ", sizeof(cudaIpcMemHandle_t),
              " CPU bytes of afd::ipc_handle, got ", handle.scalar_type(), " ", handle.sizes());
  const c10::cuda::CUDAGuard guard(like.device());
  cudaIpcMemHandle_t h;
  std::memcpy(&h, handle.contiguous().data_ptr(), sizeof(h));
  void* ptr = nullptr;
  const cudaError_t err = cudaIpcOpenMemHandle(&ptr, h, cudaIpcMemLazyEnablePeerAccess);
  if (err != cudaSuccess) {
    cudaGetLastError();  // clear it: the connector refuses the peer and goes on
    TORCH_CHECK(false, "afd::ipc_open: cudaIpcOpenMemHandle failed: ", cudaGetErrorString(err));
  }
  return owned_bytes(ptr, nbytes, like, cudaIpcCloseMemHandle);
}

at::Tensor ipc_mapped_cuda(const at::Tensor& host, const at::Tensor& like) {
  TORCH_CHECK(host.device().is_cpu() && host.is_pinned() && host.is_contiguous(),
              "afd::ipc_mapped: host must be a contiguous pinned CPU tensor");
  const c10::cuda::CUDAGuard guard(like.device());
  void* dptr = nullptr;
  C10_CUDA_CHECK(cudaHostGetDevicePointer(&dptr, host.data_ptr(), 0));
  c10::Storage keep = host.storage();  // the host tensor's memory outlives the view
  return at::from_blob(
      dptr, host.sizes(), [keep](void*) {},
      at::TensorOptions().dtype(host.scalar_type()).device(like.device()));
}

}  // namespace
}  // namespace afd

TORCH_LIBRARY_IMPL(afd, CUDA, m) {
  m.impl("ipc_post", &afd::ipc_post_cuda);
  m.impl("ipc_take", &afd::ipc_take_cuda);
  m.impl("ipc_alloc", &afd::ipc_alloc_cuda);
  m.impl("ipc_handle", &afd::ipc_handle_cuda);
  m.impl("ipc_open", &afd::ipc_open_cuda);
  m.impl("ipc_mapped", &afd::ipc_mapped_cuda);
}
