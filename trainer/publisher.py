"""Writes each policy version as an HF directory with sharded safetensors.

Layout: RUN/versions/v{N}/ holds config, tokenizer files, and `model-0000i-of-0000n.safetensors` shards
with their `model.safetensors.index.json`. A version appears under its final name only once complete
(written to a temporary name, then renamed), so nothing can serve or load half a version. The relay
tree's origin then hashes and signs it (broadcast/manifest.py). The last `keep` versions are kept;
`snapshot` keeps one for good under RUN/snapshots/ (hard links: no copy, and retention cannot touch it).
"""

from __future__ import annotations

import logging
import os
import shutil
from pathlib import Path

log = logging.getLogger(__name__)

# Tokenizer and config files copied from the base model into every version, so a node needs nothing else.
_SIDE_FILES = (
    "config.json",
    "generation_config.json",
    "tokenizer.json",
    "tokenizer_config.json",
    "special_tokens_map.json",
    "chat_template.jinja",
    "vocab.json",
    "merges.txt",
)


def version_name(version: int) -> str:
    return f"v{version:06d}"


class Publisher:
    def __init__(self, run_dir: str | Path, base_model_dir: str | Path, keep: int = 3, max_shard_bytes: int = 2 << 20):
        self.root = Path(run_dir) / "versions"
        self.root.mkdir(parents=True, exist_ok=True)
        self.base = Path(base_model_dir)
        self.keep = keep
        self.max_shard_bytes = max_shard_bytes

    def path(self, version: int) -> Path:
        return self.root / version_name(version)

    def publish(self, model, version: int, state: dict | None = None) -> Path:
        """Write `model`'s weights (or `state`, a frozen copy of them) as version `version`; returns its
        directory."""
        final = self.path(version)
        tmp = self.root / f".{version_name(version)}.tmp"
        shutil.rmtree(tmp, ignore_errors=True)
        tmp.mkdir(parents=True)
        # save_pretrained deletes tied keys from the dict it is given: hand it a copy, the caller's is shared.
        state = None if state is None else dict(state)
        model.save_pretrained(tmp, state_dict=state, safe_serialization=True, max_shard_size=self.max_shard_bytes)
        for name in _SIDE_FILES:
            src = self.base / name
            if src.exists() and not (tmp / name).exists():
                shutil.copy2(src, tmp / name)
        shutil.rmtree(final, ignore_errors=True)
        tmp.rename(final)
        self._retain(version)
        return final

    def snapshot(self, version: int, name: str) -> Path:
        """Keep published `version` as RUN/snapshots/NAME, a loadable HF directory."""
        dest = self.root.parent / "snapshots" / name
        tmp = dest.with_name(f".{name}.tmp")
        shutil.rmtree(tmp, ignore_errors=True)
        tmp.mkdir(parents=True)
        for f in self.path(version).iterdir():
            try:
                os.link(f, tmp / f.name)
            except OSError:  # a file system without hard links
                shutil.copy2(f, tmp / f.name)
        shutil.rmtree(dest, ignore_errors=True)
        tmp.rename(dest)
        return dest

    def versions(self) -> list[int]:
        return sorted(int(p.name[1:]) for p in self.root.glob("v*") if p.name[1:].isdigit())

    def _retain(self, newest: int) -> None:
        for v in self.versions():
            if v <= newest - self.keep:
                shutil.rmtree(self.path(v), ignore_errors=True)
                log.debug("retention: removed version %d", v)
