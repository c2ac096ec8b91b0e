"""Writes each policy version as an HF directory with sharded safetensors and a sha256 manifest.

Layout: RUN/versions/v{N}/ holds config, tokenizer files, `model-0000i-of-0000n.safetensors` shards
with their `model.safetensors.index.json`, and `manifest.json` (every file's size and sha256). A
version appears under its final name only once complete (written to a temporary name, then renamed),
so nothing can serve or load half a version. The last `keep` versions are kept.
"""

from __future__ import annotations

import logging
import shutil
import time
from pathlib import Path

import msgspec

from swarm.protocol import FileHash, VersionManifest
from swarm.weights import sha256_file, version_name

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


class Publisher:
    def __init__(self, run_dir: str | Path, base_model_dir: str | Path, keep: int = 3, max_shard_bytes: int = 2 << 20):
        self.root = Path(run_dir) / "versions"
        self.root.mkdir(parents=True, exist_ok=True)
        self.base = Path(base_model_dir)
        self.keep = keep
        self.max_shard_bytes = max_shard_bytes

    def path(self, version: int) -> Path:
        return self.root / version_name(version)

    def publish(self, model, version: int) -> VersionManifest:
        """Write `model`'s weights as version `version`; returns its manifest."""
        final = self.path(version)
        tmp = self.root / f".{version_name(version)}.tmp"
        shutil.rmtree(tmp, ignore_errors=True)
        tmp.mkdir(parents=True)
        model.save_pretrained(tmp, safe_serialization=True, max_shard_size=self.max_shard_bytes)
        for name in _SIDE_FILES:
            src = self.base / name
            if src.exists() and not (tmp / name).exists():
                shutil.copy2(src, tmp / name)
        files = [
            FileHash(p.name, p.stat().st_size, sha256_file(p)) for p in sorted(tmp.iterdir()) if p.is_file()
        ]
        manifest = VersionManifest(version=version, files=files, created=time.time())
        (tmp / "manifest.json").write_bytes(msgspec.json.encode(manifest))
        shutil.rmtree(final, ignore_errors=True)
        tmp.rename(final)
        self._retain(version)
        return manifest

    def manifest(self, version: int) -> VersionManifest | None:
        p = self.path(version) / "manifest.json"
        return msgspec.json.decode(p.read_bytes(), type=VersionManifest) if p.exists() else None

    def versions(self) -> list[int]:
        return sorted(int(p.name[1:]) for p in self.root.glob("v*") if p.name[1:].isdigit())

    def _retain(self, newest: int) -> None:
        for v in self.versions():
            if v <= newest - self.keep:
                shutil.rmtree(self.path(v), ignore_errors=True)
                log.debug("retention: removed version %d", v)
