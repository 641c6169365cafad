# SPDX-License-Identifier: Apache-2.0
# SPDX-FileCopyrightText: Copyright contributors to the vllm-afd project
"""The attention<->FFN wire format (vllm/afd/transport/wire.py): round trips of every
message, and every check a received header must pass."""

import gc

import msgspec
import pytest
import torch

from vllm.afd.transport import wire
from vllm.afd.transport.wire import ErrorFrame, Hello, HelloAck, LayerFrame, ProtocolError, StepHeader


def hello(**overrides) -> Hello:
    fields = {"protocol_version": wire.PROTOCOL_VERSION, "role": "attention", "rank": 1,
              "num_attention_ranks": 2, "num_ffn_ranks": 1, "num_ubatches": 2,
              "hidden_size": 128, "dtype": "bfloat16", "max_tokens": 256, "connector": "shm",
              "fingerprint": {"model": "tiny-qwen3-moe", "num_layers": "4"}}
    return Hello(**{**fields, **overrides})


def frame(**overrides) -> LayerFrame:
    fields = {"step_id": 7, "layer_id": 3, "ubatch_id": 1, "dtype": "float32",
              "shape": [8, 128], "nbytes": 8 * 128 * 4}
    return LayerFrame(**{**fields, **overrides})


def check(f: LayerFrame, **overrides) -> torch.dtype:
    expected = {"step_id": 7, "layer_id": 3, "ubatch_id": 1, "hidden_size": 128,
                "max_bytes": 1 << 20}
    return wire.check_frame(f, **{**expected, **overrides})


@pytest.mark.parametrize("message", [
    hello(),
    hello(fingerprint={}),
    HelloAck(accepted=True, rank=0, group=[0, 1], transport=bytes(range(200))),
    wire.HelloConfirm(accepted=True),
    wire.HelloConfirm(accepted=False, reason="HelloAck.transport (shm): bad names"),
    HelloAck(accepted=False, reason="hidden_size: expected 128, received 64"),
    StepHeader(step_id=0, num_tokens=[5]),
    StepHeader(step_id=2**40, num_tokens=[3, 0, 7, 1], flags=wire.SHUTDOWN),
    StepHeader(step_id=0, num_tokens=[], flags=wire.GOODBYE),
    StepHeader(step_id=9, num_tokens=[4, 2], from_layer=[3, 2**31]),
    frame(),
    frame(dtype="bfloat16", shape=[0, 4096], nbytes=0),
    frame(topk=2, nbytes=8 * 128 * 4 + 8 * 2 * 8),
    hello(routing_topk=8),
    hello(auth_nonce=bytes(range(32))),
    hello(device_kind="cuda", transport=b"\x81\xa1k\x01"),
    wire.AuthChallenge(nonce=bytes(range(32)), proof=bytes(32)),
    wire.AuthProof(proof=bytes(range(32))),
    ErrorFrame(text="FFN rank 0: MoE kernel failed"),
], ids=lambda m: type(m).__name__)
def test_round_trip(message):
    data = wire.encode(message)
    decoded = wire.decode(data)
    assert type(decoded) is type(message)
    assert decoded == message
    assert wire.decode(memoryview(bytearray(data))) == message  # transports pass views


def test_step_flags():
    step = StepHeader(step_id=1, num_tokens=[1], flags=wire.SHUTDOWN)
    assert step.is_shutdown and not step.is_goodbye


@pytest.mark.parametrize("data, needle", [
    (b"", "Input data was truncated"),
    (b"\xc1", "invalid"),
    (wire.encode(frame())[:-3], "truncated"),
    (msgspec.msgpack.encode(42), "Expected `object`, got `int`"),
    (msgspec.msgpack.encode({"kind": "pickle", "x": 1}), "Invalid value 'pickle' - at `$.kind`"),
    (msgspec.msgpack.encode({"step_id": 1}), "Object missing required field `kind`"),
    (msgspec.msgpack.encode({**msgspec.to_builtins(frame()), "kind": "layer", "layer_id": -1}),
     "Expected `int` >= 0 - at `$.layer_id`"),
    (msgspec.msgpack.encode({"kind": "layer", "step_id": 1, "layer_id": 0}),
     "missing required field `ubatch_id`"),
    (msgspec.msgpack.encode({"kind": "step", "step_id": 1, "num_tokens": [1] * 5}),
     "length <= 4 - at `$.num_tokens`"),
    (msgspec.msgpack.encode({"kind": "layer", **{k: v for k, v in msgspec.to_builtins(
        frame()).items() if k != "kind"}, "shape": [1] * 9}), "length <= 8 - at `$.shape`"),
    (msgspec.msgpack.encode({"kind": "error", "text": "x" * (wire.MAX_TEXT + 1)}),
     "length <= 4096 - at `$.text`"),
    (msgspec.msgpack.encode({**msgspec.to_builtins(hello()), "num_ubatches": 5}),
     "<= 4 - at `$.num_ubatches`"),
    (msgspec.msgpack.encode({"kind": "auth_challenge", "nonce": bytes(31),
                             "proof": bytes(32)}), "length >= 32 - at `$.nonce`"),
    (msgspec.msgpack.encode({"kind": "auth_proof", "proof": bytes(33)}),
     "length <= 32 - at `$.proof`"),
    (msgspec.msgpack.encode({"kind": "auth_proof", "proof": "not bytes"}),
     "Expected `bytes`, got `str` - at `$.proof`"),
], ids=["empty", "reserved-byte", "truncated", "not-a-map", "unknown-kind", "no-kind",
        "negative-layer", "missing-field", "too-many-ubatches", "too-many-dims",
        "text-too-long", "hello-ubatches", "short-nonce", "long-proof", "proof-not-bytes"])
def test_malformed_bytes(data, needle):
    with pytest.raises(ProtocolError, match="malformed AFD message from FFN rank 0") as e:
        wire.decode(data, source="FFN rank 0")
    assert needle in str(e.value)


def test_unknown_fields_are_ignored_for_forward_compatibility():
    data = msgspec.msgpack.encode({**msgspec.to_builtins(frame()), "added_in_v2": 1})
    assert wire.decode(data) == frame()


def test_expect_names_both_kinds():
    with pytest.raises(ProtocolError) as e:
        wire.expect(StepHeader(step_id=1, num_tokens=[1]), LayerFrame,
                    source="attention rank 0", waiting_for="layer 3")
    assert str(e.value) == ("unexpected message from attention rank 0 while waiting for "
                            "layer 3: expected LayerFrame, received StepHeader")


def test_check_frame_accepts_and_returns_dtype():
    assert check(frame()) is torch.float32
    assert check(frame(dtype="bfloat16", nbytes=8 * 128 * 2), dtype=torch.bfloat16) \
        is torch.bfloat16
    assert check(frame(shape=[0, 128], nbytes=0)) is torch.float32
    assert check(frame(), hidden_size=None, expected_shape=[8, 128]) is torch.float32
    assert check(frame(shape=[8, 2, 64]), hidden_size=None,
                 expected_shape_tail=(2, 64)) is torch.float32


@pytest.mark.parametrize("bad, overrides, message", [
    (frame(layer_id=4), {}, "LayerFrame.layer_id: expected 3, received 4"),
    (frame(ubatch_id=0), {}, "LayerFrame.ubatch_id: expected 1, received 0"),
    (frame(step_id=6), {}, "LayerFrame.step_id: expected 7, received 6"),
    (frame(shape=[8, 64], nbytes=8 * 64 * 4), {},
     "LayerFrame.shape: expected [num_tokens, 128], received [8, 64]"),
    (frame(shape=[8, 128, 1]), {}, "LayerFrame.shape: expected [num_tokens, 128], received"),
    (frame(shape=[], nbytes=0), {}, "LayerFrame.shape: expected at least one dimension"),
    (frame(), {"expected_shape": [9, 128]},
     "LayerFrame.shape: expected [9, 128], received [8, 128]"),
    (frame(dtype="bfloat16", nbytes=8 * 128 * 2), {"dtype": torch.float32},
     "LayerFrame.dtype: expected float32, received bfloat16"),
    (frame(dtype="float64"), {}, ("LayerFrame.dtype: expected one of float32, bfloat16, "
                                  "float16, int32, int64, received 'float64'")),
    (frame(nbytes=8 * 128 * 2), {},
     "LayerFrame.nbytes: expected 4096 (shape [8, 128] x float32), received 2048"),
    (frame(shape=[4096, 128], nbytes=4096 * 128 * 4), {},
     "LayerFrame.nbytes: expected at most 1048576, received 2097152"),
    # A hostile header whose nbytes is consistent with a gigantic shape: refused
    # by the size check, nothing is allocated.
    (frame(shape=[2**40, 128], nbytes=2**40 * 128 * 4), {},
     f"LayerFrame.nbytes: expected at most 1048576, received {2**40 * 512}"),
    # Routing (gate_on "attention"): only the negotiated width, sizes include it.
    (frame(topk=2, nbytes=8 * 128 * 4 + 8 * 2 * 8), {},
     "LayerFrame.topk: expected 0, received 2"),
    (frame(topk=3, nbytes=8 * 128 * 4 + 8 * 3 * 8), {"routing_topk": 2},
     "LayerFrame.topk: expected 0 or 2, received 3"),
    (frame(topk=2), {"routing_topk": 2},
     "LayerFrame.nbytes: expected 4224 (shape [8, 128] x float32, topk 2), received 4096"),
    (frame(topk=2, nbytes=8 * 128 * 4 + 8 * 2 * 4), {"routing_topk": 2},
     "LayerFrame.nbytes: expected 4224 (shape [8, 128] x float32, topk 2), received 4160"),
    (frame(topk=2, shape=[8, 2, 64], nbytes=8 * 128 * 4 + 8 * 2 * 8),
     {"routing_topk": 2, "hidden_size": None, "expected_shape_tail": (2, 64)},
     "LayerFrame.shape: expected [num_tokens, hidden_size] (routed or fp8 frame), received"),
    (frame(topk=2, shape=[2048, 128], nbytes=2048 * 128 * 4 + 2048 * 2 * 8),
     {"routing_topk": 2}, "LayerFrame.nbytes: expected at most 1048576, received 1081344"),
    # Transfer encodings (transfer_dtype): only the negotiated one, sizes by its layout.
    (frame(encoding="fp8_e4m3", scale_group=128, nbytes=1056), {},
     "LayerFrame.encoding: expected exact, received 'fp8_e4m3'"),
    (frame(), {"encoding": "fp8_e4m3", "scale_group": 128},
     "LayerFrame.encoding: expected fp8_e4m3, received 'exact'"),
    (frame(encoding="fp8_e4m3", scale_group=64, nbytes=1088),
     {"encoding": "fp8_e4m3", "scale_group": 128},
     "LayerFrame.scale_group: expected 128, received 64"),
    (frame(scale_group=128), {}, "LayerFrame.scale_group: expected 0, received 128"),
    (frame(encoding="fp8_e4m3", scale_group=128), {"encoding": "fp8_e4m3", "scale_group": 128},
     "LayerFrame.nbytes: expected 1056 (shape [8, 128] x float32, fp8_e4m3/128), "
     "received 4096"),
    (frame(encoding="fp8_e4m3", scale_group=128, shape=[8, 2, 64], nbytes=1056),
     {"encoding": "fp8_e4m3", "scale_group": 128, "hidden_size": None,
      "expected_shape_tail": (2, 64)},
     "LayerFrame.shape: expected [num_tokens, hidden_size] (routed or fp8 frame), received"),
], ids=["layer", "ubatch", "step", "hidden", "ndim", "no-dims", "tokens", "dtype",
        "dtype-not-allowed", "nbytes-mismatch", "oversized", "hostile-shape",
        "routing-not-negotiated", "routing-width", "routing-bytes-missing",
        "routing-bytes-short", "routing-3d", "routing-oversized", "fp8-not-negotiated",
        "fp8-expected", "fp8-group", "group-without-fp8", "fp8-bytes", "fp8-3d"])
def test_check_frame_errors(bad, overrides, message):
    with pytest.raises(ProtocolError) as e:
        check(bad, context="from FFN rank 0", **overrides)
    assert str(e.value).startswith(message)
    assert str(e.value).endswith("(from FFN rank 0)")


@pytest.mark.parametrize("step, message", [
    (StepHeader(step_id=3, num_tokens=[1, 1, 1]),
     "StepHeader.num_tokens: expected 1 to 2 micro-batches, received 3 ([1, 1, 1])"),
    (StepHeader(step_id=3, num_tokens=[]),
     "StepHeader.num_tokens: expected 1 to 2 micro-batches, received 0 ([])"),
    (StepHeader(step_id=3, num_tokens=[60, 5]),
     "StepHeader.num_tokens: expected at most 64 tokens in all, received 65 ([60, 5])"),
    (StepHeader(step_id=1, num_tokens=[1]),
     "StepHeader.step_id: expected >= 2 (steps only move forward), received 1"),
    (StepHeader(step_id=3, num_tokens=[1], flags=64),
     "StepHeader.flags: expected only bits 0x6, received 0x40"),
    (StepHeader(step_id=3, num_tokens=[1, 2], from_layer=[4]),
     "StepHeader.from_layer: expected none or one entry per micro-batch (2), received 1 ([4])"),
])
def test_check_step_errors(step, message):
    with pytest.raises(ProtocolError, match="^" + message.replace("[", r"\[").replace(
            "(", r"\(").replace(")", r"\)").replace("+", r"\+")):
        wire.check_step(step, num_ubatches=2, max_tokens=64, min_step_id=2)


def test_check_step_accepts():
    ok = StepHeader(step_id=2, num_tokens=[64, 0])
    assert wire.check_step(ok, num_ubatches=2, max_tokens=64, min_step_id=2) is ok
    bye = StepHeader(step_id=0, num_tokens=[], flags=wire.GOODBYE)
    assert wire.check_step(bye, num_ubatches=2, max_tokens=64, min_step_id=9) is bye
    resumed = StepHeader(step_id=2, num_tokens=[3, 1], from_layer=[5, 0])
    assert wire.check_step(resumed, num_ubatches=2, max_tokens=64, min_step_id=2) is resumed


def test_step_from_layer_defaults_to_the_first_layer_and_is_bounded():
    """A plain step carries no from_layer (every micro-batch from layer 0); a
    peer cannot announce more entries than micro-batches exist, nor negative ids."""
    assert StepHeader(step_id=0, num_tokens=[2]).from_layer == []
    decoded = wire.decode(wire.encode(StepHeader(step_id=1, num_tokens=[2], from_layer=[7])))
    assert decoded.from_layer == [7]
    for bad in ([0] * (wire.MAX_UBATCHES + 1), [-1]):
        data = msgspec.msgpack.encode({"kind": "step", "step_id": 0, "num_tokens": [1],
                                       "from_layer": bad})
        with pytest.raises(ProtocolError, match="from_layer"):
            wire.decode(data)


@pytest.mark.parametrize("dtype", list(wire.DTYPES.values()))
def test_tensor_bytes_round_trip(dtype):
    t = (torch.randn(5, 7) * 100).to(dtype)
    buffer = wire.tensor_to_buffer(t)
    assert buffer.nbytes == t.numel() * t.element_size()
    back = torch.frombuffer(bytearray(buffer), dtype=torch.uint8).view(dtype).view(5, 7)
    assert torch.equal(back, t)
    buffer[:] = bytes(buffer.nbytes)  # a view of the tensor's memory, not a copy
    assert not t.any()


def test_tensor_bytes_zero_size_and_lifetime():
    empty = torch.empty(0, 16, dtype=torch.bfloat16)
    assert wire.tensor_to_buffer(empty).nbytes == 0
    buffer = wire.tensor_to_buffer(torch.full((1024,), 3.0))
    gc.collect()  # the view keeps the (otherwise unreferenced) tensor alive
    assert torch.frombuffer(bytearray(buffer), dtype=torch.float32).eq(3.0).all()


def test_tensor_helpers_reject_bad_input():
    with pytest.raises(ValueError, match="contiguous"):
        wire.tensor_to_buffer(torch.zeros(4, 4).t())
    with pytest.raises(ValueError, match="float64 cannot travel"):
        wire.dtype_name(torch.float64)
    with pytest.raises(ProtocolError, match="received 'float64'"):
        wire.torch_dtype("float64")


def test_layer_frame_describes_tensor():
    t = torch.zeros(3, 64, dtype=torch.bfloat16)
    assert wire.layer_frame(t, step_id=1, layer_id=2, ubatch_id=0) == LayerFrame(
        step_id=1, layer_id=2, ubatch_id=0, dtype="bfloat16", shape=[3, 64], nbytes=384)


def routing(n: int, k: int, seed: int = 0) -> wire.Routing:
    g = torch.Generator().manual_seed(seed)
    return wire.Routing(torch.rand(n, k, generator=g),
                        torch.randint(0, 64, (n, k), generator=g, dtype=torch.int32))


@pytest.mark.parametrize("dtype, n, hidden", [(torch.float32, 8, 128), (torch.bfloat16, 3, 5),
                                              (torch.float16, 1, 7), (torch.bfloat16, 0, 4)])
def test_routed_payload_round_trip(dtype, n, hidden):
    """Hidden states, padding, weights, ids: one payload, viewed back by its layout."""
    h = torch.randn(n, hidden).to(dtype)
    r = routing(n, 3)
    f = wire.layer_frame(h, step_id=1, layer_id=2, ubatch_id=0, topk=3)
    assert f.topk == 3 and f.nbytes == wire.frame_nbytes(dtype, [n, hidden], 3)
    assert check(f, step_id=1, layer_id=2, ubatch_id=0, hidden_size=hidden, dtype=dtype,
                 routing_topk=3) is dtype
    raw = torch.cat([wire.tensor_bytes(p) for p in wire.routed_parts(h, r)])
    layout = wire.PayloadLayout.of(n, hidden, dtype, 0, 3)
    assert raw.numel() == f.nbytes == layout.total
    h2 = raw[:layout.hidden_nbytes].view(dtype).view(n, hidden)
    r2 = wire.routing_views(raw, layout, n, 3)
    assert torch.equal(h2, h) and torch.equal(r2.topk_weights, r.topk_weights)
    assert torch.equal(r2.topk_ids, r.topk_ids)
    assert r2.topk_weights.dtype == torch.float32 and r2.topk_ids.dtype == torch.int32
    raw.zero_()  # views, not copies
    assert not r2.topk_ids.any()


def test_routing_topk_bounds_on_the_wire():
    data = msgspec.msgpack.encode({**msgspec.to_builtins(frame()), "kind": "layer",
                                   "topk": wire.MAX_TOPK + 1})
    with pytest.raises(ProtocolError, match=r"<= 1024 - at `\$.topk`"):
        wire.decode(data)
    assert wire.decode(wire.encode(hello())).routing_topk == 0  # default: no routing
