# SPDX-License-Identifier: Apache-2.0
# SPDX-FileCopyrightText: Copyright contributors to the vllm-afd project
"""What AFD needs from the rest of vLLM's configuration (adapter).

`check_vllm_config` refuses, at config time and naming the option, what cannot
work with AFD:

- `--enable-dbo` / `ubatch_size > 1`: vLLM's own micro-batching would send both
  of its micro-batches as AFD micro-batch 0; use AFDConfig.num_ubatches.
- FULL CUDA graphs asked for explicitly (compilation_config.cudagraph_mode)
  with a connector that cannot be captured: an exchange cannot run inside a
  graph (none of the shipped connectors can).
- a connector whose payloads stay on the device (nccl) on another device type.
- a model whose architecture AFD does not split (model/families.py).
- speculative decoding: draft layers are built with the same decoder layers,
  whose FFN construction AFD marks, and would be split too.
- tensor or pipeline parallelism on the attention role: its ranks are its
  data-parallel ranks (one link each); a TP group would send every layer once
  per worker. More attention ranks come from --data-parallel-size or more
  attention servers.

`resolve_compilation` runs after vLLM chose its splitting ops: on the attention
role the remote FFN op becomes a splitting op (piecewise graphs capture the
attention between exchanges; the exchange runs eagerly), and FULL modes that
were defaults are lowered to piecewise ones, with a log line saying so.
"""

from vllm.afd.transport.connectors.registry import connector_class
from vllm.logger import init_logger

logger = init_logger(__name__)

# The remote FFN custom op (model/remote_ffn.py registers it).
REMOTE_FFN_OP = "afd_remote_ffn"
SPLITTING_OP = f"vllm::{REMOTE_FFN_OP}"


class AFDConfigError(ValueError):
    """A configuration AFD cannot run with; the message names the option."""


def check_vllm_config(vllm_config) -> None:
    afd = vllm_config.afd_config
    pc = vllm_config.parallel_config
    if vllm_config.model_config is not None:
        from vllm.afd.adapter.model.families import check_model

        check_model(vllm_config.model_config, afd.role)
    if vllm_config.speculative_config is not None:
        raise AFDConfigError(
            f"speculative decoding (--speculative-config) cannot be combined with AFD "
            f"(--afd-role {afd.role}): the draft model's layers would be split too. "
            f"Remove --speculative-config.")
    if pc.enable_dbo or pc.ubatch_size > 1:
        option = "--enable-dbo" if pc.enable_dbo else f"ubatch_size={pc.ubatch_size}"
        raise AFDConfigError(
            f"{option} (vLLM's dual-batch overlap) cannot be combined with AFD (--afd-role "
            f"{afd.role}): both would split the step into micro-batches. Remove {option}; "
            f"AFD's own micro-batch ping-pong is AFDConfig.num_ubatches.")
    if afd.is_attention and (pc.tensor_parallel_size > 1 or pc.pipeline_parallel_size > 1):
        option = (f"--tensor-parallel-size {pc.tensor_parallel_size}"
                  if pc.tensor_parallel_size > 1 else
                  f"--pipeline-parallel-size {pc.pipeline_parallel_size}")
        raise AFDConfigError(
            f"{option} cannot be used on the AFD attention role: its ranks are its "
            f"data-parallel ranks, one link each. Use --data-parallel-size (or more "
            f"attention servers) for more attention ranks; tensor/expert parallelism "
            f"belongs on the FFN role.")
    connector = connector_class(afd.connector)
    mode = vllm_config.compilation_config.cudagraph_mode  # None unless the user set it
    if (afd.is_attention and mode is not None and mode.has_full_cudagraphs()
            and not connector.graph_capturable):
        raise AFDConfigError(
            f"compilation_config.cudagraph_mode={mode.name} cannot be combined with the AFD "
            f"connector {afd.connector!r}: an exchange with the FFN server cannot be captured "
            f"in a CUDA graph. Use cudagraph_mode PIECEWISE (the default with AFD: graphs "
            f"capture the attention between exchanges) or NONE.")
    device = vllm_config.device_config.device_type if vllm_config.device_config else None
    if not connector.stages_through_host and afd.connector != "loopback" and device:
        allowed = getattr(connector, "device_types", ("cuda",))
        if device not in allowed:
            raise AFDConfigError(
                f"AFDConfig.connector={afd.connector!r} keeps payloads on the device and "
                f"needs {'/'.join(allowed)} devices; this server runs on {device}. Use "
                f"'shm' (same host) or 'tcp', which stage through host memory.")


def resolve_compilation(vllm_config) -> None:
    from vllm.config import CompilationMode, CUDAGraphMode

    afd = vllm_config.afd_config
    if not afd.is_attention:
        return
    cc = vllm_config.compilation_config
    mode = cc.cudagraph_mode
    if (mode is not None and mode.has_full_cudagraphs()
            and not connector_class(afd.connector).graph_capturable):
        lowered = (CUDAGraphMode.PIECEWISE if cc.mode == CompilationMode.VLLM_COMPILE
                   else CUDAGraphMode.NONE)
        logger.info("AFD: the %r connector cannot be captured in a CUDA graph; "
                    "cudagraph_mode %s lowered to %s (graphs capture the attention between "
                    "exchanges with the FFN)", afd.connector, mode.name, lowered.name)
        cc.cudagraph_mode = lowered
    if cc.mode == CompilationMode.VLLM_COMPILE and SPLITTING_OP not in cc.splitting_ops:
        cc.splitting_ops.append(SPLITTING_OP)
