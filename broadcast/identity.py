"""Who a tree member is: joins and connect-back answers signed with the peer's ed25519 key.

The wire format, for anyone writing a peer of their own:
  - POST /join body: a `Join` as JSON whose `signature` is the hex ed25519 signature, by `key`, of
    b"rollout-swarm/join/v1\\n" + the JSON encoding of the same Join with "signature" set to "" (fields in
    declaration order, no spaces, as msgspec writes them). `time_ms` must be within JOIN_SKEW_S of the
    tracker's clock and `nonce` (16-64 hex digits) is accepted once.
  - GET /reach?nonce=N on the advertised URL (the tracker's connect-back) answers a `ReachAnswer`: the key
    and its hex signature of b"rollout-swarm/reach/v1\\n" + N. A fresh N each time, so only the holder of
    the key, listening at that URL (or relaying for it in real time), can answer.
"""

from __future__ import annotations

import re
import secrets
import time

import msgspec

from swarm_common.keys import KeyPair, verify

from .messages import Join, ReachAnswer

JOIN_DOMAIN = b"rollout-swarm/join/v1\n"
REACH_DOMAIN = b"rollout-swarm/reach/v1\n"
JOIN_SKEW_S = 120.0
_HEX = re.compile(r"^[0-9a-f]+$")


def join_payload(msg: Join) -> bytes:
    return JOIN_DOMAIN + msgspec.json.encode(msgspec.structs.replace(msg, signature=""))


def sign_join(msg: Join, keypair: KeyPair) -> Join:
    msg = msgspec.structs.replace(msg, key=keypair.public_hex, time_ms=int(time.time() * 1000),
                                  nonce=secrets.token_hex(16), signature="")
    return msgspec.structs.replace(msg, signature=keypair.sign(join_payload(msg)).hex())


def is_hex(text: str, lo: int, hi: int) -> bool:
    return lo <= len(text) <= hi and bool(_HEX.match(text))


def check_join(msg: Join, now: float | None = None) -> str | None:
    """Why a signed join is not acceptable (None: it is); the nonce's uniqueness is the caller's to check."""
    if not is_hex(msg.key, 64, 64):
        return "key must be 64 lowercase hex digits (an ed25519 public key)"
    if not is_hex(msg.nonce, 16, 64):
        return "nonce must be 16-64 lowercase hex digits"
    if not is_hex(msg.signature, 128, 128):
        return "signature must be 128 lowercase hex digits"
    now = time.time() if now is None else now
    if abs(msg.time_ms / 1000 - now) > JOIN_SKEW_S:
        return f"time_ms is more than {JOIN_SKEW_S:.0f}s from the tracker's clock"
    if not verify(msg.key, join_payload(msg), bytes.fromhex(msg.signature)):
        return "bad signature"
    return None


def reach_answer(nonce: str, keypair: KeyPair) -> ReachAnswer:
    return ReachAnswer(keypair.public_hex, keypair.sign(REACH_DOMAIN + nonce.encode()).hex())


def check_reach(answer: ReachAnswer, nonce: str, key: str) -> str | None:
    """Why a connect-back answer does not prove `key` holds the address (None: it does)."""
    if answer.key != key:
        return f"answered by another key ({answer.key[:16]}...)"
    if not is_hex(answer.signature, 128, 128) or not verify(key, REACH_DOMAIN + nonce.encode(),
                                                            bytes.fromhex(answer.signature)):
        return "answer is not the key's signature of our nonce"
    return None
