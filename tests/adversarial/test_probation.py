"""Probation verdicts of trainer/guard.py and their effect in trainer/probation.py (no processes): release
on a clean paired test, catch on an excess, release a node that is alone once it delivered its audited
groups, never before. The paired test itself (trainer/pairing.py): like with like, references only."""

from __future__ import annotations

import random

from trainer.guard import REFERENCE, Guard, GuardConfig
from trainer.pairing import PairedRewards
from trainer.probation import Probation

G = 8


def _guard(tmp_path) -> Guard:
    g = Guard(tmp_path, GuardConfig(pair_z=4.0, pair_min=12))
    g.established.add("old")
    return g


def _group(rng: random.Random, p: float, k: int = 1) -> list[float]:
    """G rewards of 1 or 0 with chance p each; with k > 1 the best G of k*G (a cherry-picker's)."""
    draws = sorted((1.0 if rng.random() < p else 0.0 for _ in range(k * G)), reverse=True)
    return draws[:G]


def _share(g: Guard, item: str, old: list[float], new: list[float], v_old: int = 0, v_new: int = 0,
           node: str = "new") -> None:
    g.pairs.add(item, "old", v_old, old)
    g.pairs.add(item, node, v_new, new)


def test_honest_pairs_release(tmp_path):
    g = _guard(tmp_path)
    prob = Probation(g, probation_groups=16)
    prob.begin("new")
    for i in range(11):  # alike, each with some spread: no excess
        _share(g, f"i{i}", [1.0, 0.0] * 4, [0.0, 1.0] * 4)
        assert g.probation_verdict("new", 16, has_partner=True) is None  # not enough shared prompts yet
    _share(g, "i11", [1.0, 0.0] * 4, [1.0, 0.0] * 4)
    assert g.pairs.n["new"] == 12 and g.probation_verdict("new", 16, has_partner=True) == "released"
    review = prob.review(oldest=0, has_partner=lambda n: True)
    assert list(review.released) == ["new"] and not review.caught
    assert not prob.holds("new") and "new" in g.established
    prob.begin("new")  # re-registering does not put an established key back on probation
    assert not prob.holds("new")
    again = Probation(Guard(tmp_path, GuardConfig()), 16)  # a restarted trainer remembers who was established
    again.begin("new")
    again.begin("other")
    assert "new" in again.guard.established and not again.holds("new") and again.holds("other")


def test_groups_alike_and_all_alike_are_no_evidence(tmp_path):
    """Both groups all right (a prompt the policy has mastered) says nothing about cherry-picking: such
    pairs do not count toward pair_min, so a key is not released on prompts that could not catch it."""
    g = _guard(tmp_path)
    for i in range(40):
        _share(g, f"i{i}", [1.0] * G, [1.0] * G)
    assert g.pairs.n["new"] == 0 and g.probation_verdict("new", 16, has_partner=True) is None
    # ... until so many are alike that waiting would never end (there, picking the best changes nothing).
    for i in range(40, 4 * 12):
        _share(g, f"i{i}", [1.0] * G, [1.0] * G)
    assert g.probation_verdict("new", 16, has_partner=True) == "released"
    # A cherry-picker winning the few prompts that tell is not released for the many that do not.
    h = _guard(tmp_path / "h")
    for i in range(60):
        _share(h, f"i{i}", [1.0] * G if i % 10 else [1.0] * 7 + [0.0], [1.0] * G)
    assert h.pairs.n["new"] == 6 and h.probation_verdict("new", 16, has_partner=True) is None


def test_reward_excess_is_caught(tmp_path):
    g = _guard(tmp_path)
    rng = random.Random(1)
    for i in range(40):  # best-of-4 at p = 0.5
        _share(g, f"i{i}", _group(rng, 0.5), _group(rng, 0.5, k=4))
        if g.probation_verdict("new", 16, has_partner=True):
            break
    assert g.probation_verdict("new", 16, has_partner=True) == "cherry_picking"


def test_alone_stays_on_probation_unless_the_operator_allows(tmp_path):
    """With no established partner a node is not released for being alone (two new keys could be one
    cheater's); guard.release_unpaired releases it after its probation_groups audited groups."""
    g = _guard(tmp_path)
    assert g.probation_verdict("new", 16, has_partner=False) is None
    (tmp_path / "lab").mkdir()
    lab = Guard(tmp_path / "lab", GuardConfig(pair_z=4.0, pair_min=12, release_unpaired=True))
    assert lab.probation_verdict("new", 15, has_partner=False) is None
    assert lab.probation_verdict("new", 16, has_partner=True) is None  # a partner exists: wait for pairs
    assert lab.probation_verdict("new", 16, has_partner=False) == "released_unchecked"
    # Released unchecked, it is established but no reference: it cannot vouch for a second key (two
    # colluding keys released each other this way and 1,312 cherry-picked groups were trained).
    p = Probation(lab, 16)
    p.begin("new")
    p.delivered["new"] = 16
    assert list(p.review(oldest=0, has_partner=lambda n: False).released) == ["new"]
    assert lab.is_established("new") and not lab.is_reference("new")
    assert not Guard(tmp_path / "lab", GuardConfig()).is_reference("new")  # remembered across a restart
    lab.pairs.add("x", "new", 0, [1.0, 0.0] * 4)
    lab.pairs.add("x", "friend", 0, [1.0] * 8)
    assert lab.pairs.n["friend"] == 0


def test_a_middling_excess_keeps_probation_going(tmp_path):
    g = _guard(tmp_path)
    old, up, down = [1.0, 0.0] * 4, [1.0] * 5 + [0.0] * 3, [1.0] * 4 + [0.0] * 4
    for i in range(12):  # a small, noisy excess: 1 < z < 4
        _share(g, f"i{i}", old, up if i % 3 else down)
    n, z = g.pairs.z("new")
    assert n == 12 and 1.0 < z < 4.0, z
    assert g.probation_verdict("new", 16, has_partner=True) is None
    for i in range(12, 400):  # the same excess over more prompts: convicted (z grows as sqrt(n))
        _share(g, f"i{i}", old, up if i % 3 else down)
        if g.probation_verdict("new", 16, has_partner=True):
            break
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
    old, up, down = [1.0, 0.0] * 4, [1.0] * 5 + [0.0] * 3, [1.0] * 4 + [0.0] * 4
    for i in range(12):
        _share(g, f"i{i}", old, up if i % 3 else down)
    n, z = g.pairs.z("new")
    assert n == 12 and 1.0 < z < 4.0
    assert g.probation_verdict("new", 16, has_partner=True) is None  # not clean enough yet
    for i in range(12, 60):  # no excess from here on
        _share(g, f"i{i}", old, up if i % 2 else [1.0] * 3 + [0.0] * 5)
        if g.probation_verdict("new", 16, has_partner=True):
            break
    assert g.probation_verdict("new", 16, has_partner=True) == "released"

    h = _guard(tmp_path / "h")
    rng = random.Random(3)
    verdicts = []
    for i in range(200):  # best-of-2 on a task the policy gets right 80% of the time: a small excess
        _share(h, f"i{i}", _group(rng, 0.8), _group(rng, 0.8, k=2), node="cheat")
        v = h.probation_verdict("cheat", 16, has_partner=True)
        verdicts.append(v)
        if v:
            break
    assert "released" not in verdicts and verdicts[-1] == "cherry_picking"


def test_answers_of_distant_versions_are_not_compared(tmp_path):
    """The policy improves: today's answer beats one of 300 versions ago without any cheating. Only
    answers within pair_window versions of each other are compared; fresh keys' answers count for nothing,
    also against an established node (a fresh key's bad answers must not frame it)."""
    g = _guard(tmp_path)
    for i in range(30):
        _share(g, f"old{i}", [0.0] * 6 + [1.0] * 2, [1.0] * 7 + [0.0], v_old=10, v_new=310)
    assert g.pairs.n["new"] == 0
    for i in range(30):
        _share(g, f"near{i}", [1.0, 0.0] * 4, [1.0, 0.0] * 4, v_old=308, v_new=310)
    assert g.pairs.n["new"] == 30
    assert g.pairs.n["old"] == 0  # "new" is no reference: nothing it answered counts against "old"
    g.pairs.add("x", REFERENCE, 310, [1.0, 0.0] * 4)  # the trainer's own samples are a reference
    g.pairs.add("x", "new", 311, [0.0, 1.0] * 4)
    assert g.pairs.n["new"] == 31


def test_old_answers_are_forgotten():
    p = PairedRewards(window=2)
    for v in range(100):
        p.add(f"i{v}", "a", v, [1.0, 0.0])
    p.forget_before(90)
    assert sorted(p.by_item) == [f"i{v}" for v in range(90, 100)]


def test_blank_comparisons_make_room_for_more_evidence(tmp_path):
    """Strangers alone: nothing trains, so nothing leaves the quarantine. A key whose shared prompts were
    compared without evidence (groups alike and all alike) gets room for one more group each, so the
    evidence for its verdict can still come (before: two honest strangers with 16 groups each in quarantine,
    the run at step 0 for 8 minutes, tests/netlab/test_strangers_netns.py)."""
    from swarm_common import protocol as P
    from trainer.work import WorkHandout

    g = _guard(tmp_path)
    work = WorkHandout(iter(()), lambda item: [1], P.SamplingSpec(n=G, max_tokens=4, temperature=1.0, top_p=1.0),
                       inflight_groups=64, max_lag=2, work_lag=2, max_held=32, duplicate_share=0.05,
                       probation_groups=16, assignment_timeout_s=60, seed=0)
    for i in range(10):
        _share(g, f"i{i}", [1.0, 0.0] * 4, [0.0, 1.0] * 4)
    for i in range(10, 16):
        _share(g, f"i{i}", [0.0] * G, [0.0] * G)
    assert g.probation_verdict("new", 16, has_partner=True) is None  # 10 with evidence, 12 needed
    assert g.blank_comparisons("new") == 6
    assert work.room("new", 16, True, quarantined=16, blank=g.blank_comparisons("new")) == 6
    assert work.room("new", 16, True, quarantined=16, blank=0) == 0  # what left it stuck
    # Bounded: at 4x probation_groups compared, probation_verdict decides on what it has.
    assert work.room("new", 0, True, quarantined=60, blank=1000) == 4
