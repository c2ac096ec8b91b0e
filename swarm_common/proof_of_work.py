"""An admission cost for open runs: a registration carries a nonce whose hash has `bits` leading zero bits.

The hash covers the node's key and its registration time, so a proof is good for one key, once: a fresh
identity costs about 2**bits hashes (20 bits: about a second of one core) and checking it costs one.
"""

from __future__ import annotations

import hashlib


def _digest(node_id: str, time_ms: int, nonce: int) -> bytes:
    return hashlib.sha256(f"rollout-swarm-register:{node_id}:{time_ms}:{nonce}".encode()).digest()


def leading_zero_bits(digest: bytes) -> int:
    n = int.from_bytes(digest, "big")
    return len(digest) * 8 - n.bit_length()


def check(node_id: str, time_ms: int, nonce: int, bits: int) -> bool:
    return bits <= 0 or leading_zero_bits(_digest(node_id, time_ms, nonce)) >= bits


def solve(node_id: str, time_ms: int, bits: int) -> int:
    """The first nonce whose hash has `bits` leading zero bits."""
    nonce = 0
    while not check(node_id, time_ms, nonce, bits):
        nonce += 1
    return nonce
