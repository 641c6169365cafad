# SPDX-License-Identifier: Apache-2.0
# SPDX-FileCopyrightText: Copyright contributors to the vllm-afd project
"""Micro-batch ping-pong on the attention role (AFDConfig.num_ubatches > 1).

A step's tokens are split into m micro-batches (balanced by tokens, never
empty; a request may straddle two, as in vLLM's own dual-batch overlap). Each
micro-batch runs the whole model forward in its own thread with its own
forward context (attention metadata and slot mapping sliced by vLLM's
`split_attn_metadata`). The threads take turns, one at a time, in a ring:

    ubatch 0: attention L0 -> send (L0, 0) -> pass the turn
    ubatch 1: attention L0 -> send (L0, 1) -> pass the turn
    ubatch 0: receive (L0, 0) -> attention L1 -> send (L1, 0) -> pass the turn
    ubatch 1: receive (L0, 1) -> attention L1 -> ...

so the attention of one micro-batch runs while the FFN server computes the
mlp of the other, and frames leave and arrive in the order the connector
contract wants ((layer, ubatch) ascending). Only the thread holding the turn
runs model code, so the process-wide forward context is simply switched at
each hand-over.

Two seams in GPUModelRunner call in here: `maybe_ubatch_slices` after vLLM
decides its own micro-batching (vLLM then builds per-micro-batch attention
metadata and slot mappings itself), and `model_forward`, which runs the model
per micro-batch when the forward context carries slices.
"""

import queue
import threading
from collections.abc import Callable
from typing import Any

import numpy as np
import torch

import vllm.forward_context as forward_context_module
from vllm.config import CUDAGraphMode
from vllm.forward_context import create_forward_context, get_forward_context
from vllm.logger import init_logger
from vllm.sequence import IntermediateTensors
from vllm.v1.worker.ubatch_utils import UBatchSlice

logger = init_logger(__name__)

_tls = threading.local()  # .turn: (PingPong, ubatch id) while a ping-pong runs


def num_ubatches_for(vllm_config) -> int:
    afd = getattr(vllm_config, "afd_config", None)
    if afd is None or not afd.is_attention:
        return 1
    return afd.num_ubatches


def split_tokens(num_scheduled_tokens: np.ndarray, num_ubatches: int) -> list[UBatchSlice] | None:
    """Split a step's tokens into min(num_ubatches, tokens) contiguous
    micro-batches whose sizes differ by at most one; None when that is one."""
    total = int(num_scheduled_tokens.sum())
    m = min(num_ubatches, total)
    if m < 2:
        return None
    cu = np.zeros(len(num_scheduled_tokens) + 1, dtype=np.int64)
    np.cumsum(num_scheduled_tokens, out=cu[1:])
    bounds = [(i * total) // m for i in range(m + 1)]
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
    this is an attention role with num_ubatches > 1 (unchanged otherwise)."""
    m = num_ubatches_for(vllm_config)
    if m < 2 or ubatch_slices is not None:
        return ubatch_slices, ubatch_slices_padded
    slices = split_tokens(num_scheduled_tokens, m)
    if slices is None:
        return None, None
    last = slices[-1]
    padded = slices[:-1] + [UBatchSlice(slice(last.request_slice.start, num_reqs_padded),
                                        slice(last.token_slice.start, num_tokens_padded))]
    return slices, padded


def current_turn() -> "tuple[PingPong, int] | None":
    return getattr(_tls, "turn", None)


class PingPong:
    """The turn ring of one step's micro-batch threads."""

    def __init__(self, contexts: list, num_tokens: list[int]) -> None:
        self.contexts = contexts
        self.num_tokens = num_tokens
        self.num_ubatches = len(contexts)
        self.turn = 0
        self.done = [False] * self.num_ubatches
        self.error: BaseException | None = None
        self.cv = threading.Condition()

    def wait_turn(self, u: int) -> None:
        with self.cv:
            while self.turn != u and self.error is None:
                self.cv.wait()
            if self.error is not None:
                raise RuntimeError(f"AFD micro-batch {u} stopped: another micro-batch of "
                                   f"this step failed ({self.error!r})")
        forward_context_module._forward_context = self.contexts[u]

    def _pass_locked(self, u: int) -> None:
        m = self.num_ubatches
        for k in range(1, m + 1):
            nxt = (u + k) % m
            if not self.done[nxt]:
                self.turn = nxt
                break
        self.cv.notify_all()

    def yield_turn(self, u: int) -> None:
        """Let the next micro-batch run; return when it is u's turn again."""
        with self.cv:
            self._pass_locked(u)
        self.wait_turn(u)

    def finish(self, u: int, error: BaseException | None = None) -> None:
        with self.cv:
            self.done[u] = True
            if error is not None and self.error is None:
                self.error = error
            self._pass_locked(u)


class _Worker:
    """A persistent thread for micro-batches 1..m-1 (new threads would cost a
    fresh OpenMP team every step)."""

    def __init__(self, index: int) -> None:
        self.jobs: queue.SimpleQueue = queue.SimpleQueue()
        self.thread = threading.Thread(target=self._run, name=f"afd-ubatch-{index}",
                                       daemon=True)
        self.thread.start()

    def _run(self) -> None:
        while True:
            job = self.jobs.get()
            if job is None:
                return
            job()


_workers: list[_Worker] = []


def _worker(i: int) -> _Worker:
    while len(_workers) <= i:
        _workers.append(_Worker(len(_workers) + 1))
    return _workers[i]


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


def model_forward(vllm_config, model: Callable, input_ids=None, positions=None,
                  intermediate_tensors=None, inputs_embeds=None, **model_kwargs):
    """The runner's model call: per micro-batch, ping-ponged, when the forward
    context carries AFD micro-batch slices; a plain call otherwise."""
    ctx = get_forward_context()
    slices = ctx.ubatch_slices
    if slices is None or num_ubatches_for(vllm_config) < 2:
        return model(input_ids=input_ids, positions=positions,
                     intermediate_tensors=intermediate_tensors, inputs_embeds=inputs_embeds,
                     **model_kwargs)
    num_tokens = sum(s.num_tokens for s in slices)
    slot_mapping = ctx.slot_mapping if isinstance(ctx.slot_mapping, list) else None
    contexts = [
        create_forward_context(
            ctx.attn_metadata[i], vllm_config,
            cudagraph_runtime_mode=CUDAGraphMode.NONE,
            slot_mapping=slot_mapping[i] if slot_mapping else None,
            is_padding=(ctx.is_padding[s.token_slice] if ctx.is_padding is not None
                        else None),
            skip_compiled=ctx.skip_compiled)
        for i, s in enumerate(slices)
    ]
    pp = PingPong(contexts, [s.num_tokens for s in slices])
    results: list[Any] = [None] * len(slices)
    done = [threading.Event() for _ in slices]

    def run(u: int) -> None:
        s = slices[u].token_slice
        error = None
        _tls.turn = (pp, u)
        try:
            with torch.inference_mode():
                pp.wait_turn(u)
                results[u] = model(
                    input_ids=_slice_tokens(input_ids, s, num_tokens),
                    positions=_slice_tokens(positions, s, num_tokens),
                    intermediate_tensors=_slice_tokens(intermediate_tensors, s, num_tokens),
                    inputs_embeds=_slice_tokens(inputs_embeds, s, num_tokens),
                    **{k: _slice_tokens(v, s, num_tokens) for k, v in model_kwargs.items()})
        except BaseException as e:  # noqa: BLE001 - handed to the caller below
            error = e
        finally:
            _tls.turn = None
            pp.finish(u, error)
            done[u].set()

    for u in range(1, len(slices)):
        _worker(u - 1).jobs.put(lambda u=u: run(u))
    try:
        run(0)
        for event in done:
            event.wait()
    finally:
        forward_context_module._forward_context = ctx
    if pp.error is not None:
        raise pp.error
    if isinstance(results[0], tuple):  # e.g. (hidden, aux hidden states)
        return tuple(torch.cat(parts, dim=0) for parts in zip(*results))
    return torch.cat(results, dim=0)
