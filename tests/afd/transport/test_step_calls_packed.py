# SPDX-License-Identifier: Apache-2.0
# SPDX-FileCopyrightText: Copyright contributors to the vllm-afd project
"""fp8 and routed layer calls through the prepared calls (csrc/cpu/frame_codec.h:
the one C call of a message end packs or unpacks): for shm and tcp, each
direction in fp8, and routing with the hidden states of MoE layers (gate_on
"attention", dense layers without), every message end is a prepared call, the
values are exactly what plain torch's quantize/dequantize of the sent tensors
gives (the general path's), the routing arrives as sent, the packed bytes are
torch.ops.afd.pack's, and the frames are the general path's in size. Real
connectors in threads of one process; what the prepared calls save is
measured by `make bench-link` (`--transfer-dtype`)."""

import sys
import time

from types import SimpleNamespace

import pytest
import torch

from vllm.afd.adapter.config import AFDConfig
from vllm.afd.kernels import ops
from vllm.afd.transport import wire
from vllm.afd.transport.connectors import create_connector
from vllm.afd.transport.connectors.prepared import frame_template
from vllm.afd.transport.wire import StepHeader
from helpers.connectors import Background, free_port, routing_for
from helpers.devices import DeferredOps
from helpers.fp8 import reference_dequantize, reference_quantize

HIDDEN = 200  # two scale groups, the second partial
DTYPE = torch.bfloat16
GROUP = wire.FP8_SCALE_GROUP
TRANSFERS = {"fp8": "fp8", "fp8-to-ffn": {"to_ffn": "fp8"},
             "fp8-to-attention": {"to_attention": "fp8"}}
STEPS, LAYERS = [3, 1, 16, 5], 3
TOPK = 3  # helpers.connectors.routing_for's
ROUTED = {0, 2}  # gate_on "attention": the MoE layers' calls carry routing, layer 1's not

# Every test here counts prepared calls: none may fall back for a busy host.
pytestmark = pytest.mark.usefixtures("patient_waits")


def packed_pair(connector: str, transfer, hidden: int = HIDDEN, topk: int = 0,
                staged: bool = False):
    """(ffn, attention) connectors of connector, linked, with transfer_dtype
    (and routing of topk experts, when topk > 0). staged: both sides take
    the prepared calls as CUDA connectors do (fp8 and routing packed by the
    op library, the payload staged through the slots) on a fake asynchronous
    device (helpers.devices.DeferredOps): no GPU here."""
    port = free_port()

    def make(role):
        cfg = AFDConfig(role=role, connector=connector, port=port, timeout_s=10,
                        transfer_dtype=transfer, connector_extra_config={"spin_us": 20_000})
        side = create_connector(cfg, hidden_size=hidden, dtype=DTYPE, max_tokens=16,
                                routing_topk=topk)
        if staged:  # before the handshake: the slots take their ops then

            side.ops, side._on_host = DeferredOps(), False
        return side

    ffn, attn = make("ffn"), make("attention")
    accepting = Background(ffn.accept)
    attn.connect()
    accepting.join_result()
    return ffn, attn


def prepared_count(connector) -> int:
    return connector.fast_calls


def through_fp8(x: torch.Tensor) -> torch.Tensor:
    return reference_dequantize(*reference_quantize(x, GROUP), GROUP, x.dtype)


def serve(ffn, kinds: list) -> int:
    """As the FFN loop does (output = 2h + layer, plus sum(weights * ids) per
    token when routing came): take_call and reply_call; kinds gets what each
    receive gave (a tensor, or fp8 still packed: codec.Packed) and whether
    routing came."""
    steps = 0
    while True:
        step = ffn.recv_step(0)
        if step.is_goodbye or step.is_shutdown:
            return steps
        for layer in range(LAYERS):
            h = ffn.take_call(0, layer, 0)
            routing = ffn.routing(0, 0)
            kinds.append((type(h).__name__, routing is not None))
            if type(h) is not torch.Tensor:
                h = h.tensor()
            out = h * 2 + layer
            if routing is not None:
                out = out + combine(routing)
            ffn.reply_call(0, layer, 0, out)
        steps += 1


def combine(routing) -> torch.Tensor:
    """What serve() adds for routing: sum(weights * ids) per token, as DTYPE."""
    return (routing.topk_weights * routing.topk_ids).sum(1, keepdim=True).to(DTYPE)


def run(connector: str, transfer, prepared: bool, topk: int = 0, staged: bool = False) -> tuple:
    """STEPS through a pair; every output checked against the reference.
    topk > 0: the ROUTED layers' calls carry routing. (attention, ffn, what
    the FFN's receives gave)."""
    ffn, attn = packed_pair(connector, transfer, topk=topk, staged=staged)
    to_ffn = attn.codec.send_scale_group > 0
    back = attn.codec.receive_scale_group > 0
    kinds: list = []
    server = Background(serve, ffn, kinds)
    g = torch.Generator().manual_seed(7)
    try:
        for i, rows in enumerate(STEPS):
            attn.send_step(StepHeader(step_id=i + 1, num_tokens=[rows]))
            for layer in range(LAYERS):
                h = (torch.randn(rows, HIDDEN, generator=g) * 10).to(DTYPE)
                routing = routing_for(rows, 10 * i + layer) if topk and layer in ROUTED else None
                out = torch.empty_like(h)
                if prepared:
                    calls = attn.fast_calls
                    attn.send_call(layer, 0, h, routing)
                    attn.recv_call(layer, 0, out)
                    assert attn.fast_calls == calls + 2  # both C calls
                    if staged:  # the copy out of the slot lands later (the fake device)
                        attn.ops.wait_host(attn.ops.record())
                else:
                    attn.send_hidden(layer, 0, h, routing=routing)
                    attn.recv_output(layer, 0, out=out)
                received = through_fp8(h) if to_ffn else h
                expected = received * 2 + layer
                if routing is not None:
                    expected = expected + combine(routing)
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
    assert kinds == [("Tensor", False)] * calls
    general, general_ffn, general_kinds = run(connector, TRANSFERS[transfer], prepared=False)
    assert prepared_count(general) == 0
    # The same frames; only their headers' integers differ in width: fixed in
    # the templates (patched per call), minimal in the general path's.
    wider = sum(len(frame_template(DTYPE, rows, HIDDEN, attn.codec.send_scale_group)[0])
                - len(wire.encode(wire.layer_frame(
                    torch.empty(rows, HIDDEN, dtype=DTYPE, device="meta"), step_id=i + 1,
                    layer_id=layer, ubatch_id=0, scale_group=attn.codec.send_scale_group)))
                for i, rows in enumerate(STEPS) for layer in range(LAYERS))
    assert wider > 0
    assert attn.bytes_sent - general.bytes_sent == wider
    assert ffn.bytes_received - general_ffn.bytes_received == wider
    assert attn.bytes_received == general.bytes_received  # the FFN's replies: prepared
    assert ffn.bytes_sent == general_ffn.bytes_sent
    if attn.codec.send_scale_group:  # the general path's frames are left for the general receive
        assert set(general_kinds) == {("Packed", False)}


@pytest.mark.parametrize("connector", ["shm", "tcp"])
def test_a_prepared_fp8_payload_is_the_pack_ops_bytes(connector):
    """What the prepared send put on the wire (the shm slot; the tcp pack
    buffer it was sent from) is byte for byte torch.ops.afd.pack's, the
    padding before the scales zeroed over what the memory held before: the
    peer cannot tell the two paths apart."""
    ops.load()
    hidden = 203  # rows x hidden fp8 bytes need padding up to the scales
    ffn, attn = packed_pair(connector, "fp8", hidden)
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
                        attn.codec.pack_target(0, 0, nbytes, torch.device("cpu")))[:nbytes]
                sent.fill_(0xAB)  # what an earlier payload may have left there
                out = torch.empty_like(h)
                calls = attn.fast_calls
                attn.send_call(layer, 0, h)
                assert torch.equal(sent, expected), (rows, layer)
                attn.recv_call(layer, 0, out)
                assert attn.fast_calls == calls + 2  # both C calls
    finally:
        attn.close()
        server.join_result()
        ffn.close()


def test_packed_frames_of_device_tensors_where_the_op_library_packs():
    """A connector whose tensors live on a device packs fp8 and routing on
    that device (the op library's kernels), not in the prepared calls' C
    (host memory only): both connectors prepare such frames raw and pack on
    the device around the staging; on a device the library cannot pack on
    (codec.packs False) they keep the general path (exact frames without routing
    keep their staged prepared calls). Checked on the CPU through the
    predicate the prepared calls ask."""
    from vllm.afd.transport.connectors.step_calls import StepCalls

    class Fake:
        device = torch.device("cuda", 0)
        _on_host = False

    for send, receive, topk, exact in ((GROUP, 0, 0, False), (0, GROUP, 0, False),
                                       (0, 0, TOPK, False), (0, 0, 0, True)):
        for packs in (True, False):
            fake = Fake()
            fake.codec = SimpleNamespace(send_scale_group=send, receive_scale_group=receive,
                                         packs=packs)
            fake.routing_topk = topk
            assert StepCalls._prepared_enabled(fake) is (exact or packs)
            fake.device, fake._on_host = torch.device("cpu"), True
            assert StepCalls._prepared_enabled(fake)


@pytest.mark.parametrize("case", ["fp8", "fp8-to-attention", "routed", "routed-fp8-to-ffn"])
@pytest.mark.parametrize("connector", ["shm", "tcp"])
def test_device_tensors_take_prepared_calls_with_fp8_and_routing(connector, case):
    """A connector on a (fake) device: fp8 either way and routed frames take the
    prepared calls at every message end, packed by the op library on the
    device and staged through the slots, the FFN's received hidden states a
    tensor (its loop's lone path takes them) and its routing as sent on the
    routed layers; every output the reference's and the byte counters those
    of the host's prepared calls."""
    transfer = {"fp8": "fp8", "fp8-to-attention": TRANSFERS["fp8-to-attention"],
                "routed": "auto", "routed-fp8-to-ffn": TRANSFERS["fp8-to-ffn"]}[case]
    topk = TOPK if case.startswith("routed") else 0
    attn, ffn, kinds = run(connector, transfer, prepared=True, topk=topk, staged=True)
    calls = len(STEPS) * LAYERS
    assert prepared_count(attn) == 2 * calls and prepared_count(ffn) == 2 * calls
    assert kinds == [("Tensor", bool(topk) and layer in ROUTED)
                     for _ in STEPS for layer in range(LAYERS)]
    host, host_ffn, _ = run(connector, transfer, prepared=True, topk=topk)
    assert (attn.bytes_sent, attn.bytes_received) == (host.bytes_sent, host.bytes_received)
    assert (ffn.bytes_sent, ffn.bytes_received) == (host_ffn.bytes_sent, host_ffn.bytes_received)


@pytest.mark.parametrize("transfer", ["auto", "fp8-to-ffn"])
@pytest.mark.parametrize("connector", ["shm", "tcp"])
def test_routed_layer_calls_take_prepared_calls(connector, transfer):
    """gate_on "attention": the MoE layers' hidden states carry their routing
    and the dense layer's do not, in the same steps; both take prepared calls
    on both ends (the FFN's receive takes either frame), the FFN gets the
    routing as sent (views of the received payload) exactly on the routed
    layers, and the byte counters are the general path's but for the headers'
    fixed-width integers."""
    transfer = TRANSFERS.get(transfer, transfer)
    attn, ffn, kinds = run(connector, transfer, prepared=True, topk=TOPK)
    calls = len(STEPS) * LAYERS
    assert prepared_count(attn) == 2 * calls and prepared_count(ffn) == 2 * calls
    assert kinds == [("Tensor", layer in ROUTED) for _ in STEPS for layer in range(LAYERS)]
    general, general_ffn, general_kinds = run(connector, transfer, prepared=False, topk=TOPK)
    assert [routed for _, routed in general_kinds] == [routed for _, routed in kinds]
    group = attn.codec.send_scale_group
    wider = sum(len(frame_template(DTYPE, rows, HIDDEN, group, TOPK if layer in ROUTED else 0)[0])
                - len(wire.encode(wire.layer_frame(
                    torch.empty(rows, HIDDEN, dtype=DTYPE, device="meta"), step_id=i + 1,
                    layer_id=layer, ubatch_id=0, scale_group=group,
                    topk=TOPK if layer in ROUTED else 0)))
                for i, rows in enumerate(STEPS) for layer in range(LAYERS))
    assert attn.bytes_sent - general.bytes_sent == wider
    assert ffn.bytes_received - general_ffn.bytes_received == wider
    assert attn.bytes_received == general.bytes_received


@pytest.mark.parametrize("connector", ["shm", "tcp"])
def test_a_host_connectors_packed_frames_leave_device_tensors_to_the_general_path(connector):
    """A host connector's fp8 and routed frames are packed by the C call from
    host memory: a tensor elsewhere (here "meta", standing in for a device)
    is not sent by the prepared call (the general path's checks then speak),
    never packed on its device into a frame the C call would pack again."""
    for transfer, topk in (("fp8", 0), ("auto", TOPK)):
        ffn, attn = packed_pair(connector, transfer, topk=topk)
        try:
            attn.send_step(StepHeader(step_id=1, num_tokens=[4]))
            h = torch.empty(4, HIDDEN, dtype=DTYPE, device="meta")
            routing = routing_for(4, 0) if topk else None
            # The C post declined it: the general path's staging then finds no data.
            with pytest.raises(NotImplementedError, match="meta tensor"):
                attn.send_call(0, 0, h, routing)
            assert prepared_count(attn) == 0 and attn.fast_calls == 0
        finally:
            attn.close()
            ffn.close()


def test_a_device_ffn_decodes_plain_and_routed_frames_from_views_built_once(monkeypatch):
    """A device FFN decodes each routed or fp8 frame from views of its copy of
    the payload (codec._views: layout, slices, routing views), cached
    per peer and micro-batch; a step alternates plain and routed frames on
    one micro-batch (dense and MoE layers), which must not rebuild them at
    each switch: steps of one shape build them once per frame kind."""
    from vllm.afd.transport.connectors.codec import PayloadCodec

    built = []
    original = PayloadCodec._views

    def counted(self, peer, frame, dtype, raw):
        if self._peer_name(peer).startswith("attention rank"):  # the FFN side
            built.append(frame.topk)
        return original(self, peer, frame, dtype, raw)

    monkeypatch.setattr(PayloadCodec, "_views", counted)
    monkeypatch.setattr(sys.modules[__name__], "STEPS", [4, 4, 4])
    attn, ffn, kinds = run("shm", TRANSFERS["fp8-to-ffn"], prepared=True, topk=TOPK,
                           staged=True)
    assert [routed for _, routed in kinds] == [layer in ROUTED for _ in range(3)
                                               for layer in range(LAYERS)]
    assert sorted(built) == [0, TOPK], built


@pytest.mark.parametrize("connector", ["shm", "tcp"])
def test_routing_the_frame_cannot_carry_is_not_sent(connector):
    """Routing of int64 ids, of another width or not contiguous, or routing on
    a connector built without it: send_call's C post sends nothing (the
    general path then raises the caller's error, as it always did)."""
    ffn, attn = packed_pair(connector, "auto", topk=TOPK)
    plain_ffn, plain = packed_pair(connector, "auto")
    try:
        for a in (attn, plain):
            a.send_step(StepHeader(step_id=1, num_tokens=[4]))
        h = torch.randn(4, HIDDEN).to(DTYPE)
        good = routing_for(4, 1)
        for bad in (good._replace(topk_ids=good.topk_ids.long()),
                    good._replace(topk_weights=good.topk_weights[:, :2].contiguous()),
                    good._replace(topk_ids=torch.zeros(TOPK, 4, dtype=torch.int32).t())):
            with pytest.raises(ValueError, match="routing of layer 0 ubatch 0"):
                attn.send_call(0, 0, h, bad)
        with pytest.raises(ValueError, match="built without routing"):
            plain.send_call(0, 0, h, good)
        assert prepared_count(attn) == 0 and prepared_count(plain) == 0
        assert attn.fast_calls == plain.fast_calls == 0
    finally:
        for c in (attn, ffn, plain, plain_ffn):
            c.close()


@pytest.mark.parametrize("connector", ["shm", "tcp"])
def test_the_link_and_the_loop_take_prepared_calls_for_routed_fp8_steps(connector):
    """A real FFN loop serving MoE layers with routing from the attention role
    (and a dense layer between them), fp8 toward the FFN, and an attention
    link: steps of one micro-batch and of two (a real ping-pong) go through
    prepared calls on both sides, the loop's lone path runs the routed mlps
    with the routing received, and the outputs are the reference's."""
    from vllm.afd.attention.link import AttentionLink, ForwardPass
    from vllm.afd.attention.pingpong import run_micro_batches
    from vllm.afd.ffn.loop import FFNLoop
    from vllm.afd.topology import FFNPlacement
    from vllm.afd.transport.config import LinkConfig

    layers = [0, 1, 2]
    weight = (torch.randn(HIDDEN, HIDDEN) / HIDDEN).to(DTYPE)
    seen = []

    def mlp(layer, h, routing):
        seen.append((layer, routing is not None))
        out = h @ weight + layer
        return out if routing is None else out + combine(routing)

    config = dict(connector=connector, port=free_port(), timeout_s=10, num_ubatches=2,
                  transfer_to_ffn="fp8", connector_extra_config={"spin_us": 20_000})
    loop = FFNLoop(LinkConfig(role="ffn", **config), layers=layers, compute=mlp,
                   hidden_size=HIDDEN, dtype=DTYPE, max_tokens=32,
                   placement=FFNPlacement(rank=0, group=[0]), warmup_sizes=[],
                   routed_layers={layer: TOPK for layer in ROUTED})
    joined = []  # calls that waited to be joined with others, not run at once alone
    through_join = loop.batcher._join
    loop.batcher._join = lambda call: joined.append(call.layer) or through_join(call)
    loop.start()
    link = AttentionLink(LinkConfig(**config), hidden_size=HIDDEN, dtype=DTYPE, max_tokens=32)
    for layer in layers:
        link.add_layer(layer, TOPK if layer in ROUTED else 0)

    def expected(layer, h, routing):
        out = through_fp8(h) @ weight + layer
        return out if routing is None else out + combine(routing)

    try:
        assert loop.ready.wait(10)
        link.start()
        g = torch.Generator().manual_seed(11)
        for rows in (1, 5):
            link.begin_step(ForwardPass(num_tokens=(rows,)))
            h = (torch.randn(rows, HIDDEN, generator=g) * 4).to(DTYPE)
            for layer in layers:
                routing = routing_for(rows, layer) if layer in ROUTED else None
                out = link.exchange(layer, h, torch.empty_like(h), routing)
                assert torch.equal(out, expected(layer, h, routing)), (rows, layer)
            link.end_step()
        hidden = [(torch.randn(n, HIDDEN, generator=g) * 4).to(DTYPE) for n in (2, 3)]
        link.begin_step(ForwardPass(num_tokens=(2, 3)))

        def run(u):
            routings = [routing_for(hidden[u].shape[0], 10 * u + layer) if layer in ROUTED
                        else None for layer in layers]
            return [(link.exchange(layer, hidden[u], torch.empty_like(hidden[u]), r), r)
                    for layer, r in zip(layers, routings)]

        for u, results in enumerate(run_micro_batches([2, 3], run, device=link.device)):
            for layer, (out, routing) in zip(layers, results):
                assert torch.equal(out, expected(layer, hidden[u], routing)), (u, layer)
        link.end_step()
        lead = link.pool.members[0].lead
        calls = (1 + 1 + 2) * len(layers)
        assert prepared_count(lead) == 2 * calls
        deadline = time.monotonic() + 10
        while loop.stats().steps < 3 and time.monotonic() < deadline:
            time.sleep(0.01)
        [session] = list(loop._sessions.values())
        assert prepared_count(session) == 2 * calls
        assert loop.stats().routed_calls == calls * len(ROUTED) // len(layers)
        assert link.stats.routed_calls == loop.stats().routed_calls
        assert seen == [(layer, layer in ROUTED) for layer, _ in seen] and len(seen) == calls
        assert joined == []
    finally:
        link.close()
        loop.stop()


def test_a_routed_layer_called_without_routing_fails_both_sides_with_why():
    """The FFN serves layer 0 as a MoE layer whose routing comes from the
    attention role, and the attention side sends it without (gate_on set
    differently on the two roles): the FFN loop refuses the call before its
    mlp runs, on the lone path too, and the attention side's call fails with
    the FFN's reason, not a timeout."""
    from vllm.afd.attention.link import AttentionLink, ForwardPass
    from vllm.afd.ffn.loop import FFNLoop
    from vllm.afd.topology import FFNPlacement
    from vllm.afd.transport.config import LinkConfig
    from vllm.afd.transport.errors import AFDLinkDown

    ran = []
    config = dict(connector="shm", port=free_port(), timeout_s=10,
                  connector_extra_config={"spin_us": 20_000})
    loop = FFNLoop(LinkConfig(role="ffn", **config), layers=[0],
                   compute=lambda layer, h, routing: ran.append(layer) or h,
                   hidden_size=HIDDEN, dtype=DTYPE, max_tokens=8,
                   placement=FFNPlacement(rank=0, group=[0]), warmup_sizes=[],
                   routed_layers={0: TOPK})
    loop.start()
    link = AttentionLink(LinkConfig(**config), hidden_size=HIDDEN, dtype=DTYPE, max_tokens=8)
    link.add_layer(0, TOPK)
    try:
        assert loop.ready.wait(10)
        link.start()
        link.begin_step(ForwardPass(num_tokens=(2,)))
        h = torch.randn(2, HIDDEN).to(DTYPE)
        with pytest.raises(AFDLinkDown, match="expected routing with the hidden states, "
                                              "received none"):
            link.exchange(0, h, torch.empty_like(h))
        assert ran == []
    finally:
        link.close()
        loop.stop()
