// SPDX-License-Identifier: Apache-2.0
// SPDX-FileCopyrightText: Copyright contributors to the vllm-afd project
//
// CUDA kernels for afd::pack / afd::unpack: the slot layout and the fp8 rules
// of ../pack.h, bit for bit the bytes of the CPU kernels (../cpu/pack.cpp).
// One launch per call on the current stream, no host synchronization:
//
//  * exact: the hidden bytes move as 16-byte words (bytes where the pointers
//    do not allow), the padding is zeroed, the routing copied, in one kernel;
//  * fp8: a team of lanes (a power of two <= 32) per group of a token reads
//    the group once from memory (16-byte loads where the row, the group size
//    and the pointers allow), reduces its amax with shuffles, and quantizes
//    the group from L1; unpack decodes a group with its one scale.
//
// Bit-exactness with the CPU: the scale is amax / 448 and the element x / scale,
// both IEEE round-to-nearest divisions (__fdiv_rn, whatever the flags), and the
// fp8 bits come from torch's own conversion (c10::detail::fp8e4m3fn_from_fp32_value,
// which the CPU kernel's branch-free version equals); unpack multiplies torch's
// exact fp8 -> fp32 value by the scale and converts with c10's round-to-nearest-even.
//
// Not the same as the CPU: an int64 topk id outside int32 stops the kernel with
// a device-side assert (the CPU kernel raises a message naming the entry); the
// host cannot look at the ids without a synchronization.
#include <c10/cuda/CUDAException.h>
#include <c10/cuda/CUDAGuard.h>
#include <c10/cuda/CUDAStream.h>
#include <c10/util/BFloat16.h>
#include <c10/util/Float8_e4m3fn.h>
#include <c10/util/Half.h>
#include <torch/library.h>

#include <algorithm>
#include <cstdint>
#include <type_traits>

#include "../pack.h"
#include "copy_bytes.cuh"

namespace afd {
namespace {

constexpr int kThreads = 256;
// Enough blocks to fill any current GPU several times; the loops stride over the rest.
constexpr int64_t kMaxBlocks = 4096;

// Everything a launch needs; passed by value (kernel parameter space).
struct SlotArgs {
  uint8_t* slot;  // pack: written; unpack: read (cast back to const there)
  void* hidden;   // pack: read; unpack: written
  int64_t tokens, width, group, groups;
  int64_t hidden_nbytes, scales_offset, weights_offset, ids_offset;
  int64_t topk;
  void* ids;  // int32 or int64, [tokens, topk]
  void* weights;  // fp32, [tokens, topk]
  bool ids64;
  bool aligned4;  // slot address % 4 == 0: 4-byte loads/stores into the slot's tail
  int team;       // lanes per group (fp8), a power of two <= 32
};

__device__ __forceinline__ void store_u32(uint8_t* p, uint32_t v, bool aligned) {
  if (aligned) {
    *reinterpret_cast<uint32_t*>(p) = v;
  } else {
#pragma unroll
    for (int b = 0; b < 4; ++b) p[b] = static_cast<uint8_t>(v >> (8 * b));
  }
}

__device__ __forceinline__ uint32_t load_u32(const uint8_t* p, bool aligned) {
  if (aligned) return *reinterpret_cast<const uint32_t*>(p);
  uint32_t v = 0;
#pragma unroll
  for (int b = 0; b < 4; ++b) v |= static_cast<uint32_t>(p[b]) << (8 * b);
  return v;
}

// The padding between the hidden bytes and the tail: zero, so the same tensors
// always give the same slot.
__device__ __forceinline__ void zero_pad(const SlotArgs& a, int64_t tid) {
  if (tid == 0) {
    for (int64_t o = a.hidden_nbytes; o < a.scales_offset; ++o) a.slot[o] = 0;
  }
}

__device__ __forceinline__ void pack_routing(const SlotArgs& a, int64_t tid, int64_t stride) {
  const int64_t n = a.tokens * a.topk;
  const float* w = static_cast<const float*>(a.weights);
  for (int64_t i = tid; i < n; i += stride) {
    store_u32(a.slot + a.weights_offset + 4 * i, __float_as_uint(w[i]), a.aligned4);
    int32_t id;
    if (a.ids64) {
      const int64_t v = static_cast<const int64_t*>(a.ids)[i];
      CUDA_KERNEL_ASSERT(v >= INT32_MIN && v <= INT32_MAX && "afd::pack: topk id beyond int32");
      id = static_cast<int32_t>(v);
    } else {
      id = static_cast<const int32_t*>(a.ids)[i];
    }
    store_u32(a.slot + a.ids_offset + 4 * i, static_cast<uint32_t>(id), a.aligned4);
  }
}

__device__ __forceinline__ void unpack_routing(const SlotArgs& a, int64_t tid, int64_t stride) {
  const int64_t n = a.tokens * a.topk;
  float* w = static_cast<float*>(a.weights);
  for (int64_t i = tid; i < n; i += stride) {
    w[i] = __uint_as_float(load_u32(a.slot + a.weights_offset + 4 * i, a.aligned4));
    const int32_t id =
        static_cast<int32_t>(load_u32(a.slot + a.ids_offset + 4 * i, a.aligned4));
    if (a.ids64) {
      static_cast<int64_t*>(a.ids)[i] = id;
    } else {
      static_cast<int32_t*>(a.ids)[i] = id;
    }
  }
}

// ---- exact -----------------------------------------------------------------

template <bool kWide, bool kPack>
__global__ void __launch_bounds__(kThreads) exact_kernel(SlotArgs a) {
  const int64_t tid = static_cast<int64_t>(blockIdx.x) * blockDim.x + threadIdx.x;
  const int64_t stride = static_cast<int64_t>(gridDim.x) * blockDim.x;
  uint8_t* hidden = static_cast<uint8_t*>(a.hidden);
  if (kPack) {
    copy_bytes<kWide>(a.slot, hidden, a.hidden_nbytes, tid, stride);
    zero_pad(a, tid);
    if (a.topk > 0) pack_routing(a, tid, stride);
  } else {
    copy_bytes<kWide>(hidden, a.slot, a.hidden_nbytes, tid, stride);
    if (a.topk > 0) unpack_routing(a, tid, stride);
  }
}

// ---- fp8 -------------------------------------------------------------------

// kVec elements of scalar_t make one 16-byte load; their fp8 bytes one store.
template <typename scalar_t>
struct Vec {
  static constexpr int kElems = 16 / sizeof(scalar_t);
  using bytes_t = std::conditional_t<kElems == 8, uint2, uint32_t>;  // kElems fp8 bytes
  static_assert(sizeof(bytes_t) == kElems, "one fp8 byte per element");
};

__device__ __forceinline__ uint8_t to_fp8(float x, float scale) {
  return c10::detail::fp8e4m3fn_from_fp32_value(__fdiv_rn(x, scale));
}

// Token t's group g, for the team that owns it.
struct Group {
  int64_t first;  // element offset of the group in the [tokens, width] rows
  int64_t n;      // elements (the last group of a token may be short)
  int64_t index;  // t * groups + g: the scale's index
};

__device__ __forceinline__ Group group_of(const SlotArgs& a, int64_t p) {
  const int64_t t = p / a.groups;
  const int64_t g = p - t * a.groups;
  const int64_t h0 = g * a.group;
  return {t * a.width + h0, min(a.group, a.width - h0), p};
}

template <typename scalar_t, bool kVec>
__global__ void __launch_bounds__(kThreads) pack_fp8_kernel(SlotArgs a) {
  using V = Vec<scalar_t>;
  constexpr int E = V::kElems;
  const scalar_t* __restrict__ x = static_cast<const scalar_t*>(a.hidden);
  uint8_t* __restrict__ q = a.slot;
  const int team = a.team;
  const int lane = threadIdx.x & (team - 1);
  const int64_t teams_per_block = blockDim.x / team;
  const int64_t pairs = a.tokens * a.groups;
  // The loop bound is uniform over the block, so every lane reaches the shuffles.
  for (int64_t base = static_cast<int64_t>(blockIdx.x) * teams_per_block; base < pairs;
       base += static_cast<int64_t>(gridDim.x) * teams_per_block) {
    const int64_t p = base + threadIdx.x / team;
    const bool active = p < pairs;
    Group grp{0, 0, 0};
    if (active) grp = group_of(a, p);
    const scalar_t* xs = x + grp.first;
    float amax = 0.f;
    if (kVec) {
      const uint4* xv = reinterpret_cast<const uint4*>(xs);
      for (int64_t i = lane; i < grp.n / E; i += team) {
        const uint4 raw = xv[i];
        const scalar_t* v = reinterpret_cast<const scalar_t*>(&raw);
#pragma unroll
        for (int e = 0; e < E; ++e) amax = fmaxf(amax, fabsf(static_cast<float>(v[e])));
      }
    } else {
      for (int64_t i = lane; i < grp.n; i += team) {
        amax = fmaxf(amax, fabsf(static_cast<float>(xs[i])));
      }
    }
    // fmaxf drops a NaN operand, as the CPU kernel's `a > amax ? a : amax` does.
    for (int off = team / 2; off > 0; off /= 2) {
      amax = fmaxf(amax, __shfl_xor_sync(0xffffffffu, amax, off));
    }
    if (!active) continue;
    const float scale = amax > 0.f ? __fdiv_rn(amax, kFp8E4m3Max) : 1.f;
    if (lane == 0) {
      store_u32(a.slot + a.scales_offset + 4 * grp.index, __float_as_uint(scale), a.aligned4);
    }
    uint8_t* qs = q + grp.first;
    if (kVec) {
      const uint4* xv = reinterpret_cast<const uint4*>(xs);
      typename V::bytes_t* qv = reinterpret_cast<typename V::bytes_t*>(qs);
      for (int64_t i = lane; i < grp.n / E; i += team) {
        const uint4 raw = xv[i];  // from L1: the loop above just read it
        const scalar_t* v = reinterpret_cast<const scalar_t*>(&raw);
        union {
          typename V::bytes_t word;
          uint8_t b[E];
        } out;
#pragma unroll
        for (int e = 0; e < E; ++e) out.b[e] = to_fp8(static_cast<float>(v[e]), scale);
        qv[i] = out.word;
      }
    } else {
      for (int64_t i = lane; i < grp.n; i += team) {
        qs[i] = to_fp8(static_cast<float>(xs[i]), scale);
      }
    }
  }
  const int64_t tid = static_cast<int64_t>(blockIdx.x) * blockDim.x + threadIdx.x;
  const int64_t stride = static_cast<int64_t>(gridDim.x) * blockDim.x;
  zero_pad(a, tid);
  if (a.topk > 0) pack_routing(a, tid, stride);
}

template <typename scalar_t, bool kVec>
__global__ void __launch_bounds__(kThreads) unpack_fp8_kernel(SlotArgs a) {
  using V = Vec<scalar_t>;
  constexpr int E = V::kElems;
  scalar_t* __restrict__ out = static_cast<scalar_t*>(a.hidden);
  const uint8_t* __restrict__ q = a.slot;
  const int team = a.team;
  const int lane = threadIdx.x & (team - 1);
  const int64_t teams_per_block = blockDim.x / team;
  const int64_t pairs = a.tokens * a.groups;
  for (int64_t p = static_cast<int64_t>(blockIdx.x) * teams_per_block + threadIdx.x / team;
       p < pairs; p += static_cast<int64_t>(gridDim.x) * teams_per_block) {
    const Group grp = group_of(a, p);
    const float scale =
        __uint_as_float(load_u32(a.slot + a.scales_offset + 4 * grp.index, a.aligned4));
    const uint8_t* qs = q + grp.first;
    scalar_t* os = out + grp.first;
    if (kVec) {
      const typename V::bytes_t* qv = reinterpret_cast<const typename V::bytes_t*>(qs);
      uint4* ov = reinterpret_cast<uint4*>(os);
      for (int64_t i = lane; i < grp.n / E; i += team) {
        union {
          typename V::bytes_t word;
          uint8_t b[E];
        } in;
        in.word = qv[i];
        union {
          uint4 raw;
          scalar_t v[E];
        } res;
#pragma unroll
        for (int e = 0; e < E; ++e) {
          res.v[e] = static_cast<scalar_t>(
              __fmul_rn(c10::detail::fp8e4m3fn_to_fp32_value(in.b[e]), scale));
        }
        ov[i] = res.raw;
      }
    } else {
      for (int64_t i = lane; i < grp.n; i += team) {
        os[i] = static_cast<scalar_t>(
            __fmul_rn(c10::detail::fp8e4m3fn_to_fp32_value(qs[i]), scale));
      }
    }
  }
  if (a.topk > 0) {
    const int64_t tid = static_cast<int64_t>(blockIdx.x) * blockDim.x + threadIdx.x;
    unpack_routing(a, tid, static_cast<int64_t>(gridDim.x) * blockDim.x);
  }
}

// ---- host --------------------------------------------------------------------

bool aligned(const void* p, int64_t n) { return reinterpret_cast<uintptr_t>(p) % n == 0; }

int64_t blocks_for(int64_t threads) {
  return std::max<int64_t>(1, std::min(kMaxBlocks, (threads + kThreads - 1) / kThreads));
}

SlotArgs slot_args(const PackLayout& l, at::Tensor& hidden, const at::Tensor& slot,
                   const c10::optional<at::Tensor>& topk_ids,
                   const c10::optional<at::Tensor>& topk_weights, int64_t group_size) {
  SlotArgs a{};
  a.slot = static_cast<uint8_t*>(slot.data_ptr());
  a.hidden = hidden.data_ptr();
  a.tokens = hidden.size(0);
  a.width = hidden.size(1);
  a.group = group_size;
  a.groups = l.groups;
  a.hidden_nbytes = l.hidden_nbytes;
  a.scales_offset = l.scales_offset;
  a.weights_offset = l.weights_offset;
  a.ids_offset = l.ids_offset;
  a.aligned4 = aligned(a.slot, 4);
  if (topk_ids.has_value()) {
    a.topk = topk_ids->size(1);
    a.ids = topk_ids->data_ptr();
    a.weights = topk_weights->data_ptr();
    a.ids64 = topk_ids->scalar_type() == at::kLong;
  }
  return a;
}

// The smallest power of two >= the work items of one group, at most a warp.
int team_for(int64_t items) {
  int team = 1;
  while (team < 32 && team < items) team *= 2;
  return team;
}

void launch(bool pack, SlotArgs a, at::ScalarType dtype, cudaStream_t stream) {
  const int64_t routing = a.tokens * a.topk;
  if (a.group == 0) {
    const bool wide = aligned(a.slot, 16) && aligned(a.hidden, 16);
    const dim3 grid(static_cast<unsigned>(blocks_for(std::max(a.hidden_nbytes / 16, routing))));
    if (pack) {
      if (wide) exact_kernel<true, true><<<grid, kThreads, 0, stream>>>(a);
      else exact_kernel<false, true><<<grid, kThreads, 0, stream>>>(a);
    } else {
      if (wide) exact_kernel<true, false><<<grid, kThreads, 0, stream>>>(a);
      else exact_kernel<false, false><<<grid, kThreads, 0, stream>>>(a);
    }
    return;
  }
  const auto body = [&](auto zero) {
    using scalar_t = decltype(zero);
    constexpr int E = Vec<scalar_t>::kElems;
    // 16-byte loads of the hidden row and kE-byte fp8 words: every group starts
    // on a multiple of E elements, and both tensors are aligned for it.
    const bool vec = a.width % E == 0 && a.group % E == 0 && aligned(a.hidden, 16) &&
                     aligned(a.slot, E);
    a.team = team_for(vec ? a.group / E : a.group);
    const int64_t teams = a.tokens * a.groups;
    const int64_t teams_per_block = kThreads / a.team;
    const int64_t blocks = std::max(
        blocks_for(routing),
        std::min(kMaxBlocks, std::max<int64_t>(1, (teams + teams_per_block - 1) / teams_per_block)));
    const dim3 grid(static_cast<unsigned>(blocks));
    if (pack) {
      if (vec) pack_fp8_kernel<scalar_t, true><<<grid, kThreads, 0, stream>>>(a);
      else pack_fp8_kernel<scalar_t, false><<<grid, kThreads, 0, stream>>>(a);
    } else {
      if (vec) unpack_fp8_kernel<scalar_t, true><<<grid, kThreads, 0, stream>>>(a);
      else unpack_fp8_kernel<scalar_t, false><<<grid, kThreads, 0, stream>>>(a);
    }
  };
  // check_pack_args admits these three (no double: 16-byte vectors of 2 elements).
  switch (dtype) {
    case at::kFloat: body(float{}); break;
    case at::kBFloat16: body(c10::BFloat16{}); break;
    case at::kHalf: body(c10::Half{}); break;
    default: TORCH_CHECK(false, "afd::pack/unpack: unsupported dtype ", dtype);
  }
}

void pack_cuda(const at::Tensor& hidden, const c10::optional<at::Tensor>& topk_ids,
               const c10::optional<at::Tensor>& topk_weights, int64_t group_size,
               at::Tensor& slot) {
  const PackLayout l = check_pack_args(hidden, topk_ids, topk_weights, group_size, slot, true);
  if (l.total == 0) return;
  const c10::cuda::OptionalCUDAGuard guard(hidden.device());
  // c10::cuda's current stream is the one at::cuda::getCurrentCUDAStream returns;
  // ATen/cuda/CUDAContext.h would pull in the cuBLAS/cuSPARSE/cuSOLVER headers.
  const cudaStream_t stream = c10::cuda::getCurrentCUDAStream(hidden.device().index());
  at::Tensor h = hidden;  // read only; SlotArgs has one pointer type for both directions
  launch(true, slot_args(l, h, slot, topk_ids, topk_weights, group_size),
         hidden.scalar_type(), stream);
  C10_CUDA_KERNEL_LAUNCH_CHECK();
}

void unpack_cuda(const at::Tensor& slot, int64_t group_size, at::Tensor& hidden,
                 const c10::optional<at::Tensor>& topk_ids,
                 const c10::optional<at::Tensor>& topk_weights) {
  const PackLayout l = check_pack_args(hidden, topk_ids, topk_weights, group_size, slot, false);
  if (l.total == 0) return;
  const c10::cuda::OptionalCUDAGuard guard(hidden.device());
  const cudaStream_t stream = c10::cuda::getCurrentCUDAStream(hidden.device().index());
  launch(false, slot_args(l, hidden, slot, topk_ids, topk_weights, group_size),
         hidden.scalar_type(), stream);
  C10_CUDA_KERNEL_LAUNCH_CHECK();
}

}  // namespace
}  // namespace afd

TORCH_LIBRARY_IMPL(afd, CUDA, m) {
  m.impl("pack", &afd::pack_cuda);
  m.impl("unpack", &afd::unpack_cuda);
}
