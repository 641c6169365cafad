# SPDX-License-Identifier: Apache-2.0
# SPDX-FileCopyrightText: Copyright contributors to the vllm-afd project
"""The frames of a step's prepared layer calls (step_calls.py; shm_frames.py
and tcp_frames.py place them on their transport): the frame templates, the C
calls' payload encodings, and the record of one micro-batch's calls.

Why comparing bytes checks a frame: a template is wire.encode of the
LayerFrame the receiver expects (shape, dtype, nbytes, encoding, scale group,
routing width), with fixed-width integers for step (8 bytes), layer and
micro-batch (4 each) so they can be patched in place; frame_template decodes
a patched copy with wire.decode and compares it with the frame
wire.layer_frame would build before any is used. A received header equal to
the patched template decodes to exactly that frame, which passes
wire.check_frame by construction; both ends write and expect the same
templates. Headers stay ordinary msgpack (msgspec reads non-minimal
integers), so the general path reads them.
"""

import torch

from vllm.afd.transport import wire
from vllm.afd.transport.wire import LayerFrame

# Values whose msgpack encodings have a fixed width: uint64 for the step,
# uint32 for layer and micro-batch. The encoder keeps them, the decoder reads
# them as the small numbers patched in.
_STEP_MARK, _LAYER_MARK, _UBATCH_MARK = 1 << 40, 1 << 20, (1 << 20) + 1
_FIELDS = ((b"\xa7step_id\xcf", 8), (b"\xa8layer_id\xce", 4), (b"\xa9ubatch_id\xce", 4))
# csrc/cpu/step_calls.cpp's kMaxHeader: a frame's bytes up to its payload (a
# socket's prefix included).
MAX_TEMPLATE_BYTES = 512


def frame_template(dtype: torch.dtype, rows: int, hidden: int, scale_group: int = 0,
                   topk: int = 0) -> "tuple[bytes, int, int, int, int] | None":
    """(encoded LayerFrame, step offset, layer offset, micro-batch offset,
    payload bytes) for a frame of [rows, hidden] dtype, exact or (scale_group
    > 0) fp8, with topk experts of routing per row (topk > 0) or without, or
    None if its encoding cannot be patched (never for today's wire)."""
    frame = _frame(dtype, rows, hidden, scale_group, topk, _STEP_MARK, _LAYER_MARK,
                   _UBATCH_MARK)
    encoded = wire.encode(frame)
    offsets = []
    for key, _ in _FIELDS:
        at = encoded.find(key)
        if at < 0 or encoded.find(key, at + 1) >= 0:
            return None
        offsets.append(at + len(key))
    # Check: a patched template decodes to the frame layer_frame describes.
    step, layer, ubatch = 123456789, 7, 1
    patched = bytearray(encoded)
    for at, value, (_, width) in zip(offsets, (step, layer, ubatch), _FIELDS):
        patched[at:at + width] = value.to_bytes(width, "big")
    expected = _frame(dtype, rows, hidden, scale_group, topk, step, layer, ubatch)
    if len(encoded) > MAX_TEMPLATE_BYTES or wire.decode(bytes(patched)) != expected:
        return None
    return (encoded, *offsets, frame.nbytes)


def _frame(dtype: torch.dtype, rows: int, hidden: int, scale_group: int, topk: int,
           step: int, layer: int, ubatch: int) -> LayerFrame:
    """The frame wire.layer_frame makes for such a tensor (built without one:
    this may run inside a traced or captured forward, where a tensor would be
    an op)."""
    shape = [rows, hidden]
    return LayerFrame(step_id=step, layer_id=layer, ubatch_id=ubatch,
                      dtype=wire.dtype_name(dtype), shape=shape,
                      nbytes=wire.frame_nbytes(dtype, shape, topk, scale_group), topk=topk,
                      encoding=wire.FP8_E4M3 if scale_group else wire.EXACT,
                      scale_group=scale_group)


# csrc/cpu/pack_isa.h's PackDtype: the compute dtypes the fp8 row kernels take.
_PACK_DTYPES = {torch.float32: 0, torch.bfloat16: 1, torch.float16: 2}


def codec_spec(dtype: torch.dtype, rows: int, hidden: int, scale_group: int,
               buffer: int = 0, topk: int = 0) -> "tuple | None | bool":
    """How a prepared frame's C call encodes its payload (csrc/cpu/frame_codec.h):
    None for the tensor's bytes (exact, no routing), a spec for fp8 or routed
    frames (buffer: where a socket frame's payload is packed or received),
    False where the C calls cannot encode it (a dtype the kernels do not
    take: the general path does)."""
    if not (scale_group or topk):
        return None
    code = _PACK_DTYPES.get(dtype)
    return False if code is None else (rows, hidden, code, scale_group, buffer, topk)


class Ubatch:
    """One micro-batch's prepared layer calls, as the Python side needs them
    (the C side has the frames): what the checks compare, what the counters
    add, what a receive returns."""

    __slots__ = ("shape", "nbytes", "sent", "received", "view", "into", "routed", "routing",
                 "routing_shape", "unstage")

    def __init__(self, rows: int, hidden: int, dtype: torch.dtype, sent: int, received: int,
                 view: "torch.Tensor | None" = None, into: int = 0, routed: int = 0,
                 routing: "wire.Routing | None" = None, topk: int = 0,
                 unstage: "tuple | None" = None) -> None:
        self.shape = [rows, hidden]
        self.nbytes = rows * hidden * dtype.itemsize  # the tensor's, each way
        self.sent, self.received = sent, received  # bytes on the wire, frame and all
        # The FFN's received hidden states (a slot or buffer view), and the
        # address its receive unpacks fp8 into (0: none, taken in place).
        self.view, self.into = view, into
        # Routed frames (gate_on "attention"): their bytes on the wire, the
        # FFN's routing (views of the received payload), what the attention
        # side's routing tensors must be.
        self.routed, self.routing = routed, routing
        self.routing_shape = (rows, topk)
        # A device connector's packed frames (fp8, routing), left raw in the
        # slot by the C call: per received kind (plain, routed), None or the
        # (LayerFrame, payload bytes) its bytes are decoded on the device by.
        self.unstage = unstage


def received_frame(dtype: torch.dtype, rows: int, hidden: int, scale_group: int, topk: int,
                   ubatch: int) -> LayerFrame:
    """The frame a prepared receive decodes like (codec.PayloadCodec.decode:
    shape, encoding, routing width and micro-batch are what it reads)."""
    return _frame(dtype, rows, hidden, scale_group, topk, 0, 0, ubatch)


def routable(weights: torch.Tensor, ids: torch.Tensor, ub: Ubatch,
             device: "torch.device | None" = None) -> bool:
    """Whether a routing's tensors are what a routed frame's C call copies:
    float32 weights and int32 ids of [rows, topk], contiguous, host memory
    (device: on that device instead, for afd::pack there; the general path
    raises the caller's error for anything else)."""
    return (weights.dtype == wire.ROUTING_WEIGHT_DTYPE and ids.dtype == wire.ROUTING_ID_DTYPE
            and weights.shape == ub.routing_shape and ids.shape == ub.routing_shape
            and weights.is_contiguous() and ids.is_contiguous()
            and (weights.is_cpu and ids.is_cpu if device is None
                 else weights.device == device and ids.device == device))
