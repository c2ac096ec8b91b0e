"""What the sharded learner's tests share: fixed batches, the run config, and starting N real rank
processes (tests/distributed/worker.py) the way torchrun does, with its environment variables."""

from __future__ import annotations

import os
import random
import subprocess
import sys
import types
from pathlib import Path

from tests.conftest import ROOT, free_port
from trainer.config import RunConfig, TrainConfig


def run_config() -> RunConfig:
    # lr 1e-4: Adam's first step divides each gradient element by its own size, so fp32 rounding in
    # near-zero elements comes out times lr/eps (the one-process learner differs from itself by 2.6e-5 at
    # lr 1e-3 when only its micro-batching changes); the test prints that floor beside its figure.
    return RunConfig(train=TrainConfig(lr=1e-4, grad_clip=1.0, prompts_per_step=6))


def batch(seed: int, vocab: int, n: int = 6, g: int = 4) -> list:
    """n groups of g samples: one flat (skipped, but its tokens count in the normaliser), one whose
    completions are all one token long, the rest of mixed lengths; rewards of 0 and 1."""
    rng = random.Random(seed)
    groups = []
    for i in range(n):
        prompt = [rng.randrange(3, vocab) for _ in range(rng.randint(2, 9))]
        lens = [1] * g if i == 1 else [rng.randint(1, 7) for _ in range(g)]
        samples = [types.SimpleNamespace(token_ids=[rng.randrange(3, vocab) for _ in range(k)],
                                         logprobs=[-5.5 + rng.uniform(-0.3, 0.3) for _ in range(k)])
                   for k in lens]
        rewards = [float(rng.random() < 0.5) for _ in range(g)]
        if len(set(rewards)) == 1:
            rewards[0] = 1.0 - rewards[0]
        if i == 0:
            rewards = [0.5] * g
        groups.append(types.SimpleNamespace(prompt_ids=prompt, samples=samples, rewards=rewards))
    return groups


def start_ranks(world: int, *args: str, log_dir: Path, timeout_s: float) -> list[subprocess.Popen]:
    """`world` worker processes, as torchrun would start them (rank 0 hosts the rendezvous on
    127.0.0.1)."""
    port = free_port()
    procs = []
    for rank in range(world):
        env = {**os.environ, "RANK": str(rank), "WORLD_SIZE": str(world), "LOCAL_RANK": str(rank),
               "MASTER_ADDR": "127.0.0.1", "MASTER_PORT": str(port), "OMP_NUM_THREADS": "1",
               "PYTHONUNBUFFERED": "1", "SWARM_DIST_DEVICE": "cpu", "SWARM_DIST_TIMEOUT": str(timeout_s),
               "PYTHONPATH": str(ROOT)}
        log = open(log_dir / f"rank{rank}.log", "w")
        procs.append(subprocess.Popen([sys.executable, str(Path(__file__).with_name("worker.py")), *args],
                                      stdout=log, stderr=subprocess.STDOUT, env=env, cwd=ROOT))
    return procs


def logs(log_dir: Path, world: int) -> str:
    return "\n".join(f"==== rank {r}\n{(log_dir / f'rank{r}.log').read_text()[-3000:]}" for r in range(world))
