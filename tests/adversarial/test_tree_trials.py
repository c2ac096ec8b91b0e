"""Keys on trial and the share of uplinks they may take (issue 29), driven through the decision core: the
tracker on the test's clock and the origin's verdicts with the probes' answers given.

Keys holding the origin's one-piece proof (which an attacker passes) were laid out above the honest relays
and made every version after the first 2x slower (bench/tree_attacks_sim.py); zero-upload keys took an
equal share of every uplink. Each test names what it fails on in the code before.
"""

from __future__ import annotations

from broadcast.messages import Join, Received, TreeSources
from broadcast.tracker import Tracker
from broadcast.trials import FAILED_VERSIONS
from broadcast.verdicts import ReportGate, prove
from tests.adversarial.test_tree_standing import HONEST_ANSWERS, MB, drive, heartbeat, report


def swarm(n_honest: int, n_proven: int, trees: int = 2, fanout: int = 4):
    """Trusted relays with measured uplinks, then keys that hold the origin's proof and nothing else."""
    tr = Tracker("http://o:1", trees=trees, fanout=fanout)
    honest, proven = [], []
    for i in range(n_honest):
        rec = tr.peers[tr.join(Join(f"http://h{i}:1", True, f"h{i}"), key=f"h{i}", observed_host=f"10.0.0.{i}").peer_id]
        tr.set_trusted(rec.key)
        tr.probed(rec, 5 * MB)
        honest.append(rec)
    for i in range(n_proven):
        rec = tr.peers[tr.join(Join(f"http://a{i}:1", True, f"a{i}"), key=f"a{i}", observed_host=f"10.9.0.{i}").peer_id]
        drive(tr, prove(tr, rec, 1, 0), {"piece": "ok"})
        proven.append(rec)
    return tr, honest, proven


def interior(tr: Tracker, pid: str) -> bool:
    _, children = tr.topology()
    return any(children[t].get(pid) for t in range(tr.trees))


def next_version(tr: Tracker, honest, v: int) -> None:
    for p in tr.peers.values():
        p.complete = list(range(1, v))
    heartbeat(tr, honest[0], v)  # a new version: a fresh layout


def test_keys_holding_a_proof_alone_are_on_trial_a_few_at_a_time_below_the_others():
    """Fails before: every key holding the proof was laid out as a relay, the origin's child among them."""
    tr, honest, proven = swarm(16, 16)
    next_version(tr, honest, 1)
    assert all(tr.tier(a) == 1 for a in proven) and all(tr.tier(h) == 2 for h in honest)
    parents, children = tr.topology()
    trial = [a for a in proven if interior(tr, a.peer_id)]
    assert 1 <= len(trial) <= tr.trees  # at most a tenth of a tree's relays, at least one, per tree
    for t in range(tr.trees):
        assert all(c in {h.peer_id for h in honest} for c in children[t][None])  # none is the origin's child
        for h in (h for h in honest if h.group == t):  # nor above an honest relay in the tree it carries
            cur = parents[t][h.peer_id]
            while cur is not None:
                assert cur not in {a.peer_id for a in proven}
                cur = parents[t][cur]


def test_a_trial_that_delivers_nothing_fails_and_one_that_delivers_earns():
    """A relay on trial whose receivers who vouch confirm nothing gets no other trial for FAILED_VERSIONS
    versions; one whose receivers confirm what it sent earns standing and is laid out with the others."""
    tr, honest, proven = swarm(16, 16)
    next_version(tr, honest, 1)
    _, children = tr.topology()
    trial = [a for a in proven if interior(tr, a.peer_id)]
    good, bad = trial[0], trial[1:]
    kids = [tr.peers[c] for t in range(tr.trees) for c in children[t].get(good.peer_id, ()) if tr.tier(tr.peers[c]) == 2]
    assert kids, "the relay on trial has no receiver who vouches: nobody could judge it"
    heartbeat(tr, good, 1, served_bytes=64 * MB)
    for k in kids:
        tr.clock.now += 0.1
        heartbeat(tr, k, 1, received={good.url: 8 * MB}, recent={good.url: Received(8 * MB, 1.0)})
    assert tr.tier(good) == 2  # earned: receivers who vouch confirmed what it sent
    judged = {tr.peers[pid].key for pid in tr.forest.trials.running}
    assert bad and {a.key for a in bad} <= judged  # they had receivers who vouch
    next_version(tr, honest, 2)
    assert all(tr.forest.trials.failed.get(a.key) == 1 for a in bad)
    assert good.key not in tr.forest.trials.failed and interior(tr, good.peer_id)
    for v in range(3, 1 + FAILED_VERSIONS):
        next_version(tr, honest, v)
        assert not any(interior(tr, a.peer_id) for a in bad)


def test_a_receiver_who_vouches_ends_a_trial_it_finds_stalling():
    """A stall report on a relay with standing that answers the origin costs the reporter; on a relay on
    trial, placed over this very receiver to be judged by it, it ends the trial (a leaf again)."""
    tr, honest, proven = swarm(16, 16)
    next_version(tr, honest, 1)
    _, children = tr.topology()
    trial = next(a for a in proven if interior(tr, a.peer_id))
    child = next(tr.peers[c] for t in range(tr.trees) for c in children[t].get(trial.peer_id, ())
                 if tr.tier(tr.peers[c]) == 2)
    tr.sources(child.peer_id)  # given as its source (as a heartbeat's answer does)
    heartbeat(tr, child, 1)
    assert report(tr, ReportGate(), child, trial, HONEST_ANSWERS) == "trial ended"
    assert not interior(tr, trial.peer_id) and tr.points(child.key) == 0
    assert trial.key in tr.forest.trials.failed


def test_a_relay_is_told_which_members_below_it_come_after_the_others():
    """TreeSources.low: the addresses of the members below a relay that are not first in line (fresh keys,
    keys on trial), less any address a member first in line has too. Fails before: no such field."""
    tr, honest, proven = swarm(8, 8)
    next_version(tr, honest, 1)
    parents, children = tr.topology()
    top = next(h for h in honest if parents[h.group][h.peer_id] is None)  # the top of its tree: all below it
    below = tr.line.low_below(top)
    assert sorted(below) == sorted(a.addr for a in proven)
    assert tr.line.low_below(next(a for a in proven if not interior(tr, a.peer_id))) == []  # a leaf: nobody below
    kid = tr.peers[next(c for c in children[top.group][top.peer_id] if tr.tier(tr.peers[c]) == 2)]
    kid.addr = below[0]  # an honest member behind the same address (a NAT) as a fresh key
    assert below[0] not in tr.line.low_below(top) and len(tr.line.low_below(top)) == len(below) - 1


def test_the_low_addresses_and_the_relays_on_trial_travel_with_the_sources_tag():
    """A heartbeat's answer leaves out what the peer holds (the tag names sources, low and trial together);
    a change in any of them is sent in full."""
    a = TreeSources(3, [["http://r:1"]], True, low=["10.9.0.1"], trial=["http://r:1"])
    full = a.for_peer("")
    assert (full.sources, full.low, full.trial) == (a.sources, a.low, a.trial)
    assert a.for_peer(full.tag).sources == [] and a.for_peer(full.tag).low == []
    b = TreeSources(3, [["http://r:1"]], True, low=["10.9.0.2"], trial=["http://r:1"])
    assert b.for_peer(full.tag).tag != full.tag and b.for_peer(full.tag).low == ["10.9.0.2"]


def test_a_fast_probe_lifts_no_key_on_trial():
    """The origin's uplink probe times filler, which a key can serve fast and its children slowly: in the
    attack lab such keys, timed at ~300 MB/s, were laid out above all six honest relays. A key on trial is
    not probed, and a figure it has is not used: it gets a trial's one place, below the others."""
    from broadcast.trials import TRIAL_CHILDREN
    from broadcast.uplink_plan import wants_probe

    tr, honest, proven = swarm(16, 16)
    assert not any(wants_probe(tr, a) for a in proven)
    for a in proven:
        tr.probed(a, 300 * MB)
    next_version(tr, honest, 1)
    _, children = tr.topology()
    for a in proven:
        assert all(len(children[t].get(a.peer_id, ())) <= TRIAL_CHILDREN for t in range(tr.trees))
        assert all(a.peer_id not in children[t][None] for t in range(tr.trees))
