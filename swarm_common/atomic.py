"""Whole or not at all: files and directories that a crash can never leave half-written under their name.

Write beside the target, then rename over it (atomic on POSIX). Nothing here fsyncs: the callers that
need durability say so themselves (a version re-hashes its pieces on start instead; see broadcast/store.py).
"""

from __future__ import annotations

import os
import shutil
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path


def write_atomic(path: str | Path, data: bytes | str, mode: int = 0o644) -> None:
    """Replace `path` with `data` (bytes, or text written as UTF-8); a reader sees the old or the new file."""
    path = Path(path)
    tmp = path.with_name(f".{path.name}.tmp")
    fd = os.open(tmp, os.O_WRONLY | os.O_CREAT | os.O_TRUNC, mode)
    with os.fdopen(fd, "wb") as f:
        f.write(data.encode() if isinstance(data, str) else data)
    os.replace(tmp, path)


def replace_dir(src: Path, dest: Path) -> None:
    """Put the finished directory `src` at `dest`, replacing what is there."""
    if dest.exists():
        shutil.rmtree(dest)
    os.replace(src, dest)


@contextmanager
def building_dir(dest: str | Path) -> Iterator[Path]:
    """Yield an empty scratch directory beside `dest`; when the block ends without error it becomes `dest`.

    A crash inside the block leaves only the hidden scratch directory (cleared at the next attempt), so
    `dest` is never seen half-written."""
    dest = Path(dest)
    tmp = dest.with_name(f".{dest.name}.tmp")
    shutil.rmtree(tmp, ignore_errors=True)
    tmp.mkdir(parents=True)
    try:
        yield tmp
    except BaseException:
        shutil.rmtree(tmp, ignore_errors=True)
        raise
    replace_dir(tmp, dest)
