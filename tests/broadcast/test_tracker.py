"""Tree layout: every relay interior in exactly one tree, fanout respected, every peer reached everywhere."""

from __future__ import annotations

import pytest

from broadcast.messages import Join
from broadcast.tracker import Tracker


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
        for node, kids in children[t].items():
            if node is not None:
                assert len(kids) <= tr.fanout
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
    sizes = tr._group_sizes()
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
    sizes = tr._group_sizes()
    assert max(sizes) - min(sizes) <= 1
    _, children = tr.topology()
    assert not any(children[t].get(leaf) for t in range(2))
    chains = tr.sources(leaf)
    assert all(c[-1] == "http://127.0.0.1:1" for c in chains)
    tr.ban(ids[1], "corrupt", ids[3])
    assert ids[1] not in tr.peers and "http://127.0.0.1:2001" in tr.banned_urls
    _check(tr)
