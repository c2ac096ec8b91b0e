"""One rank of the sharded learner's tests, started by tests/distributed/ranks.py as torchrun would.

    worker.py equivalence MODEL_DIR OUT   rank 0 steps the sharded learner beside a one-process Learner
                                          on the same batches, publishes, checkpoints; writes OUT/*
    worker.py idle MODEL_DIR OUT          rank 0 starts the ranks, says OUT/ready, waits for OUT/go, steps

A rank that loses the others prints "RANK LOST: ..." and exits with 3.
"""

from __future__ import annotations

import json
import os
import sys
import time
from pathlib import Path

import torch
from safetensors.torch import save_file

from tests.distributed.ranks import batch, run_config
from trainer.checkpoint import TrainerState, latest_checkpoint, save_checkpoint
from trainer.dist_checkpoint import IncompatibleCheckpoint
from trainer.dist_learner import follow_main, open_driver, start_learner
from trainer.distributed import RankLost, init_distributed, shutdown
from trainer.learner import Learner
from trainer.policy import frozen_state, load_model, load_tokenizer
from trainer.publisher import Publisher


def equivalence(learner, model_dir: Path, out: Path) -> None:
    from trainer.learner import make_learner

    model, tok = learner.model, load_tokenizer(model_dir)
    plain = load_model(model_dir)
    one: Learner = make_learner(run_config(), plain, tok)
    for dtype in (torch.float32, torch.bfloat16):  # version 0, from the sharded and the plain model
        name = str(dtype).removeprefix("torch.")
        Publisher(out / f"two-{name}", model_dir).publish(model, 0, learner.full_state(dtype))
        Publisher(out / f"one-{name}", model_dir).publish(plain, 0, frozen_state(plain, dtype))
    vocab = model.config.vocab_size
    t0 = time.perf_counter()
    st_two = learner.step(batch(1, vocab))
    secs = time.perf_counter() - t0
    st_one = one.step(batch(1, vocab))
    full, ref = learner.full_state(), frozen_state(plain)
    diff = max((full[k] - ref[k]).abs().max().item() for k in ref)
    # The floor: the one-process learner against itself with other micro-batches (another summation order).
    plain2 = load_model(model_dir)
    other = make_learner(run_config(), plain2, tok)
    other.micro_batch = 4
    other.step(batch(1, vocab))
    floor = max((v - ref[k]).abs().max().item() for k, v in frozen_state(plain2).items())
    Publisher(out / "two-step", model_dir).publish(model, 1, full)
    state = TrainerState(1, 1, 42, [], "[3, [1, 2], null]", [], [], 6, 99, {}, {}, 1.5)
    ckpt = learner.save(out / "run", state)
    st2 = learner.step(batch(2, vocab))
    after = learner.full_state()
    save_file({k: v.clone() for k, v in after.items()}, out / "after2.safetensors")
    # The one-process learner's own checkpoint after step 1, resumed at 2 ranks: both take step 2.
    save_checkpoint(out / "plain-run", plain, one.opt, state)
    assert learner.load(latest_checkpoint(out / "plain-run")) == state
    learner.step(batch(2, vocab))
    one.step(batch(2, vocab))
    full, ref = learner.full_state(), frozen_state(plain)
    plain_to_two = max((full[k] - ref[k]).abs().max().item() for k in ref)
    try:  # a directory that is no checkpoint of this model: refused on rank 0, the ranks carry on
        learner.load(model_dir)
        refused = ""
    except IncompatibleCheckpoint as e:
        refused = str(e)
    learner.full_state()
    result = {"max_abs_diff": diff, "floor": floor, "stats_two": st_two, "stats_one": st_one,
              "stats_two_step2": st2, "plain_to_two": plain_to_two, "refused": refused,
              "checkpoint": str(ckpt),
              "step_s": secs}
    (out / "result.json").write_text(json.dumps(result))


def idle(learner, model_dir: Path, out: Path) -> None:
    learner.full_state()  # a collective: every rank is set up and following
    (out / "ready").write_text(str(os.getpid()))
    while not (out / "go").exists():
        time.sleep(0.1)
    t0 = time.monotonic()
    try:
        learner.step(batch(1, learner.model.config.vocab_size))
    finally:
        (out / "step_s").write_text(f"{time.monotonic() - t0:.2f}")


def main() -> int:
    scenario, model_dir, out = sys.argv[1], Path(sys.argv[2]), Path(sys.argv[3])
    torch.set_num_threads(1)
    env = init_distributed(float(os.environ.get("SWARM_DIST_TIMEOUT", "30")))
    cfg = run_config()
    try:
        if env.rank != 0:
            follow_main(cfg, env)
            return 0
        driver = open_driver(env)
        learner = start_learner(cfg, driver, model_dir, load_model(model_dir),
                                load_tokenizer(model_dir).pad_token_id)
        try:
            {"equivalence": equivalence, "idle": idle}[scenario](learner, model_dir, out)
        finally:
            learner.close()
        return 0
    except RankLost as e:
        print(f"RANK LOST: {e}", flush=True)
        return 3
    finally:
        shutdown()


if __name__ == "__main__":
    sys.exit(main())
