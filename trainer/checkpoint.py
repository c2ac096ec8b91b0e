"""Trainer checkpoints: model, optimizer, step and version, data cursor, RNG states, run history.

A checkpoint is written into a hidden temporary directory and renamed to RUN/checkpoints/step-NNNNNN
only when complete: a crash mid-write leaves the previous checkpoint as the newest complete one. The
accepted rollouts not yet trained on need no copy here: they are in the ledger (trainer/ledger.py),
which is cut back to the checkpoint's step on resume.
"""

from __future__ import annotations

import random
import shutil
from pathlib import Path

import msgspec
import torch

from rewards.base import TaskItem
from swarm_common.atomic import building_dir
from trainer.stats import EvalRow, StepRow


class TrainerState(msgspec.Struct):
    step: int
    version: int
    items_drawn: int  # the training prompt stream's cursor
    retry: list[TaskItem]  # prompts waiting to be re-assigned
    server_rng: str  # repr of random.Random.getstate(), restored with eval-free parsing below
    steps: list[StepRow]
    evals: list[EvalRow]
    accepted_groups: int
    tokens: int
    dropped: dict[str, int]
    refused: dict[str, int]
    elapsed_s: float


def _rng_to_str(rng: random.Random) -> str:
    version, internal, gauss = rng.getstate()
    return msgspec.json.encode([version, list(internal), gauss]).decode()


def _rng_from_str(text: str) -> tuple:
    version, internal, gauss = msgspec.json.decode(text)
    return (version, tuple(internal), gauss)


def checkpoint_dir(run_dir: str | Path) -> Path:
    return Path(run_dir) / "checkpoints"


def save_checkpoint(run_dir: str | Path, model, optimizer, state: TrainerState, keep: int = 2) -> Path:
    root = checkpoint_dir(run_dir)
    root.mkdir(parents=True, exist_ok=True)
    final = root / f"step-{state.step:06d}"
    with building_dir(final) as tmp:
        model.save_pretrained(tmp, safe_serialization=True)
        torch.save({"optimizer": optimizer.state_dict(), "torch_rng": torch.get_rng_state()}, tmp / "optimizer.pt")
        (tmp / "state.json").write_bytes(msgspec.json.encode(state))
    for old in sorted(root.glob("step-*"))[:-keep]:
        shutil.rmtree(old, ignore_errors=True)
    return final


def latest_checkpoint(run_dir: str | Path) -> Path | None:
    found = sorted(p for p in checkpoint_dir(run_dir).glob("step-*") if (p / "state.json").exists())
    return found[-1] if found else None


def load_checkpoint(path: Path, model, optimizer) -> TrainerState:
    """Restore `model` and `optimizer` from a checkpoint of this module's (a sharded trainer's is read by
    trainer/dist_checkpoint.py; Learner.load takes either)."""
    from safetensors.torch import load_file

    weights = {}
    for f in sorted(path.glob("*.safetensors")):
        weights.update(load_file(f))
    missing, unexpected = model.load_state_dict(weights, strict=False)
    # Tied embeddings are saved once; anything else missing is a broken checkpoint.
    if unexpected or [m for m in missing if "lm_head" not in m]:
        raise RuntimeError(f"checkpoint {path} does not match the model: missing {missing}, unexpected {unexpected}")
    if getattr(model.config, "tie_word_embeddings", False):
        model.tie_weights()
    blob = torch.load(path / "optimizer.pt", weights_only=False)
    optimizer.load_state_dict(blob["optimizer"])
    torch.set_rng_state(blob["torch_rng"])
    return msgspec.json.decode((path / "state.json").read_bytes(), type=TrainerState)


def rng_state(rng: random.Random) -> str:
    return _rng_to_str(rng)


def restore_rng(rng: random.Random, text: str) -> None:
    rng.setstate(_rng_from_str(text))
