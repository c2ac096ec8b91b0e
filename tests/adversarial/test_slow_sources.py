"""Slow-loris in the relay tree (issue 29): a source that answers at once and then sends a slice now and then
kept its children waiting, since any byte counted as progress: with the attackers placed first, no honest
node had version 1 or 2 after 60 s; answering the origin's uplink probe quickly while serving pieces slowly,
attackers were measured at 212-344 MB/s and honest nodes were placed under them. Driven through the
decision core (broadcast/sourcing.py, piece_race.py, the tracker), as the peer and the simulator drive it.
Each test fails on the code before issue 29's rate rule."""

from __future__ import annotations

from broadcast.config import PeerConfig
from broadcast.messages import ORIGIN, Join, PeerHeartbeat
from broadcast.piece_race import PieceRace
from broadcast.sourcing import SourceBook
from broadcast.tracker import Tracker

MiB = 1 << 20
LORIS = "http://loris:1"


def book(stall_timeout: float = 30.0) -> SourceBook:
    b = SourceBook(PeerConfig(first_byte_timeout=1.0, stall_timeout=stall_timeout))
    b.trees = 4
    return b


def trickle(b: SourceBook, race: PieceRace, t0: float, until: float) -> float | None:
    """The loris answers at once, then sends one 16 KiB slice every 0.5 s: when the race goes around it."""
    tr = race.start(t0)
    b.answered(tr, t0 + 0.01)
    t = t0 + 0.05
    while t < until:
        b.body(tr, 16 << 10, t)
        new, _ = race.look(t + 0.01)
        if new:
            assert new[0].src == ORIGIN
            return t - t0
        t += 0.5
    return None


def test_a_trickling_parent_is_gone_around_within_two_answer_deadlines():
    """A peer whose 1 MiB pieces usually take 1.6 s (640 KiB/s) is sent one at 32 KiB/s: gone around as soon
    as the pace has been judged (before: after 16 usual latencies, 26 s, for every piece)."""
    b = book()
    b.latency_s = 1.6
    race = PieceRace(b, b.chain([LORIS], 0.0), 0.0, MiB)
    took = trickle(b, race, 0.0, 60.0)
    assert took is not None and took <= 2 * b.deadline() + 0.5, took


def test_a_new_peer_under_trickling_parents_still_gets_its_pieces():
    """A new swarm: nothing measured yet, the loris placed first. Its pace is above the floor, so only the
    stall timeout bounds it: every piece is asked of the origin by then (before: never, while bytes came),
    and once a piece has come from anyone, the pace rule judges the loris at once."""
    b = book(stall_timeout=4.0)
    race = PieceRace(b, b.chain([LORIS], 0.0), 0.0, MiB)
    took = trickle(b, race, 0.0, 120.0)
    assert took is not None and took <= 4.0 + 0.5, took
    (tr,) = [t for t in race.tries if t.src == ORIGIN]
    b.answered(tr, took + 0.05)
    b.body(tr, MiB, took + 0.2)
    b.piece_in(tr, MiB, took + 0.2, took + 0.05)  # the origin's copy: our usual pace is known now
    race.ended(tr, took + 0.2)
    assert race.result == "ok"
    race2 = PieceRace(b, b.chain([LORIS], 10.0), 10.0, MiB)
    took2 = trickle(b, race2, 10.0, 60.0)
    assert took2 is not None and took2 <= 2 * b.deadline() + 0.5, took2


def test_a_source_that_answers_the_probe_fast_and_serves_slowly_is_placed_lower():
    """The origin's probe read the loris at 300 MB/s; the children it was given saw 32 KiB/s and went around
    it. What they saw reaches the tracker (their receive reports), and the next version's layout makes it
    a leaf: honest relays are no longer placed under it."""
    tr = Tracker("http://o:1", trees=2, fanout=2)
    joined = [tr.join(Join(f"http://h{i}:1", True, f"h{i}"), key=f"h{i}") for i in range(7)]
    loris = tr.join(Join(LORIS, True, "loris"), key="loris")
    for j in [*joined, loris]:
        rec = tr.peers[j.peer_id]
        tr.set_trusted(rec.key)
        tr.probed(rec, 300e6 if rec.url == LORIS else 5 * MiB)
    lrec = tr.peers[loris.peer_id]
    for j in [*joined, loris]:
        tr.heartbeat(PeerHeartbeat(j.peer_id, j.token), latest=1)
    _, children = tr.topology()
    kids = [k for t in range(2) for k in children[t].get(lrec.peer_id, [])]
    assert kids, "the probe placed the loris above others"
    for k in kids:  # each child races a piece from it and goes around it
        child = tr.peers[k]
        b = book()
        b.latency_s = 0.2
        race = PieceRace(b, b.chain([LORIS], 0.0), 0.0, MiB)
        trickle(b, race, 0.0, 10.0)
        (origin_try,) = [t for t in race.tries if t.src == ORIGIN]
        b.answered(origin_try, 2.6)
        b.body(origin_try, MiB, 2.8)
        b.meter.span(ORIGIN, 2.6, 2.8)
        b.piece_in(origin_try, MiB, 2.8, 2.6)
        race.ended(origin_try, 2.8)
        tr.heartbeat(PeerHeartbeat(child.peer_id, child.token, recent=b.meter.take()), latest=1)
    for p in tr.peers.values():
        p.complete = [1]
    tr.heartbeat(PeerHeartbeat(loris.peer_id, loris.token), latest=2)
    assert (tr.uploads.uplink(LORIS) or 0) < MiB  # the probe said 300 MB/s; the honest relays have 5 MiB/s
    _, children = tr.topology()
    assert not any(children[t].get(lrec.peer_id) for t in range(2)), "honest peers still under the loris"


def test_a_trickling_parent_that_set_our_usual_latency_is_judged_by_what_the_others_stream():
    """Among strangers a child whose parent in one tree sent every piece at 16 KiB/s had a usual latency of
    16 s from those pieces alone, and the pace they set was 'usual': it took 14 pieces so, 112 s (slow-loris,
    bench/tree_attacks_sim.py --n 100 --strangers, seed 3). The pace is judged against the rate the other
    sources streamed at too: gone around within two answer deadlines (before: not in 60 s)."""
    b = book(stall_timeout=60.0)
    b.latency_s = 16.0  # the loris's own pieces made it so
    for i, src in enumerate(("http://a:1", "http://b:1", "http://c:1")):  # the other trees' parents: 640 KiB/s
        t = 10.0 * i
        tr = PieceRace(b, [src, ORIGIN], t, MiB).start(t)
        b.answered(tr, t + 0.05)
        b.body(tr, MiB, t + 1.65)
        b.piece_in(tr, MiB, t + 1.65, t + 0.05)
    b.latency_s = 16.0
    race = PieceRace(b, b.chain([LORIS], 40.0), 40.0, MiB)
    took = trickle(b, race, 40.0, 100.0)
    assert took is not None and took <= 2 * b.deadline() + 0.5, took
