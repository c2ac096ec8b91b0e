"""`swarm train`: the learning run, top to bottom.

`Trainer.setup` loads the policy (or resumes from the newest complete checkpoint), publishes it, opens
the node service (zmq), the relay tree's origin and the HTTP side. `Trainer.train` evaluates the start,
then loops: wait for a batch of accepted groups, take one GRPO `step`, `publish` the new version, evaluate
every `eval_every` steps and `checkpoint` every `checkpoint_every`; `close` shuts everything down. Nodes
keep generating while the learner works; the step runs on a worker thread so the services never stall,
and a version is written, signed and announced while the next step runs (only a copy of the weights is
on the step's path).

Versions only ever go up: a run publishes its first version above every version its key has signed (a
resumed run's, and a run whose versions/ was emptied), so a node never sees one number name two different
sets of weights.
"""

from __future__ import annotations

import asyncio
import logging
import time
from pathlib import Path

import msgspec
import torch
from transformers.utils import logging as hf_logging

from broadcast.origin import Origin
from rewards.environment import Environment
from rewards.registry import make_task
from swarm_common.keys import KeyPair
from trainer.audit import Auditor
from trainer.checkpoint import TrainerState, latest_checkpoint
from trainer.config import RunConfig, dump_config
from trainer.dist_learner import follow_main, open_driver, start_learner
from trainer.distributed import DistEnv, in_torchrun, init_distributed, shutdown
from trainer.episode_eval import evaluate_task
from trainer.guard import Guard
from trainer.http_api import make_app, serve
from trainer.intake import Group
from trainer.learner import make_learner
from trainer.ledger import Ledger
from trainer.model_prep import prepare_base_model
from trainer.newcomers import warn_about_strangers
from trainer.node_registry import NodeRegistry
from trainer.node_service import NodeService
from trainer.policy import load_model, load_tokenizer
from trainer.publisher import Publisher, last_signed, record_signed
from trainer.stats import EvalRow, RunStats, SnapshotRow, StepRow
from trainer.web.view import WebView

log = logging.getLogger(__name__)


class Trainer:
    def __init__(self, cfg: RunConfig, web_extra=None, dist: DistEnv | None = None):
        """`dist`: this is rank 0 of a sharded learner (swarm train --nproc N); the other ranks only learn."""
        self.cfg, self.web_extra, self.dist = cfg, web_extra, dist
        self.run_dir = Path(cfg.run_dir)
        self.publish_dtype = getattr(torch, cfg.model.publish_dtype)
        self.state: TrainerState | None = None  # what a resumed run starts from
        self.publishing: asyncio.Task | None = None  # the newest version, being written, signed and announced
        self.version = 0

    # ---- setup ---------------------------------------------------------------------------------------

    async def setup(self, resume: bool = False) -> None:
        cfg, t = self.cfg, self.cfg.train
        torch.set_num_threads(t.torch_threads)
        torch.manual_seed(t.seed)
        # A version is saved every step: HF's shard-writing progress bar each time would drown the log.
        hf_logging.disable_progress_bar()
        self.run_dir.mkdir(parents=True, exist_ok=True)
        (self.run_dir / "config.toml").write_text(dump_config(cfg))

        driver = open_driver(self.dist) if self.dist else None  # the other ranks hear from rank 0 from now on
        self.base = await asyncio.to_thread(prepare_base_model, cfg)
        self.model, self.tok = load_model(self.base), load_tokenizer(self.base)
        self.model.eval()
        self.task = make_task(cfg.task.name, **cfg.task.params)
        if isinstance(self.task, Environment) and not self.task.replayable and cfg.task.open_to_strangers:
            raise ValueError(f"environment {self.task.name} cannot be replayed by the trainer, so it cannot be "
                             "open to strangers: set task.open_to_strangers=false and run trusted nodes")
        self.eval_items = self.task.eval_items(cfg.task.eval_size)
        if driver is None:
            self.learner = make_learner(cfg, self.model, self.tok)
        else:  # the learner shards its model over the ranks; a plain copy is what is evaluated and audited
            sharded = load_model(self.base)
            self.learner = await asyncio.to_thread(start_learner, cfg, driver, self.base, sharded,
                                                   self.tok.pad_token_id)
        self.publisher = Publisher(self.run_dir, self.base, keep=t.keep_versions,
                                   max_shard_bytes=cfg.model.max_shard_bytes)
        self.registry = NodeRegistry(cfg.server.heartbeat_s, cfg.server.gone_after_s)
        self.stats = RunStats(str(self.run_dir), t.max_steps, self.registry)
        self.ledger = Ledger(self.run_dir)
        self.resume(resume)
        # A version number is never reused under this key, even by a run resumed from an older checkpoint.
        self.version = max([*self.publisher.versions(), self.state.version if self.state else -1,
                            last_signed(self.run_dir)]) + 1

        # Weights leave the trainer only through the relay tree, signed with the trainer's key.
        key = KeyPair.load_or_create(self.run_dir / "trainer.key")
        s = cfg.server
        self.origin = Origin(self.run_dir / "broadcast", key, s.tree, host=s.host, port=s.tracker_port,
                             keep=t.keep_versions)
        await self.origin.start()
        log.info("trainer key fingerprint %s (nodes pin it with --trainer-key %s)", key.fingerprint,
                 self.run_dir / "trainer.pub")
        self.guard = Guard(self.run_dir, cfg.guard)
        warn_about_strangers(cfg, self.guard)
        self.auditor = self._make_auditor()
        # What nodes get: the trainer's fp32 weights cast to model.publish_dtype. The audit recomputes with them.
        weights = await asyncio.to_thread(self.learner.full_state, self.publish_dtype)
        if self.auditor is not None:
            self.auditor.remember(self.version, weights, keep_from=self.version - t.max_lag)
        path = await asyncio.to_thread(self.publisher.publish, self.model, self.version, weights)
        record_signed(self.run_dir, self.version)
        await self.origin.publish(path, self.version, None)
        self.stats.version = self.version

        st = self.state
        items = self.task.train_items(seed=cfg.task.seed, start=st.items_drawn if st else 0)
        self.service = NodeService(cfg, self.task, self.tok, self.model.config.vocab_size, self.stats,
                                   self.registry, lambda v: f"/v/{v}/manifest", items,  # relative: per node
                                   tracker_url=self.origin.url, trainer_key=key.public_hex, guard=self.guard,
                                   auditor=self.auditor, ledger=self.ledger, tree=self.origin)
        self.origin.on_ban = self.service.ban_from_tree  # confirmed corruption in the tree bans the node key
        self.service.restore(self.version, st, self.ledger.pending() if st else [])
        await self._serve()

    def resume(self, resume: bool) -> None:
        """Load the newest complete checkpoint (with --resume) and cut the ledger back to its step."""
        ckpt = latest_checkpoint(self.run_dir) if resume else None
        if ckpt is not None:
            st = self.state = self.learner.load(ckpt)
            self.ledger.truncate_after(st.step)
            self.stats.restore(st)
            log.info("resumed from %s (step %d)", ckpt, st.step)
        elif resume:
            log.warning("--resume: no checkpoint in %s, starting afresh", self.run_dir)
        elif (self.run_dir / "accepted.jsonl").exists() and (self.run_dir / "accepted.jsonl").stat().st_size:
            raise ValueError(f"{self.run_dir} holds an earlier run: pass --resume, or use another run dir")

    def _make_auditor(self) -> Auditor | None:
        cfg, t = self.cfg, self.cfg.train
        if not cfg.audit.enabled:
            return None
        auditor = Auditor(self.model, self.tok.pad_token_id, t.temperature, t.top_p, cfg.audit, seed=t.seed)
        self.stats.calibration = auditor.calibration
        # Versions published before a resume may still be answered with: the audit needs their weights.
        for v in self.publisher.versions():
            if v >= self.version - t.max_lag:
                weights = load_model(self.publisher.path(v)).state_dict()
                auditor.remember(v, weights, keep_from=self.version - t.max_lag)
        return auditor

    async def _serve(self) -> None:
        """The HTTP API and the web view (which samples throughput once a second), then the node service."""
        s = self.cfg.server
        self.view = WebView(self.stats)
        self.stats.tree_provider = lambda: self.origin.tracker.view(self.origin.latest, sorted(self.origin.versions))
        self.http = await serve(make_app(self.stats, self.view.extra(self.web_extra)), s.host, s.http_port)
        web_url = await self.view.start(s.web_host, s.web_port)
        await self.service.start()
        log.info("trainer up: nodes connect to tcp://%s:%d, status at http://%s:%d/api/summary",
                 s.host, s.port, s.host, s.http_port)
        if web_url:
            log.info("web view at %s", web_url)

    # ---- the run ------------------------------------------------------------------------------------

    async def train(self) -> RunStats:
        t, stats = self.cfg.train, self.stats
        if self.state is None:
            await self.evaluate(0)
            stats.t0 = time.time()  # the RL clock starts once everything is up
            if t.snapshot_every:
                await self.snapshot(self.version, 0, 0.0)
        else:
            stats.t0 = time.time() - self.state.elapsed_s
        deadline = float("inf")  # max_minutes counts from the first batch, not from engines starting up
        while stats.step < t.max_steps and time.monotonic() < deadline:
            groups = await self.service.take_batch(t.prompts_per_step, oldest=self.version - t.max_lag)
            if deadline == float("inf") and t.max_minutes > 0:
                deadline = time.monotonic() + t.max_minutes * 60
            await self.step(groups)
            if t.eval_every and stats.step % t.eval_every == 0:
                await self.evaluate(stats.step)
            if t.checkpoint_every and stats.step % t.checkpoint_every == 0:
                await self.checkpoint()
        await self.finish()
        return stats

    async def step(self, groups: list[Group]) -> None:
        """One GRPO step on `groups`; the new version goes out while the next batch is gathered."""
        t0 = time.perf_counter()
        self.service.begin_step()  # work handed out from now on is trained on from the next version
        st = await asyncio.to_thread(self.learner.step, groups)
        self.stats.step += 1
        self.version += 1
        self.service.end_step(self.version)  # with work_lag 0, new work waits for this version to be out
        weights = await asyncio.to_thread(self.learner.full_state, self.publish_dtype)
        if self.auditor is not None:  # before the announcement: a node may answer with it at once
            await asyncio.to_thread(self.auditor.remember, self.version, weights, self.version - self.cfg.train.max_lag)
        await self.published()  # the previous version overlapped this step; it goes out first
        self.publishing = asyncio.create_task(self.publish(self.version, weights, self.stats.step, self.stats.elapsed()))
        self.ledger.batch(self.stats.step, groups)
        self._record_step(groups, st, time.perf_counter() - t0)

    def _record_step(self, groups: list[Group], st: dict[str, float], secs: float) -> None:
        stats, v = self.stats, self.version
        zero = int(st["zero_adv_groups"])
        stats.trained_groups += len(groups) - zero
        stats.drop("zero_advantage", zero)
        rewards = [r for g in groups for r in g.rewards]
        correct = [c for g in groups for c in g.correct]
        lag = sum(v - 1 - g.version for g in groups) / len(groups)
        row = StepRow(stats.step, v, round(stats.elapsed(), 2), sum(rewards) / len(rewards),
                      sum(correct) / len(correct), len(groups), zero, lag, st.get("loss", 0.0),
                      st.get("clip_frac", 0.0), round(secs, 3))
        stats.record_step(row)
        log.info("step %d (v%d): reward %.3f correct %.3f lag %.2f zero-adv %d/%d loss %.4f (%.2fs)",
                 stats.step, v, row.reward_mean, row.correct_mean, lag, zero, len(groups), row.loss, secs)

    async def publish(self, version: int, weights: dict, step: int, step_time: float) -> None:
        t0 = time.perf_counter()
        path = await asyncio.to_thread(self.publisher.publish, self.model, version, weights)
        record_signed(self.run_dir, version)  # before it is signed
        t1 = time.perf_counter()
        await self.origin.publish(path, version, version - 1)
        await self.service.announce(version)
        log.info("v%d out in %.2fs (written in %.2fs, then hashed, signed and announced)", version,
                 time.perf_counter() - t0, t1 - t0)
        self.stats.version = version
        if self.cfg.train.snapshot_every and step % self.cfg.train.snapshot_every == 0:
            await self.snapshot(version, step, step_time)

    async def published(self) -> None:
        """Wait until the version in flight is out: versions go out in order, and checkpoints and
        snapshots name published versions."""
        if self.publishing is not None:
            task, self.publishing = self.publishing, None
            await task

    async def evaluate(self, step: int) -> None:
        if self.dist:  # the plain copy gets the sharded learner's current weights
            self.model.load_state_dict(await asyncio.to_thread(self.learner.full_state, None))
        ev = await asyncio.to_thread(evaluate_task, self.model, self.tok, self.task, self.eval_items,
                                     self.cfg.train.max_tokens, self.cfg.task.max_episode_tokens)
        self.stats.record_eval(EvalRow(step, round(self.stats.elapsed(), 2), ev["accuracy"], ev["reward_mean"]))
        log.info("eval step %d: held-out greedy accuracy %.3f (mean reward %.3f)", step, ev["accuracy"],
                 ev["reward_mean"])

    async def checkpoint(self) -> None:
        await self.published()
        s = self.stats
        items_drawn, retry, rng = self.service.state()
        st = TrainerState(s.step, self.version, items_drawn, retry, rng, s.steps, s.evals, s.accepted_groups,
                          s.tokens, dict(s.dropped), dict(s.refused), s.elapsed())
        path = await asyncio.to_thread(self.learner.save, self.run_dir, st)
        log.info("checkpoint %s", path.name)

    async def snapshot(self, version: int, step: int, step_time: float) -> None:
        path = await asyncio.to_thread(self.publisher.snapshot, version, f"step-{step:06d}")
        self.stats.snapshots.append(SnapshotRow(step, version, round(step_time, 3), str(path)))

    async def finish(self) -> None:
        """The run is over: nothing more comes in (a group accepted during the final eval or checkpoint
        would be trained on by nobody), and what is left in the buffer, or still in quarantine waiting
        for its node's verdict, will not be trained on: the ledger says so. Then the last eval and
        checkpoint."""
        leftover = self.service.close()
        if leftover:
            self.ledger.dropped(leftover, "run_ended", self.stats.step)
            self.stats.drop("run_ended", len(leftover))
        await self.published()
        if not self.stats.evals or self.stats.evals[-1].step != self.stats.step:
            await self.evaluate(self.stats.step)
        await self.checkpoint()

    async def close(self) -> None:
        """Stop every service and write RUN/summary.json, whatever state the run is in."""
        if self.publishing is not None:
            self.publishing.cancel()
        self.stats.done = True
        self.ledger.close()
        summary = self.stats.summary()
        (self.run_dir / "summary.json").write_bytes(msgspec.json.format(msgspec.json.encode(summary)))
        for stop in (self.service.stop, self.view.stop, self.http.cleanup, self.origin.stop):
            await stop()
        self.learner.close()


async def run_training(cfg: RunConfig, web_extra=None, resume: bool = False) -> RunStats | None:
    """The run; under torchrun (swarm train --nproc N) rank 0 runs it and the other ranks only learn."""
    dist = init_distributed(cfg.train.dist_timeout_s) if in_torchrun() else None
    if dist is not None and dist.rank > 0:
        try:
            follow_main(cfg, dist)
        finally:
            shutdown()
        return None
    try:
        return await _run(Trainer(cfg, web_extra, dist), resume)
    finally:
        if dist is not None:
            shutdown()


async def _run(trainer: Trainer, resume: bool) -> RunStats:
    await trainer.setup(resume)
    try:
        return await trainer.train()
    finally:
        await trainer.close()
