"""Taking in a node's submission: the checks, the audit, the rewards, and where accepted groups go.

A submission passes the structural checks of trainer/intake.py (pure functions), then (for a sampled
share of groups, and every group of new or suspect nodes) the computation audit of trainer/audit.py,
before any of it may enter the buffer the learner draws from. One lie taints the whole submission.
Accepted groups are written to the ledger before the node hears "accepted"; a node on probation's go to
the quarantine (trainer/probation.py), everyone else's to the learner's buffer.
"""

from __future__ import annotations

import asyncio
import logging
import time
from collections.abc import Callable
from dataclasses import dataclass

from rewards.base import Task
from rewards.environment import Environment
from rewards.sandbox import Budget
from swarm_common import protocol as P
from trainer.audit import Auditor
from trainer.batch_buffer import BatchBuffer
from trainer.episode_check import Replayed, as_samples, replay_group
from trainer.grpo import has_signal
from trainer.guard import FRAUD, Guard
from trainer.intake import Group, Held, Limits, check_rollout, check_version, episode_group, score_group
from trainer.learner import sampled_tokens
from trainer.node_registry import NodeRecord
from trainer.probation import Probation
from trainer.stats import RunStats
from trainer.work import WorkHandout

log = logging.getLogger(__name__)


@dataclass
class Outcome:
    result: P.SubmissionResult
    fraud: str | None  # the fraud that refused the submission, if any
    accepted: int
    quarantined: list[Group]  # accepted groups of a key on probation, waiting for its verdict


class Intake:
    def __init__(self, task: Task, tokenizer, limits: Limits, work: WorkHandout, guard: Guard,
                 probation: Probation, buffer: BatchBuffer, auditor: Auditor | None, stats: RunStats,
                 on_accept: Callable[[Group], None], drop: Callable[[list[Group], str], None],
                 dynamic_sampling: bool):
        self.task, self.tok, self.limits = task, tokenizer, limits
        self.work, self.guard, self.probation, self.buffer = work, guard, probation, buffer
        self.auditor, self.stats = auditor, stats
        self.env = task if isinstance(task, Environment) else None  # episodes: replayed before anything else
        self.on_accept, self.drop = on_accept, drop
        self.dynamic_sampling = dynamic_sampling
        self.closed = False  # the run is over: no group comes in

    def close(self) -> None:
        """The run is over: whatever arrives from now on is refused as run_ended, not lost in a buffer."""
        self.closed = True

    async def submit(self, rec: NodeRecord, sub: P.RolloutSubmission) -> Outcome:
        verdicts, helds = self._check(sub)
        # The audit first: it is what catches sampled tokens a node made up (code chosen to be a replay bomb,
        # say) before the replay runs any of it; then every episode is replayed.
        if self.auditor is not None and not any(v in FRAUD for v in verdicts.values()):
            await self._audit(rec, sub, verdicts, helds)
        replays: dict[str, list[Replayed]] = {}
        if self.env is not None and not any(v in FRAUD for v in verdicts.values()):
            replays = await self._replay(rec, sub, verdicts, helds)
        if self.closed:  # closed while this submission was checked or audited: refuse, not lose, the rest
            verdicts = {aid: v or "run_ended" for aid, v in verdicts.items()}
        fraud = next((v for v in verdicts.values() if v in FRAUD), None)
        if fraud:  # one lie taints the whole submission: refuse all of it
            verdicts = {aid: v or "submission_refused" for aid, v in verdicts.items()}
        refused: dict[str, str] = {}
        groups = []
        for r in sub.rollouts:
            reason, held = verdicts[r.assignment_id], helds.get(r.assignment_id)
            if reason:
                refused[r.assignment_id] = reason
                self.stats.refuse(rec, reason)
                if held is not None:
                    self.work.requeue(held.item)
                continue
            if self.env is not None:
                groups.append(episode_group(held, r.episodes, replays[r.assignment_id], sub.version, sub.node_id))
                continue
            groups.append(score_group(self.task, held, r.samples, sub.version, sub.node_id,
                                      lambda ids: self.tok.decode(ids, skip_special_tokens=True), self.limits))
        for g in groups:
            self.guard.pairs.add(g.item.id, g.node_id, g.version, g.rewards)
        on_probation = self.probation.holds(sub.node_id)
        if groups and not on_probation and self.guard.cherry_picking(sub.node_id):
            fraud = "cherry_picking"
            for g in groups:
                refused[g.assignment_id] = fraud
                self.stats.refuse(rec, fraud)
            groups = []
        for g in groups:
            self.on_accept(g)  # on disk before the node hears "accepted"
            self.stats.accepted(rec, sampled_tokens(g), self.work.version - sub.version)
            if g.assignment_id in replays:
                rs = replays[g.assignment_id]
                self.stats.episodes_accepted(rec, len(rs), sum(r.turns for r in rs), sum(r.tool_calls for r in rs),
                                    sum(r.tool_errors for r in rs))
        if on_probation:
            self.probation.admit(sub.node_id, groups)
        else:
            self.to_buffer(groups)
        if refused:
            log.warning("node %s: refused %d of %d rollouts (%s)", rec.name, len(refused), len(sub.rollouts),
                        ", ".join(sorted(set(refused.values()))))
        accepted = [g.assignment_id for g in groups]
        return Outcome(P.SubmissionResult(accepted=accepted, refused=refused), fraud, len(groups),
                       groups if on_probation else [])

    def _check(self, sub: P.RolloutSubmission) -> tuple[dict[str, str | None], dict[str, Held]]:
        """The structural checks; every assignment answered is taken off the held list, well or not."""
        version_reason = check_version(sub.version, self.work.version, self.limits)
        now = time.monotonic()
        verdicts: dict[str, str | None] = {}
        helds: dict[str, Held] = {}
        for r in sub.rollouts:
            held = self.work.answered(r.assignment_id, sub.node_id)
            if held is not None:
                helds[r.assignment_id] = held
            reason = version_reason or check_rollout(r, held, sub.node_id, sub.version, self.limits, now)
            if reason == "unassigned" and self.work.was_expired(r.assignment_id):
                reason = "late"  # an honest node that was too slow, not a forger
            verdicts[r.assignment_id] = reason
        return verdicts, helds

    async def _replay(self, rec: NodeRecord, sub: P.RolloutSubmission, verdicts: dict[str, str | None],
                      helds: dict[str, Held]) -> dict[str, list[Replayed]]:
        """Replay every episode that passed the checks (trainer/episode_check.py), with one sandbox budget
        for the whole submission; a refused episode refuses its group, written into `verdicts`. A node whose
        episodes outrun the budget is audited in full from then on: made-up code (a replay bomb) is then
        caught by the audit, before any of it runs."""
        sandbox = Budget(self.limits.replay_sandbox_s * len(sub.rollouts))
        out: dict[str, list[Replayed]] = {}
        t0 = time.perf_counter()
        for r in sub.rollouts:
            if verdicts[r.assignment_id] is not None:
                continue
            rs = await asyncio.to_thread(replay_group, self.env, helds[r.assignment_id].item, self.tok, r.episodes,
                                         self.limits.max_tokens, self.limits.max_episode_tokens,
                                         self.limits.vocab_size, sandbox)
            reason = next((x.reason for x in rs if x.reason), None)
            if reason:
                log.warning("replay of %s from %s failed: %s", r.assignment_id, rec.name, reason)
                verdicts[r.assignment_id] = reason
                if reason == "replay_budget":
                    self.guard.suspects.add(sub.node_id)
                if reason in FRAUD:
                    break
                continue
            out[r.assignment_id] = rs
        self.stats.replayed(time.perf_counter() - t0)
        return out

    async def _audit(self, rec: NodeRecord, sub: P.RolloutSubmission, verdicts: dict[str, str | None],
                     helds: dict[str, Held]) -> None:
        """Re-score the groups that passed the checks (all of a suspect's or a new node's, a share of the
        others'); a failed audit is written into `verdicts`."""
        suspect = sub.node_id in self.guard.suspects or self.probation.holds(sub.node_id)
        for r in sub.rollouts:
            if verdicts[r.assignment_id] is not None or not self.auditor.should_audit(rec.accepted_groups, suspect):
                continue
            t0 = time.perf_counter()
            samples, masks = as_samples(r.episodes) if r.episodes else (r.samples, None)
            try:
                res = await asyncio.to_thread(self.auditor.audit, helds[r.assignment_id].prompt_ids, samples,
                                              sub.version, masks)
            except Exception:  # our bug, not the node's lie: its prompt goes back to the queue
                log.exception("the audit of %s from %s failed", r.assignment_id, rec.name)
                verdicts[r.assignment_id] = "audit_error"
                continue
            self.stats.audited(time.perf_counter() - t0)
            if res.reason == "unknown_version" and sub.version <= self.work.version:
                # It was inside the window when checked and aged out during the audit: late, not a lie.
                verdicts[r.assignment_id] = "stale"
                continue
            if res.reason:
                log.warning("audit of %s from %s failed: %s (max |dlogp| %.4f, worst logp %.1f, "
                            "smallest tail mass %.2g)", r.assignment_id, rec.name, res.reason,
                            res.max_diff, res.worst_logprob, res.worst_tail)
                verdicts[r.assignment_id] = res.reason
                break

    def rewards_of(self, group: Group, completions: list[list[int]]) -> list[float]:
        """The rewards of other completions of `group`'s prompt (the trainer's reference samples), scored
        as a node's are."""
        eos = self.limits.eos_id
        return [self.task.score(group.item, self.tok.decode(c[:-1] if c and c[-1] == eos else c,
                                                            skip_special_tokens=True)).reward
                for c in completions]

    def to_buffer(self, groups: list[Group]) -> None:
        """Accepted groups join the learner's buffer. With dynamic sampling (DAPO), a group whose samples
        all scored the same does not: its advantages are all zero, so in a batch it would take the place
        of a group that teaches something. The ledger records it as dropped, and its room goes back to
        the nodes for new work."""
        if self.dynamic_sampling:
            flat = [g for g in groups if not has_signal(g.rewards)]
            if flat:
                groups = [g for g in groups if has_signal(g.rewards)]
                self.drop(flat, "zero_advantage")
        self.buffer.add(groups)
