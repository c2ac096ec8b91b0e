"""Supervised warm-up on the task's format, as real RL runs start from an SFT checkpoint.

It is deliberately short: the model learns the answer format and some of the skill, and GRPO takes
it from there. The warm-up is deterministic (seeded data and init), so the RL run's start is too.
"""

from __future__ import annotations

import itertools
import logging
from pathlib import Path

import torch
from tqdm import tqdm

from rewards.base import Task
from trainer.policy import encode_prompt, pack, sequence_logprobs

log = logging.getLogger(__name__)


def sft_warmup(
    model,
    tokenizer,
    task: Task,
    steps: int,
    batch_size: int = 64,
    lr: float = 3e-3,
    seed: int = 1234,
    out_dir: str | Path | None = None,
    progress: bool = True,
) -> None:
    torch.manual_seed(seed)
    opt = torch.optim.AdamW(model.parameters(), lr=lr, weight_decay=0.0)
    sched = torch.optim.lr_scheduler.LambdaLR(opt, lambda s: min(1.0, (s + 1) / 50))
    items = task.train_items(seed=seed)
    eos = tokenizer.eos_token_id
    model.train()
    bar = tqdm(range(steps), desc="sft warm-up", disable=not progress, unit="step")
    for _ in bar:
        batch_items = list(itertools.islice(items, batch_size))
        prompts = [encode_prompt(tokenizer, it.prompt, task.system_prompt) for it in batch_items]
        answers = [tokenizer(it.answer, add_special_tokens=False)["input_ids"] + [eos] for it in batch_items]
        b = pack(prompts, answers, None, tokenizer.pad_token_id)
        logp = sequence_logprobs(model, b)
        loss = -(logp * b.completion_mask).sum() / b.completion_mask.sum()
        opt.zero_grad(set_to_none=True)
        loss.backward()
        opt.step()
        sched.step()
        bar.set_postfix(loss=f"{loss.item():.3f}")
    model.eval()
    if out_dir is not None:
        model.save_pretrained(out_dir, safe_serialization=True)
        tokenizer.save_pretrained(out_dir)
