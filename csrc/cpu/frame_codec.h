// SPDX-License-Identifier: Apache-2.0
// SPDX-FileCopyrightText: Copyright contributors to the vllm-afd project
//
// The fp8 payload of a prepared layer call (lane_calls.cpp, sock_calls.cpp).
//
// A connector whose direction travels as fp8 (AFDConfig.transfer_dtype) used
// to leave prepared calls for its general path, where packing is
// torch.ops.afd.pack and unpacking torch.ops.afd.unpack: two dispatcher round
// trips and a dozen Python helpers per message end (bench-link, fp8 to the
// FFN, 1 KiB: 82 us a round trip against 3 us exact). Here a prepared frame
// may carry its encoding, and the one C call of a message end packs the
// caller's tensor into the payload (sending) or unpacks the payload into the
// caller's tensor (receiving) with the row kernels of afd::pack / afd::unpack
// (pack_isa.h): the same bytes, the same values (layout: ../pack.h).
#pragma once

#include <Python.h>
#include <stdint.h>

namespace afd_lane {

struct FrameCodec {
  bool fp8 = false;       // false: the payload is the tensor's bytes
  int64_t rows = 0, hidden = 0, group = 0, elem_size = 0;
  int dtype = 0;          // afd::cpu::PackDtype
  uint64_t buffer = 0;    // where a socket frame's payload is packed / received
  // The payload's layout (../pack.h): fp8 bytes, padding, scales per token.
  int64_t hidden_nbytes = 0, scales_offset = 0, groups = 0;

  // spec: None (exact) or (rows, hidden, dtype code, scale group, buffer
  // address); nbytes: the frame's payload bytes, which the layout must match.
  // False with a Python error when the spec is bad.
  bool load(PyObject* spec, uint64_t nbytes);
  // The tensor at src ([rows, hidden] of dtype) as the payload at dst.
  void encode(const uint8_t* src, uint8_t* dst) const;
  // The payload at src into the tensor at dst.
  void decode(const uint8_t* src, uint8_t* dst) const;
};

}  // namespace afd_lane
