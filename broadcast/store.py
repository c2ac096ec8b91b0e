"""On-disk versions: verified pieces only, resumable partial downloads, retention of the newest K.

Layout under a peer's data_dir:
  versions/v<N>/...        complete, every piece verified, manifest.json written last
  partial/v<N>/...         in flight: files pre-sized, `have.log` lists verified piece indices
A version moves from partial/ to versions/ by one rename, so nothing ever sees a half-verified version.
"""

from __future__ import annotations

import asyncio
import logging
import os
import re
import shutil
from pathlib import Path

from swarm_common.atomic import replace_dir

from .delta import targets_ok
from .manifest import (
    MANIFEST_NAME,
    Manifest,
    ManifestError,
    PieceRef,
    encode_manifest,
    flat_pieces,
    load_manifest,
)

log = logging.getLogger("broadcast.store")
HAVE_LOG = "have.log"
_VDIR = re.compile(r"^v(\d{1,12})$")
READ_CHUNK = 1 << 20


class VersionState:
    """One version being served and/or downloaded; `have` tracks verified pieces."""

    def __init__(self, manifest: Manifest, directory: Path, complete: bool):
        self.manifest = manifest
        self.version = manifest.version
        self.pieces: list[PieceRef] = flat_pieces(manifest)
        self.dir = directory
        self.complete = complete
        self.have = bytearray([1 if complete else 0]) * len(self.pieces)
        self.n_have = len(self.pieces) if complete else 0
        self.abandoned = False
        self._waiters: dict[int, asyncio.Event] = {}
        # Open once per version, not per piece (an open and a close per piece were a fifth of a relay's CPU
        # per 32 KiB piece): files written, files read (pread: no shared position), the log of pieces held.
        self._fds: dict[int, int] = {}
        self._rfds: dict[int, int] = {}
        self._log_fd: int | None = None

    def path_of(self, ref: PieceRef) -> Path:
        return self.dir / ref.path

    async def wait_piece(self, index: int, timeout: float) -> bool:
        """Wait until piece `index` is verified here (pipelining: children ask before we have it)."""
        if self.have[index]:
            return True
        ev = self._waiters.setdefault(index, asyncio.Event())
        try:
            async with asyncio.timeout(timeout):
                await ev.wait()
        except TimeoutError:
            return False
        return bool(self.have[index])

    def mark(self, index: int) -> None:
        if not self.have[index]:
            self.have[index] = 1
            self.n_have += 1
        ev = self._waiters.pop(index, None)
        if ev:
            ev.set()

    def abandon(self) -> None:
        """Wake every waiter; they will see the piece still missing and answer 'not held'."""
        self.abandoned = True
        for ev in self._waiters.values():
            ev.set()
        self._waiters.clear()
        self.close_fds()

    def read_chunks(self, index: int):
        """Yield a verified piece in small chunks, so serving never holds a whole piece twice."""
        ref = self.pieces[index]
        fd = self._rfds.get(ref.file_index)
        if fd is None:
            fd = self._rfds[ref.file_index] = os.open(self.path_of(ref), os.O_RDONLY)
        offset, left = ref.offset, ref.size
        while left > 0:
            chunk = os.pread(fd, min(READ_CHUNK, left), offset)
            if not chunk:
                raise OSError(f"{self.path_of(ref)} is shorter than its manifest says")
            offset += len(chunk)
            left -= len(chunk)
            yield chunk

    def on_disk_ok(self, index: int) -> bool:
        """Piece `index` as it is on disk matches the manifest."""
        ref = self.pieces[index]
        try:
            with open(self.path_of(ref), "rb") as f:
                f.seek(ref.offset)
                return ref.matches(f.read(ref.size))
        except OSError:
            return False

    def write_piece(self, index: int, data: bytes) -> None:
        ref = self.pieces[index]
        fd = self._fds.get(ref.file_index)
        if fd is None:
            fd = self._fds[ref.file_index] = os.open(self.path_of(ref), os.O_WRONLY)
        os.pwrite(fd, data, ref.offset)
        if self._log_fd is None:
            self._log_fd = os.open(self.dir / HAVE_LOG, os.O_WRONLY | os.O_APPEND | os.O_CREAT, 0o644)
        os.write(self._log_fd, b"%d\n" % index)  # after the data: a crash can only lose a piece

    def close_fds(self) -> None:
        # No fsync: the pages are verified in memory and served from it; what a crash loses is re-hashed
        # away on restart (open_partial, Store.scan_complete). Flushing 0.5 GB took 0.5-1.7 s a version.
        for fd in [*self._fds.values(), *self._rfds.values(), *([self._log_fd] if self._log_fd is not None else [])]:
            os.close(fd)
        self._fds.clear()
        self._rfds.clear()
        self._log_fd = None


class Store:
    def __init__(self, data_dir: Path | str, keep: int = 3):
        if keep < 1:
            raise ValueError("keep must be >= 1")
        self.root = Path(data_dir)
        self.keep = keep
        self.complete_dir = self.root / "versions"
        self.partial_dir = self.root / "partial"
        self.complete_dir.mkdir(parents=True, exist_ok=True)
        self.partial_dir.mkdir(parents=True, exist_ok=True)

    def version_path(self, version: int) -> Path:
        return self.complete_dir / f"v{version}"

    def scan_complete(self, trusted_public: bytes) -> dict[int, VersionState]:
        """Complete versions already on disk: manifests re-checked against the pinned key, every piece
        re-hashed. finalize() does not fsync (on the critical path of every version), so after a power
        cut a version may hold torn pages; one that fails is deleted, to be fetched again if needed."""
        out: dict[int, VersionState] = {}
        for d in self.complete_dir.iterdir():
            m = _VDIR.match(d.name)
            if not m or not d.is_dir():
                continue
            try:
                man = load_manifest(d, trusted_public)
            except (OSError, ManifestError) as e:
                log.warning("ignoring %s: %s", d, e)
                continue
            if man.version != int(m.group(1)):
                continue
            st = VersionState(man, d, complete=True)
            bad = next((i for i in range(len(st.pieces)) if not st.on_disk_ok(i)), None)
            if bad is not None:
                log.warning("%s: piece %d does not match its manifest; deleting the version", d, bad)
                shutil.rmtree(d, ignore_errors=True)
                continue
            if man.target and not targets_ok(d, man.target):  # a delta's rebuilt files, checked as well
                log.warning("%s: a rebuilt file does not match its manifest; deleting the version", d)
                shutil.rmtree(d, ignore_errors=True)
                continue
            out[man.version] = st
        return out

    def open_partial(self, manifest: Manifest) -> VersionState:
        """Create or resume a partial download; pieces logged as done are re-hashed before being trusted."""
        d = self.partial_dir / f"v{manifest.version}"
        old_manifest = None
        if (d / MANIFEST_NAME).exists():
            try:
                old_manifest = (d / MANIFEST_NAME).read_bytes()
            except OSError:
                pass
        if old_manifest != encode_manifest(manifest) and d.exists():
            shutil.rmtree(d)  # a different manifest for the same version: start over
        d.mkdir(parents=True, exist_ok=True)
        (d / MANIFEST_NAME).write_bytes(encode_manifest(manifest))
        st = VersionState(manifest, d, complete=False)
        for f in manifest.files:
            p = d / f.path
            p.parent.mkdir(parents=True, exist_ok=True)
            with open(p, "ab") as fh:
                fh.truncate(f.size)  # sparse pre-size, so pieces can land at their offsets in any order
        logged: set[int] = set()
        try:
            for line in (d / HAVE_LOG).read_text().split():
                if line.isdigit() and int(line) < len(st.pieces):
                    logged.add(int(line))
        except OSError:
            pass
        for i in sorted(logged):
            if st.on_disk_ok(i):
                st.mark(i)
        if logged:
            log.info("v%d: resuming with %d/%d verified pieces", manifest.version, st.n_have, len(st.pieces))
        return st

    def finalize(self, st: VersionState) -> Path:
        """All pieces verified: close the files (no fsync, see above), then publish the directory with one
        atomic rename."""
        assert st.n_have == len(st.pieces)
        st.close_fds()
        (st.dir / HAVE_LOG).unlink(missing_ok=True)
        dest = self.version_path(st.version)
        replace_dir(st.dir, dest)
        st.dir = dest
        st.complete = True
        return dest

    def retention(self, protect: set[int] = frozenset()) -> list[int]:
        """Keep the newest `keep` complete versions; delete older complete ones and stale partials.

        Only directories named v<N> that we created are touched; anything else in data_dir is left alone.
        """
        complete = sorted(
            (int(m.group(1)) for d in self.complete_dir.iterdir() if (m := _VDIR.match(d.name)) and d.is_dir()),
            reverse=True,
        )
        removed = []
        for v in complete[self.keep :]:
            if v in protect:
                continue
            shutil.rmtree(self.version_path(v), ignore_errors=True)
            removed.append(v)
        floor = complete[self.keep - 1] if len(complete) >= self.keep else -1
        for d in self.partial_dir.iterdir():
            m = _VDIR.match(d.name)
            if m and d.is_dir() and int(m.group(1)) < floor and int(m.group(1)) not in protect:
                shutil.rmtree(d, ignore_errors=True)
        return removed
