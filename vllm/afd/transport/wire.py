# SPDX-License-Identifier: Apache-2.0
# SPDX-FileCopyrightText: Copyright contributors to the vllm-afd project
"""Every message exchanged between the attention and the FFN servers.

All messages are msgspec Structs in one tagged union, encoded as msgpack maps
(field names on the wire, so a decode error names the field and new fields can
be added with defaults). Tensor payloads never travel inside a message: a
LayerFrame header describes the payload and the transport moves its bytes
(socket, shared-memory slot, NCCL). Nothing here unpickles anything.

Conversation, per attention rank and its FFN server:

    attention -> FFN   Hello                     once, after connecting
    FFN -> attention   AuthChallenge             only when the FFN has a secret
    attention -> FFN   AuthProof                 (transport/auth.py; see there)
    FFN -> attention   HelloAck                  accepted, or rejected with reason
    attention -> FFN   HelloConfirm              the attention side's own checks of
                                                 the ack passed (or why not); only
                                                 then does either side set up the
                                                 transport (e.g. NCCL) and serve
    attention -> FFN   StepHeader                once per model step
    attention -> FFN   LayerFrame + hidden       per layer and micro-batch
                       (+ top-k routing when AFDConfig.gate_on == "attention")
    FFN -> attention   LayerFrame + output       same layer and micro-batch
    either             StepHeader(GOODBYE)       on close
    either             ErrorFrame                on a fatal error

Headers come from another process: everything a receiver allocates or indexes
with is checked here first (check_step, check_frame), so a malformed or
malicious header raises ProtocolError instead of sizing a buffer.
"""

import ctypes
import logging
import math
from collections.abc import Sequence
from typing import Annotated, Literal, NamedTuple

import msgspec
import torch

logger = logging.getLogger(__name__)

# Bump on any incompatible change; peers with different versions refuse to talk.
# 2: LayerFrame.topk and Hello.routing_topk (routing computed on the attention side).
# 3: authentication (Hello.auth_nonce, AuthChallenge, AuthProof) and the model
#    fingerprint of vllm/afd/adapter/model/fingerprint.py in Hello.fingerprint.
# 4: HelloConfirm; Hello.device_kind; transport data as the connector's own
#    encoded struct (Hello.transport, HelloAck.transport).
# 5: transfer encodings (AFDConfig.transfer_dtype): Hello.transfer_to_ffn,
#    Hello.transfer_to_attention, Hello.scale_group; LayerFrame.encoding and
#    LayerFrame.scale_group; fp8 payloads laid out by PayloadLayout.
# 6: StepHeader.from_layer (a step resumed mid-way on a standby FFN server).
# 7: shm messages travel in a shared-memory ring with a doorbell (shm_ring.py),
#    ShmHandshake.ring_entries and ring_entry_bytes.
# 8: shm payload slots start on a page of their own (ShmHandshake.slots_offset).
PROTOCOL_VERSION = 8
MAX_TRANSPORT_BYTES = 16 * 1024  # a connector's handshake data

MAX_UBATCHES = 4  # AFDConfig.num_ubatches is 1..4 (its one definition)
MAX_DIMS = 8
MAX_TEXT = 4096  # reasons and error texts; a peer cannot make us log megabytes
MAX_FINGERPRINT_ITEMS = 64
MAX_TOPK = 1024  # experts per token; real models use 1-16
AUTH_NONCE_BYTES = 32  # fresh random bytes per connection and side
AUTH_PROOF_BYTES = 32  # HMAC-SHA256
# A fingerprint item one side could not compute (e.g. the checkpoint is not on
# its disk yet); never counts as a mismatch.
FINGERPRINT_UNAVAILABLE = "unavailable"

# Routing (AFDConfig.gate_on == "attention") travels in the same payload as the
# hidden states it belongs to, after them:
#   [hidden states: shape x dtype][zero padding to ROUTING_ALIGN]
#   [topk_weights: float32 [n, topk]][topk_ids: int32 [n, topk]]
# One payload, not a second frame: transports keep one buffer per (peer,
# micro-batch), and a second frame would overwrite the first. The padding keeps
# the weights and ids aligned for zero-copy views, whatever the hidden dtype.
ROUTING_ALIGN = 8
ROUTING_WEIGHT_DTYPE = torch.float32
ROUTING_ID_DTYPE = torch.int32

# Transfer encodings, per direction (AFDConfig.transfer_dtype): "auto" sends
# the hidden states exactly, in the model's dtype; "fp8" as float8 e4m3fn with
# one float32 scale per FP8_SCALE_GROUP elements of a token (scale = the
# group's largest |x| / 448), packed by the op library (vllm/afd/kernels).
# On a frame: LayerFrame.encoding EXACT or FP8_E4M3, with its scale_group.
TRANSFER_AUTO, TRANSFER_FP8 = "auto", "fp8"
TRANSFER_DTYPES = (TRANSFER_AUTO, TRANSFER_FP8)
EXACT, FP8_E4M3 = "exact", "fp8_e4m3"
FP8_SCALE_GROUP = 128
FP8_SCALE_DTYPE = torch.float32
MAX_SCALE_GROUP = 1 << 20

# Payload dtypes, by the names that travel in LayerFrame.dtype and Hello.dtype.
DTYPES: dict[str, torch.dtype] = {
    "float32": torch.float32,
    "bfloat16": torch.bfloat16,
    "float16": torch.float16,
    "int32": torch.int32,
    "int64": torch.int64,
}
_DTYPE_NAMES = {dtype: name for name, dtype in DTYPES.items()}

# StepHeader.flags bits (bit 0 is retired: warm-up and profile runs never
# reach the link, the runner names them; see attention/link.py).
SHUTDOWN = 2  # the attention server is shutting down; the FFN server should exit
GOODBYE = 4  # the sender closes this connection; nothing follows
KNOWN_FLAGS = SHUTDOWN | GOODBYE

NonNegInt = Annotated[int, msgspec.Meta(ge=0)]
Text = Annotated[str, msgspec.Meta(max_length=MAX_TEXT)]
Name = Annotated[str, msgspec.Meta(max_length=256)]
Nonce = Annotated[bytes, msgspec.Meta(min_length=AUTH_NONCE_BYTES,
                                      max_length=AUTH_NONCE_BYTES)]
Proof = Annotated[bytes, msgspec.Meta(min_length=AUTH_PROOF_BYTES,
                                      max_length=AUTH_PROOF_BYTES)]


class ProtocolError(ValueError):
    """A peer sent something this side cannot accept: malformed bytes, a
    message of the wrong kind, or a header that does not match what we expect."""


class Message(msgspec.Struct, tag_field="kind", kw_only=True):
    """Base of every wire message; the subclass tag selects the type on decode."""


class Hello(Message, tag="hello"):
    """First message of a connection: who the attention rank is and what it will
    send, so the FFN can refuse a mismatched peer before any tensor moves."""

    protocol_version: NonNegInt
    role: Literal["attention", "ffn"]
    rank: NonNegInt
    num_attention_ranks: Annotated[int, msgspec.Meta(ge=1)]
    num_ffn_ranks: Annotated[int, msgspec.Meta(ge=1)]
    num_ubatches: Annotated[int, msgspec.Meta(ge=1, le=MAX_UBATCHES)]
    hidden_size: Annotated[int, msgspec.Meta(ge=1)]
    dtype: Name
    max_tokens: Annotated[int, msgspec.Meta(ge=1)]
    connector: Name = ""
    # Experts per token of the routing sent with MoE layers' hidden states (0:
    # the FFN routes itself, AFDConfig.gate_on == "ffn"); both sides must agree.
    routing_topk: Annotated[int, msgspec.Meta(ge=0, le=MAX_TOPK)] = 0
    # Free-form identity of the model/config (e.g. model name, layer count,
    # quantization); keys both sides know must match.
    fingerprint: Annotated[dict[Name, Text],
                           msgspec.Meta(max_length=MAX_FINGERPRINT_ITEMS)] = {}
    # The attention side's challenge to the FFN, AUTH_NONCE_BYTES of them when
    # it has a secret (VLLM_AFD_TOKEN), empty when it has none.
    auth_nonce: Annotated[bytes, msgspec.Meta(max_length=AUTH_NONCE_BYTES)] = b""
    # The kind of device the attention rank's tensors live on ("cpu", "cuda",
    # "npu"): peers on different kinds need a connector that stages through
    # host memory.
    device_kind: Name = ""
    # The connector's own handshake data (its encoded struct; see
    # connectors/base.py transport hooks).
    transport: Annotated[bytes, msgspec.Meta(max_length=MAX_TRANSPORT_BYTES)] = b""
    # How hidden states travel to the FFN and outputs back (TRANSFER_DTYPES),
    # and the elements per fp8 scale; both sides must agree.
    transfer_to_ffn: Name = TRANSFER_AUTO
    transfer_to_attention: Name = TRANSFER_AUTO
    scale_group: Annotated[int, msgspec.Meta(ge=0, le=MAX_SCALE_GROUP)] = 0


class AuthChallenge(Message, tag="auth_challenge"):
    """The FFN's answer to a Hello when it has a secret: its own challenge, and
    its proof that it knows the secret (vllm/afd/transport/auth.py)."""

    nonce: Nonce
    proof: Proof


class AuthProof(Message, tag="auth_proof"):
    """The attention side's proof that it knows the secret."""

    proof: Proof


class HelloAck(Message, tag="hello_ack"):
    """The FFN's answer to Hello, plus what the transport needs to continue."""

    accepted: bool
    reason: Text = ""
    protocol_version: NonNegInt = PROTOCOL_VERSION
    rank: NonNegInt = 0  # the FFN rank answering
    # The FFN ranks that compute together with it (tensor/expert parallel),
    # lead first; the attention side sends to all of them, hears from the lead.
    group: Annotated[list[NonNegInt], msgspec.Meta(max_length=1024)] = []
    # The connector's own handshake data (shm: segment names and slot size;
    # nccl: unique ids), its encoded struct.
    transport: Annotated[bytes, msgspec.Meta(max_length=MAX_TRANSPORT_BYTES)] = b""


class HelloConfirm(Message, tag="hello_confirm"):
    """The attention side's answer to an accepted HelloAck: its own checks of
    the ack (group, transport data) passed, or why not. The FFN counts the peer
    as connected, and either side sets up anything costly (NCCL), only after a
    positive confirm."""

    accepted: bool
    reason: Text = ""


class StepHeader(Message, tag="step"):
    """Start of a model step on one attention rank: how many tokens each
    micro-batch carries (their sum is this rank's tokens for the step).

    from_layer: empty, every micro-batch starts at the first layer; otherwise
    one entry per micro-batch, the first layer id the FFN serves for it in
    this step. The attention side re-sends a step to a standby FFN server
    after a failover and resumes it there: the layers below from_layer[u]
    were done elsewhere, and a value above every layer leaves nothing to do."""

    step_id: NonNegInt
    num_tokens: Annotated[list[NonNegInt], msgspec.Meta(max_length=MAX_UBATCHES)]
    flags: NonNegInt = 0
    from_layer: Annotated[list[NonNegInt], msgspec.Meta(max_length=MAX_UBATCHES)] = []

    @property
    def is_shutdown(self) -> bool:
        return bool(self.flags & SHUTDOWN)

    @property
    def is_goodbye(self) -> bool:
        return bool(self.flags & GOODBYE)


class LayerFrame(Message, tag="layer"):
    """Header of one tensor payload: the hidden states of (step, layer,
    micro-batch) on the way to the FFN, or the FFN's output on the way back."""

    step_id: NonNegInt
    layer_id: NonNegInt
    ubatch_id: NonNegInt
    dtype: Name
    shape: Annotated[list[NonNegInt], msgspec.Meta(max_length=MAX_DIMS)]
    nbytes: NonNegInt
    # > 0: the payload carries this many routed experts per token after the
    # hidden states (see ROUTING_ALIGN); only attention -> FFN, MoE layers.
    topk: Annotated[int, msgspec.Meta(ge=0, le=MAX_TOPK)] = 0
    # How the tensor of shape x dtype travels: EXACT, or FP8_E4M3 with one
    # float32 scale per scale_group elements of a row (PayloadLayout).
    encoding: Name = EXACT
    scale_group: Annotated[int, msgspec.Meta(ge=0, le=MAX_SCALE_GROUP)] = 0


class ErrorFrame(Message, tag="error"):
    """The sender hit a fatal error; the receiver fails with this text instead
    of waiting out its timeout."""

    text: Text


AnyMessage = (Hello | AuthChallenge | AuthProof | HelloAck | HelloConfirm | StepHeader
              | LayerFrame | ErrorFrame)

_encoder = msgspec.msgpack.Encoder()
_decoder = msgspec.msgpack.Decoder(AnyMessage)


def encode(message: Message) -> bytes:
    return _encoder.encode(message)


def decode(data: bytes | bytearray | memoryview, *, source: str = "peer") -> AnyMessage:
    """Decode one message; malformed or truncated bytes raise ProtocolError."""
    try:
        return _decoder.decode(data)
    except msgspec.DecodeError as e:
        raise ProtocolError(
            f"malformed AFD message from {source} ({len(data)} bytes): {e}") from e


def expect(message: AnyMessage, kind: type[Message], *, source: str = "peer",
           waiting_for: object = "") -> Message:
    """Return message if it is of kind, else raise ProtocolError naming both."""
    if not isinstance(message, kind):
        what = f" while waiting for {waiting_for}" if waiting_for else ""
        raise ProtocolError(
            f"unexpected message from {source}{what}: expected {kind.__name__}, "
            f"received {type(message).__name__}")
    return message


def _mismatch(field: str, expected, received, context: object) -> ProtocolError:
    where = f" ({context})" if context else ""
    return ProtocolError(f"{field}: expected {expected}, received {received}{where}")


def dtype_name(dtype: torch.dtype) -> str:
    try:
        return _DTYPE_NAMES[dtype]
    except KeyError:
        raise ValueError(f"dtype {dtype} cannot travel between AFD servers; supported: "
                         f"{', '.join(DTYPES)}") from None


def torch_dtype(name: str) -> torch.dtype:
    """The torch dtype for a wire dtype name (ProtocolError if not allowed)."""
    try:
        return DTYPES[name]
    except KeyError:
        raise ProtocolError(f"dtype: expected one of {', '.join(DTYPES)}, received "
                            f"{name!r}") from None


def payload_nbytes(dtype: torch.dtype, shape: Sequence[int]) -> int:
    return math.prod(shape) * dtype.itemsize


class Routing(NamedTuple):
    """The router's decision for n tokens: what vLLM's FusedMoERouter.select_experts
    returns, as it travels (logical expert ids, before any EPLB mapping)."""

    topk_weights: torch.Tensor  # ROUTING_WEIGHT_DTYPE [n, topk]
    topk_ids: torch.Tensor  # ROUTING_ID_DTYPE [n, topk]


class PayloadLayout(NamedTuple):
    """Byte offsets of one LayerFrame payload of [tokens, hidden] (csrc/pack.h
    pack_layout is the same function; a test holds the two together):

        [hidden]   tokens x hidden of dtype (exact), or of fp8 e4m3fn
        [pad]      zeros up to ROUTING_ALIGN, when anything follows
        [scales]   fp8 only: float32 [tokens, groups], groups = ceil(hidden / group)
        [weights]  routing only: float32 [tokens, topk]
        [ids]      routing only: int32 [tokens, topk]
    """

    hidden_nbytes: int
    groups: int  # float32 scales per token (fp8), else 0
    scales_offset: int
    weights_offset: int
    ids_offset: int
    total: int

    @classmethod
    def of(cls, tokens: int, hidden: int, dtype: torch.dtype, group_size: int = 0,
           topk: int = 0) -> "PayloadLayout":
        fp8 = group_size > 0
        hidden_nbytes = tokens * hidden * (1 if fp8 else dtype.itemsize)
        groups = -(-hidden // group_size) if fp8 else 0
        tail = groups * FP8_SCALE_DTYPE.itemsize + topk * (ROUTING_WEIGHT_DTYPE.itemsize
                                                           + ROUTING_ID_DTYPE.itemsize)
        scales = -(-hidden_nbytes // ROUTING_ALIGN) * ROUTING_ALIGN if tail else hidden_nbytes
        weights = scales + tokens * groups * FP8_SCALE_DTYPE.itemsize
        ids = weights + tokens * topk * ROUTING_WEIGHT_DTYPE.itemsize
        return cls(hidden_nbytes, groups, scales, weights, ids,
                   ids + tokens * topk * ROUTING_ID_DTYPE.itemsize)


def frame_nbytes(dtype: torch.dtype, shape: Sequence[int], topk: int = 0,
                 scale_group: int = 0) -> int:
    """Payload bytes of a LayerFrame: the tensor (exact, or fp8 with scales
    when scale_group > 0), plus routing when topk > 0."""
    if topk == 0 and scale_group == 0:
        return payload_nbytes(dtype, shape)
    rows, hidden = shape
    return PayloadLayout.of(rows, hidden, dtype, scale_group, topk).total


def routed_parts(tensor: torch.Tensor, routing: Routing) -> list[torch.Tensor]:
    """The pieces of an exact routed payload, back to back (no copy)."""
    nbytes = tensor.numel() * tensor.element_size()
    pad = -(-nbytes // ROUTING_ALIGN) * ROUTING_ALIGN - nbytes
    parts = [tensor]
    if pad:
        parts.append(torch.zeros(pad, dtype=torch.uint8, device=tensor.device))
    return parts + [routing.topk_weights, routing.topk_ids]


def routing_views(raw: torch.Tensor, layout: PayloadLayout, rows: int,
                  topk: int) -> Routing:
    """The routing of a received payload (a flat uint8 tensor laid out by
    layout), as views."""
    weights = raw[layout.weights_offset:layout.ids_offset].view(ROUTING_WEIGHT_DTYPE)
    ids = raw[layout.ids_offset:layout.total].view(ROUTING_ID_DTYPE)
    return Routing(weights.view(rows, topk), ids.view(rows, topk))


def check_step(header: StepHeader, *, num_ubatches: int, max_tokens: int,
               min_step_id: int = 0, context: object = "") -> StepHeader:
    """Validate a StepHeader before its token counts size anything."""
    if header.flags & ~KNOWN_FLAGS:
        raise _mismatch("StepHeader.flags", f"only bits {KNOWN_FLAGS:#x}",
                        f"{header.flags:#x}", context)
    if header.is_goodbye or header.is_shutdown:
        return header  # ends the conversation; carries no step
    if header.step_id < min_step_id:
        raise _mismatch("StepHeader.step_id", f">= {min_step_id} (steps only move forward)",
                        header.step_id, context)
    if not 1 <= len(header.num_tokens) <= num_ubatches:
        raise _mismatch("StepHeader.num_tokens", f"1 to {num_ubatches} micro-batches",
                        f"{len(header.num_tokens)} ({header.num_tokens})", context)
    total = sum(header.num_tokens)
    if total > max_tokens:
        raise _mismatch("StepHeader.num_tokens", f"at most {max_tokens} tokens in all",
                        f"{total} ({header.num_tokens})", context)
    if header.from_layer and len(header.from_layer) != len(header.num_tokens):
        raise _mismatch("StepHeader.from_layer",
                        f"none or one entry per micro-batch ({len(header.num_tokens)})",
                        f"{len(header.from_layer)} ({header.from_layer})", context)
    return header


def check_frame(frame: LayerFrame, *, step_id: int, layer_id: int, ubatch_id: int,
                max_bytes: int, hidden_size: int | None = None,
                expected_shape_tail: Sequence[int] | None = None,
                expected_shape: Sequence[int] | None = None,
                dtype: torch.dtype | None = None, routing_topk: int = 0,
                encoding: str = EXACT, scale_group: int = 0,
                context: object = "") -> torch.dtype:
    """Check a received LayerFrame against what the receiver expects next and
    return its torch dtype. Raises ProtocolError naming the field, the expected
    and the received value, then context (anything printable, formatted only
    on error). nbytes is checked against shape, dtype and topk and against
    max_bytes, so it is safe to allocate or index with afterwards. topk must
    be 0 or routing_topk (a frame may carry routing only where the receiver
    negotiated it; dense layers of a MoE model carry none). encoding and
    scale_group: what this direction negotiated (EXACT, or FP8_E4M3 with its
    scale group)."""
    if frame.step_id != step_id:
        raise _mismatch("LayerFrame.step_id", step_id, frame.step_id, context)
    if frame.layer_id != layer_id:
        raise _mismatch("LayerFrame.layer_id", layer_id, frame.layer_id, context)
    if frame.ubatch_id != ubatch_id:
        raise _mismatch("LayerFrame.ubatch_id", ubatch_id, frame.ubatch_id, context)
    received_dtype = DTYPES.get(frame.dtype)
    if received_dtype is None:
        raise _mismatch("LayerFrame.dtype", f"one of {', '.join(DTYPES)}",
                        repr(frame.dtype), context)
    if dtype is not None and received_dtype != dtype:
        raise _mismatch("LayerFrame.dtype", dtype_name(dtype), frame.dtype, context)
    shape = list(frame.shape)
    if not shape:
        raise _mismatch("LayerFrame.shape", "at least one dimension", shape, context)
    if hidden_size is not None:
        expected_shape_tail = (hidden_size,)
    if expected_shape is not None and shape != list(expected_shape):
        raise _mismatch("LayerFrame.shape", list(expected_shape), shape, context)
    if expected_shape_tail is not None:
        tail = list(expected_shape_tail)
        if len(shape) != len(tail) + 1 or shape[1:] != tail:
            raise _mismatch("LayerFrame.shape", f"[num_tokens, {', '.join(map(str, tail))}]",
                            shape, context)
    if frame.topk not in (0, routing_topk):
        raise _mismatch("LayerFrame.topk", "0" if routing_topk == 0 else
                        f"0 or {routing_topk}", frame.topk, context)
    if frame.encoding != encoding:
        raise _mismatch("LayerFrame.encoding", encoding, repr(frame.encoding), context)
    expected_group = scale_group if encoding == FP8_E4M3 else 0
    if frame.scale_group != expected_group:
        raise _mismatch("LayerFrame.scale_group", expected_group, frame.scale_group, context)
    if (frame.topk or frame.scale_group) and len(shape) != 2:
        raise _mismatch("LayerFrame.shape", "[num_tokens, hidden_size] (routed or fp8 frame)",
                        shape, context)
    # prod() of a hostile shape can be huge; Python ints do not overflow, and
    # the comparison below rejects it before anything is allocated.
    nbytes = frame_nbytes(received_dtype, shape, frame.topk, frame.scale_group)
    if frame.nbytes != nbytes:
        routed = f", topk {frame.topk}" if frame.topk else ""
        if frame.scale_group:
            routed += f", {frame.encoding}/{frame.scale_group}"
        raise _mismatch("LayerFrame.nbytes", f"{nbytes} (shape {shape} x {frame.dtype}"
                        f"{routed})", frame.nbytes, context)
    if nbytes > max_bytes:
        raise _mismatch("LayerFrame.nbytes", f"at most {max_bytes}", nbytes, context)
    return received_dtype


def layer_frame(tensor: torch.Tensor, *, step_id: int, layer_id: int,
                ubatch_id: int, topk: int = 0, scale_group: int = 0) -> LayerFrame:
    """The header describing tensor (and topk experts of routing per row, when
    topk > 0; as fp8 with one scale per scale_group elements, when > 0) as the
    payload of (step, layer, ubatch)."""
    return frame_of(tensor.dtype, list(tensor.shape), step_id=step_id, layer_id=layer_id,
                    ubatch_id=ubatch_id, topk=topk, scale_group=scale_group)


def frame_of(dtype: torch.dtype, shape: list[int], *, step_id: int, layer_id: int,
             ubatch_id: int, topk: int = 0, scale_group: int = 0) -> LayerFrame:
    """layer_frame for a tensor of dtype and shape (one not at hand: a payload
    that came without a header, as the ipc connector's)."""
    return LayerFrame(step_id=step_id, layer_id=layer_id, ubatch_id=ubatch_id,
                      dtype=dtype_name(dtype), shape=shape,
                      nbytes=frame_nbytes(dtype, shape, topk, scale_group), topk=topk,
                      encoding=FP8_E4M3 if scale_group else EXACT, scale_group=scale_group)


def tensor_bytes(tensor: torch.Tensor) -> torch.Tensor:
    """A flat uint8 view of a contiguous tensor's bytes (no copy); works for
    bfloat16, which numpy and the buffer protocol do not know."""
    if not tensor.is_contiguous():
        raise ValueError(f"AFD payloads must be contiguous; got strides {tensor.stride()} "
                         f"for shape {tuple(tensor.shape)}")
    return tensor.detach().reshape(-1).view(torch.uint8)


def tensor_to_buffer(tensor: torch.Tensor) -> memoryview:
    """The bytes of a contiguous CPU tensor as a writable memoryview (no copy;
    the view keeps the tensor alive). Built over the data pointer: torch's own
    route (reshape, view, numpy) costs several times more per message."""
    if tensor.device.type != "cpu":
        raise ValueError(f"tensor_to_buffer needs a CPU tensor, got {tensor.device}")
    if not tensor.is_contiguous():
        raise ValueError(f"AFD payloads must be contiguous; got strides {tensor.stride()} "
                         f"for shape {tuple(tensor.shape)}")
    nbytes = tensor.nbytes
    if nbytes == 0:
        return memoryview(bytearray())
    raw = (ctypes.c_char * nbytes).from_address(tensor.data_ptr())
    raw._owner = tensor  # the memory belongs to the tensor: keep it alive
    return memoryview(raw).cast("B")
