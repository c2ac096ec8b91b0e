"""Supervised warm-up on the task's format, as real RL runs start from an SFT checkpoint.

It is deliberately short: the model learns the answer format and some of the skill, and GRPO takes
it from there. The warm-up is deterministic (seeded data and init), so the RL run's start is too.
"""

from __future__ import annotations

import itertools
import logging
from collections.abc import Callable
from pathlib import Path

import torch
from tqdm import tqdm

from rewards.base import Task
from rewards.environment import Environment
from rewards.token_episode import demonstration_ids, prompt_ids
from trainer.policy import pack, sequence_logprobs

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
    max_episode_tokens: int = 192,
    check: Callable[[object], float] | None = None,
    until: float = 0.0,
    check_every: int = 10,
) -> int:
    """`steps` of supervised learning on the task's answers, or, for an environment, on its worked
    episodes (`Environment.demonstration`: its tool-call format and the turns' shape). With `check` (the
    model -> an accuracy) and `until`, it stops at the first check, every `check_every` steps, that reaches
    `until`. Returns the steps taken."""
    torch.manual_seed(seed)
    opt = torch.optim.AdamW(model.parameters(), lr=lr, weight_decay=0.0)
    sched = torch.optim.lr_scheduler.LambdaLR(opt, lambda s: min(1.0, (s + 1) / 50))
    items = task.train_items(seed=seed)
    eos = tokenizer.eos_token_id
    model.train()
    bar = tqdm(range(steps), desc="sft warm-up", disable=not progress, unit="step")
    env = task if isinstance(task, Environment) else None
    taken, reached = steps, None
    for step in bar:
        batch_items = list(itertools.islice(items, batch_size))
        prompts = [prompt_ids(task, tokenizer, it) for it in batch_items]
        if env is None:  # the answer, then the stop token
            answers = [tokenizer(it.answer, add_special_tokens=False)["input_ids"] + [eos] for it in batch_items]
            b = pack(prompts, answers, None, tokenizer.pad_token_id)
            mask = b.completion_mask
        else:  # a worked episode: the model's turns are trained, the environment's answers only read
            demos = [demonstration_ids(env, tokenizer, it, max_episode_tokens) for it in batch_items]
            b = pack(prompts, [ids for ids, _ in demos], None, tokenizer.pad_token_id)
            mask = torch.zeros_like(b.completion_mask)
            for i, (p, (ids, m)) in enumerate(zip(prompts, demos, strict=True)):
                mask[i, len(p) - 1 : len(p) - 1 + len(ids)] = torch.tensor(m, dtype=mask.dtype)
        logp = sequence_logprobs(model, b)
        loss = -(logp * mask).sum() / mask.sum()
        opt.zero_grad(set_to_none=True)
        loss.backward()
        opt.step()
        sched.step()
        bar.set_postfix(loss=f"{loss.item():.3f}")
        if check is not None and until > 0 and (step + 1) % check_every == 0:
            acc = check(model)
            model.train()
            if acc >= until:
                taken, reached = step + 1, acc
                break
    bar.close()
    model.eval()
    if check is not None and until > 0:
        if reached is None:
            log.warning("the warm-up did not reach %.2f in %d steps; RL starts from where it is", until, steps)
        else:
            log.info("the warm-up reached %.3f (target %.2f) after %d steps", reached, until, taken)
    if out_dir is not None:
        model.save_pretrained(out_dir, safe_serialization=True)
        tokenizer.save_pretrained(out_dir)
    return taken
