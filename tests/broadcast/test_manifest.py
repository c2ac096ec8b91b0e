"""Manifests: signing, tamper detection, schema and size bounds, unsafe paths."""

from __future__ import annotations

import msgspec
import pytest
from bc_helpers import make_version

from broadcast.manifest import (
    MANIFEST_NAME,
    ManifestError,
    build_manifest,
    decode_manifest,
    encode_manifest,
    flat_pieces,
    verify_manifest,
)
from swarm_common.keys import KeyPair


def test_build_sign_verify_roundtrip(tmp_path):
    kp = KeyPair.generate()
    d = make_version(tmp_path / "v3", 3, size=200_000)
    m = build_manifest(d, 3, 2, kp, piece_size=64 << 10)
    assert (d / MANIFEST_NAME).exists()
    assert [f.path for f in m.files] == sorted(p.name for p in d.iterdir() if p.name != MANIFEST_NAME)
    big = next(f for f in m.files if f.size == 200_000)
    assert [p.size for p in big.pieces] == [65536, 65536, 65536, 3392]
    assert len(flat_pieces(m)) == m.n_pieces
    assert verify_manifest(m, kp.public_bytes)
    assert decode_manifest((d / MANIFEST_NAME).read_bytes(), kp.public_bytes) == m
    # A rebuild is a fresh signature over the same content and still verifies.
    assert verify_manifest(build_manifest(d, 3, 2, kp, piece_size=64 << 10), kp.public_hex)


def test_forgeries_are_refused(tmp_path):
    kp, other = KeyPair.generate(), KeyPair.generate()
    d = make_version(tmp_path / "v1", 1, size=100_000)
    m = build_manifest(d, 1, None, kp, piece_size=64 << 10)
    assert not verify_manifest(m, other.public_bytes)
    f0 = m.files[0]
    bad_piece = msgspec.structs.replace(f0.pieces[0], sha256="0" * 64)
    tampered = msgspec.structs.replace(m, files=[msgspec.structs.replace(f0, pieces=[bad_piece, *f0.pieces[1:]]), *m.files[1:]])
    assert not verify_manifest(tampered, kp.public_bytes)
    assert not verify_manifest(msgspec.structs.replace(m, version=2, parent=1), kp.public_bytes)
    assert not verify_manifest(msgspec.structs.replace(m, signature="zz"), kp.public_bytes)
    with pytest.raises(ManifestError, match="bad signature"):
        decode_manifest(encode_manifest(tampered), kp.public_bytes)
    # Signed by someone else entirely: well-formed, still refused.
    forged = build_manifest(d, 1, None, other, piece_size=64 << 10)
    with pytest.raises(ManifestError, match="bad signature"):
        decode_manifest(encode_manifest(forged), kp.public_bytes)


@pytest.mark.parametrize(
    "mutate, match",
    [
        (lambda j: j.replace(b'"version":1', b'"version":"1"'), "malformed"),
        (lambda j: j[:-1] + b',"extra":1}', "malformed"),
        (lambda j: j.replace(b'"model-00001-of-00002.safetensors"', b'"../../etc/passwd"'), "unsafe"),
        (lambda j: j.replace(b'"model-00001-of-00002.safetensors"', b'"/abs"'), "unsafe"),
        (lambda j: j.replace(b'"piece_size":65536', b'"piece_size":1'), "piece_size"),
        (lambda j: j.replace(b'"size":100000', b'"size":900000', 1), "pieces"),
        (lambda j: b"[" * 10, "malformed"),
    ],
)
def test_schema_and_semantic_validation(tmp_path, mutate, match):
    kp = KeyPair.generate()
    m = build_manifest(make_version(tmp_path / "v1", 1, size=100_000), 1, None, kp, piece_size=64 << 10)
    with pytest.raises(ManifestError, match=match):
        decode_manifest(mutate(encode_manifest(m)))


def test_size_bound():
    with pytest.raises(ManifestError, match="exceeds"):
        decode_manifest(b" " * ((16 << 20) + 1))
