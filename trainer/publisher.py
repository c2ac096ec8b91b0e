"""Writes each policy version as an HF directory with sharded safetensors.

Layout: RUN/versions/v{N}/ holds config, tokenizer files, and `model-0000i-of-0000n.safetensors` shards
with their `model.safetensors.index.json`. A version appears under its final name only once complete
(written to a temporary name, then renamed), so nothing can serve or load half a version. The relay
tree's origin then hashes and signs it (broadcast/manifest.py). The last `keep` versions are kept;
`snapshot` keeps one for good under RUN/snapshots/ (hard links: no copy, and retention cannot touch it).
"""

from __future__ import annotations

import json
import logging
import os
import shutil
from pathlib import Path

import torch
from safetensors.torch import save_file

from swarm_common.atomic import building_dir, write_atomic
from trainer.policy import tensor_identity

log = logging.getLogger(__name__)

# The highest version ever signed with RUN/trainer.key, kept beside it: a run whose versions/ was emptied
# (a demo starts afresh each time, keeping its key) must not number from 0 again, or a node that still
# holds the earlier v398, signed by the same key, would load it as this run's v398 (seen: both demo nodes
# then failed their audits and were banned).
LAST_SIGNED = "trainer.last_version"


def last_signed(run_dir: Path) -> int:
    """The highest version signed with this run dir's key, -1 if none is on record."""
    try:
        return int((Path(run_dir) / LAST_SIGNED).read_text())
    except (OSError, ValueError):
        return -1


def record_signed(run_dir: Path, version: int) -> None:
    if version > last_signed(run_dir):
        write_atomic(Path(run_dir) / LAST_SIGNED, f"{version}\n")

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


def tied_keys(model) -> set[str]:
    """Names the model declares as tied to another weight (an LM head that is the input embedding): HF
    checkpoints leave them out, and loaders (transformers, vLLM) re-tie them."""
    keys = getattr(model, "_tied_weights_keys", None) or {}
    return set(keys) if model.config.tie_word_embeddings else set()


def write_shards(state: dict[str, torch.Tensor], out: Path, max_shard_bytes: int, skip: set[str]) -> None:
    """HF's sharded safetensors layout (model-0000i-of-0000n.safetensors and the index, or one
    model.safetensors), written straight with safetensors. A tensor shared under several names is
    written once, under a name not in `skip`. (model.save_pretrained writes the same files, measured for
    SmolLM2's 0.54 GB here in 0.7 s against 0.14 s this way: a version is on the critical path.)"""
    names: dict[tuple, str] = {}
    for k, v in state.items():  # one name per tensor: the first one not in `skip`
        ident = tensor_identity(v)
        if ident not in names or (names[ident] in skip and k not in skip):
            names[ident] = k
    keep = set(names.values())
    shards: list[dict[str, torch.Tensor]] = [{}]
    size = total = 0
    for k, v in state.items():
        if k not in keep:
            continue
        n = v.numel() * v.element_size()
        if shards[-1] and size + n > max_shard_bytes:
            shards.append({})
            size = 0
        shards[-1][k] = v.contiguous()
        size += n
        total += n
    if len(shards) == 1:
        save_file(shards[0], out / "model.safetensors", metadata={"format": "pt"})
        return
    weight_map = {}
    for i, shard in enumerate(shards, 1):
        name = f"model-{i:05d}-of-{len(shards):05d}.safetensors"
        save_file(shard, out / name, metadata={"format": "pt"})
        weight_map.update(dict.fromkeys(shard, name))
    index = {"metadata": {"total_size": total}, "weight_map": weight_map}
    (out / "model.safetensors.index.json").write_text(json.dumps(index, indent=2, sort_keys=True) + "\n")


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
        self.root.mkdir(parents=True, exist_ok=True)
        with building_dir(final) as tmp:
            write_shards(model.state_dict() if state is None else state, tmp, self.max_shard_bytes,
                         tied_keys(model))
            model.config.save_pretrained(tmp)
            for name in _SIDE_FILES:
                src = self.base / name
                if src.exists() and not (tmp / name).exists():
                    shutil.copy2(src, tmp / name)
        self._retain(version)
        return final

    def snapshot(self, version: int, name: str) -> Path:
        """Keep published `version` as RUN/snapshots/NAME, a loadable HF directory."""
        dest = self.root.parent / "snapshots" / name
        dest.parent.mkdir(parents=True, exist_ok=True)
        with building_dir(dest) as tmp:
            for f in self.path(version).iterdir():
                try:
                    os.link(f, tmp / f.name)
                except OSError:  # a file system without hard links
                    shutil.copy2(f, tmp / f.name)
        return dest

    def versions(self) -> list[int]:
        return sorted(int(p.name[1:]) for p in self.root.glob("v*") if p.name[1:].isdigit())

    def _retain(self, newest: int) -> None:
        for v in self.versions():
            if v <= newest - self.keep:
                shutil.rmtree(self.path(v), ignore_errors=True)
                log.debug("retention: removed version %d", v)
