// SPDX-License-Identifier: Apache-2.0
// SPDX-FileCopyrightText: Copyright contributors to the vllm-afd project
//
// A prepared layer call's payload when it is more than the tensor's bytes
// (step_calls.cpp): fp8 hidden states with their scales, and
// the MoE routing after them (gate_on "attention").
//
// Such frames used to leave the prepared calls for the connector's general
// path, where packing is torch.ops.afd.pack and unpacking torch.ops.afd.unpack:
// two dispatcher round trips and a dozen Python helpers per message end
// (bench-link, fp8 to the FFN, 1 KiB: 82 us a round trip against 3 us exact).
// Here a prepared frame carries its encoding, and the one C call of a message
// end packs the caller's tensors into the payload (sending) or unpacks the
// payload's hidden states into the caller's tensor (receiving; the routing is
// viewed in place by the caller), with the row kernels of afd::pack /
// afd::unpack (pack_isa.h): the same bytes, the same values (layout:
// ../pack.h).
#pragma once

#include <Python.h>
#include <stdint.h>

namespace afd_lane {

struct FrameCodec {
  bool packs = false;     // false: the payload is the tensor's bytes
  int64_t rows = 0, hidden = 0, group = 0, topk = 0, elem_size = 0;
  int dtype = 0;          // afd::cpu::PackDtype
  uint64_t buffer = 0;    // where a socket frame's payload is packed / received
  // The payload's layout (../pack.h): hidden states (exact or fp8), padding,
  // scales per token (fp8), routing weights and ids (routed).
  int64_t hidden_nbytes = 0, scales_offset = 0, weights_offset = 0, ids_offset = 0, groups = 0;

  // spec: None (exact, no routing) or (rows, hidden, dtype code, scale group,
  // buffer address[, topk]); nbytes: the frame's payload bytes, which the
  // layout must match. False with a Python error when the spec is bad.
  bool load(PyObject* spec, uint64_t nbytes);
  // The tensor at src ([rows, hidden] of dtype) and, routed, the routing
  // (float32 weights, int32 ids, [rows, topk] each) as the payload at dst.
  void encode(const uint8_t* src, uint8_t* dst, const uint8_t* weights,
              const uint8_t* ids) const;
  // The payload's hidden states at src into the tensor at dst (nothing to do
  // for exact ones already there).
  void decode(const uint8_t* src, uint8_t* dst) const;
};

}  // namespace afd_lane
