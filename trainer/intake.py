"""Rollout intake: every submitted group is checked before it may enter a training batch.

A node is untrusted. What it sends is checked against what the trainer itself handed out and knows:
the assignment (held by this node, answered once, in time), the group size, the token ids and lengths,
finish reasons, log-probs, and the policy version. Rewards are always recomputed here from the
completion text; nothing a node says about quality is used.
"""

from __future__ import annotations

import math
import time
from dataclasses import dataclass

from rewards.base import Task, TaskItem
from swarm_common import protocol as P
from trainer.episode_check import Replayed, as_samples, check_shape


@dataclass
class Held:
    """An assignment the trainer handed out and is waiting for."""

    assignment_id: str
    node_id: str
    item: TaskItem
    prompt_ids: list[int]
    version: int  # the trainer's version when it was assigned
    deadline: float  # time.monotonic()


@dataclass
class Group:
    """An accepted group: one prompt and its G checked samples with recomputed rewards."""

    assignment_id: str
    node_id: str
    item: TaskItem
    prompt_ids: list[int]
    samples: list[P.Sample]  # episodes as samples: every token, log-prob 0 at the environment's
    rewards: list[float]
    correct: list[float]
    version: int  # the policy version the samples came from
    masks: list[list[bool]] | None = None  # episodes: which tokens were sampled (the rest: environment's)


@dataclass(frozen=True)
class Limits:
    group_size: int
    max_tokens: int
    vocab_size: int
    eos_id: int
    max_lag: int
    correct_metric: str = "correct"
    episodes: bool = False  # the task is an environment: rollouts hold episodes, not samples
    max_episode_tokens: int = 0  # an episode's tokens after the prompt, sampled and environment's
    replay_sandbox_s: float = 10.0  # sandbox seconds a submission's replay may spend, per group


def check_sample(s: P.Sample, lim: Limits) -> str | None:
    """The reason code this sample is refused for, or None."""
    n = len(s.token_ids)
    if n == 0 or n > lim.max_tokens or len(s.logprobs) != n:
        return "bad_length"
    if any(t < 0 or t >= lim.vocab_size for t in s.token_ids):
        return "bad_token"
    if any(not math.isfinite(x) or x > 1e-4 for x in s.logprobs):
        return "bad_logprob"
    eos_at = [i for i, t in enumerate(s.token_ids) if t == lim.eos_id]
    if s.finish_reason == "stop" and eos_at != [n - 1]:
        return "bad_finish"  # a stop must end with the stop token, and only there
    if s.finish_reason == "length" and (eos_at or n != lim.max_tokens):
        return "bad_finish"  # a length stop uses every token and never samples the stop token
    return None


def check_version(version: int, current: int, lim: Limits) -> str | None:
    if version > current:
        return "future_version"
    if version < current - lim.max_lag:
        return "stale"
    return None


def check_rollout(r: P.Rollout, held: Held | None, node_id: str, version: int, lim: Limits, now: float | None = None) -> str | None:
    if held is None:
        return "unassigned"  # unknown, already answered (replay), or re-assigned after its deadline
    if held.node_id != node_id:
        return "unassigned"
    if (now if now is not None else time.monotonic()) > held.deadline:
        return "late"
    if version < held.version - lim.max_lag:
        return "stale"
    if len(r.episodes if lim.episodes else r.samples) != lim.group_size or (r.samples if lim.episodes else r.episodes):
        return "wrong_group_size"
    for s in r.samples:
        reason = check_sample(s, lim)
        if reason:
            return reason
    for e in r.episodes:
        reason = check_shape(e, lim.vocab_size, lim.max_episode_tokens)
        if reason:
            return reason
    return None


def score_group(task: Task, held: Held, samples: list[P.Sample], version: int, node_id: str, decode, lim: Limits) -> Group:
    """Recompute every reward from the completion text."""
    rewards, correct = [], []
    for s in samples:
        ids = s.token_ids[:-1] if s.finish_reason == "stop" else s.token_ids
        score = task.score(held.item, decode(ids))
        rewards.append(score.reward)
        correct.append(score.metrics.get(lim.correct_metric, 0.0))
    return Group(held.assignment_id, node_id, held.item, held.prompt_ids, samples, rewards, correct, version)


def episode_group(held: Held, episodes: list[P.Episode], replays: list[Replayed], version: int, node_id: str) -> Group:
    """An accepted group of episodes, with the rewards of the trainer's own replay."""
    samples, masks = as_samples(episodes)
    return Group(held.assignment_id, node_id, held.item, held.prompt_ids, samples, [r.reward for r in replays],
                 [r.correct for r in replays], version, masks)
