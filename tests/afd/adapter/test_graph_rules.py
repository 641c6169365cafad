# SPDX-License-Identifier: Apache-2.0
# SPDX-FileCopyrightText: Copyright contributors to the vllm-afd project
"""Rules the vLLM adapter enforces, each with a test that fails without it:
the graph-safe remote FFN op, the compilation settings a CUDA attention
server gets, the configurations AFD refuses, and the FFN role's memory.

The CUDA case resolves a real VllmConfig with vLLM's CUDA platform object in
a subprocess (its native extension stubbed: only configuration code runs, no
kernel); what a captured graph does on a GPU is tools/testing/gpu_check's.
"""

import json
import sys
import textwrap
from types import SimpleNamespace

import pytest
import torch

from vllm.afd.attention.link import ForwardPass

import preload
from helpers.torch_ops import ALLOCATING, AtenOps

HIDDEN = 32  # shm_link's hidden size (tests/afd/conftest.py)


def test_remote_ffn_op_mutates_its_output_and_allocates_nothing(shm_link):
    from vllm.afd.adapter.model.remote_ffn import _afd_remote_ffn

    schema = torch.ops.vllm.afd_remote_ffn.default._schema
    output_arg = schema.arguments[1]
    assert output_arg.name == "output" and output_arg.alias_info.is_write
    assert len(schema.returns) == 0
    h = torch.randn(5, HIDDEN)
    shm_link.begin_step(ForwardPass(num_tokens=(5,)))
    for layer in (0, 1):
        out = torch.full((5, HIDDEN), float("nan"))
        ptr = out.data_ptr()
        with AtenOps() as ops:
            _afd_remote_ffn(h, out, layer)
        assert out.data_ptr() == ptr and torch.equal(out, h * 2 + layer)
        assert not ALLOCATING & set(ops.names), ops.names
    shm_link.end_step()
    assert shm_link.stats.steps == 1 and shm_link.stats.layer_calls == 2


def remote_ffns(mode) -> list:
    from vllm.afd.adapter.model.remote_ffn import RemoteFFN

    # The fixture installed the process's link: the config is read for its
    # compilation mode only.
    config = SimpleNamespace(compilation_config=SimpleNamespace(mode=mode))
    return [RemoteFFN(layer, config) for layer in (0, 1)]


def test_an_eager_model_calls_the_exchange_without_the_dispatcher(shm_link):
    """Compilation mode NONE: forward calls the op's function directly (the
    dispatcher's round trip costs ~4 us a layer warm); the result is the same."""
    from vllm.config import CompilationMode

    h = torch.randn(3, HIDDEN)
    shm_link.begin_step(ForwardPass(num_tokens=(3,)))
    for layer, ffn in enumerate(remote_ffns(CompilationMode.NONE)):
        with AtenOps() as ops:
            out = ffn(h)
        assert torch.equal(out, h * 2 + layer)
        assert "afd_remote_ffn" not in ops.names, ops.names
    shm_link.end_step()
    # Hidden states that are a strided view: the exchange makes them contiguous.
    strided = torch.randn(HIDDEN, 3).t()
    shm_link.begin_step(ForwardPass(num_tokens=(3,)))
    for layer, ffn in enumerate(remote_ffns(CompilationMode.NONE)):
        assert torch.equal(ffn(strided), strided * 2 + layer)
    shm_link.end_step()


def test_an_eager_remote_ffn_allocates_its_output_after_the_send(patient_waits, shm_link):
    """The eager seam leaves the output's allocation to the link, which makes
    it once the hidden states are out, while the FFN computes: on a CPU host's
    cold cache an allocation costs ~15 us, on the path both sides wait on when
    made before the send (as the op's caller must, for graphs)."""
    from vllm.config import CompilationMode

    h = torch.randn(3, HIDDEN)
    shm_link.begin_step(ForwardPass(num_tokens=(3,)))
    lead = shm_link.step.sender  # the step's lone lead connector
    fast_calls = lead.fast_calls
    for layer, ffn in enumerate(remote_ffns(CompilationMode.NONE)):
        with AtenOps() as ops:
            send = lead.send_call

            def sending(*args, send=send, names=ops.names):
                names.append("<sent>")
                return send(*args)

            lead.send_call = sending  # an instance attribute, over the method
            try:
                out = ffn(h)
            finally:
                del lead.send_call
        assert torch.equal(out, h * 2 + layer)
        allocations = [i for i, name in enumerate(ops.names) if name in ALLOCATING]
        assert allocations and ops.names.index("<sent>") < allocations[0], ops.names
    shm_link.end_step()
    assert lead.fast_calls == fast_calls + 4  # each layer's send and receive, prepared


def test_an_eager_remote_ffn_runs_the_hooks_registered_on_it(shm_link):
    """RemoteFFN's own __call__ skips nn.Module's machinery only where that
    would find nothing to run: hooks, the module's and the global ones, run."""
    from torch.nn.modules.module import register_module_forward_hook

    from vllm.config import CompilationMode

    first, second = remote_ffns(CompilationMode.NONE)
    h = torch.randn(3, HIDDEN)

    def step() -> torch.Tensor:  # a step calls each layer once, in order
        shm_link.begin_step(ForwardPass(num_tokens=(3,)))
        out = first(h)
        second(out)
        shm_link.end_step()
        return out

    assert torch.equal(step(), h * 2)  # no hooks: straight to forward
    pre = first.register_forward_pre_hook(lambda module, args: (args[0] + 1,))
    assert torch.equal(step(), (h + 1) * 2)
    pre.remove()
    post = first.register_forward_hook(lambda module, args, out: out * 3)
    assert torch.equal(step(), h * 2 * 3)
    post.remove()
    seen = []
    handle = register_module_forward_hook(lambda module, args, out: seen.append(module))
    try:
        step()
    finally:
        handle.remove()
    assert seen == [first, second]
    assert torch.equal(step(), h * 2)


def test_a_compiled_model_keeps_the_exchange_one_opaque_op(shm_link):
    """Any other mode: torch.compile sees one op per layer (the splitting op),
    with fullgraph: tracing into the link would break the graph."""
    from vllm.config import CompilationMode

    ffns = remote_ffns(CompilationMode.VLLM_COMPILE)
    targets = []

    def backend(gm, example_inputs):
        targets.extend(str(node.target) for node in gm.graph.nodes
                       if node.op == "call_function")
        return gm.forward

    @torch.compile(fullgraph=True, backend=backend)
    def two_layers(h):
        return ffns[1](ffns[0](h) + 1)

    h = torch.randn(3, HIDDEN)
    shm_link.begin_step(ForwardPass(num_tokens=(3,)))
    try:
        out = two_layers(h)
    finally:
        torch._dynamo.reset()
    shm_link.end_step()
    assert torch.equal(out, (h * 2 + 1) * 2 + 1)  # the compiled op called the link
    assert sum("afd_remote_ffn" in t for t in targets) == 2, targets


def test_an_abandoned_step_resyncs_the_ffn(shm_link):
    """The model failed between two exchanges: end_step(failed) tells the FFN
    (it drops the session) and the link reconnects; the next step works."""
    h = torch.ones(2, HIDDEN)
    shm_link.begin_step(ForwardPass(num_tokens=(2,)))
    shm_link.exchange(0, h, torch.empty(2, HIDDEN))
    shm_link.end_step(failed=True)  # layer 1 never came
    assert shm_link.state == "down" and "abandoned step" in shm_link.last_error
    shm_link._await_first_connection()
    import time

    deadline = time.monotonic() + 10
    while shm_link.connector is None:
        assert time.monotonic() < deadline
        time.sleep(0.05)
    shm_link.begin_step(ForwardPass(num_tokens=(2,)))
    outs = [shm_link.exchange(layer, h, torch.empty(2, HIDDEN)) for layer in (0, 1)]
    shm_link.end_step()
    assert torch.equal(outs[1], h * 2 + 1)


CUDA_CONFIG = textwrap.dedent('''
    import json, sys, types
    from vllm.engine.arg_utils import EngineArgs
    model, cases = sys.argv[1], json.loads(sys.argv[2])
    model_config = EngineArgs(model=model, max_model_len=512).create_model_config()
    # vLLM's CUDA platform, as a GPU server resolves it; its kernels are never called.
    sys.modules["vllm._C_stable_libtorch"] = types.ModuleType("vllm._C_stable_libtorch")
    import vllm.platforms as platforms
    from vllm.platforms.cuda import CudaPlatform
    from vllm.platforms.interface import DeviceCapability
    platforms._current_platform = CudaPlatform()
    CudaPlatform.get_device_capability = classmethod(lambda c, device_id=0: DeviceCapability(9, 0))
    from vllm.afd.adapter.config import AFDConfig
    from vllm.config import CompilationConfig, VllmConfig
    results = []
    for afd, compilation in cases:
        try:
            config = VllmConfig(model_config=model_config,
                                compilation_config=CompilationConfig(**compilation),
                                afd_config=AFDConfig(**afd) if afd else None)
        except Exception as e:
            results.append({"error": f"{type(e).__name__}: {e}"})
        else:
            cc = config.compilation_config
            results.append({"platform": type(platforms.current_platform).__name__,
                            "mode": int(cc.mode), "cudagraph_mode": cc.cudagraph_mode.name,
                            "splitting_ops": cc.splitting_ops})
    print(json.dumps(results))
''')


def resolve_on_cuda(models_dir, cases: list[tuple[dict | None, dict]]) -> list[dict]:
    """VllmConfig for each (afd_config, compilation_config), in one process
    (importing vLLM dominates)."""
    proc = preload.run([sys.executable, "-c", CUDA_CONFIG, str(models_dir / "tiny-qwen3-moe"),
                        json.dumps(cases)], capture_output=True, text=True, timeout=300)
    assert proc.returncode == 0, proc.stderr[-3000:]
    return json.loads(proc.stdout.strip().splitlines()[-1])


def test_cuda_attention_role_splits_the_graph_at_the_remote_ffn(models_dir):
    """A VllmConfig resolved for the CUDA platform: plain vLLM's default is
    FULL_AND_PIECEWISE graphs; the attention role gets piecewise graphs split
    at the remote FFN op (its exchange runs eagerly between the captured
    attention pieces), never a FULL mode; the FFN role is left alone."""
    plain, attention, ffn, full, piecewise = resolve_on_cuda(models_dir, [
        (None, {}), ({"role": "attention"}, {}), ({"role": "ffn"}, {}),
        ({"role": "attention"}, {"cudagraph_mode": "FULL"}),
        ({"role": "attention"}, {"cudagraph_mode": "PIECEWISE"})])
    assert plain["platform"].endswith("CudaPlatform") and plain["mode"] == 3  # VLLM_COMPILE
    assert plain["cudagraph_mode"] == "FULL_AND_PIECEWISE"
    assert "vllm::afd_remote_ffn" not in plain["splitting_ops"]
    assert attention["cudagraph_mode"] == "PIECEWISE"
    assert "vllm::afd_remote_ffn" in attention["splitting_ops"]
    assert set(plain["splitting_ops"]) < set(attention["splitting_ops"])
    assert "vllm::afd_remote_ffn" not in ffn["splitting_ops"]
    # Asked for explicitly, a FULL mode is refused, naming the option.
    assert "compilation_config.cudagraph_mode=FULL cannot be combined with the AFD " \
           "connector 'shm'" in full["error"]
    assert piecewise["cudagraph_mode"] == "PIECEWISE"


@pytest.mark.parametrize("args, env, message", [
    ({"enable_dbo": True}, {}, "--enable-dbo (vLLM's dual-batch overlap) cannot be combined "
                              "with AFD"),
    ({"compilation_config": {"cudagraph_mode": "FULL_DECODE_ONLY"}}, {},
     "compilation_config.cudagraph_mode=FULL_DECODE_ONLY cannot be combined"),
    ({"tensor_parallel_size": 2}, {}, "--tensor-parallel-size 2 cannot be used on the AFD "
                                      "attention role"),
    ({"pipeline_parallel_size": 2}, {}, "--pipeline-parallel-size 2 cannot be used on the AFD "
                                        "attention role"),
    ({"afd_config": {"connector": "nccl"}}, {}, "AFDConfig.connector='nccl' keeps payloads on "
                                                "the device and needs cuda devices; this "
                                                "server runs on cpu"),
])
def test_what_cannot_work_is_refused_naming_the_option(models_dir, monkeypatch, args, env,
                                                       message):
    from vllm.engine.arg_utils import EngineArgs

    for key, value in env.items():
        monkeypatch.setenv(key, value)
    kwargs = dict(model=str(models_dir / "tiny-qwen3-moe"), max_model_len=512,
                  afd_role="attention", **args)
    with pytest.raises(Exception, match=message.replace("(", r"\(").replace(")", r"\)")):
        EngineArgs(**kwargs).create_engine_config()
    # The same without AFD is upstream's business (no AFD error).
    kwargs.pop("afd_role")
    kwargs.pop("afd_config", None)
    try:
        EngineArgs(**kwargs).create_engine_config()
    except Exception as e:  # noqa: BLE001 - whatever upstream says, it is not ours
        assert "AFD" not in str(e), e


def test_ffn_role_does_not_ask_for_the_kv_cache_budget():
    """Worker.init_device's check: free memory must cover
    gpu_memory_utilization of the device. On a GPU another server already
    holds half of: the attention role (upstream's check) is refused, the FFN
    role (no KV cache) starts."""
    import vllm.afd.seams as seams
    from vllm.afd.adapter.config import AFDConfig

    snapshot = SimpleNamespace(total_memory=80 << 30, free_memory=40 << 30, device_="cuda:0")
    cache = SimpleNamespace(gpu_memory_utilization=0.9)
    ffn = SimpleNamespace(afd_config=AFDConfig(role="ffn"))
    assert seams.request_memory(ffn, snapshot, cache) == 0
    attention = SimpleNamespace(afd_config=AFDConfig(role="attention"))
    with pytest.raises(ValueError, match="less than desired GPU memory utilization"):
        seams.request_memory(attention, snapshot, cache)
