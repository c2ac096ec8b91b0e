"""Ed25519 keys: the trainer signs manifests with one, every node is identified by one.

A key lives on disk as a raw 32-byte private seed (mode 0600); its public key (32 bytes, hex) is the
identity that peers pin. Fingerprints are short, human-checkable digests of the public key.
"""

from __future__ import annotations

import hashlib
from pathlib import Path

from cryptography.exceptions import InvalidSignature
from cryptography.hazmat.primitives import serialization
from cryptography.hazmat.primitives.asymmetric.ed25519 import Ed25519PrivateKey, Ed25519PublicKey

from swarm_common.atomic import write_atomic

_RAW = serialization.Encoding.Raw


class KeyPair:
    def __init__(self, private: Ed25519PrivateKey):
        self._private = private
        self.public_bytes: bytes = private.public_key().public_bytes(_RAW, serialization.PublicFormat.Raw)

    @classmethod
    def generate(cls) -> KeyPair:
        return cls(Ed25519PrivateKey.generate())

    @classmethod
    def from_seed(cls, seed: bytes) -> KeyPair:
        return cls(Ed25519PrivateKey.from_private_bytes(seed))

    @classmethod
    def load_or_create(cls, path: str | Path) -> KeyPair:
        """Load the key at `path`, or make one there on first start."""
        path = Path(path)
        if path.exists():
            seed = path.read_bytes()
            if len(seed) != 32:
                raise ValueError(f"{path}: not a 32-byte ed25519 seed")
            return cls.from_seed(seed)
        path.parent.mkdir(parents=True, exist_ok=True)
        kp = cls.generate()
        seed = kp._private.private_bytes(_RAW, serialization.PrivateFormat.Raw, serialization.NoEncryption())
        write_atomic(path, seed, mode=0o600)
        pub = path.with_suffix(".pub")
        pub.write_text(kp.public_hex + "\n")
        return kp

    @property
    def public_hex(self) -> str:
        return self.public_bytes.hex()

    @property
    def fingerprint(self) -> str:
        return fingerprint(self.public_bytes)

    def sign(self, data: bytes) -> bytes:
        return self._private.sign(data)


def fingerprint(public: bytes | str) -> str:
    """Short digest of a public key, shown to users to compare out of band."""
    if isinstance(public, str):
        public = bytes.fromhex(public)
    d = hashlib.sha256(public).hexdigest()[:20]
    return ":".join(d[i : i + 4] for i in range(0, 20, 4))


def verify(public: bytes | str, data: bytes, signature: bytes) -> bool:
    """True when `signature` is `public`'s signature of `data`. Never raises on bad input."""
    try:
        if isinstance(public, str):
            public = bytes.fromhex(public)
        Ed25519PublicKey.from_public_bytes(public).verify(signature, data)
        return True
    except (InvalidSignature, ValueError, TypeError):
        return False


def load_public(spec: str) -> bytes:
    """A pinned public key given as 64 hex characters or as a path to a .pub file."""
    text = spec.strip()
    if len(text) != 64 or not all(c in "0123456789abcdefABCDEF" for c in text):
        text = Path(spec).read_text().strip()
    key = bytes.fromhex(text)
    if len(key) != 32:
        raise ValueError("an ed25519 public key is 32 bytes (64 hex characters)")
    return key
