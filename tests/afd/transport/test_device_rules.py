# SPDX-License-Identifier: Apache-2.0
# SPDX-FileCopyrightText: Copyright contributors to the vllm-afd project
"""The data plane's device rules, each with a test that fails without it.

No GPU here: where a rule is about asynchronous device work, a fake device
(DeferredOps: copies that land later, on a worker thread, as a GPU's copies
land after the host moved on) stands in for it, and the test says so. What
only a GPU can show is in tools/testing/gpu_check (stream-order, graphs).
"""

import threading
import time
from pathlib import Path

import pytest
import torch

from vllm.afd.attention.link import AttentionLink, ForwardPass
from vllm.afd.ffn.loop import FFNLoop, warmup_buckets
from vllm.afd.topology import FFNPlacement
from vllm.afd.transport.config import LinkConfig
from vllm.afd.transport.device import DeviceOps
from vllm.afd.transport.errors import AFDTimeoutError
from vllm.afd.transport.wire import StepHeader
from helpers.connectors import Background, FakeNccl, connect_pair, free_port, make
from helpers.connectors import HIDDEN as H
from helpers.devices import DeferredOps
from helpers.pairs import staged_tcp_pair


HIDDEN, MAX_TOKENS = 16, 32


def shm_pair_on_a_deferred_device():
    """An shm pair whose attention side consumes on the fake asynchronous
    device (set before the handshake: the slots take their ops then)."""
    port = free_port()
    ffn = make("shm", "ffn", port)
    attn = make("shm", "attention", port)
    attn.ops = DeferredOps()
    waiter = Background(ffn.connect)
    attn.connect()
    waiter.join_result()
    return attn, ffn


def staged_shm_pair(attention_ops: DeferredOps | None = None):
    """An shm pair that takes the prepared calls as CUDA connectors do (staged
    through their slots, shm_frames.py) on the fake asynchronous device: the
    attention side's copies out of the received slot land later (the FFN's
    fake device is the host's memory: it reads the slot in place).
    attention_ops: the attention side's fake device (a DeferredOps)."""
    port = free_port()
    ffn = make("shm", "ffn", port)
    attn = make("shm", "attention", port)
    for side in (attn, ffn):  # stage as on a GPU (none here)
        side.ops, side._on_host = DeferredOps(), False
    if attention_ops is not None:  # before the handshake: the slots take their ops then
        attn.ops = attention_ops
    waiter = Background(ffn.connect)
    attn.connect()
    waiter.join_result()
    return attn, ffn


@pytest.mark.parametrize("settled", [True, False])
@pytest.mark.parametrize("kind", ["shm", "tcp"])
def test_staged_calls_settle_the_slot_before_it_is_written_again(kind, settled, monkeypatch,
                                                                patient_waits):
    """A device's step calls: the output is copied out of the slot it came in
    (shm: the shared slot; tcp: the pinned receive slot) on the consumer's
    stream after the call returns (here 0.2 s later). Before that slot can be
    written again (shm: the next post on that micro-batch lets the FFN write
    it; tcp: the next receive into it) the copy is settled. settled=False
    makes the settling a no-op: the negative control, where the first output
    reads the second."""
    from vllm.afd.transport.buffers import HostSlots

    if not settled:
        monkeypatch.setattr(HostSlots, "release", lambda self, u: None)
    attn, ffn = staged_shm_pair() if kind == "shm" else staged_tcp_pair()[::-1]
    try:
        attn.send_step(StepHeader(step_id=1, num_tokens=[4]))
        ffn.recv_step(0)
        first, second = torch.full((4, H), 1.0), torch.full((4, H), 2.0)
        out1, out2 = torch.zeros(4, H), torch.zeros(4, H)
        for layer, h, out in ((0, first, out1), (1, second, out2)):
            attn.send_call(layer, 0, h)
            got = ffn.take_call(0, layer, 0)
            if kind == "tcp":  # its copy to the "device" landed
                ffn.ops.pool.submit(lambda: None).result()
            ffn.reply_call(0, layer, 0, got.clone())
            attn.recv_call(layer, 0, out)  # its copy is still in flight
        attn.ops.pool.shutdown(wait=True)
        assert attn.fast_calls == 4 and ffn.fast_calls == 4  # no general path taken
        if settled:
            assert torch.equal(out1, first) and torch.equal(out2, second)
        else:
            assert torch.equal(out1, second)  # corrupted, as predicted
    finally:
        attn.close()
        ffn.close()


class CountingOps(DeferredOps):
    """DeferredOps that counts its host calls by name (a GPU host's cost:
    each one a driver or torch call, 8-32 us inside the link on the lent H200)."""

    def __init__(self, delay: float = 0.2, landed: bool = True) -> None:
        super().__init__(delay)
        self.landed, self.calls = landed, {}

    def _count(self, name: str) -> None:
        self.calls[name] = self.calls.get(name, 0) + 1

    def copy(self, dst, src) -> None:
        self._count("copy")
        super().copy(dst, src)

    def copy_to_host(self, dst, src) -> None:
        self._count("copy_to_host")
        # The negative control's copy lands late (and, returning at once, the
        # post reaches the FFN first).
        landing = self.landing(dst, src, 0.0 if self.landed else self.delay)
        if self.landed:  # else the negative control: returns before it lands
            landing.result()

    def record(self, event=None):
        self._count("record")
        return super().record(event)

    def wait_host(self, event) -> None:
        self._count("wait_host")
        super().wait_host(event)

    def wait_host_settled(self, event) -> None:
        self._count("wait_host_settled")
        DeferredOps.wait_host(self, event)


@pytest.mark.parametrize("kind", ["shm", "tcp"])
@pytest.mark.parametrize("landed", [True, False])
def test_a_staged_send_is_one_copy_that_has_landed_before_the_header(kind, landed):
    """A device's prepared send copies the caller's tensor into its slot and
    posts the header; the peer reads the slot as soon as the header arrives,
    so the copy must have landed first. It is one blocking copy (on CUDA
    torch's copy with the stream's wait inside), not a copy, a stream lookup,
    an event and a wait: no record and no wait_host from the send side.
    landed=False returns from the copy before it lands: the negative control,
    where the FFN reads the slot's old bytes."""

    counting = CountingOps(landed=landed)
    if kind == "shm":
        attn, ffn = staged_shm_pair(counting)
    else:
        ffn, attn = staged_tcp_pair(counting)
    try:
        attn.send_step(StepHeader(step_id=1, num_tokens=[4]))
        ffn.recv_step(0)
        got, sends = [], []
        for layer in range(3):
            h = torch.full((4, H), float(layer + 1))
            before = dict(attn.ops.calls)
            attn.send_call(layer, 0, h)
            sends.append({k: v - before.get(k, 0) for k, v in attn.ops.calls.items()
                          if v != before.get(k, 0)})
            got.append(ffn.take_call(0, layer, 0).clone())
            ffn.reply_call(0, layer, 0, got[-1])
            attn.recv_call(layer, 0, torch.zeros(4, H))
        attn.ops.pool.shutdown(wait=True)
        attn.ops.writes.shutdown(wait=True)
        sent = [torch.full((4, H), float(layer + 1)) for layer in range(3)]
        # shm: the first send; then each settles the received slot's last read
        # first (a query on a GPU: the post lets the FFN write it again)
        # before its one copy. tcp settles its receive slot when it receives.
        settle = {"wait_host_settled": 1} if kind == "shm" else {}
        assert attn.fast_calls == ffn.fast_calls == 6  # every message end a C call
        assert sends == [{"copy_to_host": 1}] + [{**settle, "copy_to_host": 1}] * 2, sends
        if landed:
            assert all(torch.equal(g, s) for g, s in zip(got, sent))
        else:
            assert not torch.equal(got[0], sent[0])  # read before it landed
    finally:
        attn.close()
        ffn.close()


# ------------------------------------------------------- received tensors
@pytest.mark.parametrize("kind", ["shm", "tcp", "loopback", "nccl", "ipc"])
def test_output_lands_in_the_callers_buffer(kind):
    """recv_output(out=...) writes into the caller's tensor (the remote FFN
    op's output): same storage, the FFN's values, nothing else to copy."""
    attn, ffn = connect_pair(kind)
    try:
        attn.send_step(StepHeader(step_id=1, num_tokens=[5]))
        ffn.recv_step(0)
        h = torch.randn(5, H)
        attn.send_hidden(0, 0, h)
        got = ffn.recv_hidden(0, 0, 0)
        assert got.device == ffn.device
        ffn.send_output(0, 0, 0, got * 3)
        out = torch.full((5, H), float("nan"))
        ptr = out.data_ptr()
        result = attn.recv_output(0, 0, out=out)
        assert result is out and out.data_ptr() == ptr
        assert torch.equal(out, h * 3)
    finally:
        attn.close()
        ffn.close()


def test_slot_reuse_waits_for_the_copy_out_of_it():
    """shm, the consumer on a fake asynchronous device: the output's copy out
    of the shared slot lands 0.2 s later. The next send on that micro-batch
    (which lets the FFN overwrite the slot) must wait for it; without the
    event, the FFN's next output would reach the caller's first buffer."""
    attn, ffn = shm_pair_on_a_deferred_device()
    try:
        attn.send_step(StepHeader(step_id=1, num_tokens=[4]))
        ffn.recv_step(0)
        first, second = torch.full((4, H), 1.0), torch.full((4, H), 2.0)
        out1, out2 = torch.zeros(4, H), torch.zeros(4, H)
        attn.send_hidden(0, 0, first)
        ffn.send_output(0, 0, 0, ffn.recv_hidden(0, 0, 0).clone())
        attn.recv_output(0, 0, out=out1)  # the copy is still in flight
        attn.send_hidden(1, 0, second)  # releases the slot: waits for that copy
        ffn.send_output(0, 1, 0, ffn.recv_hidden(0, 1, 0).clone())  # overwrites it
        attn.recv_output(1, 0, out=out2)
        attn.ops.wait_host(attn.ops.record())
        assert torch.equal(out1, first) and torch.equal(out2, second)
    finally:
        attn.close()
        ffn.close()


def test_without_the_slot_event_the_copy_reads_the_next_output(monkeypatch):
    """The same exchange with the release made a no-op: the negative control
    that shows the previous test can fail."""
    from vllm.afd.transport.buffers import HostSlots

    monkeypatch.setattr(HostSlots, "release", lambda self, u: None)
    attn, ffn = shm_pair_on_a_deferred_device()
    try:
        attn.send_step(StepHeader(step_id=1, num_tokens=[4]))
        ffn.recv_step(0)
        out1 = torch.zeros(4, H)
        attn.send_hidden(0, 0, torch.full((4, H), 1.0))
        ffn.send_output(0, 0, 0, ffn.recv_hidden(0, 0, 0).clone())
        attn.recv_output(0, 0, out=out1)
        attn.send_hidden(1, 0, torch.full((4, H), 2.0))
        ffn.send_output(0, 1, 0, ffn.recv_hidden(0, 1, 0).clone())
        attn.recv_output(1, 0, out=torch.zeros(4, H))
        attn.ops.pool.shutdown(wait=True)
        assert torch.equal(out1, torch.full((4, H), 2.0))  # corrupted, as predicted
    finally:
        attn.close()
        ffn.close()


def test_connectors_take_their_device_from_the_caller():
    """Never current_device() inside a thread: the device is an argument, and
    the only call of current_device() in the data plane is where a caller
    captures its own context (DeviceContext.current)."""
    conn = make("tcp", "attention", free_port(), device="meta")
    assert conn.device == torch.device("meta") and conn.handshake.hello().device_kind == "meta"
    with pytest.raises(ValueError, match="needs a communicator_factory"):
        make("nccl", "attention", free_port(), communicator_factory=None)
    with pytest.raises(ValueError, match=r"needs a device of type \('cpu',\)"):
        make("nccl", "attention", free_port(), device="meta")
    import vllm.afd

    root = Path(vllm.afd.__file__).parent
    data_plane = [*root.glob("transport/**/*.py"), root / "attention/link.py",
                  root / "attention/pingpong.py", root / "ffn/loop.py"]
    calls = [f"{p.relative_to(root)}:{line.strip()}" for p in data_plane
             for line in p.read_text().splitlines() if ".current_device()" in line]
    assert calls == ["transport/device.py:device = torch.device(device.type, "
                     "module.current_device())"], calls


def test_a_slot_reuses_only_its_own_devices_events():
    """A slot's read event is recorded again at its next read, on this side's
    device; a read into another device's tensor records that device's event,
    which must never come back as the spare (recorded on the wrong device's
    stream). Fakes stand in for two devices (none here): each event is a token
    of the ops that made it."""
    from vllm.afd.transport.buffers import HostSlots

    class TokenOps(DeviceOps):
        def __init__(self, name):
            super().__init__("cpu")
            self.name, self.recorded = name, []

        def record(self, event=None):
            self.recorded.append(event)
            return event or (self.name, len(self.recorded))

        def wait_host_settled(self, event):
            pass

    own, other = TokenOps("own"), TokenOps("other")
    slots = HostSlots(torch.zeros(64, dtype=torch.uint8), 64, 1, own)
    foreign_out, own_out = torch.zeros(4, 4), torch.zeros(4, 4)
    slots.ops_for = lambda t: other if t is foreign_out else own
    slots.read(0, torch.float32, (4, 4), own_out)
    slots.release(0)
    slots.read(0, torch.float32, (4, 4), own_out)  # its own event again
    assert own.recorded == [None, ("own", 1)]
    slots.release(0)
    slots.read(0, torch.float32, (4, 4), foreign_out)
    slots.release(0)
    slots.read(0, torch.float32, (4, 4), own_out)  # not the other device's event
    assert other.recorded == [None] and own.recorded[-1] == ("own", 1)


def test_shm_slots_start_on_pages_of_their_own():
    """A device pins the slots (cudaHostRegister pins whole pages): they start
    on a page boundary, past the message ring, so no pinned page holds ring
    entries the peer writes meanwhile. (On the H200 host a one-page slot,
    which then shared a page with the ring, cost twice a larger one's copies;
    the alignment's effect there is not measured yet.)"""
    import mmap

    from vllm.afd.transport import shm_ring

    attn, ffn = connect_pair("shm")
    try:
        for side in (attn, ffn):
            writes, reads = side._segments[0]
            for slots, segment in ((side._tx[0], writes), (side._rx[0], reads)):
                start = slots.slot(0).data_ptr()
                assert start % mmap.PAGESIZE == 0, (start % mmap.PAGESIZE)
                assert start - segment.tensor.data_ptr() >= shm_ring.RING_BYTES
    finally:
        attn.close()
        ffn.close()


def test_a_context_names_its_streams_device_with_the_index():
    """Tensors name their device with its index (cuda:0); a context handed
    "cuda" and a stream of cuda:1 is on cuda:1, or the loopback connector
    refuses its own payloads (what the GPU check showed on an H200). A stream
    stands in for a CUDA one (no GPU here): all that is read is its device."""
    from types import SimpleNamespace

    from vllm.afd.transport.device import DeviceContext

    stream = SimpleNamespace(device=torch.device("cuda", 1))
    assert DeviceContext("cuda", stream).device == torch.device("cuda", 1)
    assert DeviceContext("cuda:1", stream).device == torch.device("cuda", 1)
    assert DeviceContext("cpu", "a token").device == torch.device("cpu")
    assert DeviceContext("cuda").device == torch.device("cuda")  # no stream, nothing known


# ----------------------------------------------------------- peer devices
@pytest.mark.parametrize("kind, accepted", [("tcp", True), ("shm", True),
                                            ("loopback", False), ("nccl", False)])
def test_peers_on_other_device_kinds(kind, accepted):
    """shm and tcp stage through host memory: a CPU FFN serves a peer whose
    tensors live elsewhere. loopback and nccl keep payloads on the device:
    the FFN refuses such a peer, naming device_kind."""
    port = free_port()
    ffn = make(kind, "ffn", port, timeout_s=3)
    extra = {"communicator_factory": type("F", (FakeNccl,), {"device_types": ("meta",)})()} \
        if kind == "nccl" else {}
    attn = make(kind, "attention", port, timeout_s=3, device="meta", **extra)
    waiter = Background(ffn.connect)
    try:
        if accepted:
            attn.connect()
            waiter.join_result()
        else:
            with pytest.raises(Exception, match="device_kind: expected 'cpu', received 'meta'"):
                attn.connect()
            assert "device_kind" in (ffn.handshake.last_refusal or "")
    finally:
        attn.close()
        ffn.close()


# --------------------------------------------------------------- nccl
class BlockingNccl(FakeNccl):
    """A fake NCCL whose init or destroy never returns (a peer that died
    between the handshake and init, operations pending at close)."""

    def __init__(self, block_create=False, block_destroy=False) -> None:
        super().__init__()
        self.block_create, self.block_destroy = block_create, block_destroy
        self.never = threading.Event()

    def create(self, unique_id, rank, world_size, device):
        if self.block_create:
            self.never.wait()
        return super().create(unique_id, rank, world_size, device)

    def destroy(self, comm) -> None:
        if self.block_destroy:
            self.never.wait()
        super().destroy(comm)


def test_nccl_init_waits_for_the_attention_sides_confirm():
    """The attention side checks the ack first: when it refuses (here: ids of
    the wrong size), neither side has entered NCCL init, and the FFN goes on
    accepting."""
    factory = FakeNccl()
    factory.unique_id = lambda: b"short"  # what a broken FFN would announce
    port = free_port()
    ffn = make("nccl", "ffn", port, timeout_s=3, communicator_factory=factory)
    attn = make("nccl", "attention", port, timeout_s=3, communicator_factory=factory)
    waiter = Background(ffn.connect)
    try:
        with pytest.raises(Exception, match=r"unique_ids: expected 2 ids of 128 bytes"):
            attn.connect()
        time.sleep(0.2)
        assert factory.created == []  # nobody entered NCCL init
        assert "refused our HelloAck" in (ffn.handshake.last_refusal or "") and waiter.is_alive()
    finally:
        attn.close()
        ffn.close()


def test_nccl_init_has_a_deadline_and_close_never_blocks():
    factory = BlockingNccl(block_create=True)
    port = free_port()
    ffn = make("nccl", "ffn", port, timeout_s=1.5, communicator_factory=factory)
    attn = make("nccl", "attention", port, timeout_s=1.5, communicator_factory=factory)
    waiter = Background(ffn.connect)
    t0 = time.monotonic()
    try:
        with pytest.raises(AFDTimeoutError, match="NCCL init with FFN rank 0 did not complete "
                                                   r"within 1.5s"):
            attn.connect()
        assert time.monotonic() - t0 < 5
        # The FFN's own init timed out too: it dropped that peer (counted) and
        # its accept ended at its own deadline, not stuck in init.
        while ffn.handshake.failures == 0:
            assert time.monotonic() - t0 < 10
            time.sleep(0.05)
        waiter.join(5)
        assert not waiter.is_alive()
    finally:
        attn.close()
        ffn.close()
    # Destroy blocking forever: close() still returns.
    from vllm.afd.transport.connectors import nccl

    factory = BlockingNccl(block_destroy=True)
    attn, ffn = connect_pair("nccl", communicator_factory=factory)
    nccl_timeout, nccl.CLOSE_TIMEOUT_S = nccl.CLOSE_TIMEOUT_S, 0.3
    try:
        t0 = time.monotonic()
        attn.close()
        ffn.close()
        assert time.monotonic() - t0 < 3
    finally:
        nccl.CLOSE_TIMEOUT_S = nccl_timeout
        factory.never.set()


def test_nccl_attention_side_receives_into_the_callers_buffer():
    """The attention side's received tensors are the model's own outputs
    (counted when the KV cache is sized): no buffer of the connector's."""
    attn, ffn = connect_pair("nccl")
    try:
        for step in (1, 2):
            attn.send_step(StepHeader(step_id=step, num_tokens=[3]))
            ffn.recv_step(0)
            attn.send_hidden(0, 0, torch.ones(3, H))
            ffn.send_output(0, 0, 0, ffn.recv_hidden(0, 0, 0) + 1)
            out = torch.empty(3, H)
            assert attn.recv_output(0, 0, out=out) is out and torch.equal(out, out * 0 + 2)
        assert attn._device_buffers == {} and len(ffn._device_buffers) == 1
    finally:
        attn.close()
        ffn.close()


# ---------------------------------------------------------- the FFN role
def _loop(compute, max_tokens=MAX_TOKENS, connector="loopback", port=None, **kwargs):
    return FFNLoop(LinkConfig(role="ffn", connector=connector, port=port or free_port(),
                              timeout_s=5), layers=[0, 1], compute=compute,
                   hidden_size=HIDDEN, dtype=torch.float32, max_tokens=max_tokens,
                   placement=FFNPlacement(rank=0, group=[0]), **kwargs)


def test_ffn_warms_up_before_it_listens():
    """Every layer at every token bucket it will see, before any peer can
    connect (no connector exists yet; ready is not set)."""
    seen = []
    loop = None

    def compute(layer, h, routing):
        seen.append((layer, h.shape[0], loop.listener is None, loop.ready.is_set()))
        return h

    loop = _loop(compute, max_tokens=48)
    loop.start()
    try:
        assert loop.ready.wait(10)
        sizes = warmup_buckets(48)
        assert sizes == [1, 2, 4, 8, 16, 32, 48]
        assert [(layer, n) for layer, n, _, _ in seen] == [(layer, n) for n in sizes
                                                          for layer in (0, 1)]
        assert all(no_connector and not ready for _, _, no_connector, ready in seen)
        assert loop.status()["warmup"]["calls"] == 2 * len(sizes)
    finally:
        loop.stop()


def test_attention_link_counts_dummy_runs_and_sends_no_frame():
    """Profile, warm-up and capture runs, named by the runner: no FFN exists,
    yet they complete at once and write zeros; a real step then needs one."""
    link = AttentionLink(LinkConfig(connector="tcp", port=free_port(), timeout_s=1),
                         hidden_size=HIDDEN, dtype=torch.float32, max_tokens=MAX_TOKENS)
    link.add_layer(0)
    try:
        for kind in ("profile", "warmup", "capture"):
            link.begin_step(ForwardPass(kind=kind))
            out = torch.full((3, HIDDEN), 7.0)
            link.exchange(0, torch.ones(3, HIDDEN), out)
            link.end_step()
            assert torch.equal(out, torch.zeros(3, HIDDEN))
        doc = link.document()
        assert doc["dummy_runs"] == {"profile": 1, "warmup": 1, "capture": 1}
        assert doc["steps"] == 0 and doc["bytes_sent"] == 0
        with pytest.raises(RuntimeError, match="called outside a step"):
            link.exchange(0, torch.ones(3, HIDDEN), out)
        from vllm.afd.transport.errors import AFDLinkDown

        with pytest.raises(AFDLinkDown):
            link.begin_step(ForwardPass(num_tokens=(3,)))
    finally:
        link.close()
