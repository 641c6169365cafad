# SPDX-License-Identifier: Apache-2.0
# SPDX-FileCopyrightText: Copyright contributors to the vllm-afd project
"""Construct a model the way vLLM's model loader does, for AFD roles, and print
what each allocated, one JSON line per spec (run as a subprocess by
test_model_split.py; one process per model, since importing vLLM costs more than
the constructions).

    role_params_probe.py MODEL SPEC [SPEC ...]    SPEC: plain | attention:GATE_ON | ffn:GATE_ON

Counts right after construction: after loading, CPU kernels repack some
weights into non-parameter storage, which would hide them from the count."""

import json
import os
import random
import sys

os.environ["VLLM_ENABLE_V1_MULTIPROCESSING"] = "0"

import torch  # noqa: E402

from vllm.config import set_current_vllm_config  # noqa: E402
from vllm.distributed import (  # noqa: E402
    init_distributed_environment,
    initialize_model_parallel,
    model_parallel_is_initialized,
)
from vllm.engine.arg_utils import EngineArgs  # noqa: E402
from vllm.model_executor.model_loader.utils import initialize_model  # noqa: E402
from vllm.utils.torch_utils import set_default_torch_dtype  # noqa: E402


def probe(model_dir: str, role: str, gate_on: str) -> dict:
    args = EngineArgs(model=model_dir, max_model_len=256, enforce_eager=True,
                      dtype="float32", afd_role=None if role == "plain" else role,
                      afd_config=None if role == "plain" else {"gate_on": gate_on})
    vllm_config = args.create_engine_config()
    with set_current_vllm_config(vllm_config):
        if not model_parallel_is_initialized():
            init_distributed_environment(
                1, 0, f"tcp://127.0.0.1:{random.randint(20000, 60000)}", 0, backend="gloo")
            initialize_model_parallel(1, 1)
        with set_default_torch_dtype(vllm_config.model_config.dtype), torch.device("cpu"):
            model = initialize_model(vllm_config=vllm_config)
    params = {n: p.numel() for n, p in model.named_parameters()}
    return {
        "role": role,
        "gate_on": gate_on,
        "num_params": sum(params.values()),
        "names": sorted(params),
        "meta": [n for n, p in model.named_parameters() if p.device.type == "meta"],
        "forward_context": sorted(vllm_config.compilation_config.static_forward_context),
        "remote_layers": sorted(m.layer_idx for m in model.modules()
                                if type(m).__name__ == "RemoteFFN"),
    }


def main() -> None:
    model_dir = sys.argv[1]
    for spec in sys.argv[2:]:
        role, _, gate_on = spec.partition(":")
        print(json.dumps(probe(model_dir, role, gate_on or "ffn")), flush=True)


if __name__ == "__main__":
    main()
