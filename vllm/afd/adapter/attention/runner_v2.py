# SPDX-License-Identifier: Apache-2.0
# SPDX-FileCopyrightText: Copyright contributors to the vllm-afd project
"""The attention role inside vLLM's Model Runner V2 (adapter).

V2 names every forward pass itself, so the link is told, never left to guess:

- `execute_model` runs real steps and, with dummy_run=True, the profile run
  (is_profile) and warm-up batches. `in_step_scope` wraps the whole call; the
  step begins in `begin_step`, where the runner has prepared its inputs and
  knows the tokens per micro-batch, and ends when the method returns (failed
  when it raised, so the FFN server is told the step was abandoned).
- `capture_model` is one CUDA-graph capture: `in_capture_scope` makes all of it a
  capture run, including the dummy runs it makes inside (a profile, capture or
  warm-up run never sends a frame and never waits for an FFN server).

With num_ubatches > 1 the runner gets AFD's micro-batch runner
(attention/ubatches_v2.py) in place of V2's dual-batch-overlap one, and
`ubatched_step` lets it split a real step. V2 builds the attention metadata
of each micro-batch itself (`prepare_attn(..., ubatch_idx=i)`), which V1 did
not (its metadata cache needed a fix patch).
"""

import threading
from collections.abc import Callable
from typing import Any

from vllm.afd.attention.link import CAPTURE, PROFILE, REAL, WARMUP, ForwardPass
from vllm.afd.adapter.attention.runner import _attention_link, num_ubatches_for
from vllm.afd.transport.device import DeviceContext

_tls = threading.local()  # .began: this thread's step scope began a step of the link


def in_step_scope(method: Callable, runner, *args, **kwargs):
    """GPUModelRunner.execute_model (V2), called: a step begun inside the call
    (begin_step) ends with it, as failed when the call raised."""
    link = _attention_link(runner.vllm_config)
    if link is None:
        return method(runner, *args, **kwargs)
    outer, _tls.began = getattr(_tls, "began", False), False
    failed = True
    try:
        out = method(runner, *args, **kwargs)
        failed = False
        return out
    finally:
        if _tls.began:
            link.end_step(failed=failed)
        _tls.began = outer


def in_capture_scope(method: Callable, runner, *args, **kwargs):
    """GPUModelRunner.capture_model (V2), called: all of it is a capture run,
    the dummy runs it makes inside included."""
    link = _attention_link(runner.vllm_config)
    if link is None or link.forward_pass is not None:
        return method(runner, *args, **kwargs)
    link.begin_step(ForwardPass(kind=CAPTURE))
    try:
        return method(runner, *args, **kwargs)
    finally:
        link.end_step()


def begin_step(vllm_config, dummy_run: bool, is_profile: bool, input_batch: Any,
               ubatch_state: Any) -> None:
    """execute_model, inputs prepared, just before the model runs: begin the
    link's step (the model is called with the batch's tokens after padding;
    ubatch_state: the micro-batches AFD's runner prepared, or None)."""
    link = _attention_link(vllm_config)
    if link is None or link.forward_pass is not None:  # inside capture_model's capture run
        return
    if dummy_run:
        forward = ForwardPass(kind=PROFILE if is_profile else WARMUP)
    else:
        tokens = (tuple(s.num_tokens for s in ubatch_state.slices)
                  if ubatch_state is not None else (input_batch.num_tokens_after_padding,))
        forward = ForwardPass(num_tokens=tokens, kind=REAL,
                              device=DeviceContext.current(vllm_config.device_config.device))
    link.begin_step(forward)
    _tls.began = True


def build_ubatch_runner(vllm_config, device, model_state, attn_groups, kv_cache_config,
                        max_num_reqs: int):
    """AFD's micro-batch runner for an attention role with num_ubatches > 1
    (else None: vLLM builds its own, or none)."""
    if num_ubatches_for(vllm_config) < 2:
        return None
    from vllm.afd.adapter.attention.ubatches_v2 import AFDUBatchRunner

    return AFDUBatchRunner(vllm_config, device, model_state, attn_groups, kv_cache_config,
                           max_num_reqs)


def ubatched_step(vllm_config, ubatch_runner, input_batch, dummy_run: bool) -> bool:
    """Whether this step runs as AFD micro-batches: a real step the link's
    micro-batch rule splits in more than one (AFD's runner keeps the slices
    for its prepare). Dummy runs are never split."""
    from vllm.afd.adapter.attention.ubatches_v2 import AFDUBatchRunner

    if dummy_run or not isinstance(ubatch_runner, AFDUBatchRunner):
        return False
    link = _attention_link(vllm_config)
    rule = link.ubatch_rule if link is not None else None
    return ubatch_runner.split(input_batch, rule)
