# SPDX-License-Identifier: Apache-2.0
# SPDX-FileCopyrightText: Copyright contributors to the vllm-afd project
"""Who may talk to an FFN server: a shared secret, proven by challenge-response.

The secret comes from the environment variable VLLM_AFD_TOKEN or from the file
named by AFDConfig.token_file (its contents, surrounding whitespace stripped).
Setting both is an error: two sources that may disagree are a trap (a stale
file silently winning over the variable, or the reverse), so each role must
name exactly one. An empty VLLM_AFD_TOKEN counts as unset.

The secret never travels. When the attention side has one, its Hello carries a
fresh random nonce; an FFN with a secret answers with its own nonce and its
proof, the attention side checks it and sends its proof, and only then does
the FFN look at the Hello and answer with a HelloAck:

    attention -> FFN   Hello(auth_nonce = Na)
    FFN -> attention   AuthChallenge(nonce = Nf, proof = P("ffn"))
    attention -> FFN   AuthProof(proof = P("attention"))
    FFN -> attention   HelloAck

    P(role) = HMAC-SHA256(secret, label, role, Na, Nf, SHA-256(Hello))

Both nonces are fresh per connection, so a recorded proof is useless on
another connection; the role in the MAC keeps one side's proof from being
reflected back as the other's; the Hello's digest (of its canonical encoding,
which both sides compute from the same decoded fields) binds the proofs to
the identity and configuration the attention side announced. Proofs are
compared with hmac.compare_digest.

What this does not do: encrypt or sign the traffic after the handshake. It
keeps unknown peers from connecting to an FFN server (and an attention server
from feeding a wrong FFN server); an attacker who can rewrite packets between
two hosts can still hijack an authenticated connection. Across untrusted
networks run the link inside a tunnel (WireGuard, IPsec, an SSH forward).
"""

import logging
import hashlib
import hmac
import ipaddress
import os
import secrets
from pathlib import Path

from vllm.afd.transport import wire

logger = logging.getLogger(__name__)

TOKEN_ENV = "VLLM_AFD_TOKEN"
# Shorter secrets are accepted (tests, quick setups) with a warning.
RECOMMENDED_SECRET_BYTES = 16
_PROOF_LABEL = b"vllm-afd auth v1"

HOW_TO_FIX = (f"set {TOKEN_ENV} (or AFDConfig.token_file) to the same value on both roles")


class AuthConfigError(ValueError):
    """The secret is configured in a way this side cannot use."""


def load_secret(token_file: str | None) -> bytes | None:
    """The shared secret of this server, or None when it has none.
    Raises AuthConfigError when both sources are set or the file is unusable."""
    from_env = os.environ.get(TOKEN_ENV, "")
    if from_env and token_file:
        raise AuthConfigError(
            f"the AFD secret is set twice, by {TOKEN_ENV} and by AFDConfig.token_file "
            f"({token_file}); use exactly one of them")
    if token_file:
        try:
            text = Path(token_file).read_text(encoding="utf-8").strip()
        except (OSError, UnicodeDecodeError) as e:
            raise AuthConfigError(f"AFDConfig.token_file: cannot read {token_file}: "
                                  f"{getattr(e, 'strerror', None) or e}") from None
        if not text:
            raise AuthConfigError(f"AFDConfig.token_file: {token_file} is empty; write the "
                                  f"shared secret into it (the same on both roles)")
        secret = text.encode()
    elif from_env:
        secret = from_env.strip().encode()
    else:
        return None
    if len(secret) < RECOMMENDED_SECRET_BYTES:
        # warning_once: every connector (one per FFN session) loads the secret.
        logger.warning_once("the AFD secret has only %d bytes; use at least %d random bytes "
                       "(e.g. `python -c 'import secrets; print(secrets.token_hex(32))'`)",
                       len(secret), RECOMMENDED_SECRET_BYTES)
    return secret


def secret_configured(token_file: str | None) -> bool:
    """Whether a secret is set, without reading it (config validation)."""
    return bool(token_file) or bool(os.environ.get(TOKEN_ENV, ""))


def is_loopback(host: str) -> bool:
    """Whether binding host only accepts connections from this machine. Names
    other than localhost are not resolved: a name counts as reachable."""
    if host.strip("[]").lower() == "localhost":
        return True
    try:
        return ipaddress.ip_address(host.strip("[]")).is_loopback
    except ValueError:
        return False


def check_listen_address(host: str, *, has_secret: bool, allow_insecure: bool,
                         what: str) -> None:
    """Refuse to listen beyond loopback without a secret (unless explicitly
    allowed): anyone who can reach the port could otherwise feed the FFN."""
    if is_loopback(host) or has_secret:
        return
    if not allow_insecure:
        raise AuthConfigError(
            f"{what} would listen on {host}, reachable from other machines, without a "
            f"secret: {HOW_TO_FIX}, or set AFDConfig.allow_insecure=true to accept "
            f"unauthenticated peers on a trusted network")
    logger.warning("%s listens on %s without a secret (allow_insecure): any peer that "
                   "reaches this port is served", what, host)


def new_nonce() -> bytes:
    return secrets.token_bytes(wire.AUTH_NONCE_BYTES)


def hello_digest(hello: wire.Hello) -> bytes:
    """Digest of the Hello's canonical encoding: both sides compute it from the
    same fields, so any change to the Hello in transit changes it."""
    return hashlib.sha256(wire.encode(hello)).digest()


def proof(secret: bytes, role: str, attention_nonce: bytes, ffn_nonce: bytes,
          hello: wire.Hello) -> bytes:
    """What the side of `role` sends to prove it knows secret."""
    mac = hmac.new(secret, digestmod=hashlib.sha256)
    for part in (_PROOF_LABEL, role.encode(), attention_nonce, ffn_nonce,
                 hello_digest(hello)):
        # Length-prefixed, so no two different inputs concatenate alike.
        mac.update(len(part).to_bytes(4, "big"))
        mac.update(part)
    return mac.digest()


def verify(secret: bytes, role: str, attention_nonce: bytes, ffn_nonce: bytes,
           hello: wire.Hello, received: bytes) -> bool:
    """Whether received is role's proof (constant-time comparison)."""
    expected = proof(secret, role, attention_nonce, ffn_nonce, hello)
    return hmac.compare_digest(expected, received)
