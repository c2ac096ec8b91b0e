"""The trainer's node-facing service: a zmq ROUTER that registers nodes, hands out work and takes rollouts.

Every frame is decoded, validated and its signature checked (swarm_common.protocol); a bad one gets an
`Error` reply and a log line, and the loop goes on. The jobs are in their own modules: registration and
forgetting silent keys (trainer/membership.py), the hand-out and its pacing (trainer/work.py), the intake
of submissions (trainer/submissions.py), keys on probation and their verdicts (trainer/newcomers.py,
trainer/probation.py), the node registry (trainer/node_registry.py). This class owns them, dispatches
messages to them, and carries out what an expiry, a strike or a ban means across all of them.

The trainer steers it through explicit calls: `begin_step()`, `end_step(version)`, `announce(version)`,
`take_batch(n, oldest)`, `restore(...)`, `state()` and `close()`.
"""

from __future__ import annotations

import asyncio
import logging
import time
from collections.abc import Callable, Iterator
from typing import Protocol

import zmq
import zmq.asyncio

from rewards.base import Task, TaskItem
from rewards.token_episode import handout, prompt_ids
from swarm_common import protocol as P
from trainer.audit import Auditor
from trainer.batch_buffer import BatchBuffer
from trainer.checkpoint import TrainerState
from trainer.config import RunConfig
from trainer.guard import Guard
from trainer.intake import Group, Limits
from trainer.ledger import Ledger
from trainer.membership import Membership
from trainer.newcomers import Newcomers
from trainer.node_registry import NodeRegistry
from trainer.probation import Probation
from trainer.reference import Reference
from trainer.stats import RunStats
from trainer.submissions import Intake
from trainer.work import WorkHandout
from trainer.work_share import WorkShare

log = logging.getLogger(__name__)

# Refusals of honest but useless work: like an expiry, they shrink the key's share (trainer/work_share.py).
LATE = frozenset({"stale", "late"})

# A work request that finds no room waits here this long at most (a long poll) and is answered as soon as
# room opens: a node polling on a timer would idle up to a period each step, which on a fast step is most of it.
PARK_S = 2.0
NEWCOMER_RETRY_S = 1.0  # when as many newcomers' requests wait as they have slots, the next asks again after this


class Tree(Protocol):
    """What the node service tells the relay tree (broadcast.origin.Origin): bans and standing, by key."""
    def ban_key(self, key: str, reason: str) -> None: ...
    def set_standing(self, key: str, established: bool = True) -> None: ...


class NodeService:
    def __init__(self, cfg: RunConfig, task: Task, tokenizer, vocab_size: int, stats: RunStats,
                 registry: NodeRegistry, manifest_url: Callable[[int], str], items: Iterator[TaskItem],
                 tracker_url: str, trainer_key: str, guard: Guard, auditor: Auditor | None, ledger: Ledger,
                 tree: Tree | None = None):
        self.cfg, self.stats, self.registry, self.guard, self.ledger = cfg, stats, registry, guard, ledger
        self.tree = tree
        self.manifest_url, self.tracker_url, self.trainer_key = manifest_url, tracker_url, trainer_key
        t = cfg.train
        self.sampling = P.SamplingSpec(n=t.group_size, max_tokens=t.max_tokens, temperature=t.temperature,
                                       top_p=t.top_p)
        self.work = WorkHandout(items, lambda item: prompt_ids(task, tokenizer, item),
                                self.sampling, inflight_groups=t.inflight_groups, max_lag=t.max_lag,
                                work_lag=t.work_lag, max_held=cfg.guard.max_held,
                                duplicate_share=cfg.guard.duplicate_share,
                                probation_groups=cfg.guard.probation_groups,
                                assignment_timeout_s=cfg.server.assignment_timeout_s, seed=t.seed,
                                pair_window=cfg.guard.pair_window)
        self.work.is_reference = guard.is_reference
        self.work.env, self.work.episode_item = handout(task, cfg.task.max_episode_tokens)  # multi-turn work
        self.share = WorkShare(cfg.guard, t.inflight_groups)
        self.probation = Probation(guard, cfg.guard.probation_groups)
        self.buffer = BatchBuffer()
        limits = Limits(t.group_size, t.max_tokens, vocab_size, tokenizer.eos_token_id, t.max_lag,
                        task.correct_metric, self.work.env is not None, cfg.task.max_episode_tokens,
                        cfg.task.replay_sandbox_s)
        self.intake = Intake(task, tokenizer, limits, self.work, guard, self.probation, self.buffer, auditor,
                             stats, ledger.accepted, self._drop, t.dynamic_sampling)
        reference = None
        if cfg.guard.reference:
            if auditor is None:
                raise ValueError("guard.reference samples with the audit's copy of each version: it needs "
                                 "audit.enabled = true")
            reference = Reference(auditor, self.intake.rewards_of, t.group_size, t.max_tokens,
                                  tokenizer.eos_token_id, tokenizer.pad_token_id, cfg.guard.reference_budget)
        self.newcomers = Newcomers(cfg, guard, registry, self.work, self.probation, stats, reference,
                                   self.intake.to_buffer, self._drop, self._strike, self._standing)
        stats.pairing_provider = self.newcomers.pairing
        self.work_changed = asyncio.Event()  # pulsed when room for work may have opened
        self.parked: dict[str, asyncio.Task] = {}  # node id -> its work request waiting for room
        self.members = Membership(cfg, guard, registry, stats, self.work, self.share, self.probation,
                                  self.newcomers, tracker_url, trainer_key, self.sampling, self.weights_info)
        self.idents = self.members.idents  # node id -> zmq routing identity
        registry.banned.update(guard.bans)
        if tree is not None:  # the tree bans whom the trainer bans, and ranks whom it trusts
            for key, reason in guard.bans.items():
                tree.ban_key(key, reason)
            for key in guard.established | guard.cfg.trusted:
                tree.set_standing(key)

    # ---- the trainer's side ---------------------------------------------------------------------------

    @property
    def version(self) -> int:
        return self.work.version

    def begin_step(self) -> None:
        self.work.begin_step()

    def end_step(self, version: int) -> None:
        self.work.end_step(version)

    def restore(self, version: int, st: TrainerState | None, pending: list[Group]) -> None:
        """Start at published `version`; resuming (`st`), also the prompt cursor and the accepted groups not
        trained on. Those of keys that had not passed probation go back to quarantine and wait for that
        key's verdict, as before."""
        self.work.start_at(version)
        if st is None:
            return
        self.work.restore(st.items_drawn, st.retry, st.server_rng)
        self.buffer.add([g for g in pending if self.guard.is_established(g.node_id)])
        self.probation.restore([g for g in pending if not self.guard.is_established(g.node_id)])
        self.stats.quarantined = len(self.probation.quarantine)
        log.info("resume: %d accepted groups back in the buffer, %d in quarantine", len(self.buffer),
                 len(self.probation.quarantine))

    def state(self) -> tuple[int, list[TaskItem], str]:
        return self.work.state()

    async def take_batch(self, n: int, oldest: int | None = None) -> list[Group]:
        """Wait for n accepted groups (oldest first), dropping any from versions before `oldest` (default:
        the max_lag window behind the announced version; the learner may be a version ahead of it)."""
        floor = (lambda: self.work.version - self.cfg.train.max_lag) if oldest is None else (lambda: oldest)
        batch = await self.buffer.take(n, floor, lambda stale: self._drop(stale, "stale"))
        self._pulse()
        return batch

    def close(self) -> list[Group]:
        """The run is over: hand out no more work and accept no more groups (a group accepted now would
        never be trained on). Returns what was accepted and is not trained on: the buffer and quarantine."""
        self.work.close()
        self.intake.close()
        leftover = self.buffer.drain() + self.probation.take(lambda g: True)
        self.stats.quarantined = 0
        self._pulse()
        return leftover

    async def announce(self, version: int) -> None:
        self.work.announce(version)
        self._pulse()
        notice = P.encode(P.VersionNotice(weights=self.weights_info()))
        # Live keys that have delivered (or are established) only: silent ones ask when they return, and a
        # key with nothing accepted yet learns of versions from its work replies and the relay tree, so a
        # crowd of throwaway keys cannot multiply every version by itself.
        for node_id, ident in list(self.idents.items()):
            rec = self.registry.get(node_id)
            if self.registry.live(node_id) and (rec.accepted_groups or self.guard.is_established(node_id)):
                await self.sock.send_multipart([ident, notice])

    def weights_info(self) -> P.WeightsInfo:
        return P.WeightsInfo(version=self.work.version, manifest_url=self.manifest_url(self.work.version))

    # ---- serving ----------------------------------------------------------------------------------

    async def start(self) -> None:
        self.ctx = zmq.asyncio.Context()
        self.sock = self.ctx.socket(zmq.ROUTER)
        self.sock.setsockopt(zmq.LINGER, 0)
        # zmq drops a peer that sends a larger message before we ever see it.
        self.sock.setsockopt(zmq.MAXMSGSIZE, self.cfg.server.max_message_bytes)
        self.sock.bind(f"tcp://{self.cfg.server.host}:{self.cfg.server.port}")
        self._task = asyncio.create_task(self._serve())
        self._reaper = asyncio.create_task(self._expire_loop())
        self.newcomers.start()

    async def stop(self) -> None:
        self.newcomers.stop()
        for t in (self._task, self._reaper, *self.parked.values()):
            t.cancel()
        self.sock.close(0)
        self.ctx.term()

    async def _serve(self) -> None:
        while True:
            frames = await self.sock.recv_multipart(copy=False)
            ident = frames[0].bytes
            try:
                source = frames[1].get("Peer-Address") if len(frames) > 1 else ""
                msg = P.decode_signed([f.bytes for f in frames[1:]], self.cfg.server.max_message_bytes)
                reply = await self.handle(ident, msg, source)
            except P.ProtocolError as e:
                log.warning("refused a message from %s: %s", ident.hex()[:12], e)
                reply = P.Error(code=e.code, message=e.message)
            except Exception as e:  # a bug must not take the service down; say so loudly
                log.exception("error handling a message")
                reply = P.Error(code="internal", message=type(e).__name__)
            if reply is not None:
                await self.sock.send_multipart([ident, P.encode(reply)])

    async def handle(self, ident: bytes, msg: P.Message, source: str = "") -> P.Message | None:
        """`msg` is a node message whose signature matches its node_id; `source` is the address it came from."""
        refusal = self.guard.admit(msg.node_id)
        if refusal:
            return P.Error(code=refusal, message="this key may not take part")
        if not self.guard.within_rate(msg.node_id):
            self.stats.refuse(self.registry.get(msg.node_id), "rate_limited")
            return P.Error(code="rate_limited", message="too many messages; slow down")
        if isinstance(msg, P.Register):
            return self.members.register(ident, msg, source)
        if isinstance(msg, P.Hello):
            return self.members.hello(msg, source)
        rec = self.registry.get(msg.node_id)
        if rec is None or self.idents.get(msg.node_id) != ident:
            return P.Error(code="unknown_node", message="register first")
        rec.last_seen = time.monotonic()
        if isinstance(msg, P.Heartbeat):
            rec.version_loaded, rec.tokens_per_s = msg.version_loaded, msg.tokens_per_s
            return None
        if isinstance(msg, P.WorkRequest):
            rec.version_loaded = msg.version_loaded
            reply = self._assign(msg)
            if reply.assignments or msg.version_loaded < reply.min_version or msg.node_id in self.parked:
                return reply  # work, or a newer version to load first: answer now
            if not self._may_park(msg.node_id):
                reply.retry_after_s = NEWCOMER_RETRY_S
                return reply
            self.parked[msg.node_id] = asyncio.create_task(self._park(ident, msg))
            return None
        out = await self.intake.submit(rec, msg)
        if out.accepted:
            self.share.accepted(msg.node_id, out.accepted, self.guard.is_established(msg.node_id))
        elif LATE & set(out.result.refused.values()):
            self._expired(msg.node_id)  # work that came too late to train on counts as work that never came
        if out.fraud:
            self._strike(msg.node_id, out.fraud)
        self.newcomers.quarantined(out.quarantined)
        if out.accepted:  # new shared prompts: this node's and its partners' verdicts may be in
            self.newcomers.review()
        self._pulse()  # refused work leaves room behind it, and probation may have released a node
        return out.result

    # ---- work ----------------------------------------------------------------------------------------

    def _room(self, node_id: str) -> int:
        """How many more groups `node_id` may be assigned: the pacing's room, within its earned share."""
        room = self.work.room(node_id, len(self.buffer), self.probation.holds(node_id),
                              self.probation.waiting(node_id), self.guard.blank_comparisons(node_id))
        established = self.guard.is_established(node_id)
        room = min(room, self.share.allowance(node_id, established) - self.work.held_by(node_id))
        if not established:  # keys that are not established share a small part of the in-flight groups
            newcomers = sum(1 for h in self.work.held.values() if not self.guard.is_established(h.node_id))
            room = min(room, self.share.newcomer_cap - newcomers)
        return room

    def _assign(self, req: P.WorkRequest) -> P.WorkAssignment:
        reply = self.work.assign(req, self._room(req.node_id), self.probation.holds(req.node_id),
                                 self.weights_info())
        if reply.assignments and self.stats.first_work_at is None:
            self.stats.first_work_at = time.time()  # a node is up with weights: generation can begin
        return reply

    def _pulse(self) -> None:
        """Wake parked work requests: the buffer, the held work or the version changed."""
        self.work_changed.set()
        self.work_changed.clear()

    def _may_park(self, node_id: str) -> bool:
        """Keys that are not established share a few slots of work (share.newcomer_cap): as many of their
        requests wait here as there are slots; the others are told to ask again later. A thousand parked
        requests would each be woken, and answered, at every pulse and every version."""
        if self.guard.is_established(node_id):
            return True
        waiting = sum(1 for n in self.parked if not self.guard.is_established(n))
        return waiting < self.share.newcomer_cap

    async def _park(self, ident: bytes, req: P.WorkRequest) -> None:
        """Answer `req` once there is room for it, a new version is out, or PARK_S has passed."""
        version, deadline = self.work.version, time.monotonic() + PARK_S
        try:
            while (left := deadline - time.monotonic()) > 0 and self.work.version == version:
                try:
                    async with asyncio.timeout(left):
                        await self.work_changed.wait()
                except TimeoutError:
                    break
                if self._room(req.node_id) > 0 and self.work.floor() <= self.work.version:
                    break
            refusal = self.guard.admit(req.node_id)
            reply = P.Error(code=refusal, message="this key may not take part") if refusal else self._assign(req)
            if not refusal and not reply.assignments:
                reply.retry_after_s = 0.0  # it waited here already: ask again at once
            await self.sock.send_multipart([ident, P.encode(reply)])
        except zmq.ZMQError as e:
            log.debug("could not answer a parked work request: %s", e)
        finally:
            self.parked.pop(req.node_id, None)

    async def _expire_loop(self) -> None:
        """Work past its deadline, or held by a node gone silent, goes back to the queue. Probation is
        reviewed too: a node may be left alone when its partners go."""
        while True:
            await asyncio.sleep(min(1.0, self.registry.gone_after_s / 4))
            # A key that is not established loses its work sooner: silent for 3 heartbeats (a node heartbeats
            # while it generates), not gone_after_s, so throwaway keys that take work and vanish do not hold
            # the newcomers' share of it for long.
            slow = self.registry.silent_for(3 * self.cfg.server.heartbeat_s)
            late = self.work.expire(self.registry.gone() | {n for n in slow if not self.guard.is_established(n)})
            if late:
                log.info("re-queued %d expired assignments (or held by gone nodes)", len(late))
            for node_id in {h.node_id for h in late}:  # one expiry event per node and sweep
                self._expired(node_id)
            self.members.forget_silent(self.parked)
            self.newcomers.review()
            self._pulse()

    def _expired(self, node_id: str) -> None:
        """Work of `node_id`'s expired: its share shrinks; it may be paused, or its registration dropped."""
        action = self.share.expired(node_id, self.guard.is_established(node_id))
        if action == "pause":
            log.warning("node %s: its work keeps expiring; no new work for %.0fs", node_id[:12],
                        self.cfg.guard.pause_s)
        elif action == "drop" and self.idents.pop(node_id, None) is not None:
            self.work.take_back(node_id)
            self.stats.refuse(self.registry.get(node_id), "work_expired")
            log.warning("node %s: dropped (its work kept expiring); it must register again", node_id[:12])

    # ---- consequences --------------------------------------------------------------------------------

    def _drop(self, groups: list[Group], reason: str) -> None:
        """Accepted groups that will never be trained on: counted, and said so in the ledger."""
        if groups:
            self.stats.drop(reason, len(groups))
            self.ledger.dropped(groups, reason, self.stats.step)

    def _standing(self, node_id: str) -> None:
        """The key passed probation: the relay tree ranks it with the established."""
        if self.tree is not None:
            self.tree.set_standing(node_id)

    def _strike(self, node_id: str, reason: str) -> None:
        # A node on probation has earned no trust yet: a fraud drops everything it has in quarantine.
        if self.probation.holds(node_id):
            self._drop(self.probation.take(lambda g: g.node_id == node_id), "fraud_on_probation")
            self.stats.quarantined = len(self.probation.quarantine)
        if not self.guard.strike(node_id, reason):
            log.warning("node %s: strike %d for %s; all its work is audited now", node_id[:12],
                        self.guard.strikes[node_id], reason)
            return
        log.warning("node %s banned after %d strikes (last: %s)", node_id[:12], self.guard.strikes[node_id], reason)
        self._banned(node_id, reason)
        if self.tree is not None:
            self.tree.ban_key(node_id, reason)

    def ban_from_tree(self, key: str, reason: str) -> None:
        """The relay tree confirmed that this key served corrupt pieces: it takes no part here either."""
        if key not in self.guard.bans:
            log.warning("node %s banned by the relay tree: %s", key[:12], reason)
            self.guard.ban(key, f"tree: {reason}")
            self._banned(key, reason)

    def _banned(self, node_id: str, reason: str) -> None:
        """Its groups not yet trained on are dropped, its assignments go to others."""
        self._drop(self.probation.end(node_id), "fraud_on_probation")
        self._drop(self.buffer.remove(lambda g: g.node_id == node_id), "banned_node")
        self.work.take_back(node_id)
        self.registry.banned.add(node_id)
