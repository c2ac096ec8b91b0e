"""The trainer's node-facing service: a zmq ROUTER that registers nodes, hands out work and takes rollouts.

Every frame is decoded, validated and its signature checked (swarm_common.protocol); a bad one gets an
`Error` reply and a log line, and the loop goes on. Work is paced: no more than `inflight_groups`
groups are assigned or waiting for the learner at once, so little work goes stale. Work not answered
in time goes back to the front of the queue for someone else.

A submission passes the structural checks of trainer/intake.py, then (for a sampled share of groups,
and every group of new or suspect nodes) the computation audit of trainer/audit.py, before any of it
may enter the buffer the learner draws from. A fraud refuses the whole submission and strikes the node.

A new key is on probation (trainer/guard.py): every prompt it gets is also handed to another node, and
its accepted groups wait in `quarantine` (never seen by the learner) until the paired reward test clears
it; then they move to the buffer, or, if the test fires, they are dropped and the node struck. Nodes
that are all new at once are paired with each other, so a fresh swarm does not wait on itself.
"""

from __future__ import annotations

import asyncio
import collections
import logging
import random
import time
import uuid
from collections.abc import Callable, Iterator

import zmq
import zmq.asyncio

from rewards.base import Task, TaskItem
from swarm_common import protocol as P
from swarm_common.chat import encode_prompt
from trainer.audit import Auditor
from trainer.config import RunConfig
from trainer.grpo import has_signal
from trainer.guard import FRAUD, Guard
from trainer.intake import Group, Held, Limits, check_rollout, check_version, score_group
from trainer.stats import RunStats

log = logging.getLogger(__name__)

# A work request that finds no room waits here this long at most (a long poll) and is answered as soon as
# room opens: a node polling on a timer would idle up to a period each step, which on a fast step is most of it.
PARK_S = 2.0


class TrainerServer:
    def __init__(self, cfg: RunConfig, task: Task, tokenizer, vocab_size: int, stats: RunStats,
                 manifest_url: Callable[[int], str], items: Iterator[TaskItem], tracker_url: str,
                 trainer_key: str, guard: Guard, auditor: Auditor | None):
        self.cfg, self.task, self.tok, self.stats = cfg, task, tokenizer, stats
        self.manifest_url = manifest_url
        self.tracker_url, self.trainer_key = tracker_url, trainer_key
        self.guard, self.auditor = guard, auditor
        t = cfg.train
        self.limits = Limits(t.group_size, t.max_tokens, vocab_size, tokenizer.eos_token_id, t.max_lag,
                             task.correct_metric)
        self.sampling = P.SamplingSpec(n=t.group_size, max_tokens=t.max_tokens, temperature=t.temperature,
                                       top_p=t.top_p)
        self.items = items
        self.retry: collections.deque[TaskItem] = collections.deque()  # prompts whose work expired
        self.dups: collections.deque[tuple[TaskItem, str]] = collections.deque()  # (prompt, first node)
        self.rng = random.Random(cfg.train.seed + 17)
        self.held: dict[str, Held] = {}
        self.expired: collections.OrderedDict[str, None] = collections.OrderedDict()  # recently expired ids
        self.buffer: list[Group] = []  # accepted, not yet trained on
        self.quarantine: list[Group] = []  # accepted from nodes on probation, not yet released to the buffer
        self.buffer_changed = asyncio.Event()
        self.work_changed = asyncio.Event()  # pulsed when room for work may have opened
        self.parked: dict[str, asyncio.Task] = {}  # node id -> its work request waiting for room
        self.version = 0  # the newest version announced to nodes
        self.newest = 0  # the newest version the learner has made (announced, or being published)
        self.training = False  # a learner step is making version newest + 1
        self.closed = False  # the run is over: no work out, no groups in
        self.idents: dict[str, bytes] = {}  # node id -> zmq routing identity
        self.items_drawn = 0
        self.gone_after_s = cfg.server.gone_after_s or 10 * cfg.server.heartbeat_s
        # The run's ledger (trainer/ledger.py) hears of every accepted and every dropped group.
        self.on_accept: Callable[[Group], None] = lambda g: None
        self.on_drop: Callable[[list[Group], str], None] = lambda gs, reason: None

    # ---- the learner's side -----------------------------------------------------------------------

    async def take_batch(self, n: int, oldest: int | None = None) -> list[Group]:
        """Wait for n accepted groups (oldest first), dropping any from versions before `oldest` (default:
        the max_lag window behind the announced version; the learner may be a version ahead of it)."""
        while True:
            floor = self.version - self.cfg.train.max_lag if oldest is None else oldest
            fresh = []
            for g in self.buffer:
                if g.version < floor:
                    self.stats.drop("stale")
                    self.on_drop([g], "stale")
                else:
                    fresh.append(g)
            self.buffer = fresh
            if len(self.buffer) >= n:
                batch, self.buffer = self.buffer[:n], self.buffer[n:]
                self._pulse()
                return batch
            self.buffer_changed.clear()
            await self.buffer_changed.wait()

    def close(self) -> list[Group]:
        """The run is over: hand out no more work and accept no more groups (a group accepted now would
        never be trained on). Returns what was accepted and is not trained on: the buffer and quarantine."""
        self.closed = True
        leftover, self.buffer, self.quarantine = self.buffer + self.quarantine, [], []
        self._pulse()
        return leftover

    async def announce(self, version: int) -> None:
        self.version = version
        self._pulse()
        notice = P.encode(P.VersionNotice(weights=self.weights_info()))
        for node_id, ident in self.idents.items():
            if node_id not in self.guard.bans:
                await self.sock.send_multipart([ident, notice])

    def weights_info(self) -> P.WeightsInfo:
        return P.WeightsInfo(version=self.version, manifest_url=self.manifest_url(self.version))

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

    async def stop(self) -> None:
        for t in (self._task, self._reaper, *self.parked.values()):
            t.cancel()
        self.sock.close(0)
        self.ctx.term()

    async def _serve(self) -> None:
        while True:
            frames = await self.sock.recv_multipart()
            ident = frames[0]
            try:
                msg = P.decode_signed(frames[1:], self.cfg.server.max_message_bytes)
                reply = await self.handle(ident, msg)
            except P.ProtocolError as e:
                log.warning("refused a message from %s: %s", ident.hex()[:12], e)
                reply = P.Error(code=e.code, message=e.message)
            except Exception as e:  # a bug must not take the service down; say so loudly
                log.exception("error handling a message")
                reply = P.Error(code="internal", message=type(e).__name__)
            if reply is not None:
                await self.sock.send_multipart([ident, P.encode(reply)])

    async def handle(self, ident: bytes, msg: P.Message) -> P.Message | None:
        """`msg` is a node message whose signature matches its node_id."""
        refusal = self.guard.admit(msg.node_id)
        if refusal:
            return P.Error(code=refusal, message="this key may not take part")
        if not self.guard.within_rate(msg.node_id):
            self.stats.refuse(msg.node_id, "rate_limited")
            return P.Error(code="rate_limited", message="too many messages; slow down")
        if isinstance(msg, P.Register):
            return self._register(ident, msg)
        node = self.stats.nodes.get(msg.node_id)
        if node is None or self.idents.get(msg.node_id) != ident:
            return P.Error(code="unknown_node", message="register first")
        node.last_seen = time.monotonic()
        if isinstance(msg, P.Heartbeat):
            node.version_loaded, node.tokens_per_s = msg.version_loaded, msg.tokens_per_s
            return None
        if isinstance(msg, P.WorkRequest):
            node.version_loaded = msg.version_loaded
            reply = self._assign(msg)
            if reply.assignments or msg.version_loaded < reply.min_version or msg.node_id in self.parked:
                return reply  # work, or a newer version to load first: answer now
            self.parked[msg.node_id] = asyncio.create_task(self._park(ident, msg))
            return None
        return await self._intake(msg)

    def _pulse(self) -> None:
        """Wake parked work requests: the buffer, the held work or the version changed."""
        self.work_changed.set()
        self.work_changed.clear()

    async def _park(self, ident: bytes, req: P.WorkRequest) -> None:
        """Answer `req` once there is room for it, a new version is out, or PARK_S has passed."""
        version, deadline = self.version, time.monotonic() + PARK_S
        try:
            while (left := deadline - time.monotonic()) > 0 and self.version == version:
                try:
                    async with asyncio.timeout(left):
                        await self.work_changed.wait()
                except TimeoutError:
                    break
                if self._room(req.node_id) > 0 and self._work_floor() <= self.version:
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

    def _register(self, ident: bytes, msg: P.Register) -> P.Message:
        if msg.protocol != P.PROTOCOL_VERSION:
            return P.Error(code="protocol", message=f"trainer speaks protocol {P.PROTOCOL_VERSION}")
        if not self.guard.fresh_register(msg.node_id, msg.time_ms):
            return P.Error(code="stale_register", message="registration older than the last one, or clock off")
        node = self.stats.node(msg.node_id, msg.name)
        node.name, node.status_url, node.last_seen = msg.name, msg.status_url, time.monotonic()
        self.idents[msg.node_id] = ident
        if self.cfg.security.probation_groups > 0:
            self.guard.begin_probation(msg.node_id)
            if msg.node_id in self.guard.probation:
                # Groups it delivered before a trainer restart wait in quarantine, audited: they count.
                waiting = sum(1 for g in self.quarantine if g.node_id == msg.node_id)
                self.guard.probation[msg.node_id] = max(self.guard.probation[msg.node_id], waiting)
        log.info("node %s registered (%s)", msg.name, msg.node_id[:12])
        return P.Registered(node_id=msg.node_id, weights=self.weights_info(), sampling=self.sampling,
                            heartbeat_s=self.cfg.server.heartbeat_s, max_lag=self.cfg.train.max_lag,
                            tracker_url=self.tracker_url, trainer_key=self.trainer_key)

    def _next_item(self, node_id: str) -> TaskItem:
        # A prompt another node already has comes first: the paired reward test needs shared prompts, and a
        # node on probation waits for them.
        for i, (item, first) in enumerate(self.dups):
            if first != node_id:
                del self.dups[i]
                return item
        if self.retry:
            item = self.retry.popleft()
        else:
            self.items_drawn += 1
            item = next(self.items)
        # Every prompt of a node on probation is shared; an established node's now and then.
        if node_id in self.guard.probation or self.rng.random() < self.cfg.security.duplicate_share:
            self.dups.append((item, node_id))
            while len(self.dups) > 4 * max(64, self.cfg.security.probation_groups):
                self.dups.popleft()
        return item

    def _room(self, node_id: str) -> int:
        """How many more groups `node_id` may be assigned now."""
        if self.closed:
            return 0
        room = self.cfg.train.inflight_groups - len(self.held) - len(self.buffer)
        mine = sum(1 for h in self.held.values() if h.node_id == node_id)
        room = min(room, self.guard.cfg.max_held - mine)
        if node_id in self.guard.probation:
            # On probation a node has at most probation_groups out or waiting in quarantine at once.
            waiting = sum(1 for g in self.quarantine if g.node_id == node_id)
            room = min(room, self.cfg.security.probation_groups - mine - waiting)
        return room

    def _work_floor(self) -> int:
        """The oldest policy new work may be generated with: within max_lag of the announced version and
        within work_lag of the newest the learner has made. Above self.version, work waits for an announcement.

        While a step is making version newest + 1, work handed out now can only be trained on from that
        version on: anything older than newest + 1 - max_lag would be dropped as stale on arrival. With
        max_lag 0 (on-policy) this keeps the nodes idle during a step instead of generating batches that
        are thrown away (and that take CPU from the learner on a shared machine)."""
        t = self.cfg.train
        trained_from = self.newest + 1 if self.training else self.newest
        return max(0, self.version - t.max_lag, self.newest - t.work_lag, trained_from - t.max_lag)

    def _assign(self, req: P.WorkRequest) -> P.WorkAssignment:
        floor = self._work_floor()
        min_version = min(floor, self.version)  # what the node must load before it asks again
        n = min(req.max_prompts, self._room(req.node_id)) if req.version_loaded >= floor else 0
        out = []
        deadline = time.monotonic() + self.cfg.server.assignment_timeout_s
        if n > 0 and self.stats.first_work_at is None:
            self.stats.first_work_at = time.time()  # a node is up with weights: generation can begin
        for _ in range(max(n, 0)):
            item = self._next_item(req.node_id)
            aid = uuid.uuid4().hex[:16]
            ids = encode_prompt(self.tok, item.prompt, self.task.system_prompt)
            self.held[aid] = Held(aid, req.node_id, item, ids, self.version, deadline)
            out.append(P.Assignment(assignment_id=aid, prompt_token_ids=ids))
        return P.WorkAssignment(weights=self.weights_info(), min_version=min_version, assignments=out,
                                sampling=self.sampling, retry_after_s=0.0 if out else 0.25)

    async def _intake(self, sub: P.RolloutSubmission) -> P.SubmissionResult:
        node = self.stats.nodes[sub.node_id]
        version_reason = check_version(sub.version, self.version, self.limits)
        now = time.monotonic()
        verdicts: dict[str, str | None] = {}
        helds: dict[str, Held] = {}
        for r in sub.rollouts:
            held = self.held.get(r.assignment_id)
            if held is not None and held.node_id == sub.node_id:
                del self.held[r.assignment_id]  # answered, well or not: never again
                helds[r.assignment_id] = held
            reason = version_reason or check_rollout(r, held, sub.node_id, sub.version, self.limits, now)
            if reason == "unassigned" and r.assignment_id in self.expired:
                reason = "late"  # an honest node that was too slow, not a forger
            verdicts[r.assignment_id] = reason
        # The audit, for groups that passed the structural checks: all of a suspect's or a new node's.
        if self.auditor is not None and not any(v in FRAUD for v in verdicts.values()):
            suspect = sub.node_id in self.guard.suspects or sub.node_id in self.guard.probation
            for r in sub.rollouts:
                if verdicts[r.assignment_id] is None and self.auditor.should_audit(node.accepted_groups, suspect):
                    t0 = time.perf_counter()
                    try:
                        res = await asyncio.to_thread(self.auditor.audit, helds[r.assignment_id].prompt_ids,
                                                      r.samples, sub.version)
                    except Exception:  # our bug, not the node's lie: its prompt goes back to the queue
                        log.exception("the audit of %s from %s failed", r.assignment_id, node.name)
                        verdicts[r.assignment_id] = "audit_error"
                        continue
                    self.stats.audits += 1
                    self.stats.audit_seconds += time.perf_counter() - t0
                    if res.reason == "unknown_version" and sub.version <= self.version:
                        # It was inside the window when checked and aged out during the audit: late, not a lie.
                        verdicts[r.assignment_id] = "stale"
                        continue
                    if res.reason:
                        log.warning("audit of %s from %s failed: %s (max |dlogp| %.4f, worst logp %.1f, "
                                    "smallest tail mass %.2g)", r.assignment_id, node.name, res.reason,
                                    res.max_diff, res.worst_logprob, res.worst_tail)
                        verdicts[r.assignment_id] = res.reason
                        break
        if self.closed:  # closed while this submission was checked or audited: refuse, not lose, the rest
            verdicts = {aid: v or "run_ended" for aid, v in verdicts.items()}
        fraud = next((v for v in verdicts.values() if v in FRAUD), None)
        if fraud:
            # One lie taints the whole submission: refuse all of it.
            verdicts = {aid: v or "submission_refused" for aid, v in verdicts.items()}
        accepted: list[str] = []
        refused: dict[str, str] = {}
        groups = []
        for r in sub.rollouts:
            reason = verdicts[r.assignment_id]
            held = helds.get(r.assignment_id)
            if reason:
                refused[r.assignment_id] = reason
                self.stats.refuse(sub.node_id, reason)
                if held is not None:
                    self.retry.append(held.item)  # the prompt goes to someone else
                continue
            groups.append(score_group(self.task, held, r.samples, sub.version, sub.node_id,
                                      lambda ids: self.tok.decode(ids, skip_special_tokens=True), self.limits))
        for g in groups:
            self.guard.pairs.add(g.item.id, g.node_id, sum(g.rewards) / len(g.rewards))
        probation = sub.node_id in self.guard.probation
        if groups and not probation and self.guard.cherry_picking(sub.node_id):
            fraud = "cherry_picking"
            for g in groups:
                refused[g.assignment_id] = fraud
                self.stats.refuse(sub.node_id, fraud)
            groups = []
        for g in groups:
            self.on_accept(g)  # on disk before the node hears "accepted"
            accepted.append(g.assignment_id)
            self.stats.accepted(sub.node_id, sum(len(s.token_ids) for s in g.samples), self.version - sub.version)
        if probation:
            self.quarantine.extend(groups)
            self.guard.probation[sub.node_id] += len(groups)
        else:
            self._to_buffer(groups)
        if fraud:
            self._strike(sub.node_id, fraud)
        if groups:  # new shared prompts: this node's and its partners' verdicts may be in
            self._review_probation()
        if refused:
            log.warning("node %s: refused %d of %d rollouts (%s)", node.name, len(refused), len(sub.rollouts),
                        ", ".join(sorted(set(refused.values()))))
        self._pulse()  # refused work leaves room behind it, and probation may have released a node
        return P.SubmissionResult(accepted=accepted, refused=refused)

    def _to_buffer(self, groups: list[Group]) -> None:
        """Accepted groups join the learner's buffer. With dynamic sampling (DAPO), a group whose samples
        all scored the same does not: its advantages are all zero, so in a batch it would take the place
        of a group that teaches something. The ledger records it as dropped, and its room goes back to
        the nodes for new work."""
        if self.cfg.train.dynamic_sampling:
            flat = [g for g in groups if not has_signal(g.rewards)]
            if flat:
                groups = [g for g in groups if has_signal(g.rewards)]
                self.stats.drop("zero_advantage", len(flat))
                self.on_drop(flat, "zero_advantage")
        if groups:
            self.buffer.extend(groups)
            self.buffer_changed.set()

    # ---- probation ---------------------------------------------------------------------------------

    def _has_partner(self, node_id: str) -> bool:
        """Is there another live node this one's prompts can be shared with?"""
        now = time.monotonic()
        return any(n != node_id and n not in self.guard.bans and now - ns.last_seen <= self.gone_after_s
                   for n, ns in self.stats.nodes.items())

    def _drop_quarantined(self, node_id: str | None, reason: str, pred=lambda g: True) -> list[Group]:
        """Take groups out of quarantine (of one node, or all when None) and count them as dropped."""
        out = [g for g in self.quarantine if (node_id is None or g.node_id == node_id) and pred(g)]
        if out:
            ids = {id(g) for g in out}
            self.quarantine = [g for g in self.quarantine if id(g) not in ids]
            self.stats.drop(reason, len(out))
            self.on_drop(out, reason)
        self.stats.quarantined = len(self.quarantine)
        return out

    def _review_probation(self) -> None:
        """Release nodes the paired test cleared, drop and strike those it caught, drop what went stale."""
        oldest = self.version - self.cfg.train.max_lag
        stale = self._drop_quarantined(None, "stale_in_quarantine", lambda g: g.version < oldest)
        if stale:
            log.info("dropped %d quarantined groups that went stale", len(stale))
        for node_id in list(self.guard.probation):
            verdict = self.guard.probation_verdict(node_id, self.cfg.security.probation_groups,
                                                   self._has_partner(node_id))
            if verdict == "released":
                self.guard.release(node_id)
                mine = [g for g in self.quarantine if g.node_id == node_id]
                self.quarantine = [g for g in self.quarantine if g.node_id != node_id]
                self.stats.quarantined = len(self.quarantine)
                self._to_buffer(mine)
                n, z = self.guard.pairs.z(node_id)
                log.info("node %s passed probation (%d shared prompts, z %.2f): %d groups released",
                         node_id[:12], n, z, len(mine))
            elif verdict == "cherry_picking" and any(g.node_id == node_id for g in self.quarantine):
                caught = self._drop_quarantined(node_id, "cherry_picking")
                for _ in caught:
                    self.stats.refuse(node_id, "cherry_picking")
                n, z = self.guard.pairs.z(node_id)
                log.warning("node %s: reward excess over its partners on %d shared prompts (z %.1f): "
                            "cherry-picking; %d quarantined groups dropped", node_id[:12], n, z, len(caught))
                self._strike(node_id, "cherry_picking")

    def _strike(self, node_id: str, reason: str) -> None:
        # A node on probation has earned no trust yet: a fraud drops everything it has in quarantine.
        if node_id in self.guard.probation:
            self._drop_quarantined(node_id, "fraud_on_probation")
        if not self.guard.strike(node_id, reason):
            log.warning("node %s: strike %d for %s; all its work is audited now", node_id[:12],
                        self.guard.strikes[node_id], reason)
            return
        # Banned: its groups not yet trained on are dropped, its assignments go to others.
        self.guard.probation.pop(node_id, None)
        kept = [g for g in self.buffer if g.node_id != node_id]
        self.stats.drop("banned_node", len(self.buffer) - len(kept))
        self.on_drop([g for g in self.buffer if g.node_id == node_id], "banned_node")
        self.buffer = kept
        for aid in [a for a, h in self.held.items() if h.node_id == node_id]:
            self.retry.append(self.held.pop(aid).item)
        self.stats.banned.add(node_id)
        log.warning("node %s banned after %d strikes (last: %s)", node_id[:12], self.guard.strikes[node_id], reason)

    async def _expire_loop(self) -> None:
        """Work past its deadline, or held by a node gone silent, goes back to the queue (a late answer is
        refused as `late`). Probation is reviewed too: a node may be left alone when its partners go."""
        while True:
            await asyncio.sleep(min(1.0, self.gone_after_s / 4))
            now = time.monotonic()
            gone = {n for n, ns in self.stats.nodes.items() if now - ns.last_seen > self.gone_after_s}
            late = [h for h in self.held.values() if h.deadline < now or h.node_id in gone]
            for h in late:
                del self.held[h.assignment_id]
                self.retry.append(h.item)
                self.expired[h.assignment_id] = None
            while len(self.expired) > 10_000:
                self.expired.popitem(last=False)
            if late:
                log.info("re-queued %d expired assignments (or held by gone nodes)", len(late))
            self._review_probation()
            self._pulse()
