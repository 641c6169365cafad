# SPDX-License-Identifier: Apache-2.0
# SPDX-FileCopyrightText: Copyright contributors to the vllm-afd project
"""afd::pack / afd::unpack (CPU) against a plain-torch reference.

Exact packing is byte for byte the protocol's LayerFrame payload; fp8 packing
is byte for byte torch's own e4m3fn conversion of x / scale, and the round trip
stays within the bound csrc/pack.h states."""

import pytest
import torch

from vllm.afd.kernels import ops
from vllm.afd.kernels.ops import PackLayout
from vllm.afd.transport.wire import Routing, routed_parts
from helpers.fp8 import reference_dequantize, reference_quantize

DTYPES = [torch.float32, torch.bfloat16, torch.float16]
GROUP = 128


def routing(tokens: int, topk: int, id_dtype: torch.dtype, seed: int = 0):
    g = torch.Generator().manual_seed(seed)
    ids = torch.randint(0, 64, (tokens, topk), generator=g).to(id_dtype)
    weights = torch.rand(tokens, topk, generator=g)
    return ids, weights


def hidden_states(tokens: int, hidden: int, dtype: torch.dtype, seed: int = 0) -> torch.Tensor:
    g = torch.Generator().manual_seed(seed)
    # Rows of very different magnitudes, as residual streams have.
    scale = torch.logspace(-3, 2, max(tokens, 1))[:tokens, None]
    return (torch.randn(tokens, hidden, generator=g) * scale).to(dtype)


def new_slot(layout: PackLayout) -> torch.Tensor:
    return torch.full((layout.total,), 0xAB, dtype=torch.uint8)  # garbage, not zeros


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("tokens, hidden", [(0, 64), (1, 1), (3, 7), (5, 129), (2, 2048)])
@pytest.mark.parametrize("topk", [0, 2])
def test_exact_pack_is_the_wire_payload(dtype, tokens, hidden, topk):
    x = hidden_states(tokens, hidden, dtype)
    ids, weights = routing(tokens, topk, torch.int32) if topk else (None, None)
    layout = PackLayout.of(tokens, hidden, dtype, 0, topk)
    slot = ops.pack(x, new_slot(layout), 0, ids, weights)
    parts = routed_parts(x, Routing(weights, ids)) if topk else [x]
    wire = torch.cat([p.contiguous().view(-1).view(torch.uint8) for p in parts])
    assert torch.equal(slot, wire)
    out = torch.empty_like(x)
    ids2 = torch.empty_like(ids) if topk else None
    w2 = torch.empty_like(weights) if topk else None
    ops.unpack(slot, out, 0, ids2, w2)
    assert torch.equal(out, x)
    if topk:
        assert torch.equal(ids2, ids) and torch.equal(w2, weights)


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("tokens, hidden", [(0, 128), (1, 1), (3, 7), (4, 129), (2, 1000),
                                            (8192, 64)])
@pytest.mark.parametrize("id_dtype", [torch.int32, torch.int64])
def test_fp8_pack_matches_torch_and_stays_within_the_bound(dtype, tokens, hidden, id_dtype):
    x = hidden_states(tokens, hidden, dtype, seed=tokens + hidden)
    x[:, :1] = 0  # an element that is exactly zero stays zero
    ids, weights = routing(tokens, 4, id_dtype)
    layout = PackLayout.of(tokens, hidden, dtype, GROUP, 4)
    slot = ops.pack(x, new_slot(layout), GROUP, ids, weights)

    q, scale = reference_quantize(x, GROUP)
    assert torch.equal(slot[:layout.hidden_nbytes], q.view(-1))
    assert torch.all(slot[layout.hidden_nbytes:layout.scales_offset] == 0)  # padding
    got_scale = slot[layout.scales_offset:layout.weights_offset].view(torch.float32)
    assert torch.equal(got_scale, scale.view(-1))
    assert torch.equal(slot[layout.weights_offset:layout.ids_offset].view(torch.float32),
                       weights.view(-1))
    assert torch.equal(slot[layout.ids_offset:].view(torch.int32), ids.view(-1).int())

    out = torch.empty_like(x)
    ids2, w2 = torch.empty_like(ids), torch.empty_like(weights)
    ops.unpack(slot, out, GROUP, ids2, w2)
    assert torch.equal(out, reference_dequantize(q, scale, GROUP, dtype))
    assert torch.equal(ids2, ids) and torch.equal(w2, weights)
    # The stated bound: |x - x'| <= |x| / 16 + scale / 1024, plus rounding x'
    # to the compute dtype (half an ulp of it).
    if tokens:
        full = scale.repeat_interleave(GROUP, dim=1)[:, :hidden]
        half_ulp = torch.finfo(dtype).eps / 2
        bound = x.float().abs() / 16 + full / 1024 + out.float().abs() * half_ulp
        err = (x.float() - out.float()).abs()
        assert torch.all(err <= bound * (1 + 1e-6)), (err - bound).max()
        assert torch.all(out[:, 0] == 0)


def test_fp8_is_a_quarter_of_the_float32_bytes():
    hidden = 2048
    exact = PackLayout.of(128, hidden, torch.bfloat16).total
    fp8 = PackLayout.of(128, hidden, torch.bfloat16, GROUP).total
    assert exact == 128 * hidden * 2
    assert fp8 == 128 * hidden + 128 * (hidden // GROUP) * 4  # 1 byte + 1/32 for scales


@pytest.mark.parametrize("group", [0, GROUP, 64])
@pytest.mark.parametrize("topk", [0, 1, 8])
def test_the_kernels_and_python_agree_on_the_layout(group, topk):
    for tokens, hidden, dtype in [(0, 8, torch.float32), (1, 1, torch.bfloat16),
                                  (7, 129, torch.float16), (3, 4096, torch.float32)]:
        layout = PackLayout.of(tokens, hidden, dtype, group, topk)
        x = torch.zeros(tokens, hidden, dtype=dtype)
        ids, weights = routing(tokens, topk, torch.int32) if topk else (None, None)
        ops.pack(x, new_slot(layout), group, ids, weights)  # exactly total: accepted
        for wrong in (layout.total - 1, layout.total + 1):
            if wrong < 0:
                continue
            with pytest.raises(RuntimeError, match=f"needs {layout.total}"):
                ops.pack(x, torch.empty(wrong, dtype=torch.uint8), group, ids, weights)


BAD = [
    (lambda x, s, i, w: ops.pack(x[None], s, 0), "hidden must be \\[tokens, hidden\\]"),
    (lambda x, s, i, w: ops.pack(x.int(), s, 0), "hidden must be float32, bfloat16 or float16"),
    (lambda x, s, i, w: ops.pack(x.t(), s, 0), "hidden must be contiguous"),
    (lambda x, s, i, w: ops.pack(x, s.float(), 0), "slot must be a contiguous 1-D uint8"),
    (lambda x, s, i, w: ops.pack(x, s, -1), "group_size must be >= 0"),
    (lambda x, s, i, w: ops.pack(x, s, 0, i, None), "topk_ids and topk_weights come together"),
    (lambda x, s, i, w: ops.pack(x, s, 0, i, w[:, :1]), "differ in shape"),
    (lambda x, s, i, w: ops.pack(x, s, 0, i[:1], w[:1]), "topk_ids must be \\[4, topk\\]"),
    (lambda x, s, i, w: ops.pack(x, s, 0, i.float(), w), "topk_ids must be int32 or int64"),
    (lambda x, s, i, w: ops.pack(x, s, 0, i, w.bfloat16()), "topk_weights must be float32"),
    (lambda x, s, i, w: ops.pack(x, s, 0, i.long() + 2**40, w), "does not fit the wire's int32"),
    (lambda x, s, i, w: ops.unpack(s[:-1], x, 0, i, w), "slot has"),
]


@pytest.mark.parametrize("call, message", BAD, ids=[m for _, m in BAD])
def test_bad_inputs_name_the_problem(call, message):
    x = hidden_states(4, 16, torch.float32)
    ids, weights = routing(4, 2, torch.int32)
    slot = new_slot(PackLayout.of(4, 16, torch.float32, 0, 2))
    with pytest.raises(RuntimeError, match=message):
        call(x, slot, ids, weights)


def test_pack_is_opaque_to_torch_compile():
    """The fake kernels let the ops sit in a compiled graph without a break."""
    layout = PackLayout.of(4, 256, torch.float32, GROUP)

    @torch.compile(fullgraph=True, backend="eager")
    def round_trip(x, slot, out):
        torch.ops.afd.pack(x, None, None, GROUP, slot)
        torch.ops.afd.unpack(slot, GROUP, out, None, None)
        return out * 1

    ops.load()
    x = hidden_states(4, 256, torch.float32)
    out = round_trip(x, new_slot(layout), torch.empty_like(x))
    q, scale = reference_quantize(x, GROUP)
    assert torch.equal(out, reference_dequantize(q, scale, GROUP, torch.float32))


def test_fp8_conversion_is_torchs_bit_for_bit():
    """Every rounding case of fp32 -> e4m3fn that pack can meet (|x / scale|
    <= 448): normal and subnormal ranges, ties, values that round up into the
    next binade, zeros of both signs and NaN. Each group of 128 starts with
    448, so its scale is 1 and the kernel converts x itself."""
    g = torch.Generator().manual_seed(7)
    magnitudes = torch.cat([
        torch.logspace(-12, 2.65, 40000, base=10.0),  # up to ~447
        torch.rand(20000, generator=g) * 448,
        torch.arange(0, 2 ** 12).float() * 2.0 ** -18,  # the subnormal steps and their ties
        torch.tensor([0.0, 2.0 ** -6, 2.0 ** -9, 2.0 ** -10, 3 * 2.0 ** -11, 432.0, 440.0,
                      447.99, 448.0]),
    ])
    values = torch.cat([magnitudes, -magnitudes, torch.tensor([-0.0, float("nan")])])
    per_group = GROUP - 1
    groups = -(-values.numel() // per_group)
    body = torch.nn.functional.pad(values, (0, groups * per_group - values.numel()))
    x = torch.cat([torch.full((groups, 1), 448.0), body.view(groups, per_group)], dim=1)
    x = x.reshape(-1, 2 * GROUP) if groups % 2 == 0 else x  # two groups per token
    layout = PackLayout.of(x.shape[0], x.shape[1], torch.float32, GROUP)
    slot = ops.pack(x.contiguous(), new_slot(layout), GROUP)
    scales = slot[layout.scales_offset:].view(torch.float32)
    assert torch.all(scales == 1.0)
    expected = x.to(torch.float8_e4m3fn).view(torch.uint8).view(-1)
    got = slot[:layout.hidden_nbytes]
    mismatch = (got != expected).nonzero().view(-1)
    assert mismatch.numel() == 0, [(x.view(-1)[i].item(), got[i].item(), expected[i].item())
                                   for i in mismatch[:5]]


# ------------------------------------------------------- every ISA, same bytes
def special_values(dtype: torch.dtype) -> torch.Tensor:
    """Values where a conversion goes wrong first, each group led by a value
    that makes the group's scale 1 (so x / scale is x): fp8 ties and their
    neighbours in every binade, the subnormal steps, the top of the range
    (432, 440, 448 and the saturation just above), zeros of both signs,
    subnormals of the compute dtype, and plain random data."""
    g = torch.Generator().manual_seed(11)
    fp8 = torch.arange(0, 127, dtype=torch.uint8).view(torch.float8_e4m3fn).float()
    ties = (fp8[:-1] + fp8[1:]) / 2
    tiny = torch.finfo(dtype).tiny
    body = torch.cat([
        fp8, ties, ties.nextafter(torch.tensor(0.0)), ties.nextafter(torch.tensor(1e9)),
        torch.arange(0, 2 ** 10).float() * 2.0 ** -16,
        torch.tensor([447.99, 448.0, 448.0001, 0.0, tiny, tiny / 4, tiny * 3]),
        torch.rand(2000, generator=g) * 448,
        torch.randn(2000, generator=g) * 10,
    ]).to(dtype).float()  # representable in the compute dtype
    values = torch.cat([body, -body, torch.tensor([-0.0])])
    per_group = GROUP - 1
    groups = -(-values.numel() // per_group)
    padded = torch.nn.functional.pad(values, (0, groups * per_group - values.numel()))
    x = torch.cat([torch.full((groups, 1), 448.0), padded.view(groups, per_group)], dim=1)
    return x.reshape(-1, 2 * GROUP if groups % 2 == 0 else GROUP).to(dtype)


def isa_cases():
    g = torch.Generator().manual_seed(5)
    for dtype in DTYPES:
        yield f"special-{dtype}", special_values(dtype)
        # Rows of every magnitude (scales from subnormal to huge) and widths
        # that leave partial vectors, in one group and across groups.
        for tokens, hidden in [(6, 1000), (3, 7), (2, 129), (5, 4096)]:
            mag = torch.logspace(-40, 30, tokens)[:, None]
            yield f"random-{dtype}-{tokens}x{hidden}", (
                torch.randn(tokens, hidden, generator=g) * mag).to(dtype)


@pytest.fixture
def restore_isa():
    previous = ops.cpu_isa()
    yield
    ops.set_cpu_isa(previous)


def test_cpu_isa_is_reported_and_switchable(restore_isa):
    isas = ops.cpu_isas()
    assert isas[-1] == "scalar" and set(isas) <= {"avx512", "avx2", "scalar"}
    assert ops.cpu_isa() in isas
    for isa in isas:
        ops.set_cpu_isa(isa)
        assert ops.cpu_isa() == isa
    with pytest.raises(RuntimeError, match="not one this CPU runs"):
        ops.set_cpu_isa("sse9")


@pytest.mark.parametrize("group", [GROUP, 64, 13])
def test_every_isa_packs_and_unpacks_the_scalar_bytes(group, restore_isa):
    """Each vectorized ISA this CPU runs against the scalar kernels, on the
    special values (ties, subnormals, +-448, zeros) and random data; pack's
    bytes and scales, and unpack's output, bit for bit."""
    isas = ops.cpu_isas()
    cases = list(isa_cases())
    results = {}
    for isa in isas:
        ops.set_cpu_isa(isa)
        for name, x in cases:
            layout = PackLayout.of(*x.shape, x.dtype, group)
            slot = ops.pack(x, new_slot(layout), group)
            out = ops.unpack(slot, torch.empty_like(x), group)
            results[isa, name] = slot, out.view(torch.uint8)
    for isa in isas[:-1]:
        for name, _ in cases:
            (slot, out), (ref_slot, ref_out) = results[isa, name], results["scalar", name]
            assert torch.equal(slot, ref_slot), (isa, name, (slot != ref_slot).nonzero()[:5])
            assert torch.equal(out, ref_out), (isa, name, (out != ref_out).nonzero()[:5])


@pytest.mark.parametrize("dtype", DTYPES)
def test_every_isa_unpacks_every_byte_as_torch(dtype, restore_isa):
    """All 256 fp8 bytes (NaN included) under scales small, 1, large and
    beyond 2^7 (the vector kernels' two multiplication paths)."""
    q = torch.arange(256, dtype=torch.uint8).repeat(8)
    for scale in (1.0, 3e-30, 0.37, 2.0 ** 7, 5e3, 1e30):
        x = torch.empty(8, 256, dtype=dtype)
        layout = PackLayout.of(8, 256, dtype, GROUP)
        slot = torch.cat([q, torch.full((8 * 2,), scale).view(torch.uint8)])
        assert slot.numel() == layout.total
        ref = (q.view(torch.float8_e4m3fn).float() * scale).to(dtype).view(8, 256)
        for isa in ops.cpu_isas():
            ops.set_cpu_isa(isa)
            out = ops.unpack(slot, x.clone(), GROUP)
            finite = ~ref.isnan()
            assert torch.equal(out[finite], ref[finite]), (isa, scale)
            assert torch.equal(out.isnan(), ref.isnan()), (isa, scale)


def test_vllm_afd_cpu_isa_forces_the_first_choice():
    """VLLM_AFD_CPU_ISA picks the kernels at load, and a name this CPU does
    not run is an error, not a crash (a subprocess that loads only torch and
    the op library, a couple of seconds)."""
    import os
    import subprocess
    import sys

    ops.load()
    library = sys.modules["vllm.afd._C"].__file__
    code = ("import sys, torch; torch.ops.load_library(sys.argv[1]); "
            "x = torch.ones(2, 8); slot = torch.empty(24, dtype=torch.uint8)\n"
            "try:\n    torch.ops.afd.pack(x, None, None, 8, slot); print(torch.ops.afd.cpu_isa())\n"
            "except RuntimeError as e:\n    print('error:', e)")
    for forced, expected in [("scalar", "scalar"), ("sse9", "error: VLLM_AFD_CPU_ISA")]:
        env = {**os.environ, "VLLM_AFD_CPU_ISA": forced}
        run = subprocess.run([sys.executable, "-c", code, library], env=env,
                             capture_output=True, text=True, timeout=120)
        assert run.returncode == 0 and run.stdout.startswith(expected), (
            run.stdout[-500:], run.stderr[-2000:])


# ------------------------------------------- the torch-op version (Ascend NPUs)
@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("tokens, hidden, group, topk", [
    (0, 64, GROUP, 2), (1, 1, GROUP, 0), (3, 7, 0, 2), (5, 129, GROUP, 8), (4, 200, 64, 1),
    (2, 2048, 0, 0), (6, 300, GROUP, 2)])
def test_composite_pack_is_the_kernels_bytes(dtype, tokens, hidden, group, topk):
    """kernels/composite.py, the pack/unpack registered for PrivateUse1 (NPUs
    have no kernels of ours), builds the C++ kernels' slot byte for byte and
    unpacks it to the same tensors: checked here on the CPU, where both run."""
    from vllm.afd.kernels import composite

    x = hidden_states(tokens, hidden, dtype, seed=tokens + hidden)
    ids, weights = routing(tokens, topk, torch.int64) if topk else (None, None)
    layout = PackLayout.of(tokens, hidden, dtype, group, topk)
    by_kernel, by_torch = new_slot(layout), new_slot(layout)
    ops.pack(x, by_kernel, group, ids, weights)
    composite.pack(x, ids, weights, group, by_torch)
    assert torch.equal(by_kernel, by_torch)
    outs = []
    for unpack in (lambda *a: ops.unpack(a[0], a[2], a[1], a[3], a[4]), composite.unpack):
        h = torch.full_like(x, 7)
        r = (torch.zeros_like(ids), torch.zeros_like(weights)) if topk else (None, None)
        unpack(by_kernel, group, h, *r)
        outs.append((h, *r))
    for a, b in zip(*outs):
        assert (a is None and b is None) or torch.equal(a, b)


class ScalarDivisionAsCuda(torch.overrides.TorchFunctionMode):
    """Tensor / Python number as CUDA's kernel computes it: a * (1 / b), not
    an IEEE division. Stands in for the GPU (none here): on the CPU torch
    divides by a scalar exactly, so only this mode shows the difference."""

    DIVISIONS = {torch.Tensor.div, torch.Tensor.__truediv__, torch.div, torch.true_divide}

    def __torch_function__(self, func, types, args=(), kwargs=None):
        kwargs = kwargs or {}
        if (func in self.DIVISIONS and len(args) == 2 and isinstance(args[1], (int, float))
                and not kwargs and args[0].is_floating_point()):
            return args[0] * (1.0 / args[1])
        return func(*args, **kwargs)


def test_composite_scales_divide_as_the_kernels_on_every_device():
    """The scale is amax / 448 rounded once (pack.h). The GPU check found
    composite.pack's bytes off the kernels' on CUDA: it divided by a Python
    number, which CUDA turns into a multiplication by the reciprocal."""
    from vllm.afd.kernels import composite

    x = hidden_states(16, 512, torch.float32, seed=3)
    amax = x.view(16, 4, 128).abs().amax(-1)
    assert (amax / 448.0 != amax * (1 / 448.0)).any()  # inputs where the two differ
    layout = PackLayout.of(16, 512, torch.float32, GROUP)
    by_kernel, by_torch = new_slot(layout), new_slot(layout)
    ops.pack(x, by_kernel, GROUP)
    with ScalarDivisionAsCuda():
        composite.pack(x, None, None, GROUP, by_torch)
    assert torch.equal(by_kernel, by_torch)


def test_composite_is_the_privateuse1_implementation():
    ops.load()
    for name in ("pack", "unpack"):
        assert torch._C._dispatch_has_kernel_for_dispatch_key(f"afd::{name}", "PrivateUse1")
