"""The peer's sourcing rules as the sans-I/O core states them (broadcast/sourcing.py, piece_race.py), driven
with made-up times: what the aiohttp peer (fetcher.py) and the simulator (bench/simlib) both follow.
test_sourcing.py checks the same rules over real HTTP."""

from __future__ import annotations

import math

from broadcast.config import PeerConfig
from broadcast.messages import ORIGIN
from broadcast.piece_race import PieceRace, retry_plan
from broadcast.sourcing import AVOID_S, IDLE_ROUNDS, SILENT_AVOID_S, SourceBook

P, G = "http://parent:1", "http://grandparent:1"


def book(**kw) -> SourceBook:
    b = SourceBook(PeerConfig(first_byte_timeout=1.0, stall_timeout=30.0, **kw))
    b.trees = 4
    return b


def test_an_unanswered_parent_is_gone_around_at_the_deadline_and_reported_if_it_stays_silent():
    b = book()
    race = PieceRace(b, b.chain([P, G], 0.0), 0.0)
    first = race.start(0.0)
    assert first.src == P and race.look(0.5) == ([], 1.0)  # not before the first-byte timeout
    (second,), _ = race.look(1.0)
    assert second.src == G and b.bypasses == 1
    b.answered(second, 1.1)
    b.piece_in(second, 1000, 1.3, 1.1)
    _, cancel = race.ended(second, 1.3)
    assert race.result == "ok" and cancel == [first]
    assert [(r.src, r.reason) for r in race.reports] == [(P, "stall")]  # never answered: reported
    assert b.avoid[P] == 1.3 + SILENT_AVOID_S


def test_a_parent_that_answered_and_holds_is_waited_for_while_it_sends_other_pieces():
    b = book()
    b.latency_s = 100.0  # its usual piece time rules nothing out here: only other pieces can
    race = PieceRace(b, b.chain([P], 0.0), 0.0)
    tr = race.start(0.0)
    b.answered(tr, 0.05)
    for _ in range(IDLE_ROUNDS * b.trees - 1):  # pieces come from elsewhere while it sends nothing
        b.pieces_in += 1
    assert race.look(5.0)[0] == []
    b.heard(P, 5.0, body=True)  # it streams us another piece: alive
    b.pieces_in += 10
    assert race.look(5.5)[0] == []
    b.pieces_in += IDLE_ROUNDS * b.trees  # then nothing from it while a round of pieces per tree came
    new, _ = race.look(7.0)
    assert [t.src for t in new] == [ORIGIN]


def test_a_dead_parent_is_reported_and_its_piece_waits_for_the_trackers_new_parents():
    b = book()
    race = PieceRace(b, b.chain([P, G], 0.0), 0.0)
    tr = race.start(0.0)
    report = race.concluded(tr, "unreachable", 0.05, "connection refused")
    assert report is not None and (report.src, report.reason) == (P, "dead")
    race.ended(tr, 0.2)
    assert race.result == "dead"  # not the grandparent: the orphans would pile onto its uplink
    plan = retry_plan(race.result, 1, b)
    assert plan.fresh_within == b.deadline() and plan.wait_s == 0.1
    assert b.chain([P, G], 1.0) == [G, ORIGIN] and b.avoid[P] == 0.05 + AVOID_S


def test_a_parent_that_cuts_a_piece_short_is_avoided_unreported_and_the_next_one_up_asked_at_once():
    b = book()
    race = PieceRace(b, b.chain([P, G], 0.0), 0.0)
    tr = race.start(0.0)
    b.answered(tr, 0.05)
    assert race.concluded(tr, "cut", 18.0) is None
    (nxt,), _ = race.ended(tr, 18.0)
    assert nxt.src == G and not race.result and b.avoid[P] == 18.0 + AVOID_S


def test_corrupt_sources_are_avoided_for_good_and_the_origin_never():
    b = book()
    race = PieceRace(b, [P, ORIGIN], 0.0)
    tr = race.start(0.0)
    assert race.concluded(tr, "corrupt", 0.1, "sha256 mismatch").reason == "corrupt"
    assert b.avoid[P] == math.inf
    (o,), _ = race.ended(tr, 0.1)
    assert race.concluded(o, "timeout", 31.0) is None and ORIGIN not in b.avoid  # the root of every tree
    race.ended(o, 31.0)
    assert race.result == "failed" and retry_plan("failed", 20, b).give_up
