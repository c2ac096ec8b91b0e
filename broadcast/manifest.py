"""Signed manifests: what a policy version contains, piece by piece.

A manifest lists every file of a version, cut into pieces of `piece_size` bytes (a piece never spans two
files), with the sha256 of each piece. The trainer signs it with its ed25519 key; peers pin that key, so a
relay can neither forge a version nor alter a piece without being caught at the next hop.
"""

from __future__ import annotations

import hashlib
import os
import re
import time
from collections.abc import Iterator
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import msgspec

from swarm_common.atomic import write_atomic
from swarm_common.keys import KeyPair, verify

MANIFEST_NAME = "manifest.json"
MAX_MANIFEST_BYTES = 16 << 20  # a 100-GiB model in 4-MiB pieces is ~2 MiB of JSON
MIN_PIECE_SIZE = 4 << 10
MAX_PIECE_SIZE = 64 << 20
MAX_FILES = 10_000
MAX_TOTAL_BYTES = 4 << 40
_DOMAIN = b"rollout-swarm/manifest/v1\n"  # a signature over a manifest can't be replayed as anything else
_HEX64 = re.compile(r"^[0-9a-f]{64}$")
_SKIP_SUFFIXES = (".tmp", ".partial")


class ManifestError(ValueError):
    """A manifest that failed decoding, validation or its signature check."""


class PieceInfo(msgspec.Struct, frozen=True, forbid_unknown_fields=True):
    offset: int  # within its file
    size: int
    sha256: str


class FileEntry(msgspec.Struct, frozen=True, forbid_unknown_fields=True):
    path: str  # relative, '/'-separated
    size: int
    pieces: list[PieceInfo]


class TargetFile(msgspec.Struct, frozen=True, forbid_unknown_fields=True):
    """A file of the version a delta reconstructs: what the node must end up holding, byte for byte."""

    path: str
    size: int
    sha256: str  # of the whole file


class Manifest(msgspec.Struct, frozen=True, forbid_unknown_fields=True):
    version: int
    parent: int | None
    piece_size: int
    files: list[FileEntry]  # what travels through the tree: the version's files, or a delta's payload
    created: float
    signature: str = ""  # hex ed25519 over signing_payload()
    # A delta version (broadcast/delta.py): `files` is the payload, applied to version `base` it gives
    # exactly `target`. A full version has base None and no target (its pieces are its files).
    base: int | None = None
    target: list[TargetFile] = []

    def signing_payload(self) -> bytes:
        # msgspec encodes fields in declaration order, so this is canonical for a given manifest.
        return _DOMAIN + msgspec.json.encode(msgspec.structs.replace(self, signature=""))

    @property
    def total_size(self) -> int:
        return sum(f.size for f in self.files)

    @property
    def n_pieces(self) -> int:
        return sum(len(f.pieces) for f in self.files)


class PieceRef(msgspec.Struct, frozen=True):
    """A piece located in the flat, version-wide numbering used on the wire."""

    index: int
    file_index: int
    path: str
    offset: int
    size: int
    sha256: str

    def matches(self, data: bytes) -> bool:
        """`data` is this piece: the right length and hash. (hashlib lets go of the GIL: threads may call it.)"""
        return len(data) == self.size and hashlib.sha256(data).hexdigest() == self.sha256


def flat_pieces(m: Manifest) -> list[PieceRef]:
    out: list[PieceRef] = []
    for fi, f in enumerate(m.files):
        for p in f.pieces:
            out.append(PieceRef(len(out), fi, f.path, p.offset, p.size, p.sha256))
    return out


def _iter_files(version_dir: Path) -> Iterator[Path]:
    for p in sorted(version_dir.rglob("*")):
        if p.is_file() and p.name != MANIFEST_NAME and not p.name.endswith(_SKIP_SUFFIXES):
            yield p


def hash_file_pieces(path: Path, piece_size: int) -> list[PieceInfo]:
    pieces = []
    with open(path, "rb") as f:
        offset = 0
        while True:
            chunk = f.read(piece_size)  # one piece in memory at a time, never the whole file
            if not chunk:
                break
            pieces.append(PieceInfo(offset, len(chunk), hashlib.sha256(chunk).hexdigest()))
            offset += len(chunk)
    return pieces


def auto_piece_size(version_dir: Path | str, target_pieces: int = 512) -> int:
    """About `target_pieces` pieces (a power of two, 32 KiB to 4 MiB). Each level of the tree holds a piece
    until it is whole and verified, so a level adds about k pieces' time on an uplink: with S/piece in the
    hundreds, that is a few percent of S/B; with 1 MiB pieces of a 16 MiB version, T was 2.5 S/B at N=32."""
    total = sum(p.stat().st_size for p in _iter_files(Path(version_dir)))
    size = 32 << 10
    while size < 4 << 20 and total > size * target_pieces:
        size *= 2
    return size


def build_manifest(
    version_dir: Path | str,
    version: int,
    parent: int | None,
    keypair: KeyPair,
    piece_size: int = 4 << 20,
    *,
    base: int | None = None,
    target: list[TargetFile] | None = None,
) -> Manifest:
    """Hash every file under `version_dir`, sign, and write `manifest.json` there (atomically). For a delta,
    `version_dir` holds its payload and `target` the files it reconstructs against version `base`."""
    version_dir = Path(version_dir)
    if not MIN_PIECE_SIZE <= piece_size <= MAX_PIECE_SIZE:
        raise ManifestError(f"piece_size {piece_size} outside [{MIN_PIECE_SIZE}, {MAX_PIECE_SIZE}]")
    paths = list(_iter_files(version_dir))
    # Files hashed in parallel (hashlib lets go of the GIL): a version is on the critical path of an
    # on-policy run, and 0.54 GB takes 0.35 s on one core here.
    with ThreadPoolExecutor(max_workers=max(1, min(8, os.cpu_count() or 1))) as pool:
        hashed = list(pool.map(lambda p: hash_file_pieces(p, piece_size), paths))
    files = [FileEntry(p.relative_to(version_dir).as_posix(), p.stat().st_size, h)
             for p, h in zip(paths, hashed, strict=True)]
    if not files:
        raise ManifestError(f"{version_dir}: no files to publish")
    m = Manifest(version, parent, piece_size, files, time.time(), base=base, target=target or [])
    m = msgspec.structs.replace(m, signature=keypair.sign(m.signing_payload()).hex())
    validate_manifest(m)
    write_atomic(version_dir / MANIFEST_NAME, encode_manifest(m))
    return m


def encode_manifest(m: Manifest) -> bytes:
    return msgspec.json.encode(m)


def verify_manifest(manifest: Manifest, trusted_public: bytes | str) -> bool:
    """True when the manifest is well-formed and signed by the pinned trainer key."""
    try:
        validate_manifest(manifest)
        sig = bytes.fromhex(manifest.signature)
    except (ManifestError, ValueError):
        return False
    return verify(trusted_public, manifest.signing_payload(), sig)


def validate_manifest(m: Manifest) -> None:
    """Semantic checks msgspec's schema can't express; raises ManifestError."""
    if m.version < 0 or (m.parent is not None and not 0 <= m.parent < m.version):
        raise ManifestError(f"bad version/parent {m.version}/{m.parent}")
    if not MIN_PIECE_SIZE <= m.piece_size <= MAX_PIECE_SIZE:
        raise ManifestError(f"piece_size {m.piece_size} out of range")
    if not 0 < len(m.files) <= MAX_FILES:
        raise ManifestError(f"{len(m.files)} files")
    seen: set[str] = set()
    total = 0
    for f in m.files:
        _check_path(f.path)
        if f.path in seen:
            raise ManifestError(f"duplicate path {f.path!r}")
        seen.add(f.path)
        if f.size < 0:
            raise ManifestError(f"{f.path}: negative size")
        total += f.size
        # Pieces must tile the file exactly: contiguous, full-sized except the last.
        expected_n = -(-f.size // m.piece_size)
        if len(f.pieces) != expected_n:
            raise ManifestError(f"{f.path}: {len(f.pieces)} pieces, expected {expected_n}")
        for i, p in enumerate(f.pieces):
            want = min(m.piece_size, f.size - i * m.piece_size)
            if p.offset != i * m.piece_size or p.size != want:
                raise ManifestError(f"{f.path}: piece {i} has offset/size {p.offset}/{p.size}")
            if not _HEX64.match(p.sha256):
                raise ManifestError(f"{f.path}: piece {i} hash is not 64 lowercase hex digits")
    if total > MAX_TOTAL_BYTES:
        raise ManifestError(f"total size {total} too large")
    if m.signature and not re.fullmatch(r"[0-9a-f]{128}", m.signature):
        raise ManifestError("signature is not 128 hex digits")
    _validate_delta(m)


DELTA_DIR = "_delta"  # a delta's payload lives here, beside the files it reconstructs


def _validate_delta(m: Manifest) -> None:
    if m.base is None:
        if m.target:
            raise ManifestError("a full version lists no target files")
        return
    if not 0 <= m.base < m.version:
        raise ManifestError(f"delta base {m.base} is not older than version {m.version}")
    if not 0 < len(m.target) <= MAX_FILES:
        raise ManifestError(f"delta lists {len(m.target)} target files")
    if any(not f.path.startswith(DELTA_DIR + "/") for f in m.files):
        raise ManifestError(f"a delta's payload lives under {DELTA_DIR}/")
    seen: set[str] = set()
    total = 0
    for t in m.target:
        _check_path(t.path)
        if t.path.split("/")[0] in (DELTA_DIR, "have.log") or t.path in seen:
            raise ManifestError(f"target path {t.path!r} is reserved or repeated")
        seen.add(t.path)
        if t.size < 0 or not _HEX64.match(t.sha256):
            raise ManifestError(f"target {t.path}: bad size or hash")
        total += t.size
    if total > MAX_TOTAL_BYTES:
        raise ManifestError(f"target size {total} too large")


def _check_path(path: str) -> None:
    parts = path.split("/")
    if (
        not path
        or len(path) > 1024
        or path.startswith("/")
        or "\\" in path
        or "\x00" in path
        or any(p in ("", ".", "..") for p in parts)
        or parts[-1] == MANIFEST_NAME
        or parts[-1].endswith(_SKIP_SUFFIXES)
    ):
        raise ManifestError(f"unsafe file path {path!r}")


def decode_manifest(data: bytes, trusted_public: bytes | str | None = None) -> Manifest:
    """Decode with a size bound and schema validation; check the signature when a key is given."""
    if len(data) > MAX_MANIFEST_BYTES:
        raise ManifestError(f"manifest of {len(data)} bytes exceeds {MAX_MANIFEST_BYTES}")
    try:
        m = msgspec.json.decode(data, type=Manifest)
    except msgspec.DecodeError as e:
        raise ManifestError(f"malformed manifest: {e}") from e
    validate_manifest(m)
    if trusted_public is not None and not verify_manifest(m, trusted_public):
        raise ManifestError(f"manifest for version {m.version} has a bad signature (not the pinned trainer key)")
    return m


def load_manifest(version_dir: Path, trusted_public: bytes | str | None = None) -> Manifest:
    return decode_manifest((Path(version_dir) / MANIFEST_NAME).read_bytes(), trusted_public)
