"""Probation verdicts of trainer/guard.py and their effect in trainer/probation.py (no processes): release
on a clean paired test, catch on an excess, release a node that is alone once it delivered its audited
groups, never before."""

from __future__ import annotations

import random

from trainer.guard import Guard, GuardConfig
from trainer.probation import Probation


def _guard(tmp_path) -> Guard:
    return Guard(tmp_path, GuardConfig(pair_z=4.0, pair_min=12))


def test_honest_pairs_release(tmp_path):
    g = _guard(tmp_path)
    prob = Probation(g, probation_groups=16)
    prob.begin("new")
    rng = random.Random(0)
    for i in range(11):
        p = rng.random()
        g.pairs.add(f"i{i}", "old", p + rng.gauss(0, 0.1))
        g.pairs.add(f"i{i}", "new", p + rng.gauss(0, 0.1))
        assert g.probation_verdict("new", 16, has_partner=True) is None  # not enough shared prompts yet
    g.pairs.add("i11", "old", 0.5)
    g.pairs.add("i11", "new", 0.5)
    assert g.probation_verdict("new", 16, has_partner=True) == "released"
    review = prob.review(oldest=0, has_partner=lambda n: True)
    assert list(review.released) == ["new"] and not review.caught
    assert not prob.holds("new") and "new" in g.established
    prob.begin("new")  # re-registering does not put an established key back on probation
    assert not prob.holds("new")
    again = Probation(Guard(tmp_path, GuardConfig()), 16)  # a restarted trainer remembers who was established
    again.begin("new")
    again.begin("other")
    assert "new" in again.guard.established and not again.holds("new") and again.holds("other")


def test_reward_excess_is_caught(tmp_path):
    g = _guard(tmp_path)
    rng = random.Random(1)
    for i in range(12):
        p = rng.uniform(0.2, 0.6)
        g.pairs.add(f"i{i}", "old", p + rng.gauss(0, 0.05))
        g.pairs.add(f"i{i}", "new", p + 0.3 + rng.gauss(0, 0.05))
    assert g.probation_verdict("new", 16, has_partner=True) == "cherry_picking"


def test_alone_stays_on_probation_unless_the_operator_allows(tmp_path):
    """With no established partner a node is not released for being alone (two new keys could be one
    cheater's); guard.release_unpaired releases it after its probation_groups audited groups."""
    g = _guard(tmp_path)
    assert g.probation_verdict("new", 16, has_partner=False) is None
    lab = Guard(tmp_path / "lab", GuardConfig(pair_z=4.0, pair_min=12, release_unpaired=True))
    assert lab.probation_verdict("new", 15, has_partner=False) is None
    assert lab.probation_verdict("new", 16, has_partner=True) is None  # a partner exists: wait for pairs
    assert lab.probation_verdict("new", 16, has_partner=False) == "released"


def test_a_middling_excess_keeps_probation_going(tmp_path):
    g = _guard(tmp_path)
    for i in range(12):  # a small, noisy excess: 1 < z < 4
        g.pairs.add(f"i{i}", "old", 0.5)
        g.pairs.add(f"i{i}", "new", 0.5 + (0.15 if i % 2 else -0.05))
    n, z = g.pairs.z("new")
    assert n == 12 and 1.0 < z < 4.0
    assert g.probation_verdict("new", 16, has_partner=True) is None
    for i in range(12, 100):  # the same excess over more prompts: convicted (z ~ 5)
        g.pairs.add(f"i{i}", "old", 0.5)
        g.pairs.add(f"i{i}", "new", 0.5 + (0.15 if i % 2 else -0.05))
    assert g.probation_verdict("new", 16, has_partner=True) == "cherry_picking"


def test_trusted_keys_skip_probation_and_still_get_struck(tmp_path):
    g = Guard(tmp_path, GuardConfig(trusted=frozenset({"mine"}), strikes_to_ban=2))
    p = Probation(g, 16)
    p.begin("mine")
    p.begin("stranger")
    assert not p.holds("mine") and g.is_established("mine")
    assert p.holds("stranger") and not g.is_established("stranger")
    assert not (tmp_path / "established.json").exists()  # trust comes from the config, not the run's record
    assert not g.strike("mine", "logprob_mismatch") and g.strike("mine", "logprob_mismatch")
    assert g.admit("mine") == "banned"  # trusted is not above the audit


def test_release_bar_rises_with_evidence(tmp_path):
    """An honest node that drew z 1.3 at pair_min is released once more prompts raise the bar past it;
    a steady excess of 0.5 sd per prompt is caught, never released, as prompts accumulate."""
    g = _guard(tmp_path)
    for i in range(12):
        g.pairs.add(f"i{i}", "old", 0.0)
        g.pairs.add(f"i{i}", "new", 0.3 if i % 3 else -0.1)
    n, z = g.pairs.z("new")
    assert n == 12 and 1.0 < z < 4.0
    assert g.probation_verdict("new", 16, has_partner=True) is None  # not clean enough yet
    for i in range(12, 60):
        g.pairs.add(f"i{i}", "old", 0.0)
        g.pairs.add(f"i{i}", "new", 0.3 if i % 2 else -0.3)
    assert g.probation_verdict("new", 16, has_partner=True) == "released"

    h = Guard(tmp_path / "h", GuardConfig(pair_z=4.0, pair_min=12))
    rng = random.Random(3)
    verdicts = []
    for i in range(200):
        h.pairs.add(f"i{i}", "old", 0.0)
        h.pairs.add(f"i{i}", "cheat", rng.gauss(0.5, 1.0))
        v = h.probation_verdict("cheat", 16, has_partner=True)
        verdicts.append(v)
        if v:
            break
    assert "released" not in verdicts and verdicts[-1] == "cherry_picking"
