# SPDX-License-Identifier: Apache-2.0
# SPDX-FileCopyrightText: Copyright contributors to the vllm-afd project
"""The workers of a tensor/expert-parallel FFN server serving several
attention peers make the same mlp calls in the same order: the lead's
LayerBatcher decides and sends orders, the followers' run exactly those
(vllm/afd/ffn/orders.py). Data plane only, in one process: the real servers are
in test_topology.py (test_one_attention_two_ffn_ranks, tp)."""

import random
import threading
import time

import pytest
import torch

from servers import free_port

from vllm.afd.ffn.batcher import LayerBatcher
from vllm.afd.ffn.orders import OrderError, QueueChannel

HIDDEN = 4


class _Recorder:
    """An mlp that records (layer, rows) of each call: rows identify the
    peers' tokens, so equal records mean equal mlp calls."""

    def __init__(self) -> None:
        self.calls: list[tuple[int, tuple]] = []
        self.lock = threading.Lock()

    partner: "_Recorder | None" = None  # see meet()

    def __call__(self, layer, x, routing=None):
        with self.lock:
            self.calls.append((layer, tuple(x[:, 0].tolist())))
        time.sleep(random.random() * 0.002)  # the mlp takes a while
        self.meet()
        return x * 2 + layer

    def meet(self, timeout_s: float = 10.0) -> None:
        """With a partner (the other worker of a group): return only once it
        made this many calls too, as vLLM's collectives inside a real mlp make
        the workers meet. Without it the lead could answer, and the attention
        side send the next layer into the slot a lagging follower has yet to
        read (shm hands the FFN a view of its slot)."""
        if self.partner is None:
            return
        n, deadline = len(self.calls), time.monotonic() + timeout_s
        while len(self.partner.calls) < n and time.monotonic() < deadline:
            time.sleep(0.0005)


def _pair(max_tokens=8, timeout_s=10.0, window_s=0.003):
    channel = QueueChannel()
    lead_mlp, follower_mlp = _Recorder(), _Recorder()
    lead = LayerBatcher(lead_mlp, max_tokens=max_tokens, window_s=window_s, role="lead",
                        orders=channel, timeout_s=timeout_s)
    follower = LayerBatcher(follower_mlp, max_tokens=max_tokens, role="follower",
                            orders=channel.end(), timeout_s=timeout_s)
    return lead, follower, lead_mlp, follower_mlp


def _rows(peer, step, layer, n):
    rows = torch.arange(n, dtype=torch.float32) + 1000 * peer + 100 * step + 10 * layer
    return rows[:, None].repeat(1, HIDDEN)


def test_follower_makes_the_leads_mlp_calls_in_its_order():
    """Three peers, each on its own thread per worker (as their sessions are),
    with random delays and sizes: some of their calls are batched together,
    some split by max_tokens, some alone (the lead's window ran out); the
    follower's mlp calls are the lead's, call for call, and every peer gets
    its own rows' output on both."""
    # The first step starts in lockstep on each side (as vLLM's data-parallel
    # ranks do) and the lead waits up to 50 ms for the others, so some calls
    # are joined however slowly a loaded machine runs the threads (with 3 ms
    # and no lockstep, once none of 54 were).
    lead, follower, lead_mlp, follower_mlp = _pair(window_s=0.05)
    steps, layers, peers = 6, 3, (0, 1, 2)
    sizes = {p: [random.Random(p * 100 + s).randint(1, 6) for s in range(steps)]
             for p in peers}
    errors = []
    lockstep = {id(b): threading.Barrier(len(peers)) for b in (lead, follower)}

    def session(batcher, peer, seed):
        rnd = random.Random(seed)
        try:
            for step in range(steps):
                batcher.begin(peer)
                if step == 0:
                    lockstep[id(batcher)].wait(30)
                for layer in range(layers):
                    time.sleep(rnd.random() * 0.004)
                    h = _rows(peer, step, layer, sizes[peer][step])
                    out = batcher.compute(layer, h, peer)
                    assert torch.equal(out, h * 2 + layer), (peer, step, layer)
                batcher.end(peer)
                time.sleep(rnd.random() * 0.004)
            batcher.leave(peer)
        except BaseException as e:  # noqa: BLE001 - reported below
            errors.append((peer, repr(e)))

    threads = [threading.Thread(target=session, args=(b, p, 10 * p + i))
               for p in peers for i, b in enumerate((lead, follower))]
    for t in threads:
        t.start()
    for t in threads:
        t.join(60)
    assert not errors, errors
    assert len(lead_mlp.calls) >= layers * steps
    assert follower_mlp.calls == lead_mlp.calls
    assert lead.calls == follower.calls == len(peers) * steps * layers
    assert lead.largest <= 8 and follower.largest <= 8
    assert lead.batches < lead.calls  # some calls of several peers were joined
    lead.close()
    follower.receiver.join(5)
    assert not follower.receiver.is_alive()  # the lead's stop ended it


def test_a_call_unlike_the_plan_is_an_error_naming_both():
    channel = QueueChannel()
    follower = LayerBatcher(lambda layer, x: x, max_tokens=8, role="follower",
                            orders=channel.end(), timeout_s=5)
    channel.send(["batch", [[1, [[0, 3]]]]])
    with pytest.raises(OrderError, match=r"the lead ordered layer 1 with 3 token\(s\) of "
                                        r"attention rank 0, but this worker has layer 1 "
                                        r"with 4 token\(s\)"):
        follower.compute(1, torch.zeros(4, HIDDEN), 0)
    # Its mlp calls no longer pair with the lead's: it serves nobody any more.
    with pytest.raises(OrderError, match="the lead ordered layer 1"):
        follower.compute(2, torch.zeros(1, HIDDEN), 1)


def test_a_planned_call_that_never_comes_fails_the_batch_in_time():
    channel = QueueChannel()
    follower = LayerBatcher(lambda layer, x: x, max_tokens=8, role="follower",
                            orders=channel.end(), timeout_s=0.3)
    channel.send(["batch", [[0, [[0, 2], [1, 2]]]]])
    t0 = time.monotonic()
    with pytest.raises(OrderError, match=r"the lead ordered layer 0 with attention rank\(s\) "
                                        r"\[0, 1\], but the call\(s\) of \[1\] did not arrive "
                                        r"within 0.3s"):
        follower.compute(0, torch.zeros(2, HIDDEN), 0)
    assert time.monotonic() - t0 < 3


def test_an_unplanned_call_times_out_alone_and_gone_drops_a_call():
    channel = QueueChannel()
    follower = LayerBatcher(lambda layer, x: x + 1, max_tokens=8, role="follower",
                            orders=channel.end(), timeout_s=0.3)
    with pytest.raises(OrderError, match="ordered no call for layer 2 of attention rank 0 "
                                        "within 0.3s"):
        follower.compute(2, torch.zeros(1, HIDDEN), 0)
    assert follower.broken is None  # nothing ran: the workers still agree
    follower.timeout_s = 10
    result = {}

    def call():
        try:
            follower.compute(0, torch.zeros(1, HIDDEN), 3)
        except OrderError as e:
            result["error"] = str(e)

    t = threading.Thread(target=call)
    t.start()
    time.sleep(0.2)
    channel.send(["gone", 3])  # the lead's session of rank 3 ended
    t.join(5)
    assert "session of attention rank 3 ended before its layer 0 call" in result["error"]
    # A later call of rank 3 (its next session) waits for its order.
    channel.send(["batch", [[0, [[3, 1]]]]])
    assert torch.equal(follower.compute(0, torch.zeros(1, HIDDEN), 3), torch.ones(1, HIDDEN))


@pytest.mark.parametrize("connector", ["loopback", "shm"])
def test_two_ffn_workers_serve_two_attention_ranks_alike(connector):
    """Two FFNLoops, the lead (FFN rank 0) and a follower (rank 1) of one group,
    and two attention ranks each connected to both as the attention side's
    pool does (PoolMember._connect: the rank's own FFN rank first, rank 1's
    being the follower, then the group its HelloAck names; frames to the
    follower first, the lead last): both workers make the same mlp calls,
    only the lead answers, and each peer gets its own output."""
    from vllm.afd.ffn.loop import FFNLoop
    from vllm.afd.topology import FFNPlacement
    from vllm.afd.transport.config import LinkConfig
    from vllm.afd.transport.connectors import create_connector
    from vllm.afd.transport.device import DeviceContext
    from vllm.afd.transport.wire import StepHeader

    cfg = dict(connector=connector, port=free_port(), timeout_s=10, num_attention_ranks=2,
               num_ffn_ranks=2)
    channel = QueueChannel()
    mlps = [_Recorder(), _Recorder()]
    mlps[0].partner, mlps[1].partner = mlps[1], mlps[0]  # their mlp calls meet
    loops = [FFNLoop(LinkConfig(role="ffn", **cfg), layers=[0, 1, 2], compute=mlps[rank],
                     hidden_size=HIDDEN, dtype=torch.float32, max_tokens=16,
                     placement=FFNPlacement(rank=rank, group=[0, 1]), warmup_sizes=[],
                     orders=channel if rank == 0 else channel.end())
             for rank in (0, 1)]
    conns = []
    try:
        for loop in loops:
            loop.start(DeviceContext.current("cpu"))
            assert loop.ready.wait(10)
        assert [loop.batcher.role for loop in loops] == ["lead", "follower"]
        members = []  # per attention rank: {FFN rank: connector}
        for rank in (0, 1):
            first = create_connector(LinkConfig(role="attention", **cfg), hidden_size=HIDDEN,
                                     dtype=torch.float32, max_tokens=16, rank=rank)
            first.connect()
            conns.append(first)
            links = {first.ffn_rank: first}
            for ffn_rank in first.ffn_group:
                if ffn_rank not in links:
                    links[ffn_rank] = create_connector(
                        LinkConfig(role="attention", **cfg), hidden_size=HIDDEN,
                        dtype=torch.float32, max_tokens=16, rank=rank, ffn_rank=ffn_rank)
                    links[ffn_rank].connect()
                    conns.append(links[ffn_rank])
            assert first.ffn_group == [0, 1]
            members.append(links)
        errors = []

        def attention(rank, links):
            rnd = random.Random(rank)
            lead, follower = links[0], links[1]
            try:
                for step in range(4):
                    n = rnd.randint(1, 8)
                    for conn in (follower, lead):
                        conn.send_step(StepHeader(step_id=step, num_tokens=[n]))
                    for layer in range(3):
                        time.sleep(rnd.random() * 0.003)
                        h = _rows(rank, step, layer, n)
                        follower.send_hidden(layer, 0, h, expect_output=False)
                        lead.send_hidden(layer, 0, h)
                        assert torch.equal(lead.recv_output(layer, 0), h * 2 + layer)
            except BaseException as e:  # noqa: BLE001 - reported below
                errors.append((rank, repr(e)))

        threads = [threading.Thread(target=attention, args=(r, m))
                   for r, m in enumerate(members)]
        for t in threads:
            t.start()
        for t in threads:
            t.join(60)
        assert not errors, errors
        deadline = time.monotonic() + 10
        while len(mlps[1].calls) < len(mlps[0].calls) and time.monotonic() < deadline:
            time.sleep(0.01)
        assert mlps[0].calls and mlps[1].calls == mlps[0].calls
        assert sorted(loops[0].serving) == sorted(loops[1].serving) == [0, 1]
        assert loops[1].status()["order_error"] is None
    finally:
        for conn in conns:
            conn.close()
        for loop in loops:
            loop.stop()
