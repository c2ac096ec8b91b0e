"""The learner over N ranks (FSDP2), with trainer/learner.py's Learner interface, driven by rank 0.

Rank 0 runs everything the trainer runs today (node service, origin, ledger, web view) and calls this
learner's step / full_state / save / load / close where it called Learner's. Each call tells the other
ranks what to do (a typed command on the channel), then does rank 0's part of the collective work with
them. Ranks 1..N-1 only run `follow_main`: receive a command, do their part, until Stop.

A step's kept groups are split whole across the ranks, balanced by tokens. Each rank's loss is divided by
the whole batch's completion token count, flat groups' included (trainer/learner.py's normalisation), and
the gradients are summed over the ranks: N ranks make the update one rank makes. Every rank runs as many
micro-batches as the busiest one (an idle rank makes zero-weight passes), and every pass goes through
the model twice (prompts, then completions padded to two tokens at least): FSDP's collectives happen per
pass and must pair up across the ranks.
"""

from __future__ import annotations

import copy
import logging
import math
import shutil
from datetime import timedelta
from pathlib import Path

import msgspec
import torch
import torch.distributed as dist
from torch.distributed.tensor import DTensor

from swarm_common.atomic import building_dir
from trainer.checkpoint import TrainerState, checkpoint_dir
from trainer.config import RunConfig
from trainer.dist_checkpoint import (
    check_compatible,
    check_unsharded_compatible,
    is_sharded_checkpoint,
    load_shards,
    load_unsharded,
    read_state,
    read_unsharded_state,
    save_shards,
    write_state,
)
from trainer.distributed import DistEnv, Driver, all_sum, collective, receive
from trainer.grpo import LossConfig
from trainer.learner import TrainGroup, add_into, backward, make_adamw, means, micro_batches, prepare
from trainer.sharding import check_world, gather_full_state, make_mesh, shard

log = logging.getLogger(__name__)


class Start(msgspec.Struct, tag="start"):
    base_dir: str  # the starting model, prepared by rank 0
    setup_timeout_s: float  # how long loading and sharding it may take


class Step(msgspec.Struct, tag="step"):
    plan: list[list[list[TrainGroup]]]  # per rank, its micro-batches (empty: an idle pass)
    total_tokens: float  # every completion token of the batch: the loss's normaliser


class Gather(msgspec.Struct, tag="gather"):
    dtype: str  # the published dtype ("float32", "bfloat16"), "" for the weights' own


class Save(msgspec.Struct, tag="save"):
    path: str


class Load(msgspec.Struct, tag="load"):
    path: str


class Ping(msgspec.Struct, tag="ping"):
    pass


class Stop(msgspec.Struct, tag="stop"):
    pass


Command = Start | Step | Gather | Save | Load | Ping | Stop


def split_work(work: list[TrainGroup], world: int, micro_batch: int) -> list[list[list[TrainGroup]]]:
    """Whole groups to ranks (largest first, each to the rank with the fewest tokens so far), each rank's
    share in micro-batches, and every rank as many micro-batches as the busiest."""
    cost = lambda g: sum(len(g.prompt_ids) + len(c) for c in g.completions)  # noqa: E731
    shares: list[list[TrainGroup]] = [[] for _ in range(world)]
    load = [0] * world
    for g in sorted(work, key=cost, reverse=True):
        r = load.index(min(load))
        shares[r].append(g)
        load[r] += cost(g)
    mbs = [micro_batches(s, micro_batch) if s else [] for s in shares]
    n = max(len(m) for m in mbs)
    return [m + [[] for _ in range(n - len(m))] for m in mbs]


class DistLearner:
    """Every rank holds one over its shard of the model; rank 0 drives it."""

    def __init__(self, model, pad_id: int, env: DistEnv, lr: float, weight_decay: float, grad_clip: float,
                 loss: LossConfig, temperature: float = 1.0, scale_adv_by_std: bool = False,
                 micro_batch: int = 256, prompts_per_step: int | None = None, driver: Driver | None = None):
        check_world(model, env.world, prompts_per_step)
        self.env, self.pad_id, self.grad_clip, self.loss_cfg = env, pad_id, grad_clip, loss
        self.temperature, self.scale_adv_by_std, self.micro_batch = temperature, scale_adv_by_std, micro_batch
        mesh, bf16 = make_mesh(env), env.device.type == "cuda"
        self.ref = None
        if loss.kl_beta > 0:  # a frozen copy of the starting policy, sharded as the policy is
            self.ref = shard(copy.deepcopy(model).eval().requires_grad_(False), mesh, bf16)
        self.model = shard(model, mesh, bf16)
        self.opt = make_adamw(self.model, lr, weight_decay)
        self._idle = [TrainGroup([pad_id], [[pad_id, pad_id]], [[0.0, 0.0]], [0.0])]
        self.driver = driver  # rank 0's end of the channel; None elsewhere

    # Rank 0: the trainer's calls.

    def step(self, groups) -> dict[str, float]:
        """One optimizer step over all ranks; the same statistics as Learner.step."""
        work, total_tokens, stats = prepare(groups, self.scale_adv_by_std)
        if not work:
            return stats
        cmd = Step(split_work(work, self.env.world, self.micro_batch), total_tokens)
        sums, grad_norm = self._drive(cmd, "step")
        return {**stats, **means(sums), "grad_norm": grad_norm}

    def full_state(self, dtype: torch.dtype | None = None) -> dict[str, torch.Tensor]:
        """The full weights on rank 0, as trainer/policy.py's frozen_state(model, dtype) gives them: what
        Publisher.publish(model, version, state) and the auditor take."""
        name = str(dtype).removeprefix("torch.") if dtype is not None else ""
        return self._drive(Gather(name), "gathering weights")

    def save(self, run_dir: str | Path, state: TrainerState, keep: int = 2) -> Path:
        """A sharded checkpoint RUN/checkpoints/step-NNNNNN, whole or not at all; the `keep` newest stay."""
        root = checkpoint_dir(run_dir)
        root.mkdir(parents=True, exist_ok=True)
        final = root / f"step-{state.step:06d}"
        with building_dir(final) as tmp:
            self._drive(Save(str(tmp)), "saving a checkpoint")
            write_state(tmp, self.model, state)
        for old in sorted(root.glob("step-*"))[:-keep]:
            shutil.rmtree(old, ignore_errors=True)
        return final

    def load(self, path: str | Path) -> TrainerState:
        """Resume from a checkpoint: a sharded one written with any number of ranks, or an unsharded
        run's (trainer/checkpoint.py)."""
        path = Path(path)
        sharded = is_sharded_checkpoint(path)
        # Refused here, before any rank reads a shard.
        (check_compatible if sharded else check_unsharded_compatible)(path, self.model)
        self._drive(Load(str(path)), "loading a checkpoint")
        return read_state(path) if sharded else read_unsharded_state(path)

    def close(self) -> None:
        if self.driver is not None:
            self.driver.close(Stop())

    def _drive(self, cmd, what: str):
        assert self.driver is not None, "only rank 0 drives the sharded learner"
        return self.driver.call(cmd, what, lambda: self._run(cmd))

    # Every rank: its part of a command.

    def follow(self) -> None:
        """Ranks 1..N-1: do what rank 0 says until it says stop."""
        while True:
            with collective("waiting for rank 0", self.env.timeout_s):
                cmd = receive(Command, self.env.channel)
            if isinstance(cmd, Stop):
                return
            with collective(type(cmd).__name__.lower(), self.env.timeout_s):
                self._run(cmd)

    def _run(self, cmd):
        if self.env.device.type == "cuda":
            torch.cuda.set_device(self.env.device)  # rank 0 calls from worker threads
        if isinstance(cmd, Step):
            return self._step(cmd)
        if isinstance(cmd, Gather):
            return gather_full_state(self.model, getattr(torch, cmd.dtype) if cmd.dtype else None,
                                     keep=self.env.rank == 0)
        if isinstance(cmd, Save):
            return save_shards(Path(cmd.path), self.model, self.opt, self.env.channel)
        if isinstance(cmd, Load):
            path = Path(cmd.path)
            if is_sharded_checkpoint(path):
                return load_shards(path, self.model, self.opt, self.env.channel)
            return load_unsharded(path, self.model, self.opt)
        if not isinstance(cmd, Ping):
            raise ValueError(f"unexpected command {type(cmd).__name__}")

    def _step(self, cmd: Step) -> tuple[dict[str, float], float]:
        self.model.train()
        self.opt.zero_grad(set_to_none=True)
        sums: dict[str, float] = {}
        args = (self.pad_id, self.temperature, self.loss_cfg)
        for mb in cmd.plan[self.env.rank]:
            if mb:
                add_into(sums, backward(self.model, self.ref, mb, *args, cmd.total_tokens, min_len=2))
            else:  # the same passes, weighted zero
                idle = backward(self.model, self.ref, self._idle, *args, math.inf, min_len=2)
                add_into(sums, dict.fromkeys(idle, 0.0))
        grad_norm = torch.nn.utils.clip_grad_norm_(self.model.parameters(), self.grad_clip)
        if isinstance(grad_norm, DTensor):
            grad_norm = grad_norm.full_tensor()
        self.opt.step()
        self.model.eval()
        keys = sorted(sums)
        totals = all_sum([sums[k] for k in keys], self.env.channel)
        return dict(zip(keys, totals, strict=True)), float(grad_norm)


def make_dist_learner(cfg: RunConfig, env: DistEnv, model, pad_id: int,
                      driver: Driver | None = None) -> DistLearner:
    """trainer/learner.py's make_learner, sharded."""
    t = cfg.train
    return DistLearner(model, pad_id, env, t.lr, t.weight_decay, t.grad_clip, cfg.loss,
                       temperature=t.temperature, scale_adv_by_std=t.scale_adv_by_std,
                       prompts_per_step=t.prompts_per_step, driver=driver)


def open_driver(env: DistEnv) -> Driver:
    """Rank 0, at once after init_distributed: from now on the other ranks hear from it (pings while it
    prepares the starting model)."""
    return Driver(env, Ping())


def _ready(env: DistEnv, learner: DistLearner, setup_timeout_s: float) -> DistLearner:
    """Wait for every rank to have loaded and sharded the model: that may take longer than a collective
    may (a large model read from disk), and a rank that never gets there is named."""
    dist.monitored_barrier(env.channel, timeout=timedelta(seconds=setup_timeout_s), wait_all_ranks=True)
    return learner


def start_learner(cfg: RunConfig, driver: Driver, base_dir: str | Path, model, pad_id: int,
                  setup_timeout_s: float = 1800.0) -> DistLearner:
    """Rank 0, once the starting model is ready in `base_dir`: every rank loads it and shards it."""
    return driver.call(Start(str(base_dir), setup_timeout_s), "starting the ranks", lambda: _ready(
        driver.env, make_dist_learner(cfg, driver.env, model, pad_id, driver), setup_timeout_s))


def follow_main(cfg: RunConfig, env: DistEnv) -> None:
    """All that ranks 1..N-1 do in a run: wait for rank 0's Start, load and shard the model, follow."""
    from trainer.policy import load_model, load_tokenizer

    while True:
        with collective("waiting for rank 0 to start", env.timeout_s):
            cmd = receive(Command, env.channel)
        if isinstance(cmd, Stop):
            return
        if isinstance(cmd, Start):
            break
    learner = make_dist_learner(cfg, env, load_model(cmd.base_dir), load_tokenizer(cmd.base_dir).pad_token_id)
    with collective("starting", env.timeout_s):
        _ready(env, learner, cmd.setup_timeout_s)
    log.info("rank %d of %d: following rank 0", env.rank, env.world)
    learner.follow()
