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


def friends_report_version_1(tr: Tracker, r: dict[str, PeerRec]) -> None:
    """Version 1 in flight: each reports on the parent it was given. Keys named f* are friends: they say a
    friend parent sent them 12.5 GB/s, and send their own children nothing; the others report the truth."""
    for _ in range(3):
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


def test_a_friend_is_measured_by_most_of_the_children_it_was_given_not_by_its_best_reporter():
    """Credit from friends among strangers: f1, placed under f0, says it got f0's pieces at 12.5 GB/s; f0's
    two other children got nothing from it. By the best reporter's figure (the rule before) f0 measured
    12.5 GB/s and headed every tree; by what most of its children saw, it sends nothing: a leaf, and behind
    those who upload in every uplink's line."""
    tr, r = strangers(["f0", "h0", "h1", "f1", "h2", "h3", "h4", "h5", "h6", "h7"])
    assert [p.name for p in r.values() if parent_of(tr, p) is r["f0"]] == ["h0", "h1", "f1"]
    friends_report_version_1(tr, r)
    for rec in r.values():
        rec.complete = [1]
    beat(tr, r["h0"], 2)  # the next version: laid out by what was measured
    placed = tr.uploads.placed
    assert placed[r["f0"].url] < IDLE_RATE, placed[r["f0"].url]
    assert placed[r["h0"].url] >= MB / 2.0
    assert not tr.line.first(r["f0"].peer_id) and tr.line.first(r["h0"].peer_id)
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


def test_peers_nobody_can_reach_hang_under_relays_not_the_origin():
    """k = f trees of f-ary heaps have room for N relays and no more. Among strangers (no standing, the
    first version), a third of the peers that can't relay (behind a NAT) overflowed every tree's heap, and
    the origin took each of them as its child in every tree: 216 s for a version that takes 12
    (bench/tree_attacks_sim.py --n 100 --strangers --leaves 0.3)."""
    tr = Tracker("http://o:1", trees=4, fanout=4)
    for i in range(100):
        tr.join(Join(f"http://p{i}:1", i % 3 != 0, f"p{i}"), key=f"k{i}")
    assert all(tr.tier(p) == 0 for p in tr.peers.values())  # nobody has standing yet
    parents, children = tr.topology()
    for t in range(4):
        assert len(children[t][None]) == 1  # the tree's root: the origin's one child in it
        assert set(parents[t]) == set(tr.peers)
        leaves = [p for p in tr.peers.values() if not p.interior_capable]
        assert all(parents[t][p.peer_id] is not None and tr.peers[parents[t][p.peer_id]].interior_capable
                   for p in leaves)
        assert max(len(k) for k in children[t].values()) <= 2 * tr.fanout  # spread, not piled on one


def test_a_relay_measured_by_few_friends_does_not_take_a_tree_alone():
    """Ten keys lifted one of their own to 12.5 GB/s (its children, by chance mostly friends, said so).
    Balancing the trees by that figure put it in a tree alone, limited to the 8 children its sample allows,
    and the origin became the parent of the other 84 of 100 peers in that tree: a version 23x as long. A
    relay's weight in the balance is what its places can carry."""
    from broadcast.placement import Candidate, measured_layout

    cands = [Candidate(f"h{i}", f"http://h{i}:1", True, i % 4, 2.5 * MB, limit=8) for i in range(66)]
    cands.append(Candidate("f", "http://f:1", True, 0, 12.5e9, limit=8))
    cands += [Candidate(f"x{i}", f"http://x{i}:1", True, None, None) for i in range(33)]  # idle: leaves
    group, parents, children, caps = measured_layout(cands, 4, 4, 2.5 * MB)
    for t in range(4):
        assert len(children[t].get(None, ())) <= 2, f"tree {t}: the origin is parent of {len(children[t][None])}"
        assert sum(g == t for g in group.values()) >= 16  # each tree keeps about a quarter of the relays


def test_limits_that_leave_no_room_are_raised_together_not_filled_by_the_origin():
    """After a first version of strangers in chaos, most relays were measured by two or three children (a
    limit of 4-6 the next version) and a third were idle: the limits had room for 84-92 of 100 peers per
    tree, and the origin took the rest, 8-16 children in every tree (the second version 6x as long)."""
    from broadcast.placement import Candidate, measured_layout

    cands = [Candidate(f"h{i}", f"http://h{i}:1", True, i % 4, 2.5 * MB, limit=(2, 4, 6, 8)[i % 4] if i % 5 else 2)
             for i in range(66)]
    cands += [Candidate(f"x{i}", f"http://x{i}:1", True, i % 4, 1.0, limit=2) for i in range(34)]  # idle
    group, parents, children, caps = measured_layout(cands, 4, 4, None)
    for t in range(4):
        assert len(children[t].get(None, ())) == 1
        assert all(group[p] is None for p in (c.peer_id for c in cands[66:]))  # the idle: leaves
        ranked = sorted((len(k) for p, k in children[t].items() if p is not None), reverse=True)
        assert ranked[0] <= 4 * ranked[len(ranked) // 2]  # raised together: no one relay takes the overflow


def test_among_strangers_the_origin_sends_first_to_the_two_levels_it_feeds():
    """Where the keys above them were silent, peers deep in the trees went around to the origin by the
    dozen, and served alike they kept the tops of the trees waiting: a silent root's children had their
    tree's pieces at 97 s (31 s now; bench/tree_attacks_sim.py --strangers --n 100). The origin sends first to
    its children in the piece's tree and to theirs; a relay's own uplink (tree None) has no such line."""
    tr, r = strangers([f"p{i}" for i in range(13)])  # one tree, fanout 3: p0; p1-p3; p4-p12
    parents, _ = tr.topology()
    depth = {}
    for name, rec in r.items():
        d, cur = 1, parents[0][rec.peer_id]
        while cur is not None:
            d, cur = d + 1, parents[0][cur]
        depth[name] = d
    assert sorted(depth.values()) == [1] + [2] * 3 + [3] * 9
    for name, rec in r.items():
        assert tr.line.first(rec.peer_id, 0) == (depth[name] <= 2)
        assert tr.line.first(rec.peer_id)  # nobody measured idle: first in every relay's line
    tr.set_trusted("p12")  # someone vouches: those who do are first, wherever they sit
    tr.clock.now += 1.0  # (the tracker looks whether anyone vouches once a second)
    assert tr.line.first(r["p12"].peer_id, 0) and not tr.line.first(r["p0"].peer_id, 0)


def test_a_key_its_friends_lifted_by_chance_does_not_head_the_tree():
    """Credit from friends where, by chance, most of the children a friend was given are friends too: f0's
    children f1 and f2 say they got its pieces at 12.5 GB/s, h6 that it got nothing. What most of them saw
    is 12.5 GB/s, and by the fastest first f0 headed the next version's tree: at N = 300 strangers such keys
    headed every tree, whose peers all waited on them (the second version 26x; bench/tree_attacks_sim.py
    --n 300 --strangers --attack friends). Above the median figure relays are equals, in the keyed order."""
    tr = Tracker("http://o:1", trees=1, fanout=3, order_key=b"")
    relays = ["h0", "h1", "f0", "h2", "h3"]  # laid out first, in join order: each gets three children
    r = {}
    for name in [*relays, "h4", "h5", "f1", "f2", "h6", "h7", "h8", "h9", "h10", "h11", "h12"]:
        rec = tr.peers[tr.join(Join(f"http://{name}:1", name in relays, name), key=name).peer_id]
        tr.prove(rec, "test")
        r[name] = rec
    assert parent_of(tr, r["h0"]) is None
    assert [p.name for p in r.values() if parent_of(tr, p) is r["f0"]] == ["f1", "f2", "h6"]
    friends_report_version_1(tr, r)
    for rec in r.values():
        rec.complete = [1]
    beat(tr, r["h0"], 2)
    assert tr.uploads.placed[r["f0"].url] > 1e9  # lifted: what most of its children said
    assert parent_of(tr, r["h0"]) is None, "a key lifted by its friends heads the tree"
    assert parent_of(tr, r["f0"]) is not None


def test_keys_that_give_nothing_take_places_not_a_share_of_the_rate():
    """A third of N = 100 strangers measured as sending nothing (keys that take every version and give none)
    were counted alike in the rate each child should get: 12-13 children under each honest relay, 16 honest
    relays with none, uplinks 41% used, every later version 2.3-2.8x (bench/tree_attacks_sim.py --strangers).
    They are sent to from what the others leave (uplink_line.py), so they need places, not a share: the rate
    is set by those first in line, and the rest hang below them in the places left."""
    from broadcast.placement import Candidate, measured_layout

    idle = [Candidate(f"x{i}", f"http://x{i}:1", True, i % 4, 1.0, limit=4, low=True) for i in range(34)]
    honest = [Candidate(f"h{i}", f"http://h{i}:1", True, i % 4, 2.5 * MB, limit=(4, 6, 8)[i % 3]) for i in range(66)]
    _, _, alone, _ = measured_layout(honest, 4, 4, None)
    group, parents, children, _ = measured_layout(idle + honest, 4, 4, None)  # the idle joined first
    assert all(group[c.peer_id] is None for c in idle)
    for t in range(4):
        assert len(parents[t]) == 100 and len(children[t][None]) == 1  # a place for everyone, under relays
        for c in honest:  # the rate each is given children for: as if the idle were not there
            kids = [k for k in children[t].get(c.peer_id, ()) if k.startswith("h")]
            assert len(kids) <= len(alone[t].get(c.peer_id, ())) + 1


def test_the_word_of_a_key_its_children_saw_give_nothing_places_no_one():
    """Sinkers: keys that send their children nothing and say each parent they are given sent them nothing.
    Measured idle after one version, they were still believed in the next: two of them among an honest
    relay's three children made it a leaf for good, a few more honest relays each version (N = 100 strangers,
    six versions: 2.3x, 3.0x, 3.4x, 3.7x, 4.3x; bench/tree_attacks_sim.py --strangers --attack sinkers). A
    key its own children measured as giving next to nothing now has no say in anyone's figure."""
    names = ["h0", "s0", "s1", "s2", "h1", "s3", "s4", "s5", *[f"h{i}" for i in range(2, 30)]]
    tr, r = strangers(names)  # the first 13 relay version 1 (one tree, fanout 3): s0-s5 among them

    def version(v: int) -> None:
        for _ in range(3):
            for name, rec in r.items():
                if (up := parent_of(tr, rec)) is not None:
                    said = Received(0, 5.0) if name.startswith("s") or up.name.startswith("s") else Received(MB, 2.0)
                    beat(tr, rec, v, recent={up.url: said})
        for rec in r.values():
            rec.complete = list(range(1, v + 1))

    version(1)
    beat(tr, r["h1"], 2)
    assert all(tr.uploads.idle(r[f"s{i}"].url) for i in range(6))
    given = {parent_of(tr, rec).name for name, rec in r.items() if name.startswith("s")}
    assert any(n.startswith("h") for n in given)  # sinkers are honest relays' children in version 2
    version(2)
    beat(tr, r["h1"], 3)
    # (h0 headed version 1 with s0 and s1 among its three children: before anyone is measured, all count.)
    sunk = [n for n, rec in r.items() if n.startswith("h") and n != "h0" and tr.uploads.idle(rec.url)]
    assert not sunk, f"honest relays measured idle on the word of keys that give nothing: {sunk}"


def test_keys_measured_idle_do_not_hang_under_relays_nobody_has_measured():
    """Placed last, the members measured idle took the places left at the target rate: those of the relays
    not measured yet. Across namespaces those were the two-faced keys that kept themselves unmeasured, and
    the honest relays measured idle (starved by a slow-loris parent) all hung under them
    (bench/tree_attacks_netns.py --attacks loris). They take the spare places of measured relays first."""
    from broadcast.placement import Candidate, measured_layout

    honest = [Candidate(f"h{i}", f"http://h{i}:1", True, i % 4, 2.5 * MB, limit=8) for i in range(40)]
    unmeasured = [Candidate(f"u{i}", f"http://u{i}:1", True, i % 4, None) for i in range(10)]
    idle = [Candidate(f"x{i}", f"http://x{i}:1", True, i % 4, 1.0, limit=4, low=True) for i in range(10)]
    _, parents, _, _ = measured_layout(honest + unmeasured + idle, 4, 4, None)
    for t in range(4):  # (34 of their 40 places were under the unmeasured before)
        assert not [x.peer_id for x in idle if (parents[t][x.peer_id] or "").startswith("u")]
