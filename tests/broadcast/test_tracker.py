"""Tree layout: every relay interior in exactly one tree, fanout respected, every peer reached everywhere."""

from __future__ import annotations

import pytest

from broadcast.messages import Join
from broadcast.tracker import Tracker
from broadcast.tree_view import render


def _check(tr: Tracker) -> None:
    parents, children = tr.topology()
    for t in range(tr.trees):
        assert set(parents[t]) == set(tr.peers), "every peer has a place in every tree"
        for pid in tr.peers:
            seen, cur = set(), pid
            while cur is not None:  # reaches the origin without cycles
                assert cur not in seen
                seen.add(cur)
                cur = parents[t][cur]
        inner = [q for q, kids in children[t].items() if q is not None and kids]
        for node, kids in children[t].items():
            if node is not None:
                # Beyond fanout only where every relay of the tree is full (more peers than the heap has
                # places: the relay with the fewest children takes the next, not the origin)
                assert len(kids) <= tr.fanout or all(len(children[t][q]) >= tr.fanout for q in inner)
                assert tr.peers[node].interior_capable
    for p in tr.peers.values():
        interior_in = [t for t in range(tr.trees) if children[t].get(p.peer_id)]
        assert len(interior_in) <= 1
        if interior_in:
            assert interior_in == [p.group]


@pytest.mark.parametrize("n", [1, 3, 4, 8, 16, 32, 33])
def test_splitstream_layout(n):
    tr = Tracker("http://127.0.0.1:1", trees=4, fanout=4)
    for i in range(n):
        tr.join(Join(f"http://127.0.0.1:{2000 + i}", True, f"p{i}"))
    _check(tr)
    sizes = tr.forest.group_sizes()
    assert max(sizes) - min(sizes) <= 1
    if n % 4 == 0:
        # the floor case: every relay uploads S (k children x S/k), the origin only k heads
        _, children = tr.topology()
        assert all(len(children[t][None]) == 1 for t in range(4))
        for p in tr.peers.values():
            assert len(children[p.group].get(p.peer_id, [])) <= 4


def test_removal_rebalances_and_non_relays_are_leaves():
    tr = Tracker("http://127.0.0.1:1", trees=2, fanout=2)
    ids = [tr.join(Join(f"http://127.0.0.1:{2000 + i}", True, f"p{i}")).peer_id for i in range(6)]
    leaf = tr.join(Join(None, False, "leaf")).peer_id
    tr.remove(ids[0], "test")
    tr.remove(ids[2], "test")
    _check(tr)
    sizes = tr.forest.group_sizes()
    assert max(sizes) - min(sizes) <= 1
    _, children = tr.topology()
    assert not any(children[t].get(leaf) for t in range(2))
    chains = tr.sources(leaf)
    assert all("http://127.0.0.1:1" not in c for c in chains)  # the origin is each peer's own tracker URL
    tr.ban(ids[1], "corrupt", ids[3])
    assert ids[1] not in tr.peers and "http://127.0.0.1:2001" in tr.banned_urls
    _check(tr)


def _ancestors(parents: dict, pid: str) -> list[str]:
    out, cur = [], parents[pid]
    while cur is not None:
        out.append(cur)
        cur = parents[cur]
    return out


@pytest.mark.parametrize("n_ranked, n_fresh", [(0, 9), (2, 9), (6, 24), (9, 3)])
def test_fresh_keys_never_sit_above_peers_with_standing(n_ranked, n_fresh):
    tr = Tracker("http://127.0.0.1:1", trees=4, fanout=4)
    fresh = [tr.join(Join(f"http://127.0.0.1:{3000 + i}", True, f"f{i}"), key=f"{i:064x}").peer_id
             for i in range(n_fresh)]  # the fresh ones join first: join order must not help them
    ranked = []
    for i in range(n_ranked):
        key = f"{i + 1000:064x}"
        tr.set_trusted(key) if i % 2 else tr.proven.add(key)
        ranked.append(tr.join(Join(f"http://127.0.0.1:{2000 + i}", True, f"r{i}"), key=key).peer_id)
    tr.join(Join(None, False, "leaf"), key="ab" * 32)
    _check(tr)
    parents, _ = tr.topology()
    tier = {pid: tr.tier(rec) for pid, rec in tr.peers.items()}
    # While a trusted key is a member, a key holding the origin's proof alone is on trial (tier 1), laid out
    # with the fresh keys, below those who vouch.
    vouching = n_ranked > 1  # the odd ones are trusted, the even ones hold the proof
    assert [tier[pid] for pid in ranked] == [(1 if vouching else 2) if i % 2 == 0 else 2 for i in range(n_ranked)]
    assert all(tier[pid] == 0 for pid in fresh)
    for t in range(tr.trees):
        for pid in ranked:
            if tier[pid] == 2:
                assert all(tier[a] == 2 for a in _ancestors(parents[t], pid)), "placed below a lower tier"
    # With no one ranked, the fresh relays still make a tree (not a star from the origin).
    if n_ranked == 0:
        assert any(p is not None for t in range(tr.trees) for p in parents[t].values())


def test_one_membership_per_key_and_one_key_per_url():
    from broadcast.tracker import TrackerError

    tr = Tracker("http://127.0.0.1:1", trees=2, fanout=2)
    a = tr.join(Join("http://127.0.0.1:2001", True, "a"), key="aa" * 32)
    a2 = tr.join(Join("http://127.0.0.1:2002", True, "a-restarted"), key="aa" * 32)
    assert a.peer_id not in tr.peers and a2.peer_id in tr.peers
    with pytest.raises(TrackerError) as e:
        tr.join(Join("http://127.0.0.1:2002", True, "b"), key="bb" * 32)
    assert e.value.status == 409 and a2.peer_id in tr.peers
    tr.ban_key("aa" * 32, "test")
    assert a2.peer_id not in tr.peers
    with pytest.raises(TrackerError, match="banned"):
        tr.join(Join("http://127.0.0.1:2003", True, "a-again"), key="aa" * 32)


def test_unconfirmed_reports_cost_the_reporter_and_unreachable_is_a_leaf():
    tr = Tracker("http://127.0.0.1:1", trees=2, fanout=2)
    j = tr.join(Join("http://127.0.0.1:2001", True, "r"), key="cc" * 32)
    rec = tr.peers[j.peer_id]
    tr.proven.add(rec.key)
    assert tr.has_standing(rec)
    for _ in range(5):
        tr.penalize(rec.key, "test")
    assert not tr.has_standing(rec)
    tr.set_reachable(rec, False, "connect-back failed")
    assert rec.group is None and not rec.interior_capable
    (pv,) = tr.view(None, []).peers  # /tree, `swarm tree` and the web view: a download-only leaf
    assert not pv.relay and pv.reachable is False and "download-only" in render(tr.view(None, []))
    _, children = tr.topology()
    assert not any(children[t].get(rec.peer_id) for t in range(2))
    tr.set_reachable(rec, True)
    assert rec.group is not None
