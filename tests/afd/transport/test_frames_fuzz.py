# SPDX-License-Identifier: Apache-2.0
# SPDX-FileCopyrightText: Copyright contributors to the vllm-afd project
"""Bad bytes from a peer, injected over a real socket into a real FFN
connector: each is refused with an error naming the peer and the field, the
process keeps going, and the FFN then serves a well-behaved peer. Then a
seeded random mutation of valid frames: every received header either passes
the checks or raises ProtocolError, nothing else."""

import logging
import random
import socket
import struct
import time

import msgspec
import pytest
import torch

from vllm.afd.transport import shm_ring, wire
from vllm.afd.transport.connectors import AFDConnectionError, ProtocolError
from vllm.afd.transport.connectors import tcp
from vllm.afd.transport.connectors.socket_stream import (MAGIC, MAX_HEADER_BYTES, PREFIX,
                                                       SocketStream)
from vllm.afd.transport.errors import LinkClosed
from vllm.afd.transport.wire import LayerFrame, StepHeader
from helpers.connectors import HIDDEN, MAX_TOKENS, Background, dial, free_port, make, raw_frame, read_message, serve_one_layer

TOKENS = 4
NBYTES = TOKENS * HIDDEN * 4  # float32


def raw_header(header: bytes, announced: int = 0) -> bytes:
    return PREFIX.pack(MAGIC, len(header), announced) + header


def hello(**changes) -> bytes:
    """A Hello as the attention connector would send it, as a raw msgpack map
    (so changes may break what the Struct would enforce)."""
    template = make("tcp", "attention", 1).handshake.hello()
    fields = {"kind": "hello", **msgspec.structs.asdict(template), **changes}
    return raw_header(msgspec.msgpack.encode(fields))


def layer(payload: bytes | None = None, announced: int | None = None, **changes) -> bytes:
    fields = {"kind": "layer", "step_id": 0, "layer_id": 0, "ubatch_id": 0,
              "dtype": "float32", "shape": [TOKENS, HIDDEN], "nbytes": NBYTES, "topk": 0,
              **changes}
    payload = bytes(NBYTES) if payload is None else payload
    announced = len(payload) if announced is None else announced
    return raw_header(msgspec.msgpack.encode(fields), announced) + payload


def step(**changes) -> bytes:
    fields = {"kind": "step", "step_id": 0, "num_tokens": [TOKENS], "flags": 0, **changes}
    return raw_header(msgspec.msgpack.encode(fields))


# ------------------------------------------------------------ the handshake
HANDSHAKE_CASES = {  # id: (bytes the peer sends, then hangs up; the FFN's reason)
    "truncated-prefix": (b"AFD1\x05", "connection closed after 5 of 16 bytes"),
    "bad-magic": (b"GET / HTTP/1.1\r\n\r\n", "expected magic b'AFD1', received b'GET '"),
    "header-over-max": (PREFIX.pack(MAGIC, MAX_HEADER_BYTES + 1, 0),
                        f"expected at most {MAX_HEADER_BYTES}, received {MAX_HEADER_BYTES + 1}"),
    "truncated-header": (PREFIX.pack(MAGIC, 100, 0) + b"\x80" * 10,
                         "connection closed after 10 of 100 bytes"),
    "msgpack-garbage": (PREFIX.pack(MAGIC, 3, 0) + b"\x93\x01\x02", "malformed AFD message"),
    "unknown-kind": (raw_header(msgspec.msgpack.encode({"kind": "rdma!"})),
                     "Invalid value 'rdma!' - at `$.kind`"),
    "not-a-hello": (step(), "expected Hello, received StepHeader"),
    "hello-with-payload": (raw_frame(make("tcp", "attention", 1).handshake.hello(), announced=1 << 40),
                           "announced a payload of 1099511627776 bytes; only LayerFrames "
                           "carry one"),
    "negative-rank": (hello(rank=-1), "Expected `int` >= 0 - at `$.rank`"),
    "huge-fingerprint": (hello(fingerprint={str(i): "x" for i in range(65)}),
                         "Expected `object` of length <= 64 - at `$.fingerprint`"),
    "long-nonce": (hello(auth_nonce=bytes(33)),
                   "Expected `bytes` of length <= 32 - at `$.auth_nonce`"),
    "silent": (b"", "timed out"),
}


@pytest.mark.parametrize("case", HANDSHAKE_CASES)
def test_bad_handshake_drops_the_peer_not_the_server(case, monkeypatch):
    garbage, reason = HANDSHAKE_CASES[case]
    monkeypatch.setattr(tcp, "HELLO_TIMEOUT_S", 0.5)  # for "silent"
    port = free_port()
    ffn = make("tcp", "ffn", port)
    good = make("tcp", "attention", port)
    records: list[logging.LogRecord] = []
    handler = logging.Handler()
    handler.emit = records.append
    log = logging.getLogger("vllm.afd.transport.handshake")
    log.addHandler(handler)
    waiter = Background(ffn.connect)
    try:
        with dial(port) as sock:
            source = "127.0.0.1:%d" % sock.getsockname()[1]
            sock.sendall(garbage)
            if garbage:
                try:
                    sock.shutdown(socket.SHUT_WR)
                except OSError:  # the FFN dropped us already (bad magic: at once)
                    pass
            sock.settimeout(5)
            try:
                assert sock.recv(1 << 16) == b""  # dropped without an answer
            except ConnectionResetError:
                pass  # dropped with unread bytes left: the kernel resets
        assert ffn.handshake.failures == 1 and waiter.is_alive()
        serve_one_layer(waiter, ffn, good)
    finally:
        log.removeHandler(handler)
        good.close()
        ffn.close()
    [warning] = [r.getMessage() for r in records if r.levelno == logging.WARNING]
    assert warning.startswith(f"AFD ffn rank 0: dropping connection from {source}: ")
    assert reason in warning


# ------------------------------------------------------------ after the handshake
def _layer_error(field: str, expected, received) -> str:
    return (f"{field}: expected {expected}, received {received} (from attention rank 0, "
            f"the hidden states of layer 0 ubatch 0 of step 0)")


MALFORMED = "malformed AFD message from attention rank 0"
SESSION_CASES = {  # id: (bytes after a good StepHeader, or a bad one; the error)
    "wrong-step": (layer(step_id=1), _layer_error("LayerFrame.step_id", 0, 1)),
    "wrong-layer": (layer(layer_id=5), _layer_error("LayerFrame.layer_id", 0, 5)),
    "wrong-ubatch": (layer(ubatch_id=1), _layer_error("LayerFrame.ubatch_id", 0, 1)),
    "unknown-dtype": (layer(dtype="float64"), _layer_error(
        "LayerFrame.dtype", "one of float32, bfloat16, float16, int32, int64", "'float64'")),
    "other-dtype": (layer(dtype="bfloat16", nbytes=NBYTES // 2, payload=bytes(NBYTES // 2)),
                    _layer_error("LayerFrame.dtype", "float32", "bfloat16")),
    "negative-shape": (layer(shape=[-TOKENS, HIDDEN]), "Expected `int` >= 0 - at `$.shape[0]`"),
    "huge-shape": (layer(shape=[2**62, HIDDEN], payload=b""),
                   _layer_error("LayerFrame.shape", [TOKENS, HIDDEN], [2**62, HIDDEN])),
    "too-many-dims": (layer(shape=[1] * 9), "Expected `array` of length <= 8 - at `$.shape`"),
    "nbytes-lie": (layer(nbytes=5), _layer_error(
        "LayerFrame.nbytes", f"{NBYTES} (shape [{TOKENS}, {HIDDEN}] x float32)", 5)),
    "payload-over-max": (layer(payload=b"", announced=1 << 40),
                         f"payload length from attention rank 0: expected {NBYTES} "
                         f"(LayerFrame.nbytes), received {1 << 40}"),
    "truncated-payload": (layer(payload=bytes(100), announced=NBYTES),
                          f"attention rank 0 at tcp://127.0.0.1:{{port}} closed the connection "
                          f"(connection closed after 100 of {NBYTES} bytes)"),
    "step-too-many-tokens": (step(step_id=1, num_tokens=[MAX_TOKENS + 1]),
                             f"StepHeader.num_tokens: expected at most {MAX_TOKENS} tokens in "
                             f"all, received {MAX_TOKENS + 1}"),
    "step-too-many-ubatches": (step(step_id=1, num_tokens=[1] * 5),
                               "Expected `array` of length <= 4 - at `$.num_tokens`"),
    "step-unknown-flags": (step(step_id=1, flags=8), "StepHeader.flags: expected only bits 0x6, "
                                          "received 0x8"),
    "step-going-back": (step(step_id=0), "StepHeader.step_id: expected >= 1 (steps only "
                                         "move forward), received 0"),
}


@pytest.mark.parametrize("case", SESSION_CASES)
def test_bad_frame_fails_the_session_then_a_new_one_serves(case):
    garbage, needle = SESSION_CASES[case]
    port = free_port()
    needle = needle.format(port=port)
    ffn = make("tcp", "ffn", port)
    waiter = Background(ffn.connect)
    with dial(port) as sock:
        sock.sendall(raw_frame(make("tcp", "attention", port).handshake.hello()))
        assert read_message(sock).accepted
        sock.sendall(raw_frame(wire.HelloConfirm(accepted=True)))
        waiter.join_result()
        sock.sendall(step())
        try:
            assert ffn.recv_step(0).num_tokens == [TOKENS]
            if case.startswith("step-"):
                # a second step header instead of the layer, or a bad first one
                sock.sendall(garbage)
                receive = lambda: ffn.recv_step(0)  # noqa: E731
            else:
                sock.sendall(garbage)
                receive = lambda: ffn.recv_hidden(0, 0, 0)  # noqa: E731
            if case == "truncated-payload":
                sock.shutdown(socket.SHUT_WR)
            with pytest.raises((ProtocolError, AFDConnectionError)) as e:
                receive()
            assert needle in str(e.value)
            assert isinstance(e.value, AFDConnectionError) == (case == "truncated-payload")
            if case != "truncated-payload":
                # The peer hears why, instead of waiting out its timeout.
                error = read_message(sock)
                assert isinstance(error, wire.ErrorFrame) and needle in error.text
            with pytest.raises(AFDConnectionError, match="unusable after an earlier error"):
                ffn.recv_step(0)
        finally:
            ffn.close()
    # What the FFN loop does next: a fresh connector on the same port.
    ffn = make("tcp", "ffn", port)
    good = make("tcp", "attention", port)
    try:
        serve_one_layer(Background(ffn.connect), ffn, good)
    finally:
        good.close()
        ffn.close()


# ------------------------------------------------------------ random mutations
def _valid_frames() -> list[bytes]:
    return [
        wire.encode(make("tcp", "attention", 1, fingerprint={"weights": "ab" * 16}).handshake.hello(
            bytes(32))),
        wire.encode(StepHeader(step_id=3, num_tokens=[TOKENS, 0])),
        wire.encode(LayerFrame(step_id=3, layer_id=2, ubatch_id=1, dtype="float32",
                               shape=[TOKENS, HIDDEN], nbytes=NBYTES)),
        wire.encode(LayerFrame(step_id=3, layer_id=2, ubatch_id=1, dtype="float32",
                               shape=[TOKENS, HIDDEN], nbytes=NBYTES + TOKENS * 2 * 8, topk=2)),
        wire.encode(wire.AuthChallenge(nonce=bytes(range(32)), proof=bytes(32))),
        wire.encode(wire.HelloAck(accepted=True, group=[0, 1], transport=b"x" * 40)),
    ]


def _mutate(data: bytes, rng: random.Random) -> bytes:
    data = bytearray(data)
    for _ in range(rng.randint(1, 4)):
        op = rng.randrange(4)
        i = rng.randrange(len(data)) if data else 0
        if op == 0 and data:  # flip a byte
            data[i] = rng.randrange(256)
        elif op == 1:  # truncate
            del data[i:]
        elif op == 2:  # insert msgpack type bytes that announce big things
            data[i:i] = rng.choice([b"\xdd\xff\xff\xff\xff", b"\xcf" + b"\xff" * 8,
                                    b"\xdb\x7f\xff\xff\xff", b"\xc6\xff\xff\xff\x00", b"\xd3"])
        elif data:  # duplicate a slice
            j = rng.randrange(i, len(data) + 1)
            data[i:i] = data[i:j]
    return bytes(data)


INTERESTING = [0, 1, 2, 3, TOKENS, HIDDEN, NBYTES, -1, 2**31, 2**63 - 1, 2**64 - 1, "float32",
               "bfloat16", "float64", "", "x" * 5000, [], [TOKENS, HIDDEN], [TOKENS, HIDDEN, 1],
               [-1, HIDDEN], [2**40, HIDDEN], [1] * 9, None, True, 1.5, b"\0" * 33, {}]


def _mutate_field(data: bytes, rng: random.Random) -> bytes:
    """Replace one field of a valid message by a value of another kind or size."""
    fields = msgspec.msgpack.decode(data)
    key = rng.choice([k for k in fields if k != "kind"])
    fields[key] = rng.choice(INTERESTING)
    return msgspec.msgpack.encode(fields)


def test_random_mutations_raise_only_protocol_errors():
    """Decoding and checking never raise anything but ProtocolError, and a
    header that passes check_frame describes a payload within max_bytes."""
    rng = random.Random(20240611)  # deterministic
    max_bytes = MAX_TOKENS * HIDDEN * 4 + MAX_TOKENS * 2 * 8
    outcomes = {"refused": 0, "decoded": 0, "passed check_frame": 0}
    valid = _valid_frames()
    for _ in range(4000):
        mutate = _mutate_field if rng.random() < 0.5 else _mutate
        data = mutate(rng.choice(valid), rng)
        try:
            message = wire.decode(data)
            outcomes["decoded"] += 1
            if isinstance(message, LayerFrame):
                dtype = wire.check_frame(message, step_id=3, layer_id=2, ubatch_id=1,
                                         max_bytes=max_bytes, hidden_size=HIDDEN,
                                         routing_topk=2)
                assert message.nbytes <= max_bytes and dtype in wire.DTYPES.values()
                outcomes["passed check_frame"] += 1
            elif isinstance(message, StepHeader):
                wire.check_step(message, num_ubatches=2, max_tokens=MAX_TOKENS)
                assert sum(message.num_tokens) <= MAX_TOKENS
        except ProtocolError:
            outcomes["refused"] += 1
    # The mutations exercised both outcomes (else this test proves nothing).
    assert outcomes["refused"] > 1000 and outcomes["decoded"] > 300, outcomes
    assert outcomes["passed check_frame"] > 10, outcomes


def test_mutated_frames_over_a_socket_never_hang_or_crash_the_reader():
    """The same mutations through SocketStream: ProtocolError or a clean
    LinkClosed at the end of the stream, within the stall timeout."""
    rng = random.Random(7)
    for _ in range(200):
        frame = _mutate(raw_frame(wire.StepHeader(step_id=1, num_tokens=[2])), rng)
        a, b = socket.socketpair()
        link = SocketStream(b, "fuzzer", stall_timeout_s=1.0)
        try:
            a.sendall(frame)
            a.shutdown(socket.SHUT_WR)
            try:
                header, payload_len = link.recv_message(None, lambda: None)
                wire.decode(header, source="fuzzer")
            except (ProtocolError, LinkClosed):
                pass
        finally:
            a.close()
            link.close()


def test_bad_frame_tensors_are_never_allocated_from_the_header(monkeypatch):
    """The receive buffer of a refused frame is never created: the check runs
    before any allocation sized by the header."""
    sizes = []
    real_empty = torch.empty

    def recording_empty(*shape, **kwargs):
        sizes.append(shape)
        return real_empty(*shape, **kwargs)

    port = free_port()
    ffn = make("tcp", "ffn", port)
    waiter = Background(ffn.connect)
    with dial(port) as sock:
        sock.sendall(raw_frame(make("tcp", "attention", port).handshake.hello()))
        assert read_message(sock).accepted
        sock.sendall(raw_frame(wire.HelloConfirm(accepted=True)))
        waiter.join_result()
        sock.sendall(step() + layer(shape=[2**40, HIDDEN], nbytes=2**40 * HIDDEN * 4,
                                    payload=b""))
        try:
            ffn.recv_step(0)
            monkeypatch.setattr(torch, "empty", recording_empty)
            with pytest.raises(ProtocolError, match="LayerFrame.shape"):
                ffn.recv_hidden(0, 0, 0)
        finally:
            monkeypatch.undo()
            ffn.close()
    assert sizes == []


# ------------------------------------------- mutations into connected connectors
FUZZ_TIMEOUT_S = 0.3  # timeout_s of the fuzzed connectors: stalls end after this
FUZZ_BOUND_S = 3.0  # each fuzzed message's whole outcome, with room for a busy CI host


def dial_kind(kind: str, port: int) -> socket.socket:
    """A raw client socket to the FFN connector of kind listening on port."""
    if kind == "tcp":
        return dial(port)
    sock = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
    sock.settimeout(10)
    for _ in range(200):
        try:
            sock.connect(f"\0vllm-afd-{port}")
            return sock
        except OSError:
                    time.sleep(0.02)
    raise AssertionError("the FFN connector never listened")


def reframe(header: bytes, payload: bytes = b"", announced: int | None = None) -> bytes:
    return raw_header(header, len(payload) if announced is None else announced) + payload


def mutations(message: wire.Message, rng: random.Random, count: int,
              payload: bytes = b"") -> list[bytes]:
    """count mutated copies of a framed message: byte-level mutations of the
    whole frame (its prefix too) and field-level ones re-framed."""
    encoded = wire.encode(message)
    out = []
    for i in range(count):
        if i % 2:
            out.append(reframe(_mutate_field(encoded, rng), payload))
        else:
            out.append(_mutate(reframe(encoded, payload), rng))
    return out


@pytest.mark.parametrize("kind", ["tcp", "shm"])
def test_mutated_handshakes_into_a_listening_ffn(kind, monkeypatch):
    """Mutated Hellos (and proofs after a real challenge) from a peer that
    then stays connected, silent: the FFN connector drops each within its
    stall/Hello timeout, counts it, never raises anything else, and still
    accepts a well-behaved peer afterwards."""
    monkeypatch.setattr(tcp, "HELLO_TIMEOUT_S", FUZZ_TIMEOUT_S)
    rng = random.Random(5 if kind == "tcp" else 11)
    port = free_port()
    ffn = make(kind, "ffn", port, timeout_s=30)
    template = make(kind, "attention", port).handshake.hello()
    cases = mutations(template, rng, 40)
    waiter = Background(ffn.connect)
    dropped = accepted = 0
    try:
        for data in cases:
            before = ffn.handshake.failures
            with dial_kind(kind, port) as sock:
                t0 = time.monotonic()
                sock.sendall(data)  # and the socket stays open
                while ffn.handshake.failures == before and not ffn._connected:
                    assert time.monotonic() - t0 < FUZZ_BOUND_S, (data[:80], "hangs")
                    time.sleep(0.005)
                if ffn._connected:  # a harmless mutation: a peer that got in
                    accepted += 1
                    break
                dropped += 1
        assert waiter.is_alive() or ffn._connected
    finally:
        ffn.close()
    assert dropped >= 20, (dropped, accepted)
    # The same port serves a good peer afterwards.
    ffn = make(kind, "ffn", port)
    good = make(kind, "attention", port)
    waiter = Background(ffn.connect)
    time.sleep(0.2)
    if not waiter.is_alive():
        waiter.join_result()  # its error
    try:
        serve_one_layer(waiter, ffn, good)
    finally:
        good.close()
        ffn.close()


def header_mutations(message: wire.Message, rng: random.Random, count: int) -> list[bytes]:
    """mutations() for the shm ring, whose messages are bare headers."""
    encoded = wire.encode(message)
    return [_mutate_field(encoded, rng) if i % 2 else _mutate(encoded, rng)
            for i in range(count)]


class RawRing:
    """A raw peer's end of one direction's shm message ring (shm_ring.py): it
    writes whatever bytes it is given as the next message, publishes the new
    head (x86 stores are ordered) and always sends a wake byte."""

    def __init__(self, segment: torch.Tensor, sock: socket.socket) -> None:
        self.view = memoryview(segment[:shm_ring.RING_BYTES].numpy())
        self.sock, self.seq = sock, 0

    def send(self, header: bytes, length: int | None = None) -> None:
        offset = 256 + (self.seq % shm_ring.RING_ENTRIES) * shm_ring.ENTRY_BYTES
        struct.pack_into("<I", self.view, offset, len(header) if length is None else length)
        self.view[offset + 4:offset + 4 + len(header)] = header
        self.seq += 1
        struct.pack_into("<I", self.view, 0, self.seq)
        self.sock.send(b"\x01")


def _connected_ffn(kind: str, port: int):
    """An FFN connector with a raw peer that did the handshake: (ffn, sock,
    send), send(bytes) putting bytes where the FFN reads its next message (the
    socket; for shm the attention->FFN ring of the segments it announced)."""
    from vllm.afd.transport.connectors.shm import ShmHandshake, ShmSegment

    ffn = make(kind, "ffn", port, timeout_s=FUZZ_TIMEOUT_S * 4)
    waiter = Background(ffn.connect)
    sock = dial_kind(kind, port)
    sock.sendall(raw_frame(make(kind, "attention", port).handshake.hello()))
    ack = read_message(sock)
    assert ack.accepted
    sock.sendall(raw_frame(wire.HelloConfirm(accepted=True)))
    waiter.join_result()
    if kind != "shm":
        return ffn, sock, sock.sendall
    shared = msgspec.msgpack.decode(ack.transport, type=ShmHandshake)
    to_ffn = ShmSegment(shared.segments[0], shm_ring.RING_BYTES, create=False)
    raw = RawRing(to_ffn.tensor, sock)
    raw.segment = to_ffn  # kept mapped while the test writes
    return ffn, sock, raw.send


@pytest.mark.parametrize("kind", ["tcp", "shm"])
def test_mutated_frames_into_a_connected_ffn(kind):
    """A connected FFN connector receives a valid step, then a mutated
    LayerFrame (or StepHeader) from a peer that stays connected and silent:
    recv_step / recv_hidden end with ProtocolError, a peer error or a timeout,
    within the bound, never anything else; a mutation that still passes every
    check yields a tensor of the expected shape."""
    rng = random.Random(17 if kind == "tcp" else 23)
    frame = LayerFrame(step_id=1, layer_id=0, ubatch_id=0, dtype="float32",
                       shape=[TOKENS, HIDDEN], nbytes=NBYTES)
    first_step = StepHeader(step_id=1, num_tokens=[TOKENS])
    if kind == "shm":  # messages are bare headers in the ring, payloads in their slots
        cases = ([("layer", d) for d in header_mutations(frame, rng, 30)]
                 + [("step", d) for d in header_mutations(first_step, rng, 14)])
    else:
        cases = ([("layer", d) for d in mutations(frame, rng, 30, bytes(NBYTES))]
                 + [("step", d) for d in mutations(first_step, rng, 14)])
    outcomes: dict[str, int] = {}
    for what, data in cases:
        port = free_port()
        ffn, sock, send = _connected_ffn(kind, port)
        try:
            if what == "layer":
                send(step(step_id=1) if kind == "tcp" else wire.encode(first_step))
                assert ffn.recv_step(0).num_tokens == [TOKENS]
            send(data)  # the peer stays connected
            t0 = time.monotonic()
            try:
                if what == "layer":
                    h = ffn.recv_hidden(0, 0, 0)
                    assert list(h.shape) == [TOKENS, HIDDEN]
                else:
                    ffn.recv_step(0, timeout_s=FUZZ_TIMEOUT_S * 4)
                outcome = "passed"
            except ProtocolError:
                outcome = "refused"
            except AFDConnectionError as e:  # timeout (a stall), or the peer's own error
                outcome = "timeout" if "timed out" in str(e) else "connection"
            assert time.monotonic() - t0 < FUZZ_BOUND_S, (data[:80], outcome)
            outcomes[outcome] = outcomes.get(outcome, 0) + 1
        finally:
            sock.close()
            ffn.close()
    # Both the checks and (tcp: a frame cut short) the stall timeout were
    # exercised; a ring message is whole or absent, so shm cannot stall.
    assert outcomes.get("refused", 0) >= 10, outcomes
    assert outcomes.get("timeout", 0) >= (3 if kind == "tcp" else 0), outcomes


def test_a_ring_entry_longer_than_its_slot_is_refused():
    """shm: the length word of a ring entry comes from the peer; one past the
    entry is a ProtocolError, not a read beyond it."""
    ffn, sock, send = _connected_ffn("shm", free_port())
    try:
        send.__self__.send(b"x", length=shm_ring.ENTRY_BYTES)
        with pytest.raises(ProtocolError, match=r"shm ring entry from .*: length 20480, "
                           r"at most 20476"):
            ffn.recv_step(0)
    finally:
        sock.close()
        ffn.close()


@pytest.mark.parametrize("kind", ["tcp", "shm"])
def test_mutated_replies_into_a_connected_attention_side(kind):
    """The other direction: a fake FFN answers a real attention connector's
    Hello with a mutated HelloAck, or its hidden states with a mutated output
    frame, and stays connected: connect() / recv_output() end with
    ProtocolError or a connection error (a timeout for stalls) within the bound."""
    from vllm.afd.transport.connectors.shm import ShmHandshake

    rng = random.Random(31 if kind == "tcp" else 37)
    outcomes: dict[str, int] = {}
    for i in range(24):
        port = free_port()
        fake = make(kind, "ffn", port)  # only its listener and its segments are used
        fake._listen()
        attn = make(kind, "attention", port, timeout_s=FUZZ_TIMEOUT_S * 4)
        try:
            handshake = i % 2 == 0
            if handshake:
                ack = wire.HelloAck(accepted=True, rank=0, group=[0])
                if kind == "shm":
                    ack = wire.HelloAck(accepted=True, rank=0, group=[0], transport=(
                        msgspec.msgpack.encode(ShmHandshake(
                            segments=[f"vllm-afd-{port}-0-a2f-0000", f"vllm-afd-{port}-0-f2a-0000"],
                            slot_bytes=attn.codec.max_bytes, ring_entries=shm_ring.RING_ENTRIES,
                            ring_entry_bytes=shm_ring.ENTRY_BYTES))))
                replies = mutations(ack, rng, 1)
            connecting = Background(attn.connect)
            sock, _ = fake._listener.accept()
            with sock:
                sock.settimeout(10)
                assert isinstance(read_message(sock), wire.Hello)
                t0 = time.monotonic()
                if handshake:
                    sock.sendall(replies[0])
                    error = None
                    try:
                        connecting.join_result()
                        outcome = "passed"
                    except ProtocolError as e:
                        outcome, error = "refused", e
                    except AFDConnectionError as e:
                        outcome, error = ("timeout" if "timed out" in str(e) else
                                          "connection"), e
                    assert time.monotonic() - t0 < FUZZ_BOUND_S, (replies[0][:80], error)
                else:
                    if kind == "shm":
                        fake._ack_transport(0, b"")  # real segments for the real side
                        data = fake._segments[0]
                        ack = wire.HelloAck(accepted=True, rank=0, group=[0], transport=(
                            msgspec.msgpack.encode(ShmHandshake(
                                segments=[data[1].name, data[0].name],
                                slot_bytes=fake.slot_bytes, ring_entries=shm_ring.RING_ENTRIES,
                                ring_entry_bytes=shm_ring.ENTRY_BYTES))))
                    else:
                        ack = wire.HelloAck(accepted=True, rank=0, group=[0])
                    sock.sendall(raw_frame(ack))
                    assert read_message(sock).accepted  # the HelloConfirm
                    connecting.join_result()
                    attn.send_step(StepHeader(step_id=1, num_tokens=[TOKENS]))
                    attn.send_hidden(0, 0, torch.ones(TOKENS, HIDDEN))
                    output = LayerFrame(step_id=1, layer_id=0, ubatch_id=0, dtype="float32",
                                        shape=[TOKENS, HIDDEN], nbytes=NBYTES)
                    if kind == "shm":  # into the FFN->attention ring the fake made
                        RawRing(fake._segments[0][0].tensor, sock).send(
                            header_mutations(output, rng, 1)[0])
                    else:
                        sock.sendall(mutations(output, rng, 1, bytes(NBYTES))[0])
                    t0 = time.monotonic()
                    try:
                        attn.recv_output(0, 0, out=torch.empty(TOKENS, HIDDEN))
                        outcome = "passed"
                    except ProtocolError:
                        outcome = "refused"
                    except AFDConnectionError as e:
                        outcome = "timeout" if "timed out" in str(e) else "connection"
                    assert time.monotonic() - t0 < FUZZ_BOUND_S, outcome
            outcomes[outcome] = outcomes.get(outcome, 0) + 1
        finally:
            attn.close()
            fake.close()
    # The checks and the stall timeout were both exercised.
    assert outcomes.get("refused", 0) >= 4 and outcomes.get("timeout", 0) >= 3, outcomes
