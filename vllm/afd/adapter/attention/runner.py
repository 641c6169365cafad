# SPDX-License-Identifier: Apache-2.0
# SPDX-FileCopyrightText: Copyright contributors to the vllm-afd project
"""The attention role inside vLLM's model runner (adapter).

The runner names every forward pass and drives the data plane's link through
its step API (attention/link.py):

- `model_forward` (execute_model's model call) is a real step: its tokens per
  micro-batch come from the slices `maybe_ubatch_slices` chose, the device and
  stream are the runner's. With m > 1 micro-batches each runs the whole model
  in its own thread, ping-ponged (attention/pingpong.py), each with its own
  forward context (attention metadata and slot mapping sliced by vLLM, as for
  its dual-batch overlap).
- `dummy_step` (around `_dummy_run`'s model call) names profile, warm-up and
  capture runs: they never touch the link and never wait for an FFN.

It also owns the process's one AttentionLink, built from the VllmConfig.
"""

import atexit
import contextlib
import threading
from collections.abc import Callable, Iterator
from typing import Any

import numpy as np
import torch

import vllm.forward_context as forward_context_module
from vllm.afd.attention.link import CAPTURE, PROFILE, REAL, WARMUP, AttentionLink, ForwardPass
from vllm.afd.attention.pingpong import run_micro_batches
from vllm.afd.attention.ubatch_rule import UbatchRule
from vllm.afd.transport.device import DeviceContext
from vllm.config import CUDAGraphMode
from vllm.forward_context import create_forward_context, get_forward_context
from vllm.logger import init_logger
from vllm.sequence import IntermediateTensors
from vllm.v1.worker.ubatch_utils import UBatchSlice

logger = init_logger(__name__)

_link: AttentionLink | None = None
_link_lock = threading.Lock()


# ------------------------------------------------------------------- the link
def get_or_create_link(vllm_config) -> AttentionLink:
    """The process's attention link (one per process, shared by every RemoteFFN)."""
    global _link
    with _link_lock:
        if _link is None:
            from vllm.afd.adapter.model.fingerprint import model_fingerprint
            from vllm.afd.adapter.nccl_factory import connector_kwargs
            from vllm.afd.topology import attention_rank

            afd, mc = vllm_config.afd_config, vllm_config.model_config
            _link = AttentionLink(
                afd.link_config(), hidden_size=mc.get_hidden_size(), dtype=mc.dtype,
                max_tokens=vllm_config.scheduler_config.max_num_batched_tokens,
                rank=attention_rank(vllm_config), fingerprint=model_fingerprint(vllm_config),
                device=DeviceContext.current(vllm_config.device_config.device),
                connector_kwargs=connector_kwargs(afd.connector),
                ubatch_rule=UbatchRule(afd.num_ubatches, afd.ubatch_policy))
            # Say goodbye at exit, so the FFN server knows the peer left on purpose.
            atexit.register(_link.close)
        return _link


def install_link(link: AttentionLink) -> None:
    """Make `link` this process's link, for a process that builds its own
    (benchmarks/layer_call.py drives RemoteFFN modules without an engine)."""
    global _link
    with _link_lock:
        if _link is not None and _link is not link:
            raise RuntimeError("AFD: this process already has an attention link")
        _link = link


def close_link() -> None:
    """Close and forget this process's link: an engine started after this one
    in the same process (tools/models/oracle.py --matrix) links anew."""
    global _link
    with _link_lock:
        link, _link = _link, None
    if link is not None:
        link.close()
        atexit.unregister(link.close)


def get_link() -> AttentionLink:
    if _link is None:
        raise RuntimeError("AFD: no attention link in this process (model not built "
                           "with --afd-role attention?)")
    return _link


def _attention_link(vllm_config) -> AttentionLink | None:
    afd = getattr(vllm_config, "afd_config", None)
    if afd is None or not afd.is_attention:
        return None
    return _link


# ------------------------------------------------------------- micro-batches
def num_ubatches_for(vllm_config) -> int:
    afd = getattr(vllm_config, "afd_config", None)
    if afd is None or not afd.is_attention:
        return 1
    return afd.num_ubatches


def split_tokens(num_scheduled_tokens: np.ndarray, num_ubatches: int,
                 whole_requests: bool = False) -> list[UBatchSlice] | None:
    """Split a step's tokens into min(num_ubatches, tokens) contiguous
    micro-batches whose sizes differ by at most one; None when that is one.

    whole_requests: never split a request's tokens between micro-batches; each
    boundary moves to the nearest request edge (fewer micro-batches when two
    meet). Layers with recurrent state (the Gated DeltaNet or Mamba layers of a
    hybrid model) need it: a request cut in two would run its recurrence in
    two pieces, which rounds differently from plain vLLM's one."""
    total = int(num_scheduled_tokens.sum())
    m = min(num_ubatches, total)
    if m < 2:
        return None
    cu = np.zeros(len(num_scheduled_tokens) + 1, dtype=np.int64)
    np.cumsum(num_scheduled_tokens, out=cu[1:])
    bounds = [(i * total) // m for i in range(m + 1)]
    if whole_requests:
        edges = {int(min(cu, key=lambda edge: (abs(int(edge) - b), int(edge))))
                 for b in bounds[1:-1]}
        bounds = sorted(edges | {0, total})
        if len(bounds) < 3:
            return None
    slices = []
    for start, end in zip(bounds[:-1], bounds[1:]):
        # Requests overlapping [start, end): the one holding `start` up to the
        # first that starts at or after `end` (exclusive).
        first = int(np.searchsorted(cu, start, side="right") - 1)
        stop = int(np.searchsorted(cu, end, side="left"))
        slices.append(UBatchSlice(slice(first, stop), slice(start, end)))
    return slices


def maybe_ubatch_slices(vllm_config, num_scheduled_tokens: np.ndarray, num_tokens_padded: int,
                        num_reqs_padded: int, ubatch_slices, ubatch_slices_padded):
    """The runner's (ubatch_slices, ubatch_slices_padded), split for AFD when
    this is an attention role with num_ubatches > 1 (unchanged otherwise).
    Only execute_model calls this (real steps): the link's UbatchRule picks
    the count and times the step from here to the end of the model forward,
    metadata builds included."""
    m = num_ubatches_for(vllm_config)
    if m < 2 or ubatch_slices is not None:
        return ubatch_slices, ubatch_slices_padded
    link = _attention_link(vllm_config)
    if link is not None and link.ubatch_rule is not None:
        m = link.ubatch_rule.choose(int(num_scheduled_tokens.sum()))
    model_config = getattr(vllm_config, "model_config", None)
    slices = split_tokens(num_scheduled_tokens, m,
                          whole_requests=bool(getattr(model_config, "is_hybrid", False)))
    if slices is None:
        return None, None
    last = slices[-1]
    padded = slices[:-1] + [UBatchSlice(slice(last.request_slice.start, num_reqs_padded),
                                        slice(last.token_slice.start, num_tokens_padded))]
    return slices, padded


def _slice_tokens(x: Any, token_slice: slice, num_tokens: int) -> Any:
    if isinstance(x, torch.Tensor):
        if x.ndim == 2 and x.shape[0] != num_tokens and x.shape[1] == num_tokens:
            return x[:, token_slice]  # M-RoPE positions: (3, tokens)
        if x.ndim >= 1 and x.shape[0] == num_tokens:
            return x[token_slice]
        return x
    if isinstance(x, IntermediateTensors):
        return x[token_slice]
    return x


def _tokens_of(input_ids, positions, inputs_embeds) -> int:
    for x in (input_ids, inputs_embeds):
        if isinstance(x, torch.Tensor):
            return x.shape[0]
    return positions.shape[-1]


# ------------------------------------------------------------------ the step
def model_forward(vllm_config, model: Callable, input_ids=None, positions=None,
                  intermediate_tensors=None, inputs_embeds=None, **model_kwargs):
    """execute_model's model call. On the attention role: one real step of
    the link, per micro-batch and ping-ponged when the forward context carries
    AFD micro-batch slices; elsewhere the plain call."""
    link = _attention_link(vllm_config)
    if link is None:
        return model(input_ids=input_ids, positions=positions,
                     intermediate_tensors=intermediate_tensors, inputs_embeds=inputs_embeds,
                     **model_kwargs)
    ctx = get_forward_context()
    slices = ctx.ubatch_slices if num_ubatches_for(vllm_config) > 1 else None
    num_tokens = _tokens_of(input_ids, positions, inputs_embeds)
    tokens = tuple(s.num_tokens for s in slices) if slices else (num_tokens,)
    forward = ForwardPass(num_tokens=tokens, kind=REAL,
                          device=DeviceContext.current(vllm_config.device_config.device))

    def run():
        if slices is None:
            return model(input_ids=input_ids, positions=positions,
                         intermediate_tensors=intermediate_tensors,
                         inputs_embeds=inputs_embeds, **model_kwargs)
        return _ping_pong(vllm_config, model, ctx, slices, forward, input_ids, positions,
                          intermediate_tensors, inputs_embeds, model_kwargs)

    # A step its connector aborted runs again whole (link.run_step): the same
    # inputs, the same KV cache entries written again.
    return link.run_step(forward, run)


def _ping_pong(vllm_config, model, ctx, slices, forward: ForwardPass, input_ids, positions,
               intermediate_tensors, inputs_embeds, model_kwargs):
    num_tokens = sum(s.num_tokens for s in slices)
    slot_mapping = ctx.slot_mapping if isinstance(ctx.slot_mapping, list) else None
    contexts = [
        create_forward_context(
            ctx.attn_metadata[i], vllm_config,
            cudagraph_runtime_mode=CUDAGraphMode.NONE,  # micro-batched steps stay eager
            slot_mapping=slot_mapping[i] if slot_mapping else None,
            is_padding=(ctx.is_padding[s.token_slice] if ctx.is_padding is not None
                        else None),
            skip_compiled=ctx.skip_compiled)
        for i, s in enumerate(slices)
    ]

    def on_turn(u: int) -> None:
        # Only the turn holder runs model code: vLLM's process-wide forward
        # context simply follows the turn.
        forward_context_module._forward_context = contexts[u]

    def run(u: int):
        s = slices[u].token_slice
        return model(
            input_ids=_slice_tokens(input_ids, s, num_tokens),
            positions=_slice_tokens(positions, s, num_tokens),
            intermediate_tensors=_slice_tokens(intermediate_tensors, s, num_tokens),
            inputs_embeds=_slice_tokens(inputs_embeds, s, num_tokens),
            **{k: _slice_tokens(v, s, num_tokens) for k, v in model_kwargs.items()})

    try:
        results = run_micro_batches(list(forward.num_tokens), run, device=forward.device,
                                    on_turn=on_turn)
    finally:
        forward_context_module._forward_context = ctx
    if isinstance(results[0], tuple):  # e.g. (hidden, aux hidden states)
        return tuple(torch.cat(parts, dim=0) for parts in zip(*results))
    return torch.cat(results, dim=0)


@contextlib.contextmanager
def dummy_step(vllm_config, is_profile: bool, is_graph_capturing: bool) -> Iterator[None]:
    """_dummy_run's model call, named: a profile, capture or warm-up run."""
    link = _attention_link(vllm_config)
    if link is None:
        yield
        return
    kind = PROFILE if is_profile else CAPTURE if is_graph_capturing else WARMUP
    link.begin_step(ForwardPass(kind=kind))
    try:
        yield
    finally:
        link.end_step()
