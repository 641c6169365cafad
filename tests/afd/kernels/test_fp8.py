# SPDX-License-Identifier: Apache-2.0
# SPDX-FileCopyrightText: Copyright contributors to the vllm-afd project
"""fp8 transfer (AFDConfig.transfer_dtype "fp8") is faithful to its stated format.

What fp8 does to a model's tokens depends on the model: on random tiny
checkpoints with nearly flat logits the agreement with plain vLLM varies from
one checkpoint to the next (docs/fp8.md keeps the measurements as data). What
does not depend on it, and what these tests hold, is that AFD applies exactly
the codec docs/fp8.md states, where it states:

- the codec, against tools/models/hf_reference.py's plain-torch e4m3 reference
  (written from the stated format, not from vllm/afd): the op library's bytes
  and round trip on every CPU ISA, and what each side of a shm or tcp link
  receives, bit for bit, on random and edge inputs;
- a served model: AFD with fp8 scores the tokens it chose as transformers' model
  does with the reference codec hooked in where AFD quantizes (teacher-forced,
  the same greedy tokens), while the same model without the hooks, or with a
  reference one step off (divisor 440), is far from it: the check can fail.
"""

import json

import pytest
import torch

from hf_reference import FP8_GROUP, fp8_encode, fp8_round_trip, teacher_forced
from servers import free_port
from vllm.afd.kernels import ops
from vllm.afd.transport.wire import StepHeader
from helpers.connectors import Background, connect_pair
from helpers.oracle import run_oracle

GROUP = FP8_GROUP  # the stated format's, not read from the code under test
DTYPES = [torch.float32, torch.bfloat16, torch.float16]


def edge_inputs(dtype: torch.dtype) -> dict[str, torch.Tensor]:
    """[tokens, hidden] inputs where a codec goes wrong first."""
    g = torch.Generator().manual_seed(7)
    random = torch.randn(6, 1000, generator=g) * torch.logspace(-3, 3, 6)[:, None]
    zeros = torch.zeros(3, 256)
    zeros[1, 128:] = torch.randn(128, generator=g)  # one all-zero group beside a full one
    huge = torch.randn(4, 384, generator=g)
    huge[:, 5] = 3e4  # one huge value per token: the rest of its group underflows
    huge[2, 200] = -6e4
    odd = {f"hidden-{h}": torch.randn(5, h, generator=g) * 7 for h in (1, 7, 129, 200)}
    tiny = torch.randn(2, 128, generator=g) * 1e-30  # scales far below float32's normals
    signed_zero = torch.full((1, 130), -0.0)
    return {name: x.to(dtype) for name, x in {
        "random": random, "zeros": zeros, "one-huge-value": huge, **odd, "tiny": tiny,
        "negative-zeros": signed_zero}.items()}


def stated_slot(x: torch.Tensor) -> torch.Tensor:
    """The payload docs/fp8.md states for x: e4m3 bytes [tokens, hidden], zeros
    up to 8 bytes, float32 scales [tokens, groups]."""
    q, scale = fp8_encode(x, GROUP)
    pad = -q.numel() % 8
    return torch.cat([q.reshape(-1), torch.zeros(pad, dtype=torch.uint8),
                      scale.reshape(-1).view(torch.uint8)])


@pytest.fixture
def restore_isa():
    previous = ops.cpu_isa()
    yield
    ops.set_cpu_isa(previous)


@pytest.mark.parametrize("dtype", DTYPES, ids=str)
def test_op_library_is_byte_exact_to_the_stated_format(dtype, restore_isa):
    """afd::pack writes the stated bytes and afd::unpack gives the reference's
    round trip, bit for bit, on every CPU ISA this host runs."""
    for isa in ops.cpu_isas():
        ops.set_cpu_isa(isa)
        for name, x in edge_inputs(dtype).items():
            expected = stated_slot(x)
            slot = ops.pack(x, torch.full_like(expected, 0xAB), GROUP)
            assert torch.equal(slot, expected), (isa, name, (slot != expected).nonzero()[:5])
            out = ops.unpack(slot, torch.empty_like(x), GROUP)
            ref = fp8_round_trip(x)
            assert torch.equal(out.view(torch.uint8), ref.view(torch.uint8)), (isa, name)


def test_a_reference_one_step_off_is_told_apart(restore_isa):
    """The negative control of the test above: the same comparison with the
    reference's divisor 448 changed to 440 fails on every input that is not
    all zeros."""
    for name, x in edge_inputs(torch.float32).items():
        slot = ops.pack(x, torch.empty_like(stated_slot(x)), GROUP)
        out = ops.unpack(slot, torch.empty_like(x), GROUP)
        off = fp8_round_trip(x, fp8_max=440.0)
        assert torch.equal(out, off) == (name == "negative-zeros"), name


@pytest.mark.parametrize("kind", ["shm", "tcp"])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=str)
def test_each_side_receives_the_reference_round_trip(kind, dtype):
    """A link with fp8 both ways (the connectors' codec, prepared calls
    included): the FFN receives the reference's round trip of each hidden
    state sent, the attention side that of each output, on the edge inputs
    (hidden 200: a full and a partial scale group)."""

    hidden = 200
    inputs = [torch.nn.functional.pad(x, (0, max(0, hidden - x.shape[1])))[:, :hidden]
              .contiguous() for x in edge_inputs(dtype).values()]
    attn, ffn = connect_pair(kind, dtype=dtype, hidden_size=hidden, transfer_dtype="fp8")
    received = []

    def serve():
        for _ in inputs:
            ffn.recv_step(0)
            h = ffn.recv_hidden(0, 0, 0)
            received.append(h.clone())
            ffn.send_output(0, 0, 0, (h.flip(0) * 3).contiguous())  # another tensor back

    server = Background(serve)
    try:
        for step, x in enumerate(inputs):
            attn.send_step(StepHeader(step_id=step, num_tokens=[x.shape[0]]))
            attn.send_hidden(0, 0, x)
            out = attn.recv_output(0, 0)
            sent_back = (fp8_round_trip(x).flip(0) * 3).contiguous()
            assert torch.equal(out, fp8_round_trip(sent_back)), step
        server.join_result()
        for x, h in zip(inputs, received, strict=True):
            assert torch.equal(h, fp8_round_trip(x))
    finally:
        attn.close()
        ffn.close()


# --------------------------------------------------------------- a served model
# Teacher-forced, AFD's logprobs and transformers' differ only where the two
# engines' float32 math (~1e-7 apart) lands an element on either side of an
# e4m3 rounding boundary, which then shifts the later positions of that prompt
# a little; the bulk is exact to float32. A codec other than the one stated
# moves every position: its median difference is 1e-3 and more (docs/fp8.md).
MEDIAN_TOL = 1e-5
NEAR = 1e-4  # "the same score" for the share of positions below
MIN_SHARE_NEAR = 0.75
FAR = 1e-4  # a wrong reference's median difference is above this


def logprob_gaps(result: dict, forced: list[dict]) -> torch.Tensor:
    return torch.tensor([abs(a - b) for r, f in zip(result["results"], forced, strict=True)
                         for a, b in zip(r["logprobs"], f["logprobs"], strict=True)])


@pytest.mark.slow
@pytest.mark.parametrize("model_name, transfer", [
    ("tiny-qwen3-moe", "fp8"),  # `make test-full` adds one direction only, and MLA:
    pytest.param("tiny-qwen3-moe", {"to_ffn": "fp8"}, marks=pytest.mark.full),
    pytest.param("tiny-deepseek-v2", "fp8", marks=pytest.mark.full),
], ids=["qwen3-moe-both-ways", "qwen3-moe-to-ffn", "deepseek-v2-both-ways"])
def test_served_fp8_is_the_reference_codec_on_the_model(models_dir, tmp_path, model_name,
                                                        transfer):
    """AFD (the attention role with its FFN engine in-process, loopback) with
    transfer_dtype fp8, 10 prompts x 32 greedy tokens, float32: transformers'
    model of the same checkpoint with tools/models/hf_reference.py's codec hooked on
    each decoder mlp's input (to_ffn) and output (to_attention), fed AFD's
    tokens, chooses AFD's tokens and gives AFD's logprobs (median difference
    under MEDIAN_TOL). Without the hooks, or with the codec's divisor 440, the
    same comparison is far off: fp8 is really applied, and only as stated."""
    from transformers import AutoModelForCausalLM

    model = models_dir / model_name
    config = {"connector": "loopback", "port": free_port(), "timeout_s": 60,
              "transfer_dtype": transfer}
    afd = run_oracle(model, tmp_path / "afd.json", config, extra=("--max-tokens", "32"))
    to_ffn = transfer == "fp8" or transfer.get("to_ffn") == "fp8"
    to_attention = transfer == "fp8" or transfer.get("to_attention") == "fp8"
    hf = AutoModelForCausalLM.from_pretrained(model, dtype=torch.float32).eval()

    forced = teacher_forced(model, afd, to_ffn, to_attention, hf=hf)
    gaps = logprob_gaps(afd, forced)
    positions = gaps.numel()
    same_greedy = sum(t == g for r, f in zip(afd["results"], forced)
                      for t, g in zip(r["token_ids"], f["greedy"]))
    share_near = float((gaps <= NEAR).float().mean())
    figures = (f"{model_name} {json.dumps(transfer)}: median {gaps.median():.2g}, max "
               f"{gaps.max():.2g}, {share_near:.1%} within {NEAR}, greedy {same_greedy}/"
               f"{positions}")
    assert positions == 10 * 32, figures
    assert gaps.median() <= MEDIAN_TOL and share_near >= MIN_SHARE_NEAR, figures
    assert same_greedy >= 0.97 * positions, figures

    for label, kwargs in (("plain", dict(to_ffn=False, to_attention=False)),
                          ("divisor 440", dict(to_ffn=to_ffn, to_attention=to_attention,
                                               round_trip=lambda x: fp8_round_trip(
                                                   x, fp8_max=440.0)))):
        off = logprob_gaps(afd, teacher_forced(model, afd, hf=hf, **kwargs))
        assert off.median() > FAR, f"{figures}; against {label}: median {off.median():.2g}"
