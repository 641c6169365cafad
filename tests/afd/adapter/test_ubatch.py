# SPDX-License-Identifier: Apache-2.0
# SPDX-FileCopyrightText: Copyright contributors to the vllm-afd project
"""Micro-batch splitting and the ping-pong turn ring (vllm/afd/adapter/attention/runner.py,
vllm/afd/attention/pingpong.py).

The end-to-end proof (identical tokens with m = 2, 3, 4, eager and compiled)
is in test_oracle.py; these check the pieces in isolation: balanced, never
empty splits with the right request ranges, and the frame order the turn
ring produces with real threads.
"""

import threading

import numpy as np
import pytest

from vllm.afd.attention.pingpong import PingPong
from vllm.afd.adapter.attention.runner import maybe_ubatch_slices, split_tokens


@pytest.mark.parametrize("tokens, m", [([1] * 32, 2), ([5, 1, 1, 30], 3), ([64], 4),
                                       ([3, 4], 4), ([1, 1, 1], 4), ([7, 1, 9, 2, 11], 3)])
def test_split_is_balanced_contiguous_and_never_empty(tokens, m):
    counts = np.array(tokens, dtype=np.int32)
    slices = split_tokens(counts, m)
    total = sum(tokens)
    assert len(slices) == min(m, total)
    sizes = [s.num_tokens for s in slices]
    assert min(sizes) >= 1 and max(sizes) - min(sizes) <= 1
    assert slices[0].token_slice.start == 0 and slices[-1].token_slice.stop == total
    cu = np.concatenate([[0], np.cumsum(counts)])
    for a, b in zip(slices, slices[1:]):
        assert a.token_slice.stop == b.token_slice.start
    for s in slices:
        # Exactly the requests that own a token of this slice.
        owners = {int(np.searchsorted(cu, t, side="right") - 1)
                  for t in range(s.token_slice.start, s.token_slice.stop)}
        assert set(range(s.request_slice.start, s.request_slice.stop)) == owners


def test_one_token_or_one_ubatch_is_not_split():
    assert split_tokens(np.array([1]), 4) is None
    assert split_tokens(np.array([5, 5]), 1) is None


@pytest.mark.parametrize("tokens, m, sizes", [
    ([1] * 8, 2, [4, 4]),            # decodes: the even split is already on edges
    ([3, 4], 4, [3, 4]),              # two requests: two micro-batches at most
    ([5, 1, 1, 30], 3, [7, 30]),      # 12 moves to 7, 24 to the end: two
    ([7, 1, 9, 2, 11], 3, [8, 11, 11]),
    ([2, 20], 2, [2, 20]),            # vLLM's own split would cut the prefill
])
def test_hybrid_models_split_between_requests_only(tokens, m, sizes):
    """Recurrent layers (hybrid models) need each request whole in one
    micro-batch: the boundaries move to the nearest request edge."""
    counts = np.array(tokens, dtype=np.int32)
    slices = split_tokens(counts, m, whole_requests=True)
    assert [s.num_tokens for s in slices] == sizes
    cu = list(np.concatenate([[0], np.cumsum(counts)]))
    for s in slices:
        assert s.token_slice.start in cu and s.token_slice.stop in cu
        assert cu.index(s.token_slice.start) == s.request_slice.start
        assert cu.index(s.token_slice.stop) == s.request_slice.stop
    assert split_tokens(np.array([64]), 4, whole_requests=True) is None


def test_micro_batch_metadata_keeps_which_requests_are_prefilling():
    """patches/fix_ubatch_slice_keeps_is_prefilling.patch: vLLM's slicing into
    micro-batches keeps is_prefilling, by which the Gated DeltaNet and Mamba
    builders zero a new prompt's recurrent state (a one-token prompt otherwise
    counts as a decode and reads its slot's stale state)."""
    import torch

    from vllm.v1.attention.backend import CommonAttentionMetadata
    from vllm.v1.worker.ubatch_utils import split_attn_metadata

    query_lens, seq_lens = [1, 1, 1, 5], [9, 1, 4, 5]  # a decode, a 1-token prompt, ...
    qsl = torch.tensor(np.concatenate([[0], np.cumsum(query_lens)]), dtype=torch.int32)
    prefilling = torch.tensor([False, True, False, True])
    metadata = CommonAttentionMetadata(
        query_start_loc=qsl, query_start_loc_cpu=qsl.clone(),
        seq_lens=torch.tensor(seq_lens, dtype=torch.int32), num_reqs=4, num_actual_tokens=8,
        max_query_len=5, max_seq_len=9, block_table_tensor=torch.zeros(4, 1, dtype=torch.int32),
        slot_mapping=torch.arange(8), seq_lens_cpu_upper_bound=torch.tensor(seq_lens),
        is_prefilling=prefilling)
    slices = split_tokens(np.array(query_lens), 2, whole_requests=True)
    ubatches = split_attn_metadata(slices, metadata)
    assert [u.is_prefilling.tolist() for u in ubatches] == [[False, True, False], [True]]


class _Cfg:
    class afd_config:  # noqa: N801 - stands in for AFDConfig
        is_attention = True
        num_ubatches = 2


def test_runner_keeps_requests_whole_for_hybrid_models():
    class Hybrid(_Cfg):
        class model_config:  # noqa: N801 - stands in for ModelConfig
            is_hybrid = True
    counts = np.array([2, 20], dtype=np.int32)
    plain, _ = maybe_ubatch_slices(_Cfg, counts, 22, 2, None, None)
    hybrid, _ = maybe_ubatch_slices(Hybrid, counts, 22, 2, None, None)
    assert [s.num_tokens for s in plain] == [11, 11]
    assert [s.num_tokens for s in hybrid] == [2, 20]


def test_runner_slices_only_for_attention_with_ubatches():
    counts = np.array([3, 3], dtype=np.int32)
    slices, padded = maybe_ubatch_slices(_Cfg, counts, 8, 3, None, None)
    assert [s.num_tokens for s in slices] == [3, 3]
    assert [s.num_tokens for s in padded] == [3, 5]  # padding goes to the last one
    assert padded[-1].request_slice == slice(1, 3)

    class Plain:
        afd_config = None
    assert maybe_ubatch_slices(Plain, counts, 6, 2, None, None) == (None, None)
    theirs = (["vLLM's own"], ["vLLM's own"])
    assert maybe_ubatch_slices(_Cfg, counts, 6, 2, *theirs) == theirs


@pytest.mark.parametrize("m", [2, 3, 4])
def test_turn_ring_orders_frames_layer_by_layer(m):
    """m threads, 3 'layers' each: every send happens in (layer, ubatch)
    order and each receive follows all sends of its layer, as the connector
    contract needs."""
    current = []  # what follows the turn (vLLM's forward context, in the runner)
    pp = PingPong([1] * m, on_turn=current.append)
    log, lock = [], threading.Lock()

    def run(u):
        pp.wait_turn(u)
        for layer in range(3):
            assert current[-1] == u
            with lock:
                log.append(("send", layer, u))
            pp.yield_turn(u)
            with lock:
                log.append(("recv", layer, u))
        pp.finish(u)

    threads = [threading.Thread(target=run, args=(u,)) for u in range(m)]
    for t in threads:
        t.start()
    for t in threads:
        t.join(10)
    sends = [(layer, u) for kind, layer, u in log if kind == "send"]
    recvs = [(layer, u) for kind, layer, u in log if kind == "recv"]
    assert sends == sorted(sends) and recvs == sorted(recvs)
    for layer in range(3):
        last_send = log.index(("send", layer, m - 1))
        assert all(log.index(("recv", layer, u)) > last_send for u in range(m))


def test_a_failing_ubatch_stops_the_others():
    pp = PingPong([1, 1])
    errors = []

    def second():
        try:
            pp.wait_turn(1)
        except RuntimeError as e:
            errors.append(str(e))

    t = threading.Thread(target=second)
    t.start()
    pp.wait_turn(0)
    pp.finish(0, ValueError("FFN gone"))
    t.join(10)
    # Micro-batch 1 waits for its turn; it gets it, with the failure: it must
    # stop rather than run (its peer's frames are out of order by now).
    assert len(errors) == 1 and "another micro-batch of this step failed" in errors[0]
    assert "FFN gone" in errors[0]
    assert not t.is_alive()
