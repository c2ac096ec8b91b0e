"""The origin's plan of uplink probes (broadcast/uplink_plan.py), driven as the prober and the simulator drive
it: figures held to a share of the origin's downlink are timed again, one at a time."""

from __future__ import annotations

import pytest

from broadcast.messages import Join
from broadcast.tracker import Tracker
from broadcast.uplink_plan import MAX_IN_FLIGHT, PRECISE_IN_FLIGHT, UplinkPlan

Mbit = 1e6 / 8
DOWNLINK = 1000 * Mbit  # the origin's, shared equally by the probes it runs at once


def _swarm(uplinks: list[float]) -> tuple[Tracker, dict[str, float]]:
    tr = Tracker("http://o:1", trees=2, fanout=2)
    up = {}
    for i, u in enumerate(uplinks):
        j = tr.join(Join(f"http://h{i}:1", True, f"p{i}"), key=f"k{i}")
        tr.set_trusted(f"k{i}")
        up[tr.peers[j.peer_id].key] = u
    return tr, up


def test_figures_held_to_a_share_of_the_origins_downlink_are_timed_again_alone():
    fast = [500 * Mbit] * 12
    slow = [10 * Mbit] * 48
    tr, up = _swarm(slow[:24] + fast + slow[24:])
    plan = UplinkPlan(tr)
    running: list = []  # (relay, the probes running when it started), in the order they end
    times: dict[str, int] = {}
    started = [rec for rec in list(tr.peers.values()) for rec in plan.after_heartbeat(rec)]
    while started or running:
        for rec in started:
            times[rec.key] = times.get(rec.key, 0) + 1
            if times[rec.key] == 2:  # a second probe: no first one waits or runs, and few beside it
                assert not plan.queue and len(running) < PRECISE_IN_FLIGHT
                assert len(times) == len(tr.peers) and all(times[r.key] == 2 for r, _ in running)
            running.append((rec, plan.running))
        assert plan.running == len(running) <= MAX_IN_FLIGHT
        rec, beside = running.pop(0)
        started = plan.done(rec, rec.url or "", "probed", min(up[rec.key], DOWNLINK / beside))
    twice = {k for k, n in times.items() if n == 2}
    assert len(times) == len(tr.peers) and max(times.values()) == 2
    assert twice == {k for k, u in up.items() if u == 500 * Mbit}  # the slow figures were their own
    for rec in tr.peers.values():  # the second figure stands: the fast relays' own uplink
        assert tr.uploads.probed[rec.url or ""] == pytest.approx(min(up[rec.key], DOWNLINK / PRECISE_IN_FLIGHT))
    assert not [r for rec in list(tr.peers.values()) for r in plan.after_heartbeat(rec)]  # nothing more to time
