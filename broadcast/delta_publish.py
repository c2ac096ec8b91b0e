"""The origin's side of delta versions: publish a version whole or as a delta, and serve its files whole.

A version goes out as a delta against the one before it, except every `full_every`-th version, when asked,
when there is no earlier version to encode against, and when the delta would not be smaller than the
version itself. The delta's payload is written under the origin's own directory; the trainer's version
directory stays as it is (it is the base of the next delta, and what a node without the base fetches).
"""

from __future__ import annotations

import logging
import shutil
import time
from pathlib import Path

from aiohttp import web

from swarm_common.keys import KeyPair

from .delta import encode, list_files
from .manifest import Manifest, build_manifest
from .ratelimit import RateLimiter
from .serving import MAX_VERSION, parse_int

log = logging.getLogger("broadcast.delta")
CHUNK = 1 << 20


def _dir_size(d: Path) -> int:
    return sum((d / r).stat().st_size for r in list_files(d))


def delta_piece_size(payload: int, piece_size: int) -> int:
    """A delta's pieces: about 32 of them (a power of two, at least 256 KiB, at most `piece_size`). In the
    full versions' pieces a delta is a few pieces per tree, and every hop stores and forwards a whole one:
    simulated at N = 1000 with churn, a 13.5 MB delta took 2.85x the fluid bound in 1 MiB pieces, 1.76x in
    512 KiB and 1.71x in 256 KiB ones, on average over five draws, before the origin's uplink probes
    (docs/tree-simulation.md)."""
    size = 256 << 10
    while size < piece_size and payload > 32 * size:
        size *= 2
    return min(size, piece_size)


def build_version(version_dir: Path, version: int, parent: int | None, keypair: KeyPair, piece_size: int,
                  base_dir: Path | None, delta_dir: Path) -> tuple[Manifest, Path]:
    """Sign `version_dir` as version `version`: as a delta against `parent` (held in `base_dir`) when one is
    given and it comes out smaller, else whole. Returns the manifest and the directory its pieces are in.
    (Runs in a worker thread: encoding and hashing let go of the GIL.)"""
    if base_dir is not None and parent is not None and base_dir.is_dir():
        t0 = time.perf_counter()
        shutil.rmtree(delta_dir, ignore_errors=True)
        target, size = encode(base_dir, parent, version_dir, delta_dir)
        full = sum(t.size for t in target)
        if size < full:
            m = build_manifest(delta_dir, version, parent, keypair, delta_piece_size(size, piece_size),
                               base=parent, target=target)
            log.info("v%d as a delta against v%d: %d bytes, %.2f%% of %d, in %.2fs", version, parent, size,
                     100 * size / max(full, 1), full, time.perf_counter() - t0)
            return m, delta_dir
        log.info("v%d: a delta would be %d bytes against %d whole; publishing it whole", version, size, full)
        shutil.rmtree(delta_dir, ignore_errors=True)
    return build_manifest(version_dir, version, parent, keypair, piece_size), version_dir


def want_delta(full: bool | None, since_full: int, full_every: int) -> bool:
    """`full`: True forces a full version, False asks for a delta, None follows the every-K rule."""
    if full is not None:
        return not full
    return full_every > 1 and since_full + 1 < full_every


async def serve_file(request: web.Request, manifests: dict[int, Manifest], dirs: dict[int, Path],
                     limiter: RateLimiter) -> web.StreamResponse:
    """GET /v/{version}/file/{path}: a file of a version whole, for a node that cannot apply its delta.
    Only the signed manifest's target paths are served (no other path can be named); the node checks the
    file's sha256 against that manifest."""
    version = parse_int(request.match_info["version"], MAX_VERSION, "version")
    rel = request.match_info["path"]
    m, d = manifests.get(version), dirs.get(version)
    names = {t.path: t.size for t in m.target} if m is not None else {}
    if m is not None and m.base is None:
        names = {f.path: f.size for f in m.files}
    if d is None or rel not in names or not (d / rel).is_file():
        raise web.HTTPNotFound(text=f"no file {rel[:100]!r} of v{version} here")
    resp = web.StreamResponse(headers={"Content-Type": "application/octet-stream"})
    resp.content_length = names[rel]
    await resp.prepare(request)
    try:
        with open(d / rel, "rb") as f:
            while chunk := f.read(CHUNK):
                await limiter.acquire(len(chunk))
                await resp.write(chunk)
    except ConnectionResetError:
        return resp
    await resp.write_eof()
    return resp
