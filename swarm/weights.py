"""Fetching a published version over HTTP: stream each file to disk, check its sha256, then commit.

A version directory appears under its final name only when every file matched the manifest, so a node
never loads a partial or unverified version. Used by nodes; the trainer's publisher shares the names.
"""

from __future__ import annotations

import hashlib
import logging
import shutil
from pathlib import Path

import aiohttp
import msgspec

from swarm.protocol import VersionManifest

log = logging.getLogger(__name__)
MAX_MANIFEST_BYTES = 1 << 20
MAX_FILE_BYTES = 64 << 30


class FetchError(RuntimeError):
    pass


def version_name(version: int) -> str:
    return f"v{version:06d}"


def sha256_file(path: Path, chunk: int = 1 << 20) -> str:
    h = hashlib.sha256()
    with open(path, "rb") as f:
        while block := f.read(chunk):
            h.update(block)
    return h.hexdigest()


def _safe_name(name: str) -> bool:
    return bool(name) and "/" not in name and "\\" not in name and name not in (".", "..") and len(name) < 256


async def fetch_version(
    session: aiohttp.ClientSession, manifest_url: str, dest_root: Path, expect_version: int | None = None
) -> Path:
    """Download the version at `manifest_url` into dest_root/vNNNNNN; returns that directory."""
    async with session.get(manifest_url) as r:
        if r.status != 200:
            raise FetchError(f"manifest {manifest_url}: HTTP {r.status}")
        raw = await r.content.read(MAX_MANIFEST_BYTES + 1)
    if len(raw) > MAX_MANIFEST_BYTES:
        raise FetchError("manifest too large")
    try:
        manifest = msgspec.json.decode(raw, type=VersionManifest)
    except msgspec.DecodeError as e:
        raise FetchError(f"bad manifest: {e}") from None
    if expect_version is not None and manifest.version != expect_version:
        raise FetchError(f"manifest is for version {manifest.version}, expected {expect_version}")
    final = dest_root / version_name(manifest.version)
    if final.exists():
        return final
    tmp = dest_root / f".{version_name(manifest.version)}.part"
    shutil.rmtree(tmp, ignore_errors=True)
    tmp.mkdir(parents=True)
    base = manifest_url.rsplit("/", 1)[0]
    try:
        for f in manifest.files:
            if not _safe_name(f.name) or not 0 <= f.size <= MAX_FILE_BYTES:
                raise FetchError(f"manifest names an unsafe file {f.name!r}")
            h, got = hashlib.sha256(), 0
            async with session.get(f"{base}/{f.name}") as r:
                if r.status != 200:
                    raise FetchError(f"{f.name}: HTTP {r.status}")
                with open(tmp / f.name, "wb") as out:
                    async for chunk in r.content.iter_chunked(1 << 20):
                        got += len(chunk)
                        if got > f.size:
                            raise FetchError(f"{f.name}: more bytes than the manifest says")
                        h.update(chunk)
                        out.write(chunk)
            if got != f.size or h.hexdigest() != f.sha256:
                raise FetchError(f"{f.name}: size or sha256 does not match the manifest")
        (tmp / "manifest.json").write_bytes(raw)
        tmp.rename(final)
    except BaseException:
        shutil.rmtree(tmp, ignore_errors=True)
        raise
    return final


def prune_versions(root: Path, keep: int) -> None:
    """Keep the newest `keep` complete versions under root."""
    done = sorted(p for p in root.glob("v*") if p.is_dir() and p.name[1:].isdigit())
    for p in done[:-keep] if keep > 0 else done:
        shutil.rmtree(p, ignore_errors=True)
