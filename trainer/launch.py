"""`swarm train --nproc N`: the same command again under torchrun, as N ranks on this machine.

torchrun starts the ranks with their environment (RANK, WORLD_SIZE, LOCAL_RANK, MASTER_ADDR/PORT); the
trainer sees it (trainer.distributed.in_torchrun) and runs sharded: rank 0 the whole trainer, the others
only the learner. Several machines: run torchrun yourself on each one, rank 0's machine first in mind
(it serves the nodes):
    torchrun --nnodes M --node-rank K --nproc-per-node G --master-addr HOST0 --master-port 29500 \\
        -m swarm train CONFIG.toml ...
"""

from __future__ import annotations

import os
import sys

from trainer.distributed import in_torchrun


def strip_nproc(argv: list[str]) -> list[str]:
    """`argv` without its --nproc N (or --nproc=N)."""
    out, skip = [], False
    for a in argv:
        if skip:
            skip = False
        elif a == "--nproc":
            skip = True
        elif not a.startswith("--nproc="):
            out.append(a)
    return out


def torchrun_argv(nproc: int, target: list[str]) -> list[str]:
    """The torchrun command for `nproc` ranks on this machine; `target` is what each rank runs
    (["-m", "swarm", "train", ...] or a script and its arguments). --standalone: a rendezvous of its own on
    a free port; a rank that fails stops them all (no restarts)."""
    if nproc < 1:
        raise ValueError(f"--nproc {nproc}: need at least 1 rank")
    return [sys.executable, "-m", "torch.distributed.run", "--standalone", f"--nproc-per-node={nproc}",
            "--max-restarts=0", *target]


def launch_train(nproc: int, argv: list[str]) -> None:
    """Replace this process by torchrun running `swarm` with `argv` (sys.argv[1:], --nproc dropped)."""
    if in_torchrun():
        raise RuntimeError("already running under torchrun: drop --nproc "
                           "(torchrun's --nproc-per-node says it)")
    cmd = torchrun_argv(nproc, ["-m", "swarm", *strip_nproc(argv)])
    os.execv(cmd[0], cmd)
