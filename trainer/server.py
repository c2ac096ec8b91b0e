"""The trainer's node-facing service: a zmq ROUTER that registers nodes, hands out work and takes rollouts.

Each frame from a node is decoded and validated (swarm.protocol); a bad one gets an `Error` reply and a
log line, and the loop goes on. Work is paced: no more than `inflight_groups` groups are assigned or
waiting for the learner at once, so little work goes stale. Work not answered in time goes back to the
front of the queue for someone else.
"""

from __future__ import annotations

import asyncio
import collections
import logging
import time
import uuid
from collections.abc import Callable, Iterator

import zmq
import zmq.asyncio

from rewards.base import Task, TaskItem
from swarm import protocol as P
from swarm.chat import encode_prompt
from swarm.config import RunConfig
from trainer.intake import Group, Held, Limits, check_rollout, check_version, score_group
from trainer.stats import RunStats

log = logging.getLogger("swarm.trainer")


class TrainerServer:
    def __init__(self, cfg: RunConfig, task: Task, tokenizer, vocab_size: int, stats: RunStats,
                 manifest_url: Callable[[int], str], items: Iterator[TaskItem], tracker_url: str,
                 trainer_key: str):
        self.cfg, self.task, self.tok, self.stats = cfg, task, tokenizer, stats
        self.manifest_url = manifest_url
        self.tracker_url, self.trainer_key = tracker_url, trainer_key
        t = cfg.train
        self.limits = Limits(t.group_size, t.max_tokens, vocab_size, tokenizer.eos_token_id, t.max_lag,
                             task.correct_metric)
        self.sampling = P.SamplingSpec(n=t.group_size, max_tokens=t.max_tokens, temperature=t.temperature,
                                       top_p=t.top_p)
        self.items = items
        self.retry: collections.deque[TaskItem] = collections.deque()  # prompts whose work expired
        self.held: dict[str, Held] = {}
        self.buffer: list[Group] = []  # accepted, not yet trained on
        self.buffer_changed = asyncio.Event()
        self.version = 0
        self.idents: dict[str, bytes] = {}  # node id -> zmq routing identity
        self.items_drawn = 0

    # ---- the learner's side -----------------------------------------------------------------------

    async def take_batch(self, n: int) -> list[Group]:
        """Wait for n accepted groups (oldest first), dropping any that went stale meanwhile."""
        while True:
            fresh = []
            for g in self.buffer:
                if g.version < self.version - self.cfg.train.max_lag:
                    self.stats.drop("stale")
                else:
                    fresh.append(g)
            self.buffer = fresh
            if len(self.buffer) >= n:
                batch, self.buffer = self.buffer[:n], self.buffer[n:]
                return batch
            self.buffer_changed.clear()
            await self.buffer_changed.wait()

    async def announce(self, version: int) -> None:
        self.version = version
        notice = P.encode(P.VersionNotice(weights=self.weights_info()))
        for ident in self.idents.values():
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
        self.sock.setsockopt(zmq.ROUTER_HANDOVER, 1)  # a node that reconnects keeps its identity
        self.sock.bind(f"tcp://{self.cfg.server.host}:{self.cfg.server.port}")
        self._task = asyncio.create_task(self._serve())
        self._reaper = asyncio.create_task(self._expire_loop())

    async def stop(self) -> None:
        for t in (self._task, self._reaper):
            t.cancel()
        self.sock.close(0)
        self.ctx.term()

    async def _serve(self) -> None:
        while True:
            frames = await self.sock.recv_multipart()
            if len(frames) != 2:
                log.warning("dropped a message with %d frames", len(frames))
                continue
            ident, data = frames
            try:
                msg = P.decode(data, self.cfg.server.max_message_bytes)
                reply = self.handle(ident, msg)
            except P.ProtocolError as e:
                log.warning("refused a message from %s: %s", ident.hex()[:12], e)
                reply = P.Error(code=e.code, message=e.message)
            except Exception as e:  # a bug must not take the service down; say so loudly
                log.exception("error handling a message")
                reply = P.Error(code="internal", message=type(e).__name__)
            if reply is not None:
                await self.sock.send_multipart([ident, P.encode(reply)])

    def handle(self, ident: bytes, msg: P.Message) -> P.Message | None:
        if isinstance(msg, P.Register):
            return self._register(ident, msg)
        node = self.stats.nodes.get(msg.node_id) if hasattr(msg, "node_id") else None
        if node is None or self.idents.get(msg.node_id) != ident:
            return P.Error(code="unknown_node", message="register first")
        node.last_seen = time.monotonic()
        if isinstance(msg, P.Heartbeat):
            node.version_loaded, node.tokens_per_s = msg.version_loaded, msg.tokens_per_s
            return None
        if isinstance(msg, P.WorkRequest):
            node.version_loaded = msg.version_loaded
            return self._assign(msg)
        if isinstance(msg, P.RolloutSubmission):
            node.tokens_per_s = sum(len(s.token_ids) for r in msg.rollouts for s in r.samples) / max(
                msg.gen_seconds, 1e-3)
            return self._intake(msg)
        return P.Error(code="unexpected", message=f"{type(msg).__name__} is not a node-to-trainer message")

    def _register(self, ident: bytes, msg: P.Register) -> P.Message:
        if msg.protocol != P.PROTOCOL_VERSION:
            return P.Error(code="protocol", message=f"trainer speaks protocol {P.PROTOCOL_VERSION}")
        node = self.stats.node(msg.node_id, msg.name)
        node.name, node.status_url, node.last_seen = msg.name, msg.status_url, time.monotonic()
        self.idents[msg.node_id] = ident
        log.info("node %s registered (%s)", msg.name, msg.node_id[:12])
        return P.Registered(node_id=msg.node_id, weights=self.weights_info(), sampling=self.sampling,
                            heartbeat_s=self.cfg.server.heartbeat_s, max_lag=self.cfg.train.max_lag,
                            tracker_url=self.tracker_url, trainer_key=self.trainer_key)

    def _next_item(self) -> TaskItem:
        if self.retry:
            return self.retry.popleft()
        self.items_drawn += 1
        return next(self.items)

    def _assign(self, req: P.WorkRequest) -> P.WorkAssignment:
        min_version = max(0, self.version - self.cfg.train.max_lag)
        room = self.cfg.train.inflight_groups - len(self.held) - len(self.buffer)
        n = min(req.max_prompts, room) if req.version_loaded >= min_version else 0
        out = []
        deadline = time.monotonic() + self.cfg.server.assignment_timeout_s
        for _ in range(max(n, 0)):
            item = self._next_item()
            aid = uuid.uuid4().hex[:16]
            ids = encode_prompt(self.tok, item.prompt, self.task.system_prompt)
            self.held[aid] = Held(aid, req.node_id, item, ids, self.version, deadline)
            out.append(P.Assignment(assignment_id=aid, prompt_token_ids=ids))
        return P.WorkAssignment(weights=self.weights_info(), min_version=min_version, assignments=out,
                                sampling=self.sampling, retry_after_s=0.0 if out else 0.25)

    def _intake(self, sub: P.RolloutSubmission) -> P.SubmissionResult:
        accepted: list[str] = []
        refused: dict[str, str] = {}
        version_reason = check_version(sub.version, self.version, self.limits)
        now = time.monotonic()
        for r in sub.rollouts:
            held = self.held.get(r.assignment_id)
            reason = version_reason or check_rollout(r, held, sub.node_id, sub.version, self.limits, now)
            if held is not None and held.node_id == sub.node_id:
                del self.held[r.assignment_id]  # answered, well or not: never again
                if reason:
                    self.retry.append(held.item)  # the prompt goes to someone else
            if reason:
                refused[r.assignment_id] = reason
                self.stats.refuse(sub.node_id, reason)
                continue
            group = score_group(self.task, held, r.samples, sub.version, sub.node_id,
                                lambda ids: self.tok.decode(ids, skip_special_tokens=True), self.limits)
            self.buffer.append(group)
            accepted.append(r.assignment_id)
            self.stats.accepted(sub.node_id, sum(len(s.token_ids) for s in r.samples), self.version - sub.version)
        if accepted:
            self.buffer_changed.set()
        if refused:
            log.warning("node %s: refused %d of %d rollouts (%s)", sub.node_id[:12], len(refused),
                        len(sub.rollouts), ", ".join(sorted(set(refused.values()))))
        return P.SubmissionResult(accepted=accepted, refused=refused)

    async def _expire_loop(self) -> None:
        """Work past its deadline goes back to the queue (its late answer will be refused)."""
        while True:
            await asyncio.sleep(1.0)
            now = time.monotonic()
            late = [h for h in self.held.values() if h.deadline < now]
            for h in late:
                del self.held[h.assignment_id]
                self.retry.append(h.item)
            if late:
                log.info("re-queued %d expired assignments", len(late))
