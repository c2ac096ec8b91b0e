"""The sharded learner (FSDP2 over gloo, 2 real rank processes) against the one-process learner.

One run of 2 ranks steps beside a one-process Learner on the same batches, publishes and checkpoints;
this process then resumes from that 2-rank checkpoint with the one-process learner (resume at 1).
"""

from __future__ import annotations

import json
from pathlib import Path

import pytest
from safetensors.torch import load_file

from model_builders.default_model import build_default_model
from tests.distributed.ranks import batch, logs, run_config, start_ranks
from trainer.checkpoint import latest_checkpoint
from trainer.dist_checkpoint import IncompatibleCheckpoint
from trainer.learner import make_learner
from trainer.policy import frozen_state, load_model, load_tokenizer
from trainer.publisher import Publisher
from trainer.sharding import check_world


@pytest.fixture(scope="module")
def model_dir(tmp_path_factory) -> Path:
    return build_default_model(tmp_path_factory.mktemp("tiny"), seed=0)


@pytest.fixture(scope="module")
def two_ranks(model_dir, tmp_path_factory) -> Path:
    out = tmp_path_factory.mktemp("two")
    procs = start_ranks(2, "equivalence", str(model_dir), str(out), log_dir=out, timeout_s=60)
    codes = [p.wait(150) for p in procs]
    assert codes == [0, 0], logs(out, 2)
    return out


def _files(path: Path) -> dict[str, bytes]:
    return {str(f.relative_to(path)): f.read_bytes() for f in sorted(path.rglob("*")) if f.is_file()}


def test_one_step_on_two_ranks_equals_one_step_on_one(two_ranks):
    r = json.loads((two_ranks / "result.json").read_text())
    print(f"\nmax |w_2ranks - w_1rank| after one step: {r['max_abs_diff']:.3g} (the one-rank learner against "
          f"itself with other micro-batches: {r['floor']:.3g}); 2-rank step {r['step_s']:.2f} s")
    assert r["max_abs_diff"] < 1e-5
    two, one = r["stats_two"], r["stats_one"]
    assert two.keys() == one.keys() and two["tokens"] == one["tokens"] == 61 and two["zero_adv_groups"] == 1
    for k in ("loss", "clip_frac", "ratio_mean", "grad_norm"):
        assert abs(two[k] - one[k]) < 1e-5 * max(1.0, abs(one[k])), k


def test_published_version_is_byte_identical_to_one_rank(two_ranks):
    for dtype in ("float32", "bfloat16"):
        two = _files(two_ranks / f"two-{dtype}" / "versions")
        one = _files(two_ranks / f"one-{dtype}" / "versions")
        assert two.keys() == one.keys() and any(k.endswith(".safetensors") for k in two)
        assert two == one, dtype


def test_checkpoint_at_two_ranks_resumes_at_one(two_ranks, model_dir, tmp_path):
    ckpt = latest_checkpoint(two_ranks / "run")
    assert ckpt is not None and ckpt.name == "step-000001"
    assert not list((two_ranks / "run" / "checkpoints").glob(".*"))  # the scratch directory became it
    model, tok = load_model(model_dir), load_tokenizer(model_dir)
    learner = make_learner(run_config(), model, tok)
    state = learner.load(ckpt)
    assert (state.step, state.version, state.items_drawn, state.tokens) == (1, 1, 42, 99)
    assert model.lm_head.weight.data_ptr() == model.model.embed_tokens.weight.data_ptr()
    # The state the 2 ranks published after step 1, read back by one process: the same bytes.
    Publisher(tmp_path / "one", model_dir).publish(model, 1, frozen_state(model))
    assert _files(tmp_path / "one" / "versions") == _files(two_ranks / "two-step" / "versions")
    st = learner.step(batch(2, model.config.vocab_size))
    two_after = load_file(two_ranks / "after2.safetensors")
    diff = max((two_after[k] - v).abs().max().item() for k, v in frozen_state(model).items())
    print(f"\nstep 2 resumed at 1 rank vs continued at 2: max |dw| {diff:.3g}")
    assert diff < 1e-5
    st2 = json.loads((two_ranks / "result.json").read_text())["stats_two_step2"]
    assert abs(st["loss"] - st2["loss"]) < 1e-5 and st["tokens"] == st2["tokens"]


def test_an_unsharded_checkpoint_resumes_at_two_ranks(two_ranks):
    r = json.loads((two_ranks / "result.json").read_text())
    print(f"\nstep 2 from the one-process learner's checkpoint, at 2 ranks vs at 1: max |dw| "
          f"{r['plain_to_two']:.3g}")
    assert r["plain_to_two"] < 1e-5


def test_a_checkpoint_of_another_model_is_refused(two_ranks, tmp_path):
    refused = json.loads((two_ranks / "result.json").read_text())["refused"]
    assert "is not one of this model's" in refused and "no optimizer.pt" in refused
    other = load_model(build_default_model(tmp_path / "wide", hidden_size=64, intermediate_size=128))
    with pytest.raises(IncompatibleCheckpoint, match="written for another model"):
        make_learner(run_config(), other, load_tokenizer(tmp_path / "wide")).load(latest_checkpoint(two_ranks / "run"))


def test_an_n_the_model_cannot_be_sharded_over_is_refused(model_dir):
    model = load_model(model_dir)
    check_world(model, 2, prompts_per_step=2)
    with pytest.raises(ValueError, match="over 300 ranks: model.embed_tokens.weight has 259 rows"):
        check_world(model, 300)
    with pytest.raises(ValueError, match="some ranks would hold nothing"):
        check_world(model, 48)  # pieces of 2 rows: 32 ranks hold the 64
    with pytest.raises(ValueError, match="prompts_per_step=4"):
        check_world(model, 8, prompts_per_step=4)
    with pytest.raises(ValueError, match="at least 1"):
        check_world(model, 0)
