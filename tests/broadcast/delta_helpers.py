"""Versions that change a little from one to the next, as a training run's do, for the delta tests."""

from __future__ import annotations

import json
from pathlib import Path

import numpy as np
from safetensors.numpy import save_file

N = 200_000  # uint16 elements (the width of bf16): 400 kB of weights per version


def model_version(d: Path, step: int, n: int = N) -> Path:
    """Step `step` of a fake run: the step-0 weights with 1% of the elements redrawn at each step since."""
    d.mkdir(parents=True, exist_ok=True)
    w = np.random.default_rng(0).integers(0, 1 << 16, n, dtype=np.uint16)
    for s in range(1, step + 1):
        r = np.random.default_rng(1000 + s)
        idx = r.choice(n, n // 100, replace=False)
        w[idx] = r.integers(0, 1 << 16, len(idx), dtype=np.uint16)
    save_file({"w": w, "b": w[:1000].copy()}, str(d / "model.safetensors"))
    (d / "config.json").write_text(json.dumps({"step": step}))
    return d


def same_model(got: Path, want: Path) -> bool:
    """`got` holds every file of `want`, byte for byte."""
    names = [p.name for p in want.iterdir() if p.is_file() and p.name != "manifest.json"]
    return bool(names) and all((got / n).is_file() and (got / n).read_bytes() == (want / n).read_bytes()
                               for n in names)
