# SPDX-License-Identifier: Apache-2.0
# SPDX-FileCopyrightText: Copyright contributors to the vllm-afd project
"""Every function and class the patch series calls (patches/, docs/patches.md).

A patch imports only this module (`import vllm.afd.seams as afd_seams`, or
`from vllm.afd.seams import X`), so files can move inside vllm/afd without
touching a patch. Each seam is a no-op, or upstream's own behaviour, when AFD
is off. Imports are lazy: upstream's platform detection and CLI import this
module early, and must not pull in the rest of vllm/afd.

Which patch calls which seam, in which upstream file: docs/patches.md,
generated from the series (`make docs`); tools/build/check_series.py fails when a
patch calls a name missing from __all__ below, or a name there is called by
no patch.
"""

import functools
import logging
from typing import Any

from vllm.afd.version import distribution_version

logger = logging.getLogger(__name__)

__all__ = [
    "AFDConfig", "AFDWorkerMixin", "add_afd_cli_args", "afd_config_from_cli", "begin_mlp",
    "begin_step", "build_model", "capture_scope", "check_vllm_config",
    "distribution_version", "dummy_step", "filter_weights", "guard_step", "install_api",
    "is_ffn_engine", "is_ffn_role", "maybe_ubatch_slices", "model_forward",
    "num_ubatches_for", "raise_if_link_failed", "ray_accelerator_ids",
    "ray_actor_resources", "ray_worker_bundles", "ray_worker_runtime_envs",
    "request_memory", "resolve_compilation", "run_ffn_server", "step_scope",
    "ubatch_runner", "ubatched_step",
]


def __getattr__(name: str) -> Any:
    # Classes a patch names at import time, imported when first asked for.
    if name == "AFDConfig":
        from vllm.afd.adapter.config import AFDConfig

        return AFDConfig
    if name == "AFDWorkerMixin":
        from vllm.afd.adapter.worker import AFDWorkerMixin

        return AFDWorkerMixin
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")


def _afd(vllm_config) -> Any:
    return getattr(vllm_config, "afd_config", None)


# ----------------------------------------------------------------- config, CLI
def add_afd_cli_args(parser) -> None:
    from vllm.afd.adapter.cli import add_afd_cli_args as add

    add(parser)


def afd_config_from_cli(afd_config, afd_role, additional_config):
    from vllm.afd.adapter.config import AFDConfig

    return AFDConfig.from_cli(afd_config, afd_role, additional_config)


def check_vllm_config(vllm_config) -> None:
    """Start of VllmConfig.__post_init__: refuse, naming the option, what
    cannot work with AFD (vllm/afd/adapter/compat.py)."""
    if _afd(vllm_config) is not None:
        from vllm.afd.adapter.compat import check_vllm_config as check

        check(vllm_config)


def resolve_compilation(vllm_config) -> None:
    """After vLLM chose its splitting ops: the remote FFN op splits the graph
    on the attention role, and FULL graphs are lowered for connectors that
    cannot be captured (vllm/afd/adapter/compat.py)."""
    if _afd(vllm_config) is not None:
        from vllm.afd.adapter.compat import resolve_compilation as resolve

        resolve(vllm_config)


# ------------------------------------------------------------------ the model
def build_model(vllm_config, construct):
    from vllm.afd.adapter.model.split import build_model as build

    return build(vllm_config, construct)


def filter_weights(model, weights):
    from vllm.afd.adapter.model.split import filter_weights as filter_

    return filter_(model, weights)


def begin_mlp(vllm_config=None):
    """None: the config being built (layers that are not handed it)."""
    from vllm.afd.adapter.model.split import begin_mlp as begin

    return begin(vllm_config)


# -------------------------------------------------------------------- engine
def is_ffn_engine(vllm_config) -> bool:
    afd = _afd(vllm_config)
    return afd is not None and afd.is_ffn


def guard_step(engine_core, step):
    from vllm.afd.adapter.attention.failover import guard_step as guard

    return guard(engine_core, step)


# -------------------------------------------------------------------- worker
def request_memory(vllm_config, init_snapshot, cache_config, external_weight_memory=0):
    """Worker.init_device's memory request. The FFN role has no KV cache:
    gpu_memory_utilization (a KV-cache budget) does not apply to it, so it
    neither checks nor reserves it and can share a GPU with an attention
    server (docs/architecture.md, "Device rules")."""
    from vllm.v1.worker.utils import request_memory as upstream

    if is_ffn_engine(vllm_config):
        logger.info("AFD FFN role: no KV cache; gpu_memory_utilization (%.2f) does not "
                    "apply (%.2f GiB free of %.2f GiB)", cache_config.gpu_memory_utilization,
                    init_snapshot.free_memory / 2**30, init_snapshot.total_memory / 2**30)
        return 0
    return upstream(init_snapshot, cache_config, external_weight_memory)


# -------------------------------------------------------------------- runner
def num_ubatches_for(vllm_config) -> int:
    from vllm.afd.adapter.attention.runner import num_ubatches_for as count

    return count(vllm_config)


def maybe_ubatch_slices(vllm_config, num_scheduled_tokens, num_tokens_padded,
                        num_reqs_padded, ubatch_slices, ubatch_slices_padded):
    if _afd(vllm_config) is None:
        return ubatch_slices, ubatch_slices_padded
    from vllm.afd.adapter.attention.runner import maybe_ubatch_slices as split

    return split(vllm_config, num_scheduled_tokens, num_tokens_padded, num_reqs_padded,
                 ubatch_slices, ubatch_slices_padded)


def model_forward(vllm_config, model, **kwargs):
    if _afd(vllm_config) is None:
        return model(**kwargs)
    from vllm.afd.adapter.attention.runner import model_forward as forward

    return forward(vllm_config, model, **kwargs)


def dummy_step(vllm_config, is_profile: bool, is_graph_capturing: bool):
    """A context manager around _dummy_run's model call: names the run."""
    import contextlib

    if _afd(vllm_config) is None:
        return contextlib.nullcontext()
    from vllm.afd.adapter.attention.runner import dummy_step as step

    return step(vllm_config, is_profile, is_graph_capturing)


# ---------------------------------------------------------- runner (V2)
# Model Runner V2 names its runs itself (execute_model's dummy_run/is_profile,
# capture_model), so these seams pass its words on (adapter/attention/runner_v2.py).
def step_scope(execute_model):
    """Decorates V2's execute_model: the AFD step begun inside it (begin_step)
    ends with it, as failed when it raised."""
    return _runner_v2_scope(execute_model, "in_step_scope")


def capture_scope(capture_model):
    """Decorates V2's capture_model: a capture run, which never touches the link."""
    return _runner_v2_scope(capture_model, "in_capture_scope")


def _runner_v2_scope(method, scope: str):
    """method of V2's runner, run inside runner_v2's scope (its name) when AFD is on."""

    @functools.wraps(method)
    def wrapper(runner, *args, **kwargs):
        if _afd(runner.vllm_config) is None:
            return method(runner, *args, **kwargs)
        from vllm.afd.adapter.attention import runner_v2

        return getattr(runner_v2, scope)(method, runner, *args, **kwargs)
    return wrapper


def begin_step(vllm_config, dummy_run: bool, is_profile: bool, input_batch,
               ubatch_state) -> None:
    """execute_model, just before the model runs: a real, profile or warm-up step."""
    if _afd(vllm_config) is not None:
        from vllm.afd.adapter.attention.runner_v2 import begin_step as begin

        begin(vllm_config, dummy_run, is_profile, input_batch, ubatch_state)


def ubatch_runner(build_upstream, vllm_config, *args):
    """V2's micro-batch runner: AFD's (the FFN ping-pong) on an attention role
    with num_ubatches > 1, else upstream's builder's (DBO, or None)."""
    if _afd(vllm_config) is not None:
        from vllm.afd.adapter.attention.runner_v2 import build_ubatch_runner

        runner = build_ubatch_runner(vllm_config, *args)
        if runner is not None:
            return runner
    return build_upstream(vllm_config, *args)


def ubatched_step(vllm_config, ubatch_runner, input_batch, dummy_run: bool) -> bool:
    """Whether AFD splits this step into micro-batches (real steps only)."""
    if _afd(vllm_config) is None:
        return False
    from vllm.afd.adapter.attention.runner_v2 import ubatched_step as split

    return split(vllm_config, ubatch_runner, input_batch, dummy_run)


# ------------------------------------------------------------------- serving
def is_ffn_role(args) -> bool:
    from vllm.afd.adapter.ffn.http import is_ffn_role as check

    return check(args)


def run_ffn_server(args) -> None:
    from vllm.afd.adapter.ffn.http import run_ffn_server as run

    run(args)


def install_api(app, args) -> None:
    from vllm.afd.adapter.attention.http import install

    install(app, args)


def raise_if_link_failed(request_id: str) -> None:
    from vllm.afd.adapter.attention.failover import raise_if_link_failed as check

    check(request_id)


# ------------------------------------------------------- Ray on the CPU platform
# Not AFD-gated: upstream raises on these paths on the CPU (see adapter/upstream_fixes/ray_cpu.py), and
# on every other platform each returns upstream's own value.
def ray_actor_resources(device_key: str, upstream: dict) -> dict:
    from vllm.afd.adapter.upstream_fixes.ray_cpu import actor_resources

    return actor_resources(device_key, upstream)


def ray_accelerator_ids(device_key: str) -> list:
    from vllm.afd.adapter.upstream_fixes.ray_cpu import accelerator_ids

    return accelerator_ids(device_key)


def ray_worker_bundles(device_key: str, bundles: list, world_size: int) -> list:
    from vllm.afd.adapter.upstream_fixes.ray_cpu import worker_bundles

    return worker_bundles(device_key, bundles, world_size)


def ray_worker_runtime_envs(device_key: str, vllm_config, runtime_env: dict,
                            assignments: list) -> list:
    from vllm.afd.adapter.upstream_fixes.ray_cpu import worker_runtime_envs

    return worker_runtime_envs(device_key, vllm_config, runtime_env, assignments)
