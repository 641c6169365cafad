# SPDX-License-Identifier: Apache-2.0
# SPDX-FileCopyrightText: Copyright contributors to the vllm-afd project
"""Worker methods for AFD, called by the engine through collective_rpc (adapter).

The FFN role's worker builds the data plane's FFNLoop (ffn/loop.py) from the
vLLM model it loaded: the layers to serve, a compute function that runs one
layer's mlp in vLLM's forward context (with received routing when gate_on is
"attention"), the model fingerprint and the worker's rank, device and stream.
A multi-worker (TP/EP) FFN server's workers also get the channel on which the
lead sends its batch orders to the followers (ffn/orders.py).
"""

from datetime import timedelta

import torch

from vllm.afd.transport.device import DeviceContext


def build_ffn_loop(vllm_config, model: torch.nn.Module, worker_rank: int):
    """The FFN loop of one worker (not started)."""
    from vllm.afd.ffn.loop import FFNLoop
    from vllm.afd.adapter.model.fingerprint import model_fingerprint
    from vllm.afd.adapter.model.module_call import call_module
    from vllm.afd.adapter.model.routing import call_with_routing
    from vllm.afd.adapter.model.split import ffn_layers
    from vllm.afd.adapter.nccl_factory import connector_kwargs
    from vllm.afd.topology import ffn_placement
    import vllm.forward_context as forward_context_module
    from vllm.forward_context import create_forward_context

    afd = vllm_config.afd_config
    mlps = ffn_layers(model)
    forward_context = create_forward_context(None, vllm_config)

    def compute(layer: int, h: torch.Tensor, routing) -> torch.Tensor:
        # override_forward_context, without its generator's frames (this runs
        # once per layer call, on a cold cache: each Python frame costs
        # microseconds there).
        previous = forward_context_module._forward_context
        forward_context_module._forward_context = forward_context
        try:
            return (call_module(mlps[layer], h) if routing is None
                    else call_with_routing(mlps[layer], h, routing))
        finally:
            forward_context_module._forward_context = previous

    placement = ffn_placement(vllm_config, worker_rank)
    mc = vllm_config.model_config
    return FFNLoop(
        afd.link_config(), layers=list(mlps), compute=compute,
        hidden_size=mc.get_hidden_size(), dtype=mc.dtype,
        max_tokens=vllm_config.scheduler_config.max_num_batched_tokens,
        placement=placement, orders=order_channel(placement),
        routed_layers=getattr(model, "afd_routed_layers", {}),
        fingerprint=model_fingerprint(vllm_config),
        connector_kwargs=connector_kwargs(afd.connector))


# A follower's receive waits this long for the lead's next message: the lead
# sends one at least every batcher.KEEPALIVE_S once serving, and warm-up (before
# it) takes far less.
ORDER_TIMEOUT = timedelta(hours=2)


def order_channel(placement):
    """The batch orders' channel of a multi-worker FFN server (None for one
    worker): a gloo group of its own for the server's workers, so an order's
    broadcast never interleaves with the collectives the mlp itself issues
    (vLLM's TP/EP groups, on the compute threads). Called on every worker, in
    the same order (afd_start_ffn_loop runs on all of them through
    collective_rpc): torch.distributed.new_group is collective over the world.
    The group's first rank is the lead (FFNPlacement.group[0] is worker 0)."""
    if len(placement.group) == 1:
        return None
    import torch.distributed as dist

    from vllm.afd.ffn.orders import TorchDistChannel
    from vllm.distributed.parallel_state import get_tp_group

    tp = get_tp_group()
    if tp.world_size != len(placement.group):  # topology.py: the workers are the TP group
        raise RuntimeError(f"AFD FFN: the FFN group {placement.group} is not the tensor "
                           f"parallel group {tp.ranks}")
    mine = None
    # As vLLM builds its own groups: every rank creates every TP group's (one
    # here: no pipeline or data parallelism on the FFN role).
    for ranks in tp.group_ranks:
        group = dist.new_group(ranks, backend="gloo", timeout=ORDER_TIMEOUT)
        if tp.rank in ranks:
            mine = TorchDistChannel(group, lead_rank=ranks[0])
    return mine


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
        from vllm.afd.adapter.attention import runner

        return runner._link.stats.as_dict() if runner._link is not None else {}

    def afd_link_document(self) -> dict:
        """Attention role: the link's state and counters (dummy runs included)."""
        from vllm.afd.adapter.attention import runner

        return runner._link.document() if runner._link is not None else {}

    def afd_stop_ffn_loop(self) -> None:
        if self._afd_ffn_loop is not None:
            self._afd_ffn_loop.stop()
            self._afd_ffn_loop = None
