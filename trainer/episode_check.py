"""The trainer's replay of a node's episode: every environment token a stranger sends is re-derived here.

For each submitted episode the trainer walks its turns with a `TokenEpisode` of its own
(rewards/token_episode.py, the rules the node follows): it takes each sampled turn as the node sent it
(up to and including its stop token), decodes it, calls the environment itself, renders the answer with
the chat template and tokenizer, and requires the node's environment tokens to be exactly those. Then
the rewards are computed from the replayed trajectory; the audit (trainer/audit.py) checks the sampled
tokens' log-probs; the learner trains on sampled tokens only.

Refusal codes (all fraud, except the last two):
  bad_episode             structure: lengths, log-prob count, tokens outside the vocabulary, a length stop
                          claimed with tokens left
  bad_mask                the environment's answer labelled as sampled tokens
  observation_mismatch    environment tokens that are not the environment's answer (a forged or edited
                          observation, or the right text tokenized another way)
  missing_observation     a turn the environment answered, followed by sampled tokens (a skipped answer)
  unexpected_observation  tokens after the environment ended the episode (an invented tool call or turn)
  cut_short               the episode ends while the environment still expects a turn and there is room
  bad_finish              the finish reason is not the one the replay gives
  replay_budget           (not fraud) the submission's sandbox time ran out before its replay did
  replay_error            (not fraud) the environment failed in the replay: our problem, logged
"""

from __future__ import annotations

import logging
import math
from dataclasses import dataclass

from rewards.base import TaskItem
from rewards.environment import Environment
from rewards.sandbox import Budget, BudgetSpent, budget
from rewards.token_episode import TokenEpisode
from swarm_common import protocol as P

log = logging.getLogger(__name__)

NOT_FRAUD = frozenset({"replay_budget", "replay_error"})
EPISODE_FRAUD = frozenset({"bad_episode", "bad_mask", "observation_mismatch", "missing_observation",
                           "unexpected_observation", "cut_short", "bad_finish"})


@dataclass
class Replayed:
    """An episode the trainer replayed: its verdict and, when it passed, what the learner and views need."""

    reason: str | None
    reward: float = 0.0
    correct: float = 0.0
    turns: int = 0
    tool_calls: int = 0
    tool_errors: int = 0


def check_shape(e: P.Episode, vocab_size: int, max_episode_tokens: int) -> str | None:
    n = len(e.token_ids)
    if n == 0 or n > max_episode_tokens or len(e.mask) != n or len(e.logprobs) != sum(e.mask) or not e.mask[0]:
        return "bad_episode"
    if any(t < 0 or t >= vocab_size for t in e.token_ids):
        return "bad_episode"
    if any(not math.isfinite(x) or x > 1e-4 for x in e.logprobs):
        return "bad_episode"
    return None


def replay_episode(env: Environment, item: TaskItem, tok, e: P.Episode, max_tokens: int,
                   max_episode_tokens: int, vocab_size: int) -> Replayed:
    """Walk the node's episode with the environment; the first thing that does not match refuses it."""
    why = check_shape(e, vocab_size, max_episode_tokens)
    if why:
        return Replayed(why)
    te = TokenEpisode(env, item, tok, max_tokens, max_episode_tokens)
    ids, mask, n = e.token_ids, e.mask, len(e.token_ids)
    i = lp = 0
    while not te.done:
        if i == n:
            return Replayed("cut_short")  # the environment answered and waits for a turn
        if not mask[i]:
            return Replayed("unexpected_observation")
        j = i
        while j < n and mask[j]:
            j += 1
        run = ids[i:j]
        if te.stop_id in run:  # the turn ends at its stop token; sampled tokens after it are checked below
            turn = run[: run.index(te.stop_id) + 1]
            if len(turn) > te.turn_budget():
                return Replayed("bad_episode")
        else:
            turn = run
            if len(turn) != te.turn_budget() or j != n:
                return Replayed("cut_short" if len(turn) < te.turn_budget() else "bad_episode")
        try:
            answer = te.add_turn(turn, e.logprobs[lp : lp + len(turn)])
        except BudgetSpent:
            return Replayed("replay_budget")
        except Exception:  # an environment that fails on model text is a bug in it, not the node's lie
            log.exception("environment %s failed replaying item %s", env.name, item.id)
            return Replayed("replay_error")
        i, lp = i + len(turn), lp + len(turn)
        if te.done:
            break
        if i == n:
            return Replayed("cut_short")
        if mask[i]:  # sampled tokens where the environment's answer is due: it is labelled sampled, or skipped
            return Replayed("bad_mask" if ids[i : i + len(answer)] == answer else "missing_observation")
        m = i
        while m < n and not mask[m]:
            m += 1
        if ids[i:m] != answer:
            return Replayed("observation_mismatch")
        i = m
    if i != n:  # an answer, or another turn, after the environment ended the episode
        return Replayed("unexpected_observation")
    if e.finish_reason != te.finish:
        return Replayed("bad_finish")
    score = te.score()
    return Replayed(None, score.reward, score.metrics.get(env.correct_metric, 0.0), te.turns,
                    te.episode.tool_calls, te.episode.tool_errors)


def replay_group(env: Environment, item: TaskItem, tok, episodes: list[P.Episode], max_tokens: int,
                 max_episode_tokens: int, vocab_size: int, sandbox: Budget) -> list[Replayed]:
    """Every episode of a group, spending from its submission's sandbox budget; stops at the first refusal."""
    token = budget.set(sandbox)
    try:
        out = []
        for e in episodes:
            out.append(replay_episode(env, item, tok, e, max_tokens, max_episode_tokens, vocab_size))
            if out[-1].reason:
                break
        return out
    finally:
        budget.reset(token)


def full_logprobs(e: P.Episode) -> list[float]:
    """One log-prob per token: the node's for sampled tokens, 0 at the environment's."""
    it = iter(e.logprobs)
    return [next(it) if sampled else 0.0 for sampled in e.mask]


def as_samples(episodes: list[P.Episode]) -> tuple[list[P.Sample], list[list[bool]]]:
    """Episodes in the learner's and the audit's layout: every token with a log-prob (0 at the
    environment's), and the mask of sampled tokens."""
    return [P.Sample(e.token_ids, full_logprobs(e), e.finish_reason) for e in episodes], [e.mask for e in episodes]

