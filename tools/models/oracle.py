# SPDX-License-Identifier: Apache-2.0
# SPDX-FileCopyrightText: Copyright contributors to the vllm-afd project
"""Greedy tokens and logprobs of a fixed prompt set, through plain vLLM or AFD.

    python tools/models/oracle.py MODEL --out result.json [--afd-config JSON] [--compile]
        [--attention-backend NAME] [--fake-amx [all|linear]]

Runs an in-process `LLM` (VLLM_ENABLE_V1_MULTIPROCESSING=0). With --afd-config
the engine is the attention role and needs an FFN server listening; with the
`loopback` connector the FFN engine runs in this process too. The prompts
have different lengths and a small token budget per step, so steps mix prefill
and decode. The correctness oracle compares two such result files.
"""

import argparse
import json
import os
import signal
import sys
import time

PROMPTS = [
    "In a hole in the ground there lived a hobbit. Not a nasty, dirty, wet hole",
    "Hello",
    "The capital of France is",
    "1 2 3 4 5 6 7 8 9 10 11 12",
    "def fibonacci(n):",
    "Once upon a time, in a land far away, there was a small village where",
    "A",
    "The quick brown fox jumps over the lazy dog. The quick brown fox jumps over the",
    "Mixture-of-experts models route every token to a few experts",
    "Q: What is two plus two?\nA:",
]


# The MLA kernels for DeepSeek on every CPU in float32. Without an explicit
# choice an Intel host with AMX picks AMX_MLA, which refuses fp32 weights (plain
# vLLM as well as AFD), while AMD hosts run CPU_MLA: the suite would test other
# kernels on each host, or fail on one. In bfloat16 (what users serve) the
# tests leave the choice to vLLM: there the point is each host's own kernels.
MLA_BACKEND = "CPU_MLA"


def attention_backend_for(model, dtype: str = "float32") -> str | None:
    """The attention backend the tests pin for a checkpoint (None: vLLM's choice)."""
    from pathlib import Path

    config = json.loads((Path(model) / "config.json").read_text())
    pin = config.get("kv_lora_rank") and dtype == "float32"
    return MLA_BACKEND if pin else None


def engine_cli_args(model, dtype: str = "float32") -> list[str]:
    """`vllm serve` arguments the tests add for a checkpoint."""
    backend = attention_backend_for(model, dtype)
    return ["--attention-backend", backend] if backend else []


def kernel_report(worker) -> dict:
    """The kernels a worker's layers run (plain or either AFD role: attention
    backends and ISAs, linear kernels, MoE experts), by vllm/afd/adapter/model/kernel_paths.py.
    Run in the worker through collective_rpc (the engines here are in-process);
    the module is loaded from its file, which imports only torch, so stock vLLM
    (the stock reference, whose `vllm` has no `afd`) reports its kernels too."""
    import importlib.util
    from pathlib import Path

    path = (Path(__file__).resolve().parents[2] / "vllm" / "afd" / "adapter" / "model"
            / "kernel_paths.py")
    spec = importlib.util.spec_from_file_location("afd_kernel_report", path)
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module.kernel_report(worker.model_runner.get_model(),
                                worker.vllm_config.compilation_config.static_forward_context)


NOT_TORN_DOWN: list = []  # run(teardown=False)'s engines: kept until the process exits


def run(model: str, afd_config: str | None, compile_model: bool, max_tokens: int,
        num_prompts: int, dtype: str, attention_backend: str | None = None,
        prompts: list[str] | None = None, teardown: bool = True) -> dict:
    """One engine's results; teardown=False leaves the in-process FFN engine
    running (for a process that exits right after)."""
    os.environ["VLLM_ENABLE_V1_MULTIPROCESSING"] = "0"
    import gc

    from vllm import LLM, SamplingParams

    # What lives now is this process's imports (and earlier engines' results):
    # frozen, the gc.collect() calls vLLM makes while engines start skip it
    # (~0.3 s each here, several an engine: about half of a tiny model's plain
    # and AFD runs). Engine shutdowns unfreeze it (EngineCore.shutdown).
    gc.freeze()

    kwargs = dict(model=model, max_model_len=512, dtype=dtype, seed=0,
                  max_num_batched_tokens=64, max_num_seqs=16,
                  enforce_eager=not compile_model, enable_prefix_caching=False)
    if attention_backend:
        kwargs["attention_backend"] = attention_backend
    if afd_config:
        kwargs["afd_config"] = json.loads(afd_config)
        kwargs["afd_role"] = "attention"
    ffn_engine = None
    if afd_config and kwargs["afd_config"].get("connector") == "loopback":
        ffn_engine = start_inprocess_ffn(kwargs)
    t0 = time.monotonic()
    llm = LLM(**kwargs)
    t_init = time.monotonic() - t0
    params = SamplingParams(temperature=0, max_tokens=max_tokens, logprobs=1,
                            ignore_eos=True)
    t0 = time.monotonic()
    outs = llm.generate(prompts or PROMPTS[:num_prompts], params, use_tqdm=False)
    t_gen = time.monotonic() - t0
    results = []
    for o in outs:
        c = o.outputs[0]
        results.append({
            "prompt": o.prompt,
            "token_ids": list(c.token_ids),
            "logprobs": [lp[t].logprob for t, lp in zip(c.token_ids, c.logprobs)],
            "text": c.text,
        })
    link_stats = llm.collective_rpc("afd_link_stats")[0] if afd_config else None
    link = llm.collective_rpc("afd_link_document")[0] if afd_config else None
    kernels = llm.collective_rpc(kernel_report)[0]
    ffn_kernels = None
    if ffn_engine is not None:
        ffn_kernels = ffn_engine.core.collective_rpc(kernel_report)[0]
        if teardown:
            ffn_engine.shutdown()
    if not teardown:  # freed on return, the engine would shut down (vLLM's finalizer)
        NOT_TORN_DOWN.append((llm, ffn_engine))
    import torch

    import vllm

    return {"results": results, "init_s": t_init, "generate_s": t_gen, "link_stats": link_stats,
            "vllm": {"version": vllm.__version__, "file": vllm.__file__,
                     "afd": hasattr(llm.llm_engine.vllm_config, "afd_config")},
            "dummy_runs": (link or {}).get("dummy_runs"),
            "attention_backends": kernels and kernels["attention_backends"],
            # this engine's kernels (adapter/model/kernel_paths.py), and the in-process FFN role's
            "kernels": kernels, "ffn_kernels": ffn_kernels,
            "ubatches": (link or {}).get("ubatches"),
            "dtype": str(llm.llm_engine.vllm_config.model_config.dtype),
            # Model Runner V1 or V2 (V2 on a CPU: Triton's interpreter,
            # tools/testing/triton_interpret)
            "runner": "v2" if llm.llm_engine.vllm_config.use_v2_model_runner else "v1",
            "amx": torch.cpu._is_amx_tile_supported()}


def run_matrix(args) -> int:
    """The model matrix (tests/afd/e2e/test_families.py): one process start for
    every model's plain and AFD runs, each run in a child of it. A model that
    fails is recorded, and the others still run."""
    from pathlib import Path

    out = Path(args.matrix)
    out.mkdir(parents=True, exist_ok=True)
    inspect_in_parallel(args.model)
    runs_of = ForkedRuns(args.model)
    for model in args.model:
        name = Path(model).name
        t0 = time.monotonic()
        both = args.gate_on == "both"
        runs = [("plain", None), ("afd", loopback_config("ffn" if both else args.gate_on))]
        if both and is_moe(model):
            runs.append(("routed", loopback_config("attention")))
        if args.plain_only or args.afd_only:
            runs = runs[:1] if args.plain_only else runs[1:]
        for kind, config in runs:
            def one_run(model=model, config=config) -> dict:
                result = run(model, config, False, args.max_tokens, args.num_prompts,
                             args.dtype, attention_backend_for(model, args.dtype),
                             args.prompt, teardown=False)
                result["wall_s"] = time.monotonic() - t0
                return result

            # A run that fails is reported per model; the next model runs.
            if not runs_of(one_run, out / f"{name}.{kind}.json", out / f"{name}.error.txt"):
                break
    return 0


class ForkedRuns:
    """Engine runs, each in a child forked from this process (in_child), which
    has imported vLLM and starts no engine itself: every run starts from the
    same state, and none is torn down. A teardown cost more than a tiny model's
    run: vLLM's shutdown unfreezes the gc heap (~0.7 M objects after the
    imports) and collects it in full, ~0.5 s each, four times an engine with
    the cleanup a next engine in the same process needs. Frozen here, the
    children's collections skip the imports (and leave their pages shared)."""

    def __init__(self, models: list[str]):
        import gc

        self._gc = gc
        compile_the_samplers_logprob_ranks(models)
        gc.freeze()

    def __call__(self, fn, out, error) -> bool:
        """fn() -> dict in a child: its JSON in `out`, or why it failed in `error`."""
        import importlib

        ok, imported = in_child(fn, out, error)
        # What the child imported (engine, worker and model modules, torch's
        # compiler stack: seconds), imported here once for the next children.
        for module in imported:
            try:
                importlib.import_module(module)
            except Exception:  # noqa: BLE001 - only a speed-up
                pass
        self._gc.freeze()
        return ok


def compile_the_samplers_logprob_ranks(models: list[str]) -> None:
    """vLLM's sampler ranks each sampled token's logprob with a torch.compile'd
    function (batched_count_greater_than), compiled at a process's first
    logprobs: ~1.5 s, more than a tiny model's run. Compiled here, for each
    vocabulary size the models have, the children reuse it."""
    from pathlib import Path

    import torch

    from vllm.v1.sample.sampler import Sampler

    vocab_sizes = set()
    for model in models:
        config = json.loads((Path(model) / "config.json").read_text())
        vocab_sizes.add(config.get("vocab_size") or config.get("text_config", {})["vocab_size"])
    # On one thread: an OpenMP thread pool started here would hang the
    # children, which fork without its threads (GNU libgomp is not fork-safe).
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    try:
        for vocab_size in sorted(vocab_sizes):
            for batch in (1, 3):  # its batch dimension is symbolic from the first call
                logprobs = torch.randn(batch, vocab_size).log_softmax(-1)
                Sampler.gather_logprobs(logprobs, 1, torch.zeros(batch, dtype=torch.int64))
    finally:
        torch.set_num_threads(threads)


RUN_TIMEOUT_S = 300  # one engine's start and 10 prompts: seconds, on any CPU here


class Child:
    """fn() in a forked child that writes its result (JSON) to `out`, or its
    traceback to `error`, and exits at once: no engine teardown, no atexit.
    Started at construction; wait() for it."""

    def __init__(self, fn, out, error):
        import tempfile
        import traceback

        self.out, self.error = out, error
        sys.stdout.flush()
        sys.stderr.flush()
        self._imports = tempfile.NamedTemporaryFile("r", prefix="oracle-imports-")
        self.pid = os.fork()
        if self.pid == 0:
            code = 1
            try:  # whatever happens, the child never returns into the parent's code
                before = set(sys.modules)
                try:
                    out.write_text(json.dumps(fn()))
                    code = 0
                except BaseException:  # noqa: BLE001 - the parent reads it
                    error.write_text(traceback.format_exc())
                with open(self._imports.name, "w") as f:
                    f.write("\n".join(m for m in list(sys.modules) if m not in before))
                sys.stdout.flush()
                sys.stderr.flush()
            finally:
                os._exit(code)

    def wait(self, timeout_s: float | None = None) -> tuple[bool, list[str]]:
        """Whether it succeeded (else `error` says why: its traceback, the
        signal it died of, or the timeout it was killed at: RUN_TIMEOUT_S
        unless given), and the modules it imported, in order."""
        timeout_s = RUN_TIMEOUT_S if timeout_s is None else timeout_s
        deadline = time.monotonic() + timeout_s
        while not (done := os.waitpid(self.pid, os.WNOHANG))[0] and time.monotonic() < deadline:
            time.sleep(0.01)
        name = self.out.name
        if not done[0]:
            os.kill(self.pid, signal.SIGKILL)
            done = os.waitpid(self.pid, 0)
            self.error.write_text(f"the run did not end in {timeout_s} s (writing {name})\n")
        code = os.waitstatus_to_exitcode(done[1])
        with self._imports:
            imported = self._imports.read().split()
        if code < 0 and not self.error.exists():
            self.error.write_text(f"the run's process died of signal {-code} (writing {name})\n")
        return code == 0, imported


def in_child(fn, out, error) -> tuple[bool, list[str]]:
    """Child(fn, out, error).wait(): one run, to its end."""
    return Child(fn, out, error).wait()


def loopback_config(gate_on: str) -> str:
    """Both roles in this process (loopback binds nothing; the port is only
    validated)."""
    return json.dumps({"connector": "loopback", "port": 7700, "timeout_s": 60,
                       "role": "attention", "gate_on": gate_on})


def is_moe(model: str) -> bool:
    from pathlib import Path

    from vllm.afd.adapter.model.families import family_of

    config = json.loads((Path(model) / "config.json").read_text())
    family = family_of(config["architectures"])
    return family is not None and family.moe


def inspect_in_parallel(models: list[str]) -> None:
    """vLLM inspects each architecture's class once, in a subprocess of its own
    (then caches it under VLLM_CACHE_ROOT): start them all at once instead of
    one per engine start (a cold cache costs ~8 s per architecture here). Only
    a speed-up: on any error the engines inspect as usual."""
    from concurrent.futures import ThreadPoolExecutor
    from pathlib import Path

    try:
        from vllm.model_executor.models.registry import ModelRegistry

        archs = {a for m in models
                 for a in json.loads((Path(m) / "config.json").read_text())["architectures"]}
        with ThreadPoolExecutor(len(archs)) as pool:
            list(pool.map(ModelRegistry._try_inspect_model_cls, sorted(archs)))
    except Exception as e:  # noqa: BLE001
        print(f"oracle: parallel inspection skipped: {type(e).__name__}: {e}", file=sys.stderr)


def release_engine() -> None:
    """Free the last LLM's engine so another can start in this process."""
    import gc

    from vllm.distributed import cleanup_dist_env_and_memory

    try:  # vllm-afd's; stock vLLM (the stock reference) has none
        from vllm.afd.adapter.attention.runner import close_link
    except ImportError:
        close_link = None
    if close_link is not None:
        close_link()  # the next engine in this process links anew
    gc.collect()
    cleanup_dist_env_and_memory()


def start_inprocess_ffn(llm_kwargs: dict):
    """The FFN role in this process (uniprocessor executor): the loopback
    connector's two ends must share a process."""
    from vllm.afd.adapter.ffn.engine import FFNEngine
    from vllm.engine.arg_utils import EngineArgs

    kwargs = dict(llm_kwargs, afd_role="ffn", distributed_executor_backend="uni")
    return FFNEngine(EngineArgs(**kwargs).create_engine_config())


def fake_amx(scope: str) -> None:
    """Tests only: vLLM's kernel choices as on a host with AMX tiles."""
    import torch

    if scope == "all":
        torch.cpu._is_amx_tile_supported = lambda: True
        return
    import vllm.model_executor.layers.utils as layer_utils

    real_check, real_amx = layer_utils.check_cpu_sgl_kernel, torch.cpu._is_amx_tile_supported

    def check_as_on_amx(n: int, k: int, dtype) -> bool:
        torch.cpu._is_amx_tile_supported = lambda: True
        try:
            return real_check(n, k, dtype)
        finally:
            torch.cpu._is_amx_tile_supported = real_amx

    layer_utils.check_cpu_sgl_kernel = check_as_on_amx


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("model", nargs="+", help="one checkpoint (several with --matrix)")
    ap.add_argument("--out", help="the result file (the AFD run's with --plain-out)")
    ap.add_argument("--matrix", metavar="DIR",
                    help="for each model in turn, in this one process: plain vLLM, then AFD "
                         "with both roles here (loopback); writes DIR/NAME.plain.json and "
                         "DIR/NAME.afd.json, or DIR/NAME.error.txt if that model failed")
    ap.add_argument("--plain-only", action="store_true",
                    help="with --matrix: plain vLLM only (e.g. stock vLLM, which has no AFD)")
    ap.add_argument("--afd-only", action="store_true",
                    help="with --matrix: AFD only (the plain runs are another matrix's)")
    ap.add_argument("--gate-on", default="ffn", choices=["ffn", "attention", "both"],
                    help="with --matrix: where the AFD runs' MoE routers run; 'both': a "
                         "second AFD run of each MoE model with them on the attention "
                         "role (DIR/NAME.routed.json)")
    ap.add_argument("--afd-config", default=None)
    ap.add_argument("--compile", action="store_true")
    ap.add_argument("--max-tokens", type=int, default=16)
    ap.add_argument("--num-prompts", type=int, default=len(PROMPTS))
    ap.add_argument("--dtype", default="float32")
    ap.add_argument("--prompt", action="append", help="instead of the fixed prompts (repeat)")
    ap.add_argument("--attention-backend", default=None,
                    help="e.g. CPU_MLA: the MLA kernels every CPU runs (else AMX hosts "
                         "pick AMX_MLA, which refuses fp32 weights)")
    ap.add_argument("--plain-out", default=None,
                    help="first run plain vLLM in this process and write its result here "
                         "(then the --afd-config run: one process start for both)")
    ap.add_argument("--fake-amx", nargs="?", const="all", choices=["all", "linear"],
                    help="tests: make this process's vLLM believe the CPU has AMX tiles "
                         "(the choices an Intel AMX host makes, on any CPU); 'linear': only "
                         "its small-GEMM choice, SGL's packed GEMM, which runs on any "
                         "AVX512-BF16 CPU (AMX's attention and experts need the tiles)")
    ap.add_argument("--stand-ins", metavar="DIR",
                    help="tests: put DIR first on this process's path (and its "
                         "subprocesses' PYTHONPATH); tests/stand_ins holds an import-only "
                         "torchvision, which vLLM's Qwen3.5 module imports")
    args = ap.parse_args()
    if args.stand_ins:  # here, not by PYTHONPATH: the test's preloaded process can run this
        sys.path.insert(0, args.stand_ins)
        os.environ["PYTHONPATH"] = os.pathsep.join(
            filter(None, (args.stand_ins, os.environ.get("PYTHONPATH"))))
    if args.fake_amx:
        fake_amx(args.fake_amx)
    if args.matrix:
        return run_matrix(args)
    if len(args.model) != 1 or not args.out:
        ap.error("one model and --out (several models need --matrix)")
    args.model = args.model[0]
    if args.plain_out:
        plain = run(args.model, None, args.compile, args.max_tokens, args.num_prompts,
                    args.dtype, args.attention_backend, args.prompt)
        with open(args.plain_out, "w") as f:
            json.dump(plain, f)
        release_engine()
    result = run(args.model, args.afd_config, args.compile, args.max_tokens,
                 args.num_prompts, args.dtype, args.attention_backend, args.prompt)
    with open(args.out, "w") as f:
        json.dump(result, f)
    return 0


if __name__ == "__main__":
    sys.exit(main())
