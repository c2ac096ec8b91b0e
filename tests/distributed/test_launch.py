"""`swarm train --nproc N` becomes torchrun's command line (the torchrun run itself: bench/gpu_trainer.sh)."""

import sys

import pytest

from trainer.launch import strip_nproc, torchrun_argv


def test_the_torchrun_command_line():
    argv = ["-v", "train", "cfg.toml", "--nproc", "4", "--resume", "--nproc=2", "--set", "train.lr=1e-5"]
    assert strip_nproc(argv) == ["-v", "train", "cfg.toml", "--resume", "--set", "train.lr=1e-5"]
    assert torchrun_argv(4, ["-m", "swarm", "train"]) == [
        sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc-per-node=4",
        "--max-restarts=0", "-m", "swarm", "train"]
    with pytest.raises(ValueError, match="at least 1"):
        torchrun_argv(0, ["-m", "swarm", "train"])
