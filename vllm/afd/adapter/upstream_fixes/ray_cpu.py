# SPDX-License-Identifier: Apache-2.0
# SPDX-FileCopyrightText: Copyright contributors to the vllm-afd project
"""vLLM's Ray executor (RayExecutorV2) and Ray data parallelism on the CPU platform.

Upstream 0.32.0 refuses Ray on the CPU: CpuPlatform.ray_device_key is empty, so
every Ray path raises "current platform cpu does not support ray". The patch
fix_ray_cpu_platform gives the CPU the key "CPU" (placement groups then hold one
{"CPU": 1} bundle per worker) and calls the functions below where the executor
would otherwise treat "CPU" as an accelerator. On other platforms each of them
returns upstream's own value.

What a CPU worker needs from its placement, and how it gets it here:
  * resources: the bundle reserves the CPU; the actor asks for none itself
    (Ray refuses "CPU" among custom `resources`, and upstream passes num_cpus=0).
  * accelerator ids: none. The executor passes an empty list, which the patched
    initialize_worker reads as "no logical-to-physical mapping", as with mp.
  * its cores: mp sets the OpenMP binding (VLLM_CPU_OMP_THREADS_BIND, through
    vllm.utils.ompmultiprocessing) in each worker process's environment before
    it starts, which also inherits LD_PRELOAD (PyTorch's libgomp, tcmalloc);
    here the same variables go into that actor's runtime_env, which Ray applies
    when it starts the actor's process (OpenMP reads them when it loads, so
    setting them later, in initialize_worker, would be too late).
  * which bundles are workers': Ray DP placement groups end with a control
    bundle {"CPU": 1} for the engine actor, indistinguishable by resources from
    a CPU worker's bundle; the workers take the lowest-indexed bundles.
"""

from __future__ import annotations

import os
from typing import Any

CPU_KEY = "CPU"


def is_cpu(device_key: str) -> bool:
    return device_key == CPU_KEY


def actor_resources(device_key: str, upstream: dict[str, Any]) -> dict[str, Any]:
    """Ray actor options for one worker (besides num_cpus=0, which upstream sets)."""
    if is_cpu(device_key):
        return {"num_gpus": 0}
    return upstream


def accelerator_ids(device_key: str) -> list[str]:
    """The accelerator ids Ray assigned to this actor: none for a CPU worker."""
    if is_cpu(device_key):
        return []
    import ray

    return ray.get_runtime_context().get_accelerator_ids()[device_key]


def worker_bundles(device_key: str, bundles: list[tuple[int, str, str]],
                   world_size: int) -> list[tuple[int, str, str]]:
    """(bundle index, node id, node ip) of the workers' bundles, in the
    executor's order. On the CPU every bundle matches the device key, the DP
    control bundle too: keep the world_size lowest-indexed (the control bundle
    is the last), in the order given."""
    if not is_cpu(device_key) or len(bundles) <= world_size:
        return bundles
    keep = set(sorted(b[0] for b in bundles)[:world_size])
    return [b for b in bundles if b[0] in keep]


def omp_env(vllm_config, rank: int, local_rank: int, manager=None) -> dict[str, str]:
    """The environment mp gives a CPU worker process for its OpenMP binding
    (OMPProcessManager.configure_omp_envs), as a dict; empty with
    VLLM_CPU_OMP_THREADS_BIND=nobind."""
    if manager is None:
        from vllm.utils.ompmultiprocessing import OMPProcessManager

        manager = OMPProcessManager(vllm_config)
    before = dict(os.environ)
    with manager.configure_omp_envs(rank=rank, local_rank=local_rank):
        return {k: v for k, v in os.environ.items() if before.get(k) != v}


def worker_runtime_envs(device_key: str, vllm_config, runtime_env: dict,
                        assignments: list[dict[str, Any]]) -> list[dict]:
    """One runtime_env per worker actor, in the order of `assignments` (the
    executor's bundle assignments: rank, node_id, ...). CPU workers get their
    OpenMP binding for their local rank on their node (the index among the
    workers on that node, as the executor numbers them after placement)."""
    if not is_cpu(device_key):
        return [runtime_env] * len(assignments)
    from vllm.utils.ompmultiprocessing import OMPProcessManager

    manager = OMPProcessManager(vllm_config)
    # What mp's worker processes inherit: CpuPlatform.check_and_update_config
    # puts PyTorch's libgomp (thread binding) and tcmalloc here, and they only
    # take effect when loaded at process start. Paths of the driver's host: a
    # Ray cluster runs the same install on every node.
    preload = {"LD_PRELOAD": os.environ["LD_PRELOAD"]} if os.environ.get("LD_PRELOAD") else {}
    seen: dict[str, int] = {}
    envs = []
    for a in assignments:
        local_rank = seen.get(a["node_id"], 0)
        seen[a["node_id"]] = local_rank + 1
        env = dict(runtime_env)
        env["env_vars"] = {**runtime_env.get("env_vars", {}), **preload,
                           **omp_env(vllm_config, a["rank"], local_rank, manager)}
        envs.append(env)
    return envs
