"""`swarm train`: the learning run, top to bottom.

Start (or resume from the newest complete checkpoint): load the policy, publish it, open the node
service (zmq), the relay tree's origin and the HTTP side, and evaluate the starting point. Then loop:
wait for a batch of accepted groups, take one GRPO step, publish and announce the new version, log the
batch, evaluate every `eval_every` steps, checkpoint every `checkpoint_every` and keep a snapshot of the
policy every `snapshot_every` (for evaluation after the run, off the run's clock). Nodes keep generating
while the learner works; the step runs on a worker thread so the services never stall, and a version is
written, signed and announced while the next step runs (only a copy of the weights is on the step's path).

Versions only ever go up: a resumed run publishes its first version above every version already
published, so a node never sees one number name two different sets of weights.
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
from rewards.registry import make_task
from swarm_common.keys import KeyPair
from trainer.audit import AuditConfig, Auditor
from trainer.checkpoint import (
    TrainerState,
    latest_checkpoint,
    load_checkpoint,
    restore_rng,
    rng_state,
    save_checkpoint,
)
from trainer.config import RunConfig, dump_config
from trainer.grpo import LossConfig
from trainer.guard import Guard, GuardConfig
from trainer.http_api import make_app, serve
from trainer.learner import Learner, evaluate
from trainer.ledger import Ledger
from trainer.model_prep import prepare_base_model
from trainer.policy import frozen_state, load_model, load_tokenizer
from trainer.publisher import Publisher
from trainer.server import TrainerServer
from trainer.stats import EvalRow, RunStats, SnapshotRow, StepRow
from trainer.web.view import WebView

log = logging.getLogger(__name__)


def make_learner(cfg: RunConfig, model, tok) -> Learner:
    t = cfg.train
    return Learner(model, tok, t.lr, t.weight_decay, t.grad_clip,
                   LossConfig(t.eps_low, t.eps_high, t.delta, t.seq_is_cap, t.kl_beta),
                   temperature=t.temperature, scale_adv_by_std=t.scale_adv_by_std)


async def run_training(cfg: RunConfig, web_extra=None, resume: bool = False) -> RunStats:
    t = cfg.train
    torch.set_num_threads(t.torch_threads)
    torch.manual_seed(t.seed)
    # A version is saved every step: HF's shard-writing progress bar each time would drown the trainer's log.
    hf_logging.disable_progress_bar()
    run_dir = Path(cfg.run_dir)
    run_dir.mkdir(parents=True, exist_ok=True)
    (run_dir / "config.toml").write_text(dump_config(cfg))

    base = await asyncio.to_thread(prepare_base_model, cfg)
    model, tok = load_model(base), load_tokenizer(base)
    model.eval()
    task = make_task(cfg.task.name, **cfg.task.params)
    eval_items = task.eval_items(cfg.task.eval_size)
    learner = make_learner(cfg, model, tok)
    publisher = Publisher(run_dir, base, keep=t.keep_versions, max_shard_bytes=cfg.model.max_shard_bytes)
    stats = RunStats(str(run_dir), t.max_steps)
    ledger = Ledger(run_dir)

    ckpt = latest_checkpoint(run_dir) if resume else None
    state: TrainerState | None = None
    if ckpt is not None:
        state = load_checkpoint(ckpt, model, learner.opt)
        ledger.truncate_after(state.step)
        stats.step, stats.steps, stats.evals = state.step, state.steps, state.evals
        stats.accepted_groups, stats.tokens = state.accepted_groups, state.tokens
        stats.dropped.update(state.dropped)
        stats.refused.update(state.refused)
        stats.trained_groups = sum(r.groups - r.zero_adv_groups for r in state.steps)
        log.info("resumed from %s (step %d)", ckpt, state.step)
    elif resume:
        log.warning("--resume: no checkpoint in %s, starting afresh", run_dir)
    elif (run_dir / "accepted.jsonl").exists() and (run_dir / "accepted.jsonl").stat().st_size:
        raise ValueError(f"{run_dir} holds an earlier run: pass --resume, or use another run dir")
    # A version number is never reused, even for a run resumed from an older checkpoint.
    version = max([*publisher.versions(), state.version if state else -1]) + 1

    # Weights leave the trainer only through the relay tree, signed with the trainer's key.
    key = KeyPair.load_or_create(run_dir / "trainer.key")
    origin = Origin(run_dir / "broadcast", key, host=cfg.server.host, port=cfg.server.tracker_port,
                    fanout=cfg.server.fanout, keep=t.keep_versions, piece_size=cfg.server.piece_bytes,
                    heartbeat_interval=cfg.server.heartbeat_s)
    await origin.start()
    log.info("trainer key fingerprint %s (nodes pin it with --trainer-key %s)", key.fingerprint,
             run_dir / "trainer.pub")
    sec = cfg.security
    guard = Guard(run_dir, GuardConfig(
        allowlist=frozenset(k.lower() for k in sec.allowlist), trusted=frozenset(k.lower() for k in sec.trusted),
        strikes_to_ban=sec.strikes_to_ban, msg_rate=sec.msg_rate, msg_burst=sec.msg_burst,
        max_held=sec.max_held, pair_z=sec.pair_z, pair_min=sec.pair_min, release_z=sec.pair_release_z))
    auditor = None
    if sec.audit:
        auditor = Auditor(model, tok.pad_token_id, t.temperature, t.top_p,
                          AuditConfig(sec.audit_rate, sec.audit_new_node_groups, sec.audit_tol,
                                      sec.min_tail_mass), seed=t.seed)
        stats.calibration = auditor.calibration
        # Versions published before a resume may still be answered with: the audit needs their weights.
        for v in publisher.versions():
            if v >= version - t.max_lag:
                auditor.remember(v, load_model(publisher.path(v)).state_dict(), keep_from=version - t.max_lag)
    # What nodes get: the trainer's fp32 weights cast to model.publish_dtype. The audit recomputes with them.
    publish_dtype = getattr(torch, cfg.model.publish_dtype)
    weights = frozen_state(model, publish_dtype)
    if auditor is not None:
        auditor.remember(version, weights, keep_from=version - t.max_lag)
    stats.banned.update(guard.bans)
    await origin.publish(await asyncio.to_thread(publisher.publish, model, version, weights), version, None)
    stats.version = version

    items = task.train_items(seed=cfg.task.seed, start=state.items_drawn if state else 0)
    server = TrainerServer(cfg, task, tok, model.config.vocab_size, stats,
                           lambda v: f"{origin.url}/v/{v}/manifest", items,
                           tracker_url=origin.url, trainer_key=key.public_hex, guard=guard, auditor=auditor)
    server.version = server.newest = version
    server.on_accept = ledger.accepted
    server.on_drop = lambda groups, reason: ledger.dropped(groups, reason, stats.step)
    if state is not None:
        server.items_drawn = state.items_drawn
        server.retry.extend(state.retry)
        restore_rng(server.rng, state.server_rng)
        # Accepted before the crash and not trained on in a kept step. Groups of keys that had not passed
        # probation go back to quarantine: they wait for that key's verdict (or go stale), as before.
        for g in ledger.pending():
            (server.buffer if guard.is_established(g.node_id) else server.quarantine).append(g)
        stats.quarantined = len(server.quarantine)
        log.info("resume: %d accepted groups back in the buffer, %d in quarantine", len(server.buffer),
                 len(server.quarantine))
    host, http_port = cfg.server.host, cfg.server.http_port
    # The web view samples throughput once a second and serves the live page on its own port; its /api
    # routes go on http_port too.
    view = WebView(stats, cfg.server.heartbeat_s)
    stats.tree_provider = lambda: origin.tracker.view(origin.latest, sorted(origin.versions))
    http = await serve(make_app(stats, cfg.server.heartbeat_s, view.extra(web_extra)), host, http_port)
    web_url = await view.start(cfg.server.web_host, cfg.server.web_port)
    await server.start()
    log.info("trainer up: nodes connect to tcp://%s:%d, status at http://%s:%d/api/summary",
             host, cfg.server.port, host, http_port)
    if web_url:
        log.info("web view at %s", web_url)

    async def run_eval(step: int) -> None:
        ev = await asyncio.to_thread(evaluate, model, tok, task, eval_items, t.max_tokens)
        stats.evals.append(EvalRow(step, round(stats.elapsed(), 2), ev["accuracy"], ev["reward_mean"]))
        stats.m_eval.set(ev["accuracy"])
        log.info("eval step %d: held-out greedy accuracy %.3f (mean reward %.3f)", step, ev["accuracy"],
                 ev["reward_mean"])

    publishing: asyncio.Task | None = None  # the newest version, being written, signed and announced

    async def publish(v: int, weights: dict, step: int, step_time: float) -> None:
        t0 = time.perf_counter()
        path = await asyncio.to_thread(publisher.publish, model, v, weights)
        t1 = time.perf_counter()
        await origin.publish(path, v, v - 1)
        await server.announce(v)
        log.info("v%d out in %.2fs (written in %.2fs, then hashed, signed and announced)", v,
                 time.perf_counter() - t0, t1 - t0)
        stats.version = v
        if t.snapshot_every and step % t.snapshot_every == 0:
            await snapshot(v, step, step_time)

    async def published() -> None:
        """Wait until the version in flight is out: versions go out in order, and checkpoints and
        snapshots name published versions."""
        nonlocal publishing
        if publishing is not None:
            task, publishing = publishing, None
            await task

    async def checkpoint() -> None:
        await published()
        st = TrainerState(stats.step, version, server.items_drawn,
                          list(server.retry) + [h.item for h in server.held.values()], rng_state(server.rng),
                          stats.steps, stats.evals, stats.accepted_groups, stats.tokens, dict(stats.dropped),
                          dict(stats.refused), stats.elapsed())
        path = await asyncio.to_thread(save_checkpoint, run_dir, model, learner.opt, st)
        log.info("checkpoint %s", path.name)

    async def snapshot(v: int, step: int, step_time: float) -> None:
        path = await asyncio.to_thread(publisher.snapshot, v, f"step-{step:06d}")
        stats.snapshots.append(SnapshotRow(step, v, round(step_time, 3), str(path)))

    try:
        if state is None:
            await run_eval(0)
            stats.t0 = time.time()  # the RL clock starts once everything is up
            if t.snapshot_every:
                await snapshot(version, 0, 0.0)
        else:
            stats.t0 = time.time() - state.elapsed_s
        deadline = float("inf")  # max_minutes counts from the first batch, not from engines starting up
        while stats.step < t.max_steps and time.monotonic() < deadline:
            groups = await server.take_batch(t.prompts_per_step, oldest=version - t.max_lag)
            if deadline == float("inf") and t.max_minutes > 0:
                deadline = time.monotonic() + t.max_minutes * 60
            t0 = time.perf_counter()
            server.training = True  # work handed out from now on is trained on from the next version
            st = await asyncio.to_thread(learner.step, groups)
            stats.step += 1
            version += 1
            server.newest = version  # with work_lag 0, new work waits for this version to be out
            server.training = False
            weights = await asyncio.to_thread(frozen_state, model, publish_dtype)
            if auditor is not None:  # before the announcement: a node may answer with it at once
                await asyncio.to_thread(auditor.remember, version, weights, version - t.max_lag)
            await published()  # the previous version overlapped this step; it goes out first
            # Writing, hashing, signing and announcing this version overlaps the next step.
            publishing = asyncio.create_task(publish(version, weights, stats.step, stats.elapsed()))
            ledger.batch(stats.step, groups)
            secs = time.perf_counter() - t0
            zero = int(st["zero_adv_groups"])
            stats.trained_groups += len(groups) - zero
            stats.drop("zero_advantage", zero)
            rewards = [r for g in groups for r in g.rewards]
            correct = [c for g in groups for c in g.correct]
            lag = sum(version - 1 - g.version for g in groups) / len(groups)
            row = StepRow(stats.step, version, round(stats.elapsed(), 2), sum(rewards) / len(rewards),
                          sum(correct) / len(correct), len(groups), zero, lag, st.get("loss", 0.0),
                          st.get("clip_frac", 0.0), round(secs, 3))
            stats.steps.append(row)
            stats.m_steps.inc()
            stats.m_version.set(version)
            stats.m_reward.set(row.reward_mean)
            stats.m_step_s.observe(secs)
            log.info("step %d (v%d): reward %.3f correct %.3f lag %.2f zero-adv %d/%d loss %.4f (%.2fs)",
                     stats.step, version, row.reward_mean, row.correct_mean, lag, zero, len(groups), row.loss, secs)
            if t.eval_every and stats.step % t.eval_every == 0:
                await run_eval(stats.step)
            if t.checkpoint_every and stats.step % t.checkpoint_every == 0:
                await checkpoint()
        # The run is over: nothing more comes in (a group accepted during the final eval or checkpoint
        # would be trained on by nobody), and what is left in the buffer, or still in quarantine waiting
        # for its node's verdict, will not be trained on. Say so in the ledger.
        leftover = server.close()
        if leftover:
            ledger.dropped(leftover, "run_ended", stats.step)
            stats.drop("run_ended", len(leftover))
        stats.quarantined = 0
        await published()
        if not stats.evals or stats.evals[-1].step != stats.step:
            await run_eval(stats.step)
        await checkpoint()
    finally:
        if publishing is not None:
            publishing.cancel()
        stats.done = True
        ledger.close()
        summary = stats.summary(cfg.server.heartbeat_s)
        (run_dir / "summary.json").write_bytes(msgspec.json.format(msgspec.json.encode(summary)))
        await server.stop()
        await view.stop()
        await http.cleanup()
        await origin.stop()
    return stats
