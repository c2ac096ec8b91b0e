"""The model a run starts from: a local HF directory, or the embedded default built and warmed up offline."""

from __future__ import annotations

import hashlib
import itertools
import logging
from pathlib import Path

import msgspec

from model_builders.default_model import build_default_model
from rewards.registry import make_task
from swarm_common.hf_config import hoist_rope_theta
from trainer.config import RunConfig

log = logging.getLogger(__name__)
CHECK_ITEMS = 240  # the warm-up's check (model.sft_until): a standard error of about 0.03 near 0.4
CHECK_SEED = 987_654  # its items' draw from the training split


def prepare_base_model(cfg: RunConfig, progress: bool = True) -> Path:
    """Return the directory of the run's starting policy, building the default one if needed.

    The default is cached under RUN/base-model with a stamp of everything that shaped it, so a rerun
    with the same settings starts at once and a changed setting rebuilds it. A model of your own
    (`model.path`) is used as it is, or, when `model.sft_steps` is set, warmed up on the task's format into
    RUN/base-model the same way (a multi-turn environment's tool calls are a format the model must know).
    With `model.sft_until`, the warm-up stops once its check on training items reaches that accuracy.
    """
    steps = cfg.model.sft_steps
    if cfg.model.path:
        path = Path(cfg.model.path)
        if not (path / "config.json").exists():
            raise FileNotFoundError(f"{path} is not a Hugging Face model directory (no config.json)")
        if steps <= 0:
            return path
    else:
        path, steps = None, 150 if steps < 0 else steps
    out = Path(cfg.run_dir) / "base-model"
    # v3: the chat template renders episodes. A model of your own is named by its config and weights' sizes.
    source = "" if path is None else _fingerprint(path)
    recipe = msgspec.json.encode({"model": cfg.model, "task": cfg.task, "v": 3, "source": source})
    stamp = hashlib.sha256(recipe).hexdigest()
    stamp_file = out / "recipe.sha256"
    if stamp_file.exists() and stamp_file.read_text().strip() == stamp:
        return out
    import torch

    from trainer.policy import load_model, load_tokenizer
    from trainer.sft import sft_warmup

    if path is None:
        log.info("building the default model in %s", out)
        build_default_model(out, seed=cfg.model.seed)
    else:
        log.info("warming %s up on the task's format (%d steps) into %s", path, steps, out)
    if steps > 0:
        torch.manual_seed(cfg.model.seed)
        src = out if path is None else path
        model, tok = load_model(src), load_tokenizer(src)
        task = make_task(cfg.task.name, **cfg.task.params)
        check = _training_accuracy(cfg, task, tok) if cfg.model.sft_until > 0 else None
        sft_warmup(model, tok, task, steps, batch_size=cfg.model.sft_batch, lr=cfg.model.sft_lr,
                   seed=cfg.model.seed + 1, out_dir=out, progress=progress,
                   max_episode_tokens=cfg.task.max_episode_tokens, check=check, until=cfg.model.sft_until)
        hoist_rope_theta(out)  # sft_warmup saved it anew, with rope_theta nested
    stamp_file.write_text(stamp + "\n")
    return out


def _training_accuracy(cfg: RunConfig, task, tok):
    """The warm-up's check: greedy accuracy on CHECK_ITEMS items of the training split (drawn apart from the
    warm-up's own batches), as the run's evaluation scores them. Never the held-out items: choosing where
    to stop by them would be choosing by the test."""
    from trainer.episode_eval import evaluate_task

    items = check_items(task)
    return lambda model: evaluate_task(model, tok, task, items, cfg.train.max_tokens,
                                       cfg.task.max_episode_tokens)["accuracy"]


def check_items(task) -> list:
    """The warm-up check's items: CHECK_ITEMS of the training split, in a draw of their own."""
    return list(itertools.islice(task.train_items(seed=CHECK_SEED), CHECK_ITEMS))


def _fingerprint(path: Path) -> str:
    """What names a model directory's contents cheaply: its config, and its files' names and sizes."""
    files = sorted((f.name, f.stat().st_size) for f in path.iterdir() if f.is_file())
    return hashlib.sha256((path / "config.json").read_bytes() + repr(files).encode()).hexdigest()
