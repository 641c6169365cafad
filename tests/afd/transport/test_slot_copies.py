# SPDX-License-Identifier: Apache-2.0
# SPDX-FileCopyrightText: Copyright contributors to the vllm-afd project
"""How the shm lane copies payloads into slots (csrc/cpu/slot_copy.h): cached
or non-temporal (streamed) stores, chosen per direction by measuring the
sender's copy plus the receiver's read. Exact payloads whichever way; the
configured way honoured; the measured choice follows the cheaper way and a
change of it. Which way is faster on this host is `make bench-link`'s to say."""

import socket

import pytest
import torch

from vllm.afd.adapter.config import AFDConfig
from vllm.afd.transport import shm_ring
from vllm.afd.transport.connectors import create_connector
from vllm.afd.transport.connectors.prepared import frame_template
from vllm.afd.transport.wire import StepHeader
from helpers.connectors import Background, free_port
from helpers.pairs import echo

HIDDEN = 1000  # float32: 4000 bytes a token, so payloads are no multiple of 64 bytes
MIN_ADAPTIVE = 4096  # slot_copy.h kMinAdaptiveBytes
FIRST_SAMPLES = 4  # slot_copy.h kFirstSamples


def shm_pair(stream_copies: str):
    port = free_port()
    extra = {"stream_copies": stream_copies, "spin_us": 20_000}

    def make(role):
        cfg = AFDConfig(role=role, connector="shm", port=port, timeout_s=10,
                        connector_extra_config=extra)
        return create_connector(cfg, hidden_size=HIDDEN, dtype=torch.float32, max_tokens=8)

    ffn, attn = make("ffn"), make("attention")
    accepting = Background(ffn.accept)
    attn.connect()
    accepting.join_result()
    return ffn, attn


def unaligned(rows: int, g: torch.Generator) -> torch.Tensor:
    """A contiguous [rows, HIDDEN] tensor 4 bytes past a 16-byte boundary."""
    return torch.randn(rows * HIDDEN + 1, generator=g)[1:].view(rows, HIDDEN)


@pytest.mark.parametrize("stream_copies", ["auto", "on", "off"])
def test_payloads_arrive_exact_whichever_way_they_are_copied(stream_copies):
    """Both directions, the prepared calls and the one-message calls, payloads
    from under one cache line's worth past the adaptive minimum to a slot's
    size, from unaligned sources: every output exact. "on" streams every
    payload, "off" none, "auto" measures both ways (the receiver's reports
    reach the sender) and uses both."""
    ffn, attn = shm_pair(stream_copies)
    layers = 4
    server = Background(echo, ffn, layers)
    g = torch.Generator().manual_seed(0)
    try:
        for step, rows in enumerate([1, 3, 5, 8] * 6):
            attn.send_step(StepHeader(step_id=step + 1, num_tokens=[rows]))
            for layer in range(layers):
                h = unaligned(rows, g)
                out = torch.empty_like(h)
                attn.send_call(layer, 0, h)  # the C calls: the lane's copier
                assert attn.recv_call(layer, 0, out) is out
                assert torch.equal(out, h * 2 + layer), (stream_copies, rows, layer)
        assert attn.fast_calls > 0 and ffn.fast_calls > 0
        sides = {"attention": attn._streams[0].copy_stats, "ffn": ffn._streams[0].copy_stats}
    finally:
        attn.close()
        assert server.join_result() == 24
        ffn.close()
    for side, stats in sides.items():
        moved = stats["cached_bytes"] + stats["streamed_bytes"]
        assert moved == sum(r * HIDDEN * 4 for r in [1, 3, 5, 8] * 6) * layers, side
        if stream_copies == "on":
            assert stats["cached_bytes"] == 0, (side, stats)
        elif stream_copies == "off":
            assert stats["streamed_bytes"] == 0, (side, stats)
        else:
            # Payloads under the minimum go cached; the rest try both ways, and
            # the receiver's reports come back: costs for both.
            assert stats["cached_bytes"] > 0 and stats["streamed_bytes"] > 0, (side, stats)
            assert stats["cached_samples"] >= FIRST_SAMPLES, (side, stats)
            assert stats["streamed_samples"] >= FIRST_SAMPLES, (side, stats)
            assert stats["cached_ns_per_byte"] > 0 and stats["streamed_ns_per_byte"] > 0


def test_the_copier_uses_the_cheaper_way_and_follows_a_change():
    """One side's lane, its peer played here: after each payload it consumes
    the entry and reports a read time, short for one way of copying and long
    for the other (the copy of that payload is known from the lane's byte
    counts). The lane settles on the cheap way, trying the other now and then,
    and moves over when the costs swap."""
    C = shm_ring.lane_module()
    tx_region = torch.zeros(shm_ring.RING_BYTES, dtype=torch.uint8)
    rx_region = torch.zeros(shm_ring.RING_BYTES, dtype=torch.uint8)
    a, b = socket.socketpair()
    lane = C.lane_new(tx_region.data_ptr(), rx_region.data_ptr(), a.fileno(),
                      shm_ring.RING_ENTRIES, shm_ring.ENTRY_BYTES, shm_ring.COPY_POLICIES["auto"])
    rows = 16  # 64000 bytes
    encoded, step_at, layer_at, ubatch_at, nbytes = frame_template(torch.float32, rows, HIDDEN)
    src = torch.randn(rows, HIDDEN)
    slot = torch.empty(nbytes, dtype=torch.uint8)
    tail = tx_region[128:132].view(torch.int32)
    seq_word = tx_region[192:196].view(torch.int32)
    read_ns = tx_region[200:208].view(torch.int64)
    read_bytes = tx_region[208:216].view(torch.int64)

    def run(posts: int, cheap: str) -> list[str]:
        ways = []
        for _ in range(posts):
            before = C.lane_copy_stats(lane)[:2]
            assert C.lane_send_frame(lane, encoded, step_at, layer_at, ubatch_at, 1, 0, 0,
                                     src.data_ptr(), slot.data_ptr(), nbytes) == 0
            after = C.lane_copy_stats(lane)[:2]
            way = "cached" if after[0] > before[0] else "streamed"
            assert after[1 if way == "cached" else 0] == before[1 if way == "cached" else 0]
            ways.append(way)
            sent = C.lane_counters(lane)[0]
            assert torch.equal(slot.view(torch.float32).view(rows, HIDDEN), src)
            tail[0] = sent  # consumed
            read_ns[0] = 1_000 if way == cheap else 10_000_000
            read_bytes[0] = nbytes
            seq_word[0] = sent  # 1 + the entry's sequence number (sent - 1)
        return ways

    try:
        first = run(200, cheap="streamed")
        assert first[:2 * FIRST_SAMPLES].count("cached") == FIRST_SAMPLES  # both tried first
        settled = first[-150:]
        assert settled.count("streamed") >= 140, settled.count("streamed")
        assert "cached" in settled  # the other way is still tried now and then
        second = run(200, cheap="cached")
        assert second[-150:].count("cached") >= 140, second[-150:].count("cached")
        stats = C.lane_copy_stats(lane)
        assert stats[2] < stats[3]  # cached now the cheaper per byte
    finally:
        a.close()
        b.close()


def test_payloads_under_the_minimum_are_copied_through_the_caches():
    """A few cache lines are not worth measuring: under kMinAdaptiveBytes an
    "auto" lane never streams, while "on" does."""
    C = shm_ring.lane_module()
    a, b = socket.socketpair()
    rows, hidden = 1, 1000
    encoded, step_at, layer_at, ubatch_at, nbytes = frame_template(torch.float32, rows, hidden)
    assert nbytes < MIN_ADAPTIVE
    src, slot = torch.randn(rows, hidden), torch.empty(nbytes, dtype=torch.uint8)
    try:
        for policy, streamed in (("auto", 0), ("on", 20 * nbytes)):
            tx = torch.zeros(shm_ring.RING_BYTES, dtype=torch.uint8)
            rx = torch.zeros(shm_ring.RING_BYTES, dtype=torch.uint8)
            lane = C.lane_new(tx.data_ptr(), rx.data_ptr(), a.fileno(), shm_ring.RING_ENTRIES,
                              shm_ring.ENTRY_BYTES, shm_ring.COPY_POLICIES[policy])
            for i in range(20):
                assert C.lane_send_frame(lane, encoded, step_at, layer_at, ubatch_at, 1, i, 0,
                                         src.data_ptr(), slot.data_ptr(), nbytes) == 0
                assert torch.equal(slot.view(torch.float32).view(rows, hidden), src)
                tx[128:132].view(torch.int32)[0] = i + 1  # consumed
            assert C.lane_copy_stats(lane)[1] == streamed, policy
    finally:
        a.close()
        b.close()


def test_an_unknown_copy_policy_is_refused_with_the_choices():
    with pytest.raises(ValueError, match="stream_copies.*'fast'.*'auto', 'off', 'on'"):
        create_connector(AFDConfig(role="ffn", connector="shm", port=free_port(),
                                   connector_extra_config={"stream_copies": "fast"}),
                         hidden_size=HIDDEN, dtype=torch.float32, max_tokens=8)
    C = shm_ring.lane_module()
    with pytest.raises(ValueError, match="copy_policy"):
        C.lane_new(0, 0, -1, shm_ring.RING_ENTRIES, shm_ring.ENTRY_BYTES, 3)


def test_a_streamed_copy_is_exact_at_any_alignment_and_length():
    """Streamed stores need 16-byte aligned destinations: an unaligned head and
    a tail shorter than 16 bytes go the ordinary way, and nothing around the
    destination is touched."""
    C = shm_ring.lane_module()
    a, b = socket.socketpair()
    encoded, step_at, layer_at, ubatch_at, _ = frame_template(torch.float32, 1, 8)
    tx = torch.zeros(shm_ring.RING_BYTES, dtype=torch.uint8)
    rx = torch.zeros(shm_ring.RING_BYTES, dtype=torch.uint8)
    lane = C.lane_new(tx.data_ptr(), rx.data_ptr(), a.fileno(), shm_ring.RING_ENTRIES,
                      shm_ring.ENTRY_BYTES, shm_ring.COPY_POLICIES["on"])
    g = torch.Generator().manual_seed(1)
    src = torch.randint(0, 256, (9000,), dtype=torch.uint8, generator=g)
    streamed = 0
    try:
        for k, (src_at, dst_at, n) in enumerate([(0, 0, 1), (1, 3, 15), (0, 7, 16), (5, 1, 17),
                                                  (3, 9, 63), (0, 0, 64), (2, 15, 65),
                                                  (1, 8, 4093), (0, 12, 8191)]):
            dst = torch.full((8400,), 0xA5, dtype=torch.uint8)
            assert C.lane_send_frame(lane, encoded, step_at, layer_at, ubatch_at, 1, k, 0,
                                     src.data_ptr() + src_at, dst.data_ptr() + dst_at, n) == 0
            tx[128:132].view(torch.int32)[0] = k + 1  # consumed
            assert torch.equal(dst[dst_at:dst_at + n], src[src_at:src_at + n]), (src_at, dst_at, n)
            assert bool((dst[:dst_at] == 0xA5).all()) and bool((dst[dst_at + n:] == 0xA5).all())
            streamed += n
        assert C.lane_copy_stats(lane)[:2] == (0, streamed)
    finally:
        a.close()
        b.close()
