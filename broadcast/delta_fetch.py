"""A peer's side of delta versions: turn a delta's verified pieces into the files of the version.

Called once every piece of a delta version is verified (the version is still in partial/, and its pieces
are served to children meanwhile). The version's files are rebuilt from the base version into a scratch
directory, every file is checked against the sha256 the signed manifest gives for it, and only then moved
beside the pieces; the store then publishes the whole directory with one rename. So what a node loads is
exactly what the trainer signed, and nothing half-applied is ever under versions/.

Without the base (a late joiner, a peer that missed versions) the peer fetches the chain of versions that
leads to it from something it holds, or from the newest full version, when those bytes are fewer than the
version whole; else, and whenever the chain is missing, refused (a manifest not signed by the pinned key)
or the delta does not reproduce the signed files, it fetches the version's files whole from the origin,
each checked against the same signed sha256.
"""

from __future__ import annotations

import asyncio
import hashlib
import logging
import os
import shutil
from pathlib import Path
from typing import TYPE_CHECKING, Protocol
from urllib.parse import quote

import aiohttp

from .delta import PAYLOAD, DeltaError, apply
from .errors import FetchError
from .manifest import Manifest, TargetFile
from .piece_pass import file_name

if TYPE_CHECKING:
    from .store import VersionState

log = logging.getLogger("broadcast.delta")
MAX_CHAIN = 64  # versions walked back looking for a base
WHOLE_CONCURRENCY = 4
RECV = 1 << 20


class Versions(Protocol):
    """What delta fetching needs of the peer's versions (downloads.Downloads)."""

    origin_url: str

    @property
    def session(self) -> aiohttp.ClientSession: ...
    def held(self, version: int) -> Path | None: ...
    def pending(self, version: int) -> asyncio.Task | None: ...
    def ensure(self, version: int) -> asyncio.Task: ...
    async def manifest(self, version: int) -> Manifest: ...
    def pass_headers(self, name: str) -> dict[str, str]: ...


async def materialize(versions: Versions, st: VersionState) -> None:
    """Put the verified files of delta version `st` beside its pieces in st.dir, or raise FetchError."""


    m = st.manifest
    scratch = st.dir.with_name(st.dir.name + ".build")
    await asyncio.to_thread(shutil.rmtree, scratch, True)
    try:
        base_dir = await _obtain_base(versions, m)
        applied = False
        if base_dir is not None:
            try:
                await asyncio.to_thread(apply, base_dir, st.dir / PAYLOAD, m.target, m.base, scratch)
                applied = True
            except (DeltaError, OSError) as e:
                log.error("v%d: REFUSED the delta against v%d (%s); fetching the full version", m.version,
                          m.base, e)
                await asyncio.to_thread(shutil.rmtree, scratch, True)
        if not applied:
            try:
                await _fetch_whole(versions, m, scratch)
            except (OSError, aiohttp.ClientError, TimeoutError) as e:
                raise FetchError(f"v{m.version}: could not fetch the full version: {e}") from e
        for t in m.target:  # every file verified: now they join the pieces
            dest = st.dir / t.path
            dest.parent.mkdir(parents=True, exist_ok=True)
            os.replace(scratch / t.path, dest)
        log.info("v%d: %s", m.version, f"rebuilt from v{m.base} and its delta" if applied else "fetched whole")
    finally:
        await asyncio.to_thread(shutil.rmtree, scratch, True)


async def _obtain_base(versions: Versions, m: Manifest) -> Path | None:
    """The directory of the base, held or fetched; None when the full version is the better (or only) way."""
    assert m.base is not None
    if (d := versions.held(m.base)) is not None:
        return d
    task = versions.pending(m.base)
    if task is None:
        if not await _chain_is_cheaper(versions, m):
            return None
        task = versions.ensure(m.base)
    try:
        await asyncio.shield(task)
    except Exception as e:  # noqa: BLE001 - any failure of the base means: take the full version
        log.warning("v%d: its base v%d could not be had (%s)", m.version, m.base, e)
        return None
    return versions.held(m.base)


async def _chain_is_cheaper(versions: Versions, m: Manifest) -> bool:
    """Walk the bases back to one held (or on its way) or a full version, adding up their sizes; True when
    that chain is complete, signed, and smaller than this version whole."""


    whole = sum(t.size for t in m.target)
    cost, cur, path = 0, m.base, []
    for _ in range(MAX_CHAIN):
        assert cur is not None
        if versions.held(cur) is not None or versions.pending(cur) is not None:
            break
        try:
            mm = await versions.manifest(cur)  # refused unless signed by the pinned key
        except FetchError as e:
            log.warning("v%d: the chain to its base breaks at v%d (%s); fetching the full version", m.version,
                        cur, e)
            return False
        cost += mm.total_size
        path.append(cur)
        if mm.base is None:
            break
        cur = mm.base
    else:
        return False
    cheaper = cost < whole
    log.info("v%d: base v%d not held; the chain %s is %d bytes, the full version %d: fetching %s", m.version,
             m.base, ",".join(f"v{v}" for v in reversed(path)), cost, whole,
             "the chain" if cheaper else "the full version")
    return cheaper


async def _fetch_whole(versions: Versions, m: Manifest, scratch: Path) -> None:
    sem = asyncio.Semaphore(WHOLE_CONCURRENCY)

    async def one(t: TargetFile) -> None:
        async with sem:
            await _fetch_file(versions, m.version, t, scratch)

    await asyncio.gather(*(one(t) for t in m.target))


async def _fetch_file(versions: Versions, version: int, t: TargetFile, scratch: Path) -> None:
    """One file of the version whole from the origin, kept only if it has the signed size and sha256."""


    dest = scratch / t.path
    dest.parent.mkdir(parents=True, exist_ok=True)
    h, got = hashlib.sha256(), 0
    async with versions.session.get(f"{versions.origin_url}/v/{version}/file/{quote(t.path)}",
                                    headers=versions.pass_headers(file_name(version, t.path))) as r:
        if r.status != 200:
            raise FetchError(f"the origin answered {r.status} for {t.path} of v{version}")
        with open(dest, "wb") as f:
            async for chunk in r.content.iter_chunked(RECV):
                got += len(chunk)
                if got > t.size:
                    break
                h.update(chunk)
                f.write(chunk)
    if got != t.size or h.hexdigest() != t.sha256:
        log.error("REFUSED %s of v%d from the origin: %d bytes, not the signed file", t.path, version, got)
        raise FetchError(f"{t.path} of v{version} from the origin does not match the signed manifest")
