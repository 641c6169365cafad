# SPDX-License-Identifier: Apache-2.0
# SPDX-FileCopyrightText: Copyright contributors to the vllm-afd project
"""The handshake (protocol 3): model fingerprints, the shared secret and its
challenge-response, and where an FFN server may listen. Real sockets; rogue
peers are raw sockets speaking the wire format by hand."""

import json
import logging
import secrets
import shutil
import socket
import sys
import threading
import time
from contextlib import contextmanager
from types import SimpleNamespace

import msgspec
import pytest
import torch
from safetensors.torch import load_file, save_file

import preload
from transformers import AutoConfig

from vllm.afd.transport import auth, shm_ring, wire
from vllm.afd.adapter.model import fingerprint
from vllm.afd.adapter.config import AFDConfig
from vllm.afd.transport.connectors import (AFDConnectionError, ProtocolError, create_connector)
from vllm.afd.transport.connectors.shm import ShmHandshake
from vllm.afd.transport.handshake import REFUSALS_KEPT
from vllm.afd.transport.wire import AuthChallenge, AuthProof, Hello, HelloAck
from helpers.connectors import FAKE_NCCL, HIDDEN, MAX_TOKENS, Background, dial, free_port, raw_frame, read_message, serve_one_layer

FIX = "set VLLM_AFD_TOKEN (or AFDConfig.token_file) to the same value on both roles"


@pytest.fixture(autouse=True)
def _no_token_in_env(monkeypatch):
    monkeypatch.delenv(auth.TOKEN_ENV, raising=False)


def connector(role: str, port: int, *, kind: str = "tcp", token: str | None = None,
              tmp_path=None, fingerprint: dict | None = None, timeout_s: float = 10,
              **config):
    token_file = None
    if token is not None:
        token_file = tmp_path / f"{role}-{secrets.token_hex(4)}.token"
        token_file.write_text(f"  {token}\n")  # surrounding whitespace is ignored
    cfg = AFDConfig(role=role, connector=kind, port=port, timeout_s=timeout_s,
                    token_file=None if token_file is None else str(token_file), **config)
    extra = {"communicator_factory": FAKE_NCCL, "device": "cpu"} if kind == "nccl" else {}
    return create_connector(cfg, hidden_size=HIDDEN, dtype=torch.float32,
                            max_tokens=MAX_TOKENS, fingerprint=fingerprint, **extra)


@contextmanager
def captured_logs():
    """Records of the handshake's logger (the source tree may leave vllm's
    logging unconfigured, so caplog cannot be relied on)."""
    records: list[logging.LogRecord] = []
    handler = logging.Handler(logging.DEBUG)
    handler.emit = records.append
    log = logging.getLogger("vllm.afd.transport.handshake")
    old_level = log.level
    log.setLevel(logging.INFO)
    log.addHandler(handler)
    try:
        yield records
    finally:
        log.removeHandler(handler)
        log.setLevel(old_level)


def wait_until(condition, timeout: float = 10) -> float:
    start = time.monotonic()
    while not condition():
        assert time.monotonic() - start < timeout, "condition not met in time"
        time.sleep(0.01)
    return time.monotonic() - start


# ------------------------------------------------------------------ fingerprint
def model_config_of(path, dtype=torch.bfloat16):
    """What model_fingerprint reads of a VllmConfig (test_config.py checks the
    real one has these)."""
    hf = AutoConfig.from_pretrained(path)
    return SimpleNamespace(model_config=SimpleNamespace(
        model=str(path), hf_config=hf, hf_text_config=hf, dtype=dtype, quantization=None,
        revision=None))


@pytest.fixture(scope="module")
def deepseek(models_dir):
    return models_dir / "tiny-deepseek-v3"


def test_fingerprint_items(deepseek, models_dir):
    fp = fingerprint.model_fingerprint(model_config_of(deepseek))
    # Deterministic: computed again from the files (not the cache), and in
    # another process, it is the same.
    fingerprint._digest_files.cache_clear()
    assert fp == fingerprint.model_fingerprint(model_config_of(deepseek))
    assert fingerprint._digest_files.cache_info().misses == 1
    other = preload.run(
        [sys.executable, "-c", "import json, sys; from vllm.afd.adapter.model import fingerprint; "
         "print(json.dumps(fingerprint.weights_digest(sys.argv[1])))", str(deepseek)],
        capture_output=True, text=True, timeout=120)
    assert other.returncode == 0, other.stderr[-2000:]
    assert json.loads(other.stdout.strip().splitlines()[-1]) == fp["weights"]
    expected = {"architecture": "DeepseekV3ForCausalLM", "hidden_size": "128",
                "num_hidden_layers": "3", "dtype": "bfloat16", "n_routed_experts": "4",
                "num_experts_per_tok": "2", "n_shared_experts": "1",
                "first_k_dense_replace": "1", "moe_intermediate_size": "64",
                "quantization": "none"}
    assert {k: fp[k] for k in expected} == expected
    assert len(fp["weights"]) == 32 and len(fp["series"]) == 16
    assert all(isinstance(v, str) and len(v) <= 64 for v in fp.values())
    assert len(fp) <= wire.MAX_FINGERPRINT_ITEMS
    other = fingerprint.model_fingerprint(model_config_of(models_dir / "tiny-qwen3-moe"))
    assert other["architecture"] == "Qwen3MoeForCausalLM" and other["num_experts"] == "8"
    assert other["weights"] != fp["weights"]


@pytest.mark.parametrize("full_hash_bytes", [fingerprint.FULL_HASH_BYTES, 0],
                         ids=["whole-data", "sampled"])
def test_weights_digest_tells_checkpoints_apart(deepseek, tmp_path, monkeypatch,
                                                full_hash_bytes):
    monkeypatch.setattr(fingerprint, "FULL_HASH_BYTES", full_hash_bytes)
    fingerprint._digest_files.cache_clear()
    original = fingerprint.weights_digest(str(deepseek))
    tensors = load_file(deepseek / "model.safetensors")
    copy = tmp_path / "copy"
    copy.mkdir()
    # Same tensors, other file metadata: same weights, same digest.
    save_file(tensors, copy / "model.safetensors", metadata={"format": "pt", "note": "x"})
    assert fingerprint.weights_digest(str(copy)) == original
    # Same names, dtypes and shapes, other values (another training run).
    retrained = tmp_path / "retrained"
    retrained.mkdir()
    g = torch.Generator().manual_seed(1)
    save_file({k: torch.randn(v.shape, generator=g).to(v.dtype) for k, v in tensors.items()},
              retrained / "model.safetensors")
    assert fingerprint.weights_digest(str(retrained)) not in (original, "unavailable")
    # A renamed tensor changes the header digest.
    renamed = tmp_path / "renamed"
    renamed.mkdir()
    name = sorted(tensors)[0]
    save_file({(name + "_x" if k == name else k): v for k, v in tensors.items()},
              renamed / "model.safetensors")
    assert fingerprint.weights_digest(str(renamed)) != original


def test_weights_unavailable(tmp_path):
    assert fingerprint.weights_digest(str(tmp_path)) == "unavailable"  # no safetensors
    assert fingerprint.weights_digest("no-such-org/no-such-model") == "unavailable"
    (tmp_path / "model.safetensors").write_bytes(b"\xff" * 64)  # not safetensors
    assert fingerprint.weights_digest(str(tmp_path)) == "unavailable"


ITEMS = ["architecture", "model_type", "hidden_size", "num_hidden_layers", "dtype",
         "n_routed_experts", "num_experts_per_tok", "n_shared_experts",
         "first_k_dense_replace", "moe_intermediate_size", "quantization", "weights",
         "series"]


@pytest.mark.parametrize("item", ITEMS)
def test_mismatched_item_is_named_and_both_sides_fail_fast(deepseek, item):
    fp = fingerprint.model_fingerprint(model_config_of(deepseek))
    assert item in fp
    port = free_port()
    ffn = connector("ffn", port, fingerprint=fp)
    attn = connector("attention", port, fingerprint={**fp, item: fp[item] + "-other"})
    with captured_logs() as logs:
        waiter = Background(ffn.connect)
        try:
            start = time.monotonic()
            with pytest.raises(ProtocolError) as e:
                attn.connect()
            attention_failed = time.monotonic() - start
            ffn_failed = attention_failed + wait_until(lambda: ffn.handshake.refusals)
            expected = f"fingerprint[{item!r}]: expected {fp[item]!r}, received " \
                       f"{fp[item] + '-other'!r}"
            assert str(e.value).endswith(f"refused AFD attention rank 0: {expected}")
            assert attention_failed < 10 and ffn_failed < 10
            assert waiter.is_alive()  # the FFN still accepts
        finally:
            attn.close()
            ffn.close()
    errors = [r.getMessage() for r in logs if r.levelno == logging.ERROR]
    assert len(errors) == 1 and errors[0].startswith("AFD ffn rank 0 refused attention "
                                                     "rank 0 (127.0.0.1:")
    assert errors[0].endswith(expected)


def test_different_checkpoints_are_refused_then_the_right_one_served(deepseek, models_dir,
                                                                     tmp_path):
    """End to end from the checkpoints: another model (architecture, shapes...)
    and the same model with other weights are refused; the same one served."""
    fp = fingerprint.model_fingerprint(model_config_of(deepseek))
    qwen = fingerprint.model_fingerprint(model_config_of(models_dir / "tiny-qwen3-moe"))
    retrained = tmp_path / "retrained"
    shutil.copytree(deepseek, retrained)
    tensors = load_file(retrained / "model.safetensors")
    save_file({k: v + 1 for k, v in tensors.items()}, retrained / "model.safetensors")
    other_weights = fingerprint.model_fingerprint(model_config_of(retrained))
    port = free_port()
    ffn = connector("ffn", port, fingerprint=fp)
    waiter = Background(ffn.connect)
    peers = [connector("attention", port, fingerprint=f) for f in (qwen, other_weights, fp)]
    try:
        with pytest.raises(ProtocolError) as e:
            peers[0].connect()
        for needle in ("fingerprint['architecture']: expected 'DeepseekV3ForCausalLM', "
                       "received 'Qwen3MoeForCausalLM'", "fingerprint['weights']",
                       "fingerprint['num_hidden_layers']: expected '3', received '4'"):
            assert needle in str(e.value)
        with pytest.raises(ProtocolError) as e:
            peers[1].connect()
        assert str(e.value).endswith(f"fingerprint['weights']: expected {fp['weights']!r}, "
                                     f"received {other_weights['weights']!r}")
        serve_one_layer(waiter, ffn, peers[2])
        assert ffn.handshake.failures == 2 and len(ffn.handshake.refusals) == 2
    finally:
        for c in (*peers, ffn):
            c.close()


def test_unavailable_item_is_no_mismatch():
    port = free_port()
    ffn = connector("ffn", port, fingerprint={"weights": "unavailable", "hidden_size": "64"})
    attn = connector("attention", port, fingerprint={"weights": "abc", "hidden_size": "64"})
    serve_one_layer(Background(ffn.connect), ffn, attn)
    attn.close()
    ffn.close()


def test_refusals_are_bounded():
    port = free_port()
    ffn = connector("ffn", port, fingerprint={"model": "a"})
    waiter = Background(ffn.connect)
    try:
        for i in range(REFUSALS_KEPT + 3):
            bad = connector("attention", port, fingerprint={"model": f"b{i}"})
            with pytest.raises(ProtocolError):
                bad.connect()
            bad.close()
        assert ffn.handshake.failures == REFUSALS_KEPT + 3
        assert len(ffn.handshake.refusals) == REFUSALS_KEPT
        assert ffn.handshake.last_refusal.endswith(f"received 'b{REFUSALS_KEPT + 2}'")
    finally:
        ffn.close()
    with pytest.raises(AFDConnectionError, match="was closed"):
        waiter.join_result()


# ------------------------------------------------------------- authentication
TOKEN = "a-shared-secret-" + "7f3a" * 8


@pytest.mark.parametrize("kind", ["tcp", "shm", "nccl", "ipc"])
def test_same_secret_connects(kind, tmp_path):
    port = free_port()
    ffn = connector("ffn", port, kind=kind, token=TOKEN, tmp_path=tmp_path)
    attn = connector("attention", port, kind=kind, token=TOKEN, tmp_path=tmp_path)
    try:
        assert ffn.handshake.has_secret and attn.handshake.has_secret
        serve_one_layer(Background(ffn.connect), ffn, attn)
        assert ffn.handshake.auth_failures == attn.handshake.auth_failures == ffn.handshake.failures == 0
    finally:
        attn.close()
        ffn.close()


def test_secret_from_the_environment(monkeypatch):
    monkeypatch.setenv(auth.TOKEN_ENV, TOKEN)
    port = free_port()
    ffn, attn = connector("ffn", port), connector("attention", port)
    try:
        assert ffn.handshake.has_secret and attn.handshake.has_secret
        serve_one_layer(Background(ffn.connect), ffn, attn)
    finally:
        attn.close()
        ffn.close()
    # The in-process loopback pair has nothing to prove.
    assert not connector("ffn", port, kind="loopback").handshake.has_secret


@pytest.mark.parametrize("ffn_token, attention_token, needle, ffn_log", [
    (TOKEN, TOKEN[::-1],
     f"FFN rank 0 at tcp://127.0.0.1:{{port}} failed authentication: its proof does not "
     f"match the secret of AFD attention rank 0; {FIX}",
     "AFD ffn rank 0: dropping attention rank 0 (127.0.0.1:{src}) during authentication: "
     "attention rank 0 (127.0.0.1:{src}) reported a fatal error"),
    (TOKEN, None,
     f"FFN rank 0 at tcp://127.0.0.1:{{port}} refused AFD attention rank 0: authentication: "
     f"this FFN server requires a secret and the attention server has none; {FIX}",
     "AFD ffn rank 0 refused attention rank 0 (127.0.0.1:{src}): authentication: this FFN "
     "server requires a secret"),
    (None, TOKEN,
     f"FFN rank 0 at tcp://127.0.0.1:{{port}} refused AFD attention rank 0: authentication: "
     f"the attention server has a secret and this FFN server has none; {FIX}",
     "AFD ffn rank 0 refused attention rank 0 (127.0.0.1:{src}): authentication: the "
     "attention server has a secret"),
], ids=["wrong-secret", "attention-without-secret", "ffn-without-secret"])
def test_unauthenticated_peer_is_dropped_then_a_good_peer_served(
        tmp_path, ffn_token, attention_token, needle, ffn_log):
    port = free_port()
    ffn = connector("ffn", port, token=ffn_token, tmp_path=tmp_path)
    bad = connector("attention", port, token=attention_token, tmp_path=tmp_path)
    good = connector("attention", port, token=ffn_token, tmp_path=tmp_path)
    with captured_logs() as logs:
        waiter = Background(ffn.connect)
        try:
            start = time.monotonic()
            with pytest.raises(ProtocolError) as e:
                bad.connect()
            assert str(e.value) == needle.format(port=port)
            wait_until(lambda: ffn.handshake.auth_failures == 1)
            assert time.monotonic() - start < 10
            assert bad.handshake.auth_failures == (1 if ffn_token and attention_token else 0)
            serve_one_layer(waiter, ffn, good)
            assert ffn.handshake.auth_failures == ffn.handshake.failures == 1
        finally:
            bad.close()
            good.close()
            ffn.close()
    warnings = [r.getMessage() for r in logs if r.levelno == logging.WARNING]
    assert len(warnings) == 1, warnings
    src = warnings[0].split("(127.0.0.1:")[1].split(")")[0]  # the bad peer's port
    assert src.isdigit()
    assert warnings[0].startswith(ffn_log.format(src=src))
    assert TOKEN not in warnings[0]


def test_secret_never_on_the_wire(tmp_path):
    """Everything both sides send, captured by a relay between them."""
    ffn_port, relay_port = free_port(), free_port()
    captured = {"to_ffn": bytearray(), "to_attention": bytearray()}
    relay = socket.create_server(("127.0.0.1", relay_port))

    def pump(src: socket.socket, dst: socket.socket, into: bytearray) -> None:
        try:
            while data := src.recv(65536):
                into += data
                dst.sendall(data)
            dst.shutdown(socket.SHUT_WR)
        except OSError:  # the other direction's end closed first
            pass

    def run_relay() -> None:
        client, _ = relay.accept()
        upstream = dial(ffn_port)
        back = threading.Thread(target=pump, args=(upstream, client,
                                                   captured["to_attention"]), daemon=True)
        back.start()
        try:
            pump(client, upstream, captured["to_ffn"])
        except OSError:
            pass
        back.join(10)

    relaying = Background(run_relay)
    ffn = connector("ffn", ffn_port, token=TOKEN, tmp_path=tmp_path)
    attn = connector("attention", relay_port, token=TOKEN, tmp_path=tmp_path)
    try:
        serve_one_layer(Background(ffn.connect), ffn, attn)
    finally:
        attn.close()
        ffn.close()
        relaying.join_result()
        relay.close()
    wire_bytes = bytes(captured["to_ffn"] + captured["to_attention"])
    # The relay saw the whole conversation, authentication included...
    for tag in (b"hello", b"auth_challenge", b"auth_proof", b"hello_ack", b"layer"):
        assert tag in wire_bytes
    # ...and never the secret, in any common spelling.
    for spelling in (TOKEN.encode(), TOKEN.encode().hex().encode(), TOKEN[:12].encode()):
        assert spelling not in wire_bytes


@pytest.mark.parametrize("forgery", ["none", "replayed", "other-hello", "reflected"])
def test_forged_proofs_are_refused(tmp_path, forgery):
    """A client that knows the secret but plays the protocol wrongly: a proof
    from another connection (replay), for another Hello, or the FFN's own proof
    sent back. Only the honest one ("none") gets in."""
    port = free_port()
    ffn = connector("ffn", port, token=TOKEN, tmp_path=tmp_path)
    template = connector("attention", port)
    secret = TOKEN.encode()
    waiter = Background(ffn.connect)
    with dial(port) as sock:
        nonce = auth.new_nonce()
        hello = template.handshake.hello(nonce)
        sock.sendall(raw_frame(hello))
        challenge = read_message(sock)
        assert isinstance(challenge, AuthChallenge)
        assert auth.verify(secret, "ffn", nonce, challenge.nonce, hello, challenge.proof)
        proof = {
            "none": auth.proof(secret, "attention", nonce, challenge.nonce, hello),
            "replayed": auth.proof(secret, "attention", nonce, auth.new_nonce(), hello),
            "other-hello": auth.proof(secret, "attention", nonce, challenge.nonce,
                                      template.handshake.hello(auth.new_nonce())),
            "reflected": challenge.proof,
        }[forgery]
        sock.sendall(raw_frame(AuthProof(proof=proof)))
        ack = read_message(sock)
        assert isinstance(ack, HelloAck)
        try:
            if forgery == "none":
                sock.sendall(raw_frame(wire.HelloConfirm(accepted=True)))
                waiter.join_result()
                assert ack.accepted and ffn.handshake.auth_failures == 0
            else:
                assert not ack.accepted and ffn.handshake.auth_failures == 1
                assert ack.reason == ("authentication failed: the attention server's proof "
                                      f"does not match this FFN server's secret; {FIX}")
        finally:
            ffn.close()


@pytest.mark.parametrize("rogue", ["accepts-without-auth", "bad-proof", "not-a-reply"])
def test_attention_refuses_an_ffn_that_does_not_prove_the_secret(tmp_path, rogue):
    port = free_port()
    listener = socket.create_server(("127.0.0.1", port))

    def rogue_ffn() -> None:
        sock, _ = listener.accept()
        with sock:
            hello = read_message(sock)
            assert isinstance(hello, Hello) and len(hello.auth_nonce) == 32
            sock.sendall(raw_frame({
                "accepts-without-auth": HelloAck(accepted=True, rank=0),
                "bad-proof": AuthChallenge(nonce=auth.new_nonce(), proof=bytes(32)),
                "not-a-reply": wire.StepHeader(step_id=0, num_tokens=[1]),
            }[rogue]))
            sock.recv(1)  # until the attention side hangs up

    server = Background(rogue_ffn)
    attn = connector("attention", port, token=TOKEN, tmp_path=tmp_path)
    try:
        with pytest.raises(ProtocolError) as e:
            attn.connect()
        server.join_result()
    finally:
        attn.close()
        listener.close()
    address = f"FFN rank 0 at tcp://127.0.0.1:{port}"
    assert str(e.value) == {
        "accepts-without-auth": f"{address} accepted AFD attention rank 0 without "
                                f"authenticating: this side has a secret, the FFN server has "
                                f"none or does not check it; {FIX}",
        "bad-proof": f"{address} failed authentication: its proof does not match the secret "
                     f"of AFD attention rank 0; {FIX}",
        "not-a-reply": f"unexpected message from {address} while waiting for the handshake "
                       f"reply (HelloAck): expected HelloAck or AuthChallenge, received "
                       f"StepHeader",
    }[rogue]
    assert attn.handshake.auth_failures == (0 if rogue == "not-a-reply" else 1)


def test_listening_beyond_loopback(tmp_path, monkeypatch):
    """The connector itself refuses (the config check may have run under
    another environment); allow_insecure lets it bind, and it then works."""
    monkeypatch.setenv(auth.TOKEN_ENV, TOKEN)
    checked = AFDConfig(role="ffn", connector="tcp", host="0.0.0.0", port=free_port())
    monkeypatch.delenv(auth.TOKEN_ENV)
    ffn = create_connector(checked, hidden_size=HIDDEN, dtype=torch.float32,
                           max_tokens=MAX_TOKENS)
    with pytest.raises(auth.AuthConfigError) as e:
        ffn.connect()
    assert str(e.value) == (
        f"AFD ffn rank 0 at tcp://0.0.0.0:{checked.port} would listen on 0.0.0.0, reachable "
        f"from other machines, without a secret: {FIX}, or set AFDConfig.allow_insecure=true "
        f"to accept unauthenticated peers on a trusted network")
    port = free_port()
    ffn = connector("ffn", port, host="0.0.0.0", allow_insecure=True)
    attn = connector("attention", port)
    try:
        serve_one_layer(Background(ffn.connect), ffn, attn)
    finally:
        attn.close()
        ffn.close()


def test_unreadable_token_file(tmp_path):
    cfg = AFDConfig(role="attention", connector="tcp", token_file=str(tmp_path / "missing"))
    with pytest.raises(auth.AuthConfigError, match="AFDConfig.token_file: cannot read "
                       f"{tmp_path / 'missing'}: No such file or directory"):
        create_connector(cfg, hidden_size=HIDDEN, dtype=torch.float32, max_tokens=MAX_TOKENS)
    (tmp_path / "empty").write_text("\n")
    cfg = AFDConfig(role="attention", connector="tcp", token_file=str(tmp_path / "empty"))
    with pytest.raises(auth.AuthConfigError, match="is empty"):
        create_connector(cfg, hidden_size=HIDDEN, dtype=torch.float32, max_tokens=MAX_TOKENS)


def test_load_secret(tmp_path, monkeypatch):
    assert auth.load_secret(None) is None
    monkeypatch.setenv(auth.TOKEN_ENV, "")  # empty counts as unset
    assert auth.load_secret(None) is None
    monkeypatch.setenv(auth.TOKEN_ENV, f" {TOKEN}\n")
    assert auth.load_secret(None) == TOKEN.encode()
    (tmp_path / "token").write_text(TOKEN)
    with pytest.raises(auth.AuthConfigError, match="set twice"):
        auth.load_secret(str(tmp_path / "token"))
    monkeypatch.delenv(auth.TOKEN_ENV)
    assert auth.load_secret(str(tmp_path / "token")) == TOKEN.encode()
    # Proofs: deterministic, and distinct per role, nonce and Hello.
    hello = connector("attention", 1).handshake.hello(bytes(32))
    base = auth.proof(b"k", "ffn", bytes(32), bytes(32), hello)
    assert base == auth.proof(b"k", "ffn", bytes(32), bytes(32), hello)
    assert len({base, auth.proof(b"k", "attention", bytes(32), bytes(32), hello),
                auth.proof(b"k", "ffn", bytes(31) + b"\1", bytes(32), hello),
                auth.proof(b"k", "ffn", bytes(32), bytes(31) + b"\1", hello),
                auth.proof(b"k2", "ffn", bytes(32), bytes(32), hello),
                auth.proof(b"k", "ffn", bytes(32), bytes(32),
                           msgspec.structs.replace(hello, max_tokens=1))}) == 6


RING = dict(ring_entries=shm_ring.RING_ENTRIES, ring_entry_bytes=shm_ring.ENTRY_BYTES)


def test_ack_contents_from_the_ffn_are_checked():
    """What an accepted HelloAck makes the attention side do next is bounded:
    the group names existing FFN ranks, shm names are this connection's."""
    attn = connector("attention", 7700)
    with pytest.raises(ProtocolError, match=r"HelloAck.group from tcp://127.0.0.1:7700: "
                       r"expected distinct FFN ranks in 0-0, received \[0, 7\]"):
        attn.handshake._check_ack(HelloAck(accepted=True, rank=0, group=[0, 7]))
    shm = connector("attention", 7700, kind="shm")
    slot = shm.codec.max_bytes
    for names in (["/etc/passwd", "vllm-afd-7700-0-f2a-1a2b"],
                  ["vllm-afd-7700-0-a2f-../../x", "vllm-afd-7700-0-f2a-1a2b"],
                  ["vllm-afd-7700-0-f2a-1a2b", "vllm-afd-7700-0-a2f-1a2b"],
                  ["vllm-afd-7700-1-a2f-1a2b", "vllm-afd-7700-1-f2a-1a2b"]):
        data = msgspec.msgpack.encode(ShmHandshake(segments=names, slot_bytes=slot, **RING))
        with pytest.raises(ProtocolError, match=r"HelloAck.transport \(shm\) segments: "
                           "expected names vllm-afd-7700-0-"):
            shm._on_ack(data)
    with pytest.raises(ProtocolError, match=r"HelloAck.transport \(shm\): "):
        shm._on_ack(b"\xc1 not msgpack")
    with pytest.raises(ProtocolError, match=r"slot_bytes: expected"):
        shm._on_ack(msgspec.msgpack.encode(ShmHandshake(
            segments=["vllm-afd-7700-0-a2f-1a2b", "vllm-afd-7700-0-f2a-1a2b"], slot_bytes=8,
            **RING)))
    # Both ends must lay out the message ring alike (shm_ring.py).
    with pytest.raises(ProtocolError, match=r"message ring: expected 16 entries of 20480 "
                       r"bytes, received 4 of 20480"):
        shm._on_ack(msgspec.msgpack.encode(ShmHandshake(
            segments=["vllm-afd-7700-0-a2f-1a2b", "vllm-afd-7700-0-f2a-1a2b"], slot_bytes=slot,
            **dict(RING, ring_entries=4))))
    # ... and start the slots where the other does (a page of their own).
    with pytest.raises(ProtocolError, match=rf"slots_offset: expected {shm_ring.SLOTS_OFFSET} "
                       rf"\(the ring, then whole pages\), received {shm_ring.RING_BYTES}"):
        shm._on_ack(msgspec.msgpack.encode(ShmHandshake(
            segments=["vllm-afd-7700-0-a2f-1a2b", "vllm-afd-7700-0-f2a-1a2b"], slot_bytes=slot,
            slots_offset=shm_ring.RING_BYTES, **RING)))
