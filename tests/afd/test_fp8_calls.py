# SPDX-License-Identifier: Apache-2.0
# SPDX-FileCopyrightText: Copyright contributors to the vllm-afd project
"""fp8 layer calls through the prepared calls (csrc/cpu/frame_codec.h: the one
C call of a message end packs or unpacks): for shm and tcp and each direction
in fp8, every message end is a prepared call, the values are exactly what
plain torch's quantize/dequantize of the sent tensors gives (the general
path's), the packed bytes are torch.ops.afd.pack's, and the frames are the
general path's in size. Real connectors in threads of one process; what the
prepared calls save is measured by `make bench-link` (`--transfer-dtype`)."""

import pytest
import torch
from test_connectors import Background, free_port
from test_pack_ops import reference_dequantize, reference_quantize

from vllm.afd.config import AFDConfig
from vllm.afd.kernels import ops
from vllm.afd.transport import wire
from vllm.afd.transport.connectors.base import create_connector
from vllm.afd.transport.connectors.shm_fast import frame_template
from vllm.afd.transport.wire import StepHeader

HIDDEN = 200  # two scale groups, the second partial
DTYPE = torch.bfloat16
GROUP = wire.FP8_SCALE_GROUP
TRANSFERS = {"fp8": "fp8", "fp8-to-ffn": {"to_ffn": "fp8"},
             "fp8-to-attention": {"to_attention": "fp8"}}
STEPS, LAYERS = [3, 1, 16, 5], 3

# Every test here counts prepared calls: none may fall back for a busy host.
pytestmark = pytest.mark.usefixtures("patient_waits")


def fp8_pair(connector: str, transfer, hidden: int = HIDDEN):
    """(ffn, attention) connectors of connector, linked, with transfer_dtype."""
    port = free_port()

    def make(role):
        cfg = AFDConfig(role=role, connector=connector, port=port, timeout_s=10,
                        transfer_dtype=transfer, connector_extra_config={"spin_us": 20_000})
        return create_connector(cfg, hidden_size=hidden, dtype=DTYPE, max_tokens=16)

    ffn, attn = make("ffn"), make("attention")
    accepting = Background(ffn.accept)
    attn.connect()
    accepting.join_result()
    return ffn, attn


def prepared_count(connector) -> int:
    return connector.fast_calls if hasattr(connector, "fast_calls") else connector.socket_calls


def through_fp8(x: torch.Tensor) -> torch.Tensor:
    return reference_dequantize(*reference_quantize(x, GROUP), GROUP, x.dtype)


def serve(ffn, kinds: list) -> int:
    """As the FFN loop does (output = 2h + layer): reply_and_recv between a
    step's first receive and its last send; kinds gets what each receive gave
    (a tensor, or fp8 still packed: codec.Packed)."""
    steps = 0
    while True:
        step = ffn.recv_step(0)
        if step.is_goodbye or step.is_shutdown:
            return steps
        h = ffn.recv_hidden(0, 0, 0, defer=True)
        for layer in range(LAYERS):
            kinds.append(type(h).__name__)
            if type(h) is not torch.Tensor:
                h = h.tensor()
            out = h * 2 + layer
            if layer + 1 < LAYERS:
                h = ffn.reply_and_recv(0, layer, 0, out, layer + 1, 0)
            else:
                ffn.send_output(0, layer, 0, out)
        steps += 1


def run(connector: str, transfer, prepared: bool) -> tuple:
    """STEPS through a pair; every output checked against the reference.
    (attention, ffn, what the FFN's receives gave)."""
    ffn, attn = fp8_pair(connector, transfer)
    to_ffn = attn.send_scale_group > 0
    back = attn.receive_scale_group > 0
    kinds: list = []
    server = Background(serve, ffn, kinds)
    g = torch.Generator().manual_seed(7)
    try:
        for i, rows in enumerate(STEPS):
            attn.send_step(StepHeader(step_id=i + 1, num_tokens=[rows]))
            assert attn.exchange_prepared()
            for layer in range(LAYERS):
                h = (torch.randn(rows, HIDDEN, generator=g) * 10).to(DTYPE)
                out = torch.empty_like(h)
                if prepared:
                    assert attn.prepared_send(layer, 0, h, out)
                    assert attn.prepared_recv(layer, 0, out)
                else:
                    attn.send_hidden(layer, 0, h)
                    attn.recv_output(layer, 0, out=out)
                received = through_fp8(h) if to_ffn else h
                expected = received * 2 + layer
                if back:
                    expected = through_fp8(expected)
                assert torch.equal(out, expected), (i, layer)
                if to_ffn:
                    assert not torch.equal(received, h)  # it really went as fp8
    finally:
        attn.close()
        assert server.join_result() == len(STEPS)
        ffn.close()
    return attn, ffn, kinds


@pytest.mark.parametrize("transfer", TRANSFERS)
@pytest.mark.parametrize("connector", ["shm", "tcp"])
def test_fp8_layer_calls_take_prepared_calls_with_the_general_paths_values(connector, transfer):
    """Every message end a prepared call on both ends, the FFN's hidden states
    unpacked by it (a tensor, not codec.Packed: the FFN loop's lone path takes
    them), the values the reference's, and the byte counters those of the same steps
    through the general path but for the headers' fixed-width integers (the
    same frames). The general path's frames, read by the FFN's prepared
    receive, go the general way."""
    attn, ffn, kinds = run(connector, TRANSFERS[transfer], prepared=True)
    calls = len(STEPS) * LAYERS
    assert prepared_count(attn) == 2 * calls and prepared_count(ffn) == 2 * calls
    assert kinds == ["Tensor"] * calls
    general, general_ffn, general_kinds = run(connector, TRANSFERS[transfer], prepared=False)
    assert prepared_count(general) == 0
    # The same frames; only their headers' integers differ in width: fixed in
    # the templates (patched per call), minimal in the general path's.
    wider = sum(len(frame_template(DTYPE, rows, HIDDEN, attn.send_scale_group)[0])
                - len(wire.encode(wire.layer_frame(
                    torch.empty(rows, HIDDEN, dtype=DTYPE, device="meta"), step_id=i + 1,
                    layer_id=layer, ubatch_id=0, scale_group=attn.send_scale_group)))
                for i, rows in enumerate(STEPS) for layer in range(LAYERS))
    assert wider > 0
    assert attn.bytes_sent - general.bytes_sent == wider
    assert ffn.bytes_received - general_ffn.bytes_received == wider
    assert attn.bytes_received == general.bytes_received  # the FFN's replies: prepared
    assert ffn.bytes_sent == general_ffn.bytes_sent
    if attn.send_scale_group:  # the general path's frames are left for the general receive
        assert set(general_kinds) == {"Packed"}


@pytest.mark.parametrize("connector", ["shm", "tcp"])
def test_a_prepared_fp8_payload_is_the_pack_ops_bytes(connector):
    """What the prepared send put on the wire (the shm slot; the tcp pack
    buffer it was sent from) is byte for byte torch.ops.afd.pack's, the
    padding before the scales zeroed over what the memory held before: the
    peer cannot tell the two paths apart."""
    ops.load()
    hidden = 203  # rows x hidden fp8 bytes need padding up to the scales
    ffn, attn = fp8_pair(connector, "fp8", hidden)
    kinds: list = []
    server = Background(serve, ffn, kinds)
    try:
        for i, rows in enumerate([1, 7]):
            attn.send_step(StepHeader(step_id=i + 1, num_tokens=[rows]))
            for layer in range(LAYERS):
                h = (torch.randn(rows, hidden) * 3).to(DTYPE)
                nbytes = wire.frame_nbytes(DTYPE, [rows, hidden], 0, GROUP)
                expected = torch.full((nbytes,), 0xAB, dtype=torch.uint8)
                torch.ops.afd.pack(h, None, None, GROUP, expected)
                assert (rows * hidden) % 8 and not expected[rows * hidden].item()  # padding
                sent = (attn._tx[0].slot(0) if connector == "shm" else
                        attn._pack_target(0, 0, nbytes, torch.device("cpu")))[:nbytes]
                sent.fill_(0xAB)  # what an earlier payload may have left there
                out = torch.empty_like(h)
                assert attn.prepared_send(layer, 0, h, out)
                assert torch.equal(sent, expected), (rows, layer)
                assert attn.prepared_recv(layer, 0, out)
    finally:
        attn.close()
        server.join_result()
        ffn.close()


def test_fp8_on_a_device_connector_keeps_the_general_path(monkeypatch):
    """A connector whose tensors live on a device packs fp8 on that device
    (the op library's kernels), not in the prepared calls' C (host memory
    only): fp8 there keeps the general path; exact transfer keeps its staged
    prepared calls. Checked on the CPU through the predicate the prepared
    calls of both connectors ask."""
    from vllm.afd.transport.connectors.shm_fast import FastFrames
    from vllm.afd.transport.connectors.tcp_fast import SocketCalls

    class Fake:
        routing_topk = 0
        device = torch.device("cuda", 0)
        _on_host = _socket_on_host = False

    for send, receive, usable in ((GROUP, 0, False), (0, GROUP, False), (0, 0, True)):
        fake = Fake()
        fake.send_scale_group, fake.receive_scale_group = send, receive
        assert FastFrames._prepared_enabled(fake) is usable
        assert SocketCalls._socket_calls_usable(fake) is usable
        fake.device, fake._on_host, fake._socket_on_host = torch.device("cpu"), True, True
        assert FastFrames._prepared_enabled(fake) and SocketCalls._socket_calls_usable(fake)
