# SPDX-License-Identifier: Apache-2.0
# SPDX-FileCopyrightText: Copyright contributors to the vllm-afd project
"""AFD's micro-batch runner for Model Runner V2 (adapter).

V2 runs vLLM's own micro-batches (dual-batch overlap) through a UBatchRunner:
`prepare` slices the step's InputBatch and builds each micro-batch's attention
metadata and forward context, `run` runs the model on each. Its `run` hands
the GPU over at the expert all-to-all on CUDA streams, and a step is split in
a fixed number of halves. AFD's ping-pong is another schedule: the attention
of one micro-batch runs while the FFN server computes another's layer, the
turn passing at every remote FFN exchange (attention/pingpong.py), on any
device, with a count the link's micro-batch rule picks per step.

So the attention role with num_ubatches > 1 gets this runner in V2's place. It
keeps V2's own slicing of the InputBatch and its per-micro-batch metadata
(`prepare_attn(..., ubatch_idx=i)`), splits where AFD splits (balanced, whole
requests for hybrid models: attention/runner.py `split_tokens`), and runs the
micro-batches ping-ponged. It has V2's runner's `prepare` and `run`; the
runner calls them only for steps that `split` divided (runner_v2.ubatched_step).
"""

import numpy as np
import torch

import vllm.forward_context as forward_context_module
from vllm.afd.attention.pingpong import run_micro_batches
from vllm.afd.adapter.attention.runner import split_tokens
from vllm.afd.transport.device import DeviceContext
from vllm.config import CUDAGraphMode
from vllm.forward_context import create_forward_context
from vllm.v1.worker.gpu.attn_utils import build_slot_mappings_by_layer
from vllm.v1.worker.gpu.ubatch_utils import (
    UBatchState,
    _slice_input_batch,
    merge_ubatch_outputs,
    slice_model_inputs,
)
from vllm.v1.worker.ubatch_utils import UBatchSlice


class AFDUBatchRunner:
    """Micro-batches of one real step, ping-ponged with the FFN server."""

    def __init__(self, vllm_config, device: torch.device, model_state, attn_groups,
                 kv_cache_config, max_num_reqs: int) -> None:
        pc = vllm_config.parallel_config
        if pc.decode_context_parallel_size > 1:
            # compat.py refuses TP on the attention role, and DCP needs a TP group.
            raise ValueError("AFD micro-batches: decode context parallelism is not supported")
        self.vllm_config = vllm_config
        self.num_ubatches = vllm_config.afd_config.num_ubatches
        self.device = device
        self.model_state = model_state
        self.attn_groups = attn_groups
        self.kv_cache_config = kv_cache_config
        self.hybrid = bool(getattr(vllm_config.model_config, "is_hybrid", False))
        # A micro-batch's query_start_loc and seq_lens are rebased onto its own
        # tokens, so they are its own buffers (stable addresses, as V2's).
        self.query_start_loc = [torch.zeros(max_num_reqs + 1, dtype=torch.int32, device=device)
                                for _ in range(self.num_ubatches)]
        self.seq_lens = [torch.zeros(max_num_reqs, dtype=torch.int32, device=device)
                         for _ in range(self.num_ubatches)]
        self._slices: list[UBatchSlice] | None = None

    # ------------------------------------------------------------ the split
    def split(self, input_batch, rule) -> bool:
        """Choose this real step's micro-batches (rule: the link's UbatchRule,
        which also starts timing the step); False when it runs whole."""
        tokens = np.asarray(input_batch.num_scheduled_tokens[:input_batch.num_reqs])
        m = rule.choose(int(tokens.sum())) if rule is not None else self.num_ubatches
        slices = split_tokens(tokens, min(m, self.num_ubatches), whole_requests=self.hybrid)
        if slices is None:
            self._slices = None
            return False
        # The last micro-batch also takes the padding (the model is called
        # with num_tokens_after_padding rows).
        last = slices[-1]
        slices[-1] = UBatchSlice(
            slice(last.request_slice.start, input_batch.num_reqs_after_padding),
            slice(last.token_slice.start, input_batch.num_tokens_after_padding))
        self._slices = slices
        return True

    def prepare(self, input_batch, block_tables, slot_mappings, *graph_args,
                for_capture: bool = False, **graph_kwargs) -> UBatchState:
        """Each micro-batch's InputBatch, attention metadata and
        forward context. Micro-batched steps run eagerly, so what V2 passes
        about graphs (0.32: the graph mode; 0.34: the batch descriptor and the
        DP sync state) does not apply."""
        slices, self._slices = self._slices, None
        if slices is None:
            raise RuntimeError("AFD micro-batches: prepare() without a split() that split")
        contexts = []
        for i, s in enumerate(slices):
            ubatch = _slice_input_batch(input_batch, s, self.query_start_loc[i],
                                        self.seq_lens[i])
            ubatch_slot_mappings = slot_mappings[:, s.token_slice]
            metadata = self.model_state.prepare_attn(
                ubatch, CUDAGraphMode.NONE,
                tuple(bt[s.request_slice] for bt in block_tables),
                ubatch_slot_mappings, self.attn_groups, self.kv_cache_config,
                ubatch_idx=i, for_capture=for_capture)
            contexts.append(create_forward_context(
                metadata, self.vllm_config, cudagraph_runtime_mode=CUDAGraphMode.NONE,
                slot_mapping=build_slot_mappings_by_layer(ubatch_slot_mappings,
                                                          self.kv_cache_config),
                is_padding=ubatch.is_padding))
        return UBatchState(slices=slices, forward_contexts=contexts)

    # ------------------------------------------------------------------ run
    def run(self, model, model_inputs: dict, ubatch_state: UBatchState):
        """The model on every micro-batch, ping-ponged; outputs joined."""
        slices, contexts = ubatch_state.slices, ubatch_state.forward_contexts
        outer = forward_context_module._forward_context

        def on_turn(u: int) -> None:
            # Only the turn holder runs model code: vLLM's process-wide
            # forward context simply follows the turn.
            forward_context_module._forward_context = contexts[u]

        def run(u: int):
            return model(**slice_model_inputs(model_inputs, slices[u].token_slice))

        try:
            outputs = run_micro_batches(
                [s.num_tokens for s in slices], run,
                device=DeviceContext.current(self.vllm_config.device_config.device),
                on_turn=on_turn)
        finally:
            forward_context_module._forward_context = outer
        return merge_ubatch_outputs(outputs)
