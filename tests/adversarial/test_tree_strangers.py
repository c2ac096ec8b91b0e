"""Placement among strangers alone (issue 29): where no member vouches, every key that showed the origin a
piece reports what it received, so placement may believe no single reporter. Driven through the tracker on
a clock of the test's, as the origin and the simulator drive it (bench/tree_attacks_sim.py --strangers runs
the same rules at swarm scale). Each test fails on the code before the rule it names.
"""

from __future__ import annotations

from broadcast.messages import Join, PeerHeartbeat, Received
from broadcast.receive_meter import ReceiveMeter
from broadcast.tracker import PeerRec, Tracker
from broadcast.upload_meter import IDLE_RATE, SILENT_RATE, UploadMeter

MB = 1 << 20


def strangers(names: list[str]) -> tuple[Tracker, dict[str, PeerRec]]:
    """One tree, fanout 3, laid out in join order (the first joined on top); every key has shown the origin
    a piece (as the attack lab's honest relays and attackers alike have), none is trusted."""
    tr = Tracker("http://o:1", trees=1, fanout=3, order_key=b"")
    recs = {}
    for name in names:
        rec = tr.peers[tr.join(Join(f"http://{name}:1", True, name), key=name).peer_id]
        tr.prove(rec, "test")
        recs[name] = rec
    return tr, recs


def beat(tr: Tracker, rec: PeerRec, latest: int, **kw) -> None:
    tr.clock.now += 0.1
    tr.heartbeat(PeerHeartbeat(rec.peer_id, rec.token, **kw), latest)


def parent_of(tr: Tracker, rec: PeerRec) -> PeerRec | None:
    parents, _ = tr.topology()
    pid = parents[0].get(rec.peer_id)
    return tr.peers[pid] if pid is not None else None


def test_a_friend_is_measured_by_most_of_the_children_it_was_given_not_by_its_best_reporter():
    """Credit from friends among strangers: f1, placed under f0, says it got f0's pieces at 12.5 GB/s; f0's
    two other children got nothing from it. By the best reporter's figure (the rule before) f0 measured
    12.5 GB/s and headed every tree; by what most of its children saw, it sends nothing: a leaf, and behind
    those who upload in every uplink's line."""
    tr, r = strangers(["f0", "h0", "h1", "f1", "h2", "h3", "h4", "h5", "h6", "h7"])
    assert [p.name for p in r.values() if parent_of(tr, p) is r["f0"]] == ["h0", "h1", "f1"]
    for _ in range(3):  # version 1 in flight: each reports on the parent it was given
        for name, rec in r.items():
            up = parent_of(tr, rec)
            if up is None:
                continue
            if name.startswith("f") and up.name.startswith("f"):
                said = Received(25_000 * MB, 2.0)  # a friend's claim
            elif up.name.startswith("f"):
                said = Received(0, 5.0)  # it answered, then sent nothing (receive_meter.silent)
            else:
                said = Received(MB, 2.0)
            beat(tr, rec, 1, recent={up.url: said})
    for rec in r.values():
        rec.complete = [1]
    beat(tr, r["h0"], 2)  # the next version: laid out by what was measured
    placed = tr.uploads.placed
    assert placed[r["f0"].url] < IDLE_RATE, placed[r["f0"].url]
    assert placed[r["h0"].url] >= MB / 2.0
    assert not tr.first_in_line(r["f0"].peer_id) and tr.first_in_line(r["h0"].peer_id)
    _, children = tr.topology()
    assert not children[0].get(r["f0"].peer_id), "a key its children saw send nothing is given children"


def test_what_a_stranger_reported_before_its_proof_counts_once_it_has_it():
    """Strangers earn the origin's proof only once they hold a whole version, so everything they reported of
    version 1 was dropped and version 2 was laid out knowing nothing of the relays that had carried it."""
    tr = Tracker("http://o:1", trees=1, fanout=3, order_key=b"")
    top = tr.peers[tr.join(Join("http://top:1", True, "top"), key="top").peer_id]
    tr.prove(top, "test")
    kid = tr.peers[tr.join(Join("http://kid:1", True, "kid"), key="kid").peer_id]  # no proof yet
    assert parent_of(tr, kid) is top
    beat(tr, kid, 1)  # given its sources
    beat(tr, kid, 1, recent={top.url: Received(2 * MB, 4.0)})
    beat(tr, top, 1)
    tr.prove(kid, "it held version 1 and served the origin a piece of it")
    beat(tr, kid, 1)  # it counts now, with nothing new to say
    for rec in (top, kid):
        rec.complete = [1]
    beat(tr, top, 2)
    assert tr.uploads.placed.get(top.url) == MB / 2.0


def test_a_source_that_answered_and_sent_nothing_is_measured_as_sending_nothing():
    """A key that answers every request and sends no one anything left no trace in placement's evidence
    (reports named only sources that delivered bytes), so each new layout placed it inside the trees again
    as a relay not yet measured. Now its silence is reported, and a figure of 0 stays a figure."""
    meter = ReceiveMeter()
    meter.silent("http://quiet:1", 4.0)
    meter.span("http://busy:1", 0.0, 2.0)
    meter.credit("http://busy:1", MB)
    meter.silent("http://busy:1", 3.0)  # it delivered meanwhile: its bytes say more than its silence
    assert meter.take() == {"http://quiet:1": Received(0, 4.0), "http://busy:1": Received(MB, 2.0)}
    assert meter.take() == {}
    up = UploadMeter()
    up.note({"http://quiet:1": Received(0, 4.0)}, "child")
    assert up.estimate["http://quiet:1"] == SILENT_RATE
