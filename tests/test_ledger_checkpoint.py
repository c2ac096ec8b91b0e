"""Ledger accounting and atomic checkpoints, without processes."""

import random

import torch

from model_builders.default_model import build_default_model
from rewards.base import TaskItem
from swarm_common import protocol as P
from trainer.checkpoint import (
    TrainerState,
    latest_checkpoint,
    load_checkpoint,
    restore_rng,
    rng_state,
    save_checkpoint,
)
from trainer.intake import Group
from trainer.ledger import Ledger, accounting
from trainer.policy import load_model


def _group(i: int) -> Group:
    item = TaskItem(id=f"item{i}", prompt="1+2", answer="3")
    return Group(f"a{i}", "n" * 64, item, [5, 6], [P.Sample([51, 0], [-0.1, -0.2], "stop")], [1.0], [1.0], 0)


def test_ledger_resume_cuts_later_steps_and_returns_their_groups(tmp_path):
    led = Ledger(tmp_path)
    gs = [_group(i) for i in range(6)]
    for g in gs:
        led.accepted(g)
    led.batch(1, gs[0:2])
    led.dropped([gs[2]], "stale", 1)
    led.batch(2, gs[3:5])  # trained after the checkpoint of step 1: redone on resume
    led.dropped([gs[5]], "banned_node", 2)
    with open(tmp_path / "batches.jsonl", "ab") as f:
        f.write(b'{"step": 3, "gro')  # a line torn by a crash
    led.truncate_after(1)
    assert [g.assignment_id for g in led.pending()] == ["a3", "a4", "a5"]
    assert led.pending()[0] == gs[3]  # the group comes back whole
    led.batch(2, gs[3:6])
    led.close()
    acct = accounting(tmp_path)
    assert acct["accepted"] == 6 and acct["trained"] == 5 and acct["dropped"] == {"stale": 1}
    assert acct["twice"] == [] and acct["unaccounted"] == [] and acct["unknown"] == []


def test_accounting_finds_double_training(tmp_path):
    led = Ledger(tmp_path)
    g = _group(0)
    led.accepted(g)
    led.batch(1, [g])
    led.batch(2, [g])
    led.accepted(_group(1))
    led.close()
    acct = accounting(tmp_path)
    assert acct["twice"] == ["a0"] and acct["unaccounted"] == ["a1"]


def test_checkpoint_round_trip_and_atomicity(tmp_path):
    torch.manual_seed(0)
    model = load_model(build_default_model(tmp_path / "m"))
    opt = torch.optim.AdamW(model.parameters(), lr=1e-3)
    model(input_ids=torch.tensor([[1, 2, 3]])).logits.sum().backward()
    opt.step()
    rng = random.Random(5)
    rng.random()
    st = TrainerState(7, 9, 123, [TaskItem(id="r", prompt="p", answer="1")], rng_state(rng), [], [], 10, 100,
                      {"stale": 1}, {}, 12.5)
    save_checkpoint(tmp_path / "run", model, opt, st)
    (tmp_path / "run" / "checkpoints" / ".step-000008.tmp").mkdir()  # a write cut short by a crash
    path = latest_checkpoint(tmp_path / "run")
    assert path.name == "step-000007"

    model2 = load_model(build_default_model(tmp_path / "m2", seed=1))
    opt2 = torch.optim.AdamW(model2.parameters(), lr=1e-3)
    st2 = load_checkpoint(path, model2, opt2)
    assert st2 == st
    for (k, a), b in zip(model.state_dict().items(), model2.state_dict().values(), strict=True):
        assert torch.equal(a, b), k
    assert model2.lm_head.weight.data_ptr() == model2.model.embed_tokens.weight.data_ptr()
    s1, s2 = opt.state_dict()["state"], opt2.state_dict()["state"]
    assert all(torch.equal(s1[i]["exp_avg"], s2[i]["exp_avg"]) for i in s1)
    rng2 = random.Random(0)
    restore_rng(rng2, st2.server_rng)
    assert rng2.random() == rng.random()
