"""Held-out evaluation of an environment: greedy episodes with the trainer's own model, batched by turn.

Each episode runs by the same rules as a node's (rewards/token_episode.py): the trainer's model writes a
turn greedily, the environment answers, until the episode ends. Accuracy is the environment's correct
metric; the figures also give the mean reward, turns and tool calls per episode. `evaluate_task` picks
this or a single answer's evaluation (learner.evaluate) by the task's kind.
"""

from __future__ import annotations

import torch

from rewards.base import Task, TaskItem
from rewards.environment import Environment
from rewards.token_episode import TokenEpisode, prompt_ids
from trainer.learner import evaluate


@torch.no_grad()
def greedy_turns(model, tokenizer, seqs: list[list[int]], budgets: list[int], stop_id: int) -> list[list[int]]:
    """Each sequence's next turn, greedy: up to and including the stop token, or its budget of tokens."""
    dev = next(model.parameters()).device
    pad = tokenizer.pad_token_id
    L = max(len(s) for s in seqs)
    ids = torch.full((len(seqs), L), pad, dtype=torch.long)
    attn = torch.zeros_like(ids)
    for i, s in enumerate(seqs):
        ids[i, L - len(s) :] = torch.tensor(s)
        attn[i, L - len(s) :] = 1
    out = model.generate(input_ids=ids.to(dev), attention_mask=attn.to(dev), max_new_tokens=max(budgets),
                         do_sample=False, eos_token_id=stop_id, pad_token_id=pad)
    turns = []
    for row, budget in zip(out[:, L:].tolist(), budgets, strict=True):
        row = row[:budget]
        if stop_id in row:
            row = row[: row.index(stop_id) + 1]
        turns.append(row)
    return turns


def evaluate_episodes(model, tokenizer, env: Environment, items: list[TaskItem], max_tokens: int,
                      max_episode_tokens: int, batch: int = 64) -> dict[str, float]:
    model.eval()
    totals = {"accuracy": 0.0, "reward_mean": 0.0, "turns": 0.0, "tool_calls": 0.0}
    for lo in range(0, len(items), batch):
        chunk = items[lo : lo + batch]
        eps = [TokenEpisode(env, it, tokenizer, max_tokens, max_episode_tokens) for it in chunk]
        prompts = [prompt_ids(env, tokenizer, it) for it in chunk]
        while active := [i for i, te in enumerate(eps) if not te.done]:
            turns = greedy_turns(model, tokenizer, [prompts[i] + eps[i].ids for i in active],
                                 [eps[i].turn_budget() for i in active], eps[active[0]].stop_id)
            for i, turn in zip(active, turns, strict=True):
                eps[i].add_turn(turn, [0.0] * len(turn))
        for te in eps:
            s = te.score()
            totals["accuracy"] += s.metrics.get(env.correct_metric, 0.0)
            totals["reward_mean"] += s.reward
            totals["turns"] += te.turns
            totals["tool_calls"] += te.episode.tool_calls
    n = max(len(items), 1)
    return {k: v / n for k, v in totals.items()}


def evaluate_task(model, tokenizer, task: Task, items: list[TaskItem], max_tokens: int,
                  max_episode_tokens: int) -> dict[str, float]:
    """Greedy accuracy and mean reward on `items`: whole episodes for an environment, one answer otherwise."""
    if isinstance(task, Environment):
        return evaluate_episodes(model, tokenizer, task, items, max_tokens, max_episode_tokens)
    return evaluate(model, tokenizer, task, items, max_tokens)
