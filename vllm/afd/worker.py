# SPDX-License-Identifier: Apache-2.0
# SPDX-FileCopyrightText: Copyright contributors to the vllm-afd project
"""Worker methods for AFD, called by the engine through collective_rpc (adapter).

The FFN role's worker builds the data plane's FFNLoop (ffn/loop.py) from the
vLLM model it loaded: the layers to serve, a compute function that runs one
layer's mlp in vLLM's forward context (with received routing when gate_on is
"attention"), the model fingerprint and the worker's rank, device and stream.
"""

import torch

from vllm.afd.transport.device import DeviceContext


def build_ffn_loop(vllm_config, model: torch.nn.Module, worker_rank: int):
    """The FFN loop of one worker (not started)."""
    from vllm.afd.ffn.loop import FFNLoop
    from vllm.afd.model.fingerprint import model_fingerprint
    from vllm.afd.model.routing import call_with_routing
    from vllm.afd.model.split import ffn_layers
    from vllm.afd.nccl_factory import connector_kwargs
    from vllm.afd.topology import ffn_placement
    from vllm.forward_context import create_forward_context, override_forward_context

    afd = vllm_config.afd_config
    mlps = ffn_layers(model)
    forward_context = create_forward_context(None, vllm_config)

    def compute(layer: int, h: torch.Tensor, routing) -> torch.Tensor:
        with override_forward_context(forward_context):
            return call_with_routing(mlps[layer], h, routing)

    mc = vllm_config.model_config
    return FFNLoop(
        afd.link_config(), layers=list(mlps), compute=compute,
        hidden_size=mc.get_hidden_size(), dtype=mc.dtype,
        max_tokens=vllm_config.scheduler_config.max_num_batched_tokens,
        placement=ffn_placement(vllm_config, worker_rank),
        routed_layers=getattr(model, "afd_routed_layers", {}),
        fingerprint=model_fingerprint(vllm_config),
        connector_kwargs=connector_kwargs(afd.connector))


class AFDWorkerMixin:
    """Mixed into vLLM's Worker (and so CPUWorker): the FFN role's loop control."""

    _afd_ffn_loop = None

    def afd_start_ffn_loop(self) -> None:
        if self._afd_ffn_loop is None:
            loop = build_ffn_loop(self.vllm_config, self.model_runner.get_model(), self.rank)
            # This worker's device and the stream it computes on: the loop's
            # threads enter them (never device 0 or the default stream).
            device = getattr(self, "device", None) or self.vllm_config.device_config.device
            loop.start(DeviceContext.current(device))
            self._afd_ffn_loop = loop

    def afd_ffn_loop_status(self) -> dict:
        if self._afd_ffn_loop is None:
            return {"running": False, "ready": False, "error": None, "steps": 0}
        return self._afd_ffn_loop.status()

    def afd_link_stats(self) -> dict:
        """Attention role: the link's cumulative statistics (observability/stats.py);
        empty before the first step."""
        from vllm.afd.attention import runner

        return runner._link.stats.as_dict() if runner._link is not None else {}

    def afd_link_document(self) -> dict:
        """Attention role: the link's state and counters (dummy runs included)."""
        from vllm.afd.attention import runner

        return runner._link.document() if runner._link is not None else {}

    def afd_attention_backends(self) -> list[str]:
        """The attention backends this worker's layers run (plain or AFD), e.g.
        ["CPU_MLA"]: tests report which kernels ran."""
        context = self.vllm_config.compilation_config.static_forward_context
        return sorted({layer.attn_backend.get_name() for layer in context.values()
                       if getattr(layer, "attn_backend", None) is not None})

    def afd_stop_ffn_loop(self) -> None:
        if self._afd_ffn_loop is not None:
            self._afd_ffn_loop.stop()
            self._afd_ffn_loop = None
