"""Multi-turn work on the node: the environment runs beside the engine, and every token stays as it was made.

All episodes of a hand-out (G per assignment, every assignment) advance together: each round, one engine
pass samples the next turn of every episode still running (prefix caching shares their common tokens),
then the environment answers each finished turn (in parallel threads: a sandboxed tool call waits on its
process), and the answers' ids are appended. Nothing is re-tokenized: the sampled ids are the engine's,
the answers' ids come from `observation_ids` (swarm_common/chat.py), as the trainer computes them when it
replays the episode (rewards/token_episode.py holds the rules both follow).
"""

from __future__ import annotations

import concurrent.futures
from dataclasses import dataclass

import msgspec

from rewards.base import TaskItem
from rewards.environment import Environment
from rewards.registry import make_task
from rewards.token_episode import TokenEpisode
from swarm_common import protocol as P


@dataclass
class EpisodeStats:
    episodes: int = 0
    turns: int = 0
    tool_calls: int = 0
    tool_errors: int = 0
    sampled_tokens: int = 0


class EpisodeRunner:
    """Builds the environments the trainer names (once each) and runs hand-outs of episodes."""

    def __init__(self, tool_threads: int = 8):
        self.envs: dict[bytes, Environment] = {}
        self.pool = concurrent.futures.ThreadPoolExecutor(max_workers=tool_threads, thread_name_prefix="env")

    def env(self, spec: P.EnvSpec) -> Environment:
        key = msgspec.json.encode([spec.name, spec.params])
        if key not in self.envs:
            env = make_task(spec.name, **spec.params)
            if not isinstance(env, Environment):
                raise ValueError(f"{spec.name} is not an environment")
            self.envs[key] = env
        return self.envs[key]

    def run(self, engine, work: P.WorkAssignment) -> tuple[list[P.Rollout], EpisodeStats]:
        """G episodes of every assignment, batched in one engine; blocking (the node's engine thread)."""
        env, s, tok = self.env(work.env), work.sampling, engine.tokenizer
        runs = []  # (assignment, its prompt ids, its G episodes)
        for a in work.assignments:
            item = TaskItem(id=a.item.id, prompt=a.item.prompt, answer="", meta=dict(a.item.meta))
            runs.append((a, a.prompt_token_ids, [TokenEpisode(env, item, tok, s.max_tokens, work.env.max_episode_tokens)
                                                 for _ in range(s.n)]))
        flat = [(p, te) for _, p, eps in runs for te in eps]
        stop = flat[0][1].stop_id
        while active := [(p, te) for p, te in flat if not te.done]:
            turns = engine.turns([p + te.ids for p, te in active], [te.turn_budget() for _, te in active],
                                 s.temperature, s.top_p, stop)
            # The environment answers every finished turn; tool calls run side by side.
            list(self.pool.map(lambda pair: pair[0][1].add_turn(pair[1].token_ids, pair[1].logprobs),
                               zip(active, turns, strict=True)))
        stats = EpisodeStats()
        rollouts = []
        for a, _, eps in runs:
            rollouts.append(P.Rollout(a.assignment_id, [], [P.Episode(te.ids, te.mask, te.logprobs, te.finish)
                                                            for te in eps]))
            for te in eps:
                stats.episodes += 1
                stats.turns += te.turns
                stats.tool_calls += te.episode.tool_calls
                stats.tool_errors += te.episode.tool_errors
                stats.sampled_tokens += len(te.logprobs)
        return rollouts, stats
