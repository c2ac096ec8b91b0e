"""The connect-back verdict on a reported relay (broadcast/verdicts.recheck_reach): a probe that times out is
tried once more a second later (a loaded machine may miss one deadline), a refused connection counts at
once (nothing listens there). The real prober (judge.Prober) tells the two apart over a real socket."""

from __future__ import annotations

import asyncio
import socket

import aiohttp

from broadcast.judge import Prober
from broadcast.messages import Join
from broadcast.tracker import Tracker
from broadcast.verdicts import REFUSED, RETRY_S, Pause, Probe, recheck_reach


def _relay() -> tuple[Tracker, object]:
    tr = Tracker("http://127.0.0.1:1", trees=2, fanout=2)
    j = tr.join(Join("http://127.0.0.1:2001", True, "r"), key="cc" * 32)
    return tr, tr.peers[j.peer_id]


def _drive(flow, answers: list[str]) -> tuple[list, str]:
    """Run the verdict, answering its probes in order; -> (the steps it yielded, its result)."""
    steps, result, answers = [], None, list(answers)
    try:
        while True:
            step = flow.send(result)
            steps.append(step)
            result = answers.pop(0) if isinstance(step, Probe) else None
    except StopIteration as end:
        return steps, end.value


def test_a_refused_connect_back_makes_a_leaf_at_once():
    tr, rec = _relay()
    assert rec.group is not None
    steps, verdict = _drive(recheck_reach(tr, rec), [f"unreachable: connect-back failed: {REFUSED}"])
    assert [type(s) for s in steps] == [Probe] and REFUSED in verdict  # no pause, no second probe
    assert rec.group is None and not rec.reachable


def test_a_connect_back_that_times_out_is_tried_again_a_second_later():
    tr, rec = _relay()
    steps, verdict = _drive(recheck_reach(tr, rec), ["unreachable: TimeoutError", "ok"])
    assert [type(s) for s in steps] == [Probe, Pause, Probe] and steps[1].seconds == RETRY_S
    assert verdict == "ok" and rec.group is not None and rec.reachable


def test_the_prober_names_a_refused_connection():
    with socket.socket() as s:  # a port nothing listens on
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]

    async def go() -> tuple[str, str | None, str]:
        async with aiohttp.ClientSession() as session:
            return await Prober(session, connect_timeout=1.0, ttfb=1.0).reach(f"http://127.0.0.1:{port}", None)

    status, key, detail = asyncio.run(go())
    assert status == "unreachable" and key is None and REFUSED in detail
