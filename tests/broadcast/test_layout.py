"""While a version is in flight the tracker repairs its layout in place: a peer that leaves, is demoted or
arrives moves only the peers it must (broadcast/layout.py); the next version, or a swarm with nothing in
flight, gets a fresh layout."""

from __future__ import annotations

import copy

from broadcast.messages import Join, PeerHeartbeat
from broadcast.tracker import Tracker

TREES, FANOUT = 2, 2


def _swarm(n: int, trusted: range) -> tuple[Tracker, list]:
    tr = Tracker("http://o:1", trees=TREES, fanout=FANOUT)
    joined = [tr.join(Join(f"http://h{i}:1", True, f"p{i}"), key=f"k{i}") for i in range(n)]
    for i in trusted:
        tr.set_trusted(f"k{i}")
    return tr, joined


def _publish(tr: Tracker, joined: list, version: int, complete: bool = False) -> None:
    for j in joined:
        if j.peer_id in tr.peers:
            tr.heartbeat(PeerHeartbeat(j.peer_id, j.token, [version] if complete else []), latest=version)


def _check(tr: Tracker) -> None:
    """Everyone has a place in every tree, reaches the origin without a cycle, the children lists agree with
    the parents, and no fresh key sits above a peer with standing."""
    parents, children = tr.topology()
    for t in range(TREES):
        assert set(parents[t]) == set(tr.peers)
        for pid, parent in parents[t].items():
            assert pid in children[t][parent]
            seen, cur = set(), pid
            while cur is not None:
                assert cur not in seen
                seen.add(cur)
                cur = parents[t][cur]
                if tr._ranked(tr.peers[pid]) and cur is not None:
                    assert tr._ranked(tr.peers[cur]), "a fresh key above a peer with standing"
        assert sum(len(k) for k in children[t].values()) == len(tr.peers)


def _interior(tr: Tracker, t: int) -> str:
    """A peer with children in tree t, not at the top."""
    parents, children = tr.topology()
    return next(p for p, kids in children[t].items() if p is not None and kids and parents[t][p] is not None)


def test_a_departure_mid_version_moves_only_its_children():
    tr, joined = _swarm(24, trusted=range(12))
    _publish(tr, joined, 1)
    before = copy.deepcopy(tr.topology()[0])
    gone = _interior(tr, 0)
    orphans = set(tr.topology()[1][0][gone])
    tr.remove(gone, "left")
    _check(tr)
    after = tr.topology()[0]
    for t in range(TREES):
        moved = {p for p in after[t] if after[t][p] != before[t][p]}
        assert moved == {p for p in after[t] if before[t][p] == gone}
    assert orphans and all(after[0][o] != gone for o in orphans)


def test_a_newcomer_mid_version_is_a_leaf_and_moves_no_one():
    tr, joined = _swarm(16, trusted=range(16))
    _publish(tr, joined, 1)
    before = copy.deepcopy(tr.topology()[0])
    new = tr.join(Join("http://new:1", True, "new"), key="knew")
    _check(tr)
    parents, children = tr.topology()
    for t in range(TREES):
        assert {p: parents[t][p] for p in before[t]} == before[t]
        assert not children[t].get(new.peer_id)


def test_a_demoted_relay_keeps_its_places_and_loses_its_children():
    tr, joined = _swarm(16, trusted=range(16))
    _publish(tr, joined, 1)
    before = copy.deepcopy(tr.topology()[0])
    slow = _interior(tr, 1)
    tr.demote(slow, "stalls")
    _check(tr)
    parents, children = tr.topology()
    assert not any(children[t].get(slow) for t in range(TREES))
    assert all(parents[t][slow] == before[t][slow] for t in range(TREES))


def test_a_fresh_layout_for_the_next_version_and_when_nothing_is_in_flight():
    tr, joined = _swarm(16, trusted=range(16))
    _publish(tr, joined, 1)
    tr.remove(_interior(tr, 0), "left")
    repaired = copy.deepcopy(tr.topology())
    _publish(tr, joined, 2)
    fresh = tr.topology()
    tr.forest.layout = None  # what laying out from scratch gives
    assert fresh == tr.topology() != repaired
    _publish(tr, joined, 2, complete=True)  # the version is everywhere: changes lay out afresh at once
    tr.remove(_interior(tr, 1), "left")
    now = copy.deepcopy(tr.topology())
    tr.forest.layout = None
    assert now == tr.topology()
    _check(tr)


def test_overflow_goes_to_the_relay_with_most_room_not_the_origin():
    """With every place taken, a newcomer goes under the node with the most places per child it would then
    have: the origin feeds the top of every tree, and taking all of the overflow starved those (1000 peers
    simulated with 10% churn: 1.61x the fluid bound, 1.28x with this rule; docs/tree-simulation.md)."""
    from broadcast.layout import Layout

    def ranked(pid):
        return True

    # One tree: the origin (2 places) holds a big relay (8 places) and a small one (2), both full.
    parents = [{"big": None, "small": None, **{f"b{i}": "big" for i in range(8)}, "s0": "small", "s1": "small"}]
    children = [{None: ["big", "small"], "big": [f"b{i}" for i in range(8)], "small": ["s0", "s1"]}]
    caps = [{None: 2, "big": 8, "small": 2, **{f"b{i}": 0 for i in range(8)}, "s0": 0, "s1": 0}]
    lay = Layout(parents, children, caps)
    lay.add("new", ranked)
    assert lay.parents[0]["new"] == "big"  # 8/9 places per child, against 2/3 (origin, small)
    # With room somewhere, the shallowest free place as before.
    lay.caps[0]["small"] = 3
    lay.add("newer", ranked)
    assert lay.parents[0]["newer"] == "small"


def test_a_rehomed_subtree_keeps_true_depths_and_newcomers_take_the_truly_shallowest_place():
    """An orphan moves with its subtree: the depths below it move too. Stale ones made a deep free place look
    shallow, and the next orphans and newcomers went under it."""
    from broadcast.layout import Layout

    def ranked(pid):
        return True

    tree = {None: ["R"], "R": ["M", "P"], "M": ["O1", "O2"], "O1": ["L1", "L2"], "O2": ["W2"], "P": ["Q"],
            "Q": ["F"], "F": ["H"]}
    cap = {None: 1, "R": 2, "M": 2, "O1": 2, "O2": 1, "W2": 1, "P": 1, "Q": 1, "F": 2, "H": 1, "L1": 0, "L2": 0}
    parents = {c: p for p, cs in tree.items() for c in cs}
    lay = Layout([parents], [tree], [cap])
    lay.remove("M", ranked)  # O1 takes M's place under R; O2, with W2 below it, goes under F (depth 5)
    assert lay.parents[0]["O1"] == "R" and lay.parents[0]["O2"] == "F"

    def true_depth(node):
        d = 0
        while node is not None:
            node, d = lay.parents[0][node], d + 1
        return d

    assert {n: lay.depth[0][n] for n in lay.parents[0]} == {n: true_depth(n) for n in lay.parents[0]}
    lay.add("new", ranked)
    assert lay.parents[0]["new"] == "H"  # depth 6, not under W2 (depth 7; W2 was recorded at 4)


def test_a_departed_relays_children_are_not_hung_under_one_another():
    """Each orphan moved brings its free places a level down: taken by the next orphan, one departure made a
    chain of its relay children (8 hops in the 1000-peer simulation). Siblings are rehomed beside each other."""
    from broadcast.layout import Layout

    def ranked(pid):
        return True

    orphans = ["A", "B", "C", "D"]
    tree = {None: ["R", "S"], "R": orphans, "S": ["s1"], **{o: [o.lower() + "1"] for o in orphans}}
    cap = {None: 2, "R": 4, "S": 2, "s1": 0, **{o: 3 for o in orphans}, **{o.lower() + "1": 0 for o in orphans}}
    parents = {c: p for p, cs in tree.items() for c in cs}
    lay = Layout([parents], [tree], [cap])
    lay.remove("R", ranked)
    assert not any(lay.parents[0][o] in orphans for o in orphans), lay.parents[0]
    assert {lay.parents[0][o] for o in orphans} <= {None, "S"}
    assert max(lay.depth[0].values()) == 3  # an orphan's leaf, two levels under S at most (4 and 5 chained)
    assert sorted(lay.parents[0]) == sorted(p for p in parents if p != "R")
