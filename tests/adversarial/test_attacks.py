"""The attack suite: a malicious node over real sockets, beside an honest vLLM node, against one trainer.

For every attack: it is refused or detected with the expected reason codes, repeated fraud bans the key,
nothing it sent ever appears in a trained batch (RUN/batches.jsonl), and the honest node carries on with
no refusal at all (checked after each attack, and again at the end of the module).
"""

from __future__ import annotations

import json

import pytest
import torch

from rewards.base import TaskItem
from rewards.registry import make_task
from tests.adversarial.attacks import ATTACKS, Ctx, Outcome
from tests.adversarial.conftest import MAX_LAG, MAX_MESSAGE_BYTES, REGISTER_BURST
from tests.adversarial.evil_node import Sampler
from tests.adversarial.identity_attacks import IDENTITY_ATTACKS
from trainer.config import TaskConfig
from trainer.policy import load_tokenizer

# Attacks that are fraud: every attempt strikes, and the third strike bans the key.
FRAUD = {"tampered_tokens", "fabricated_logprobs", "different_model", "false_version", "replay", "unassigned",
         "fewer_samples", "more_samples", "best_of_4"}


@pytest.fixture(scope="module")
def ctx(swarm) -> Ctx:
    torch.set_num_threads(1)
    tc = TaskConfig()
    return Ctx(swarm.zport, Sampler(swarm.run_dir), make_task(tc.name, **tc.params), group_size=8, max_lag=MAX_LAG,
               strikes_to_ban=3, max_message_bytes=MAX_MESSAGE_BYTES, summary=swarm.summary)


def _check_after(swarm, out: Outcome) -> None:
    """The trainer keeps training on the honest node; nothing of the attacker's is ever in a batch."""
    swarm.wait_carry_on()
    assert not set(out.node_ids) & swarm.trained_node_ids()
    assert swarm.honest_row()["refused"] == {}
    summary = swarm.summary()
    if out.banned:
        assert set(out.node_ids) <= set(summary["banned"])


@pytest.mark.parametrize("name", [n for n in ATTACKS if n not in ("best_of_4", "flood")])
def test_attack_is_refused(swarm, ctx, name):
    out = ATTACKS[name](ctx)
    assert out.attempts > 0
    assert out.detected == out.attempts, (name, dict(out.codes))
    if name in FRAUD:
        assert out.banned, (name, dict(out.codes))
        for node_id in out.node_ids:
            row = swarm.node_row(node_id)
            assert sum(row["refused"].values()) >= ctx.strikes_to_ban, row
            assert row["state"] == "banned"
    _check_after(swarm, out)


def test_rewards_are_recomputed(swarm, ctx):
    """Every accepted group's rewards are the trainer's own score of the completion text (the node sends none)."""
    path = swarm.run_dir / "accepted.jsonl"
    groups = [json.loads(line) for line in path.read_text().splitlines() if line.strip()]
    assert groups
    tok = load_tokenizer(swarm.run_dir / "base-model")
    for g in groups[:50]:
        item = TaskItem(**g["item"])
        want = []
        for ids, _, finish in g["samples"]:
            text = tok.decode(ids[:-1] if finish == "stop" else ids, skip_special_tokens=True)
            want.append(ctx.task.score(item, text).reward)
        assert g["rewards"] == pytest.approx(want)


def test_best_of_k_cherry_picking_is_caught_in_probation(swarm, ctx):
    out = ATTACKS["best_of_4"](ctx)
    assert out.attempts > 0
    assert out.detected > 0, dict(out.codes)  # its quarantined groups dropped as cherry_picking
    assert out.banned, dict(out.codes)
    _check_after(swarm, out)
    dropped = swarm.summary()["dropped"]
    assert dropped.get("cherry_picking", 0) > 0


def test_flood_is_rate_limited(swarm, ctx):
    before = swarm.summary()["refused"].get("rate_limited", 0)
    out = ATTACKS["flood"](ctx)
    assert out.detected > 0
    # Counted run-wide (the flooding key itself goes silent having delivered nothing: a count, not a row).
    assert swarm.summary()["refused"].get("rate_limited", 0) - before >= out.detected
    _check_after(swarm, out)


def test_work_hoarding_by_fresh_keys_leaves_room_for_a_batch(swarm, ctx):
    """Four fresh keys take all the work they can and never answer: each holds new_key_held assignments,
    and the honest node keeps its room (the trainer went from 186 to 1 steps a minute before shares)."""
    out = IDENTITY_ATTACKS["work_hoarding"](ctx)
    assert out.codes["granted"] <= 4 * 2, dict(out.codes)  # 2 each, within a quarter of inflight_groups
    assert out.steps_kept is not None and out.steps_kept > 0.5, out.steps_kept
    _check_after(swarm, out)


def test_colluding_cherry_pickers_are_not_paired_with_each_other(swarm, ctx):
    out = IDENTITY_ATTACKS["colluding_best_of_4"](ctx)
    assert out.detected > 0 and out.banned, dict(out.codes)
    _check_after(swarm, out)


def test_registration_flood_is_rate_limited(swarm, ctx):
    """Last: it empties the address's registration bucket. Past the burst and what the rate refills
    (0.5/s over the flood's tens of seconds), every registration is refused."""
    out = IDENTITY_ATTACKS["register_flood"](ctx)
    assert out.attempts - out.detected <= REGISTER_BURST + 40, dict(out.codes)
    _check_after(swarm, out)
