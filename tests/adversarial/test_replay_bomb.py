"""A replay bomb: episodes whose every tool call is a program that never ends, sent to a trainer running the
python tool. The trainer's replay runs them in its sandbox (each call stopped by its CPU and wall limits),
stops at the submission's budget, refuses the rest as replay_budget and audits the node in full from then
on: the bomb costs the trainer its budget, not its time. (From a fresh key with a trained model the audit,
which runs first, refuses made-up code before any of it runs; here no auditor runs, as for an established
node's unaudited group.)"""

from __future__ import annotations

import asyncio
import time

import pytest

from rewards.sandbox import available
from swarm_common import protocol as P
from swarm_common.keys import KeyPair
from tests.test_episode_service import _register, episodes, serve
from tests.test_server_work import Client

pytestmark = pytest.mark.timeout(120)


@pytest.mark.skipif(bool(available()), reason=str(available()))
def test_a_replay_bomb_costs_the_trainer_its_budget_only(tmp_path):
    """Every episode calls an endless loop: the replay stops at the budget (1.5 s per group here), refuses
    the rest as replay_budget (no strike: an honest model can write a loop) and audits the node in full."""

    async def go():
        kp = KeyPair.generate()
        srv = await serve(tmp_path, "python", [kp.public_hex], replay_sandbox_s=1.5, max_episode_tokens=400)
        c = Client(srv.cfg.server.port, kp)
        try:
            assert isinstance(await _register(c), P.Registered)
            await c.ask(2)
            work = await c.recv()
            bomb = [episodes(work, a, ["[python('while True: pass')]", "[python('while True: pass')]", "1"])
                    for a in work.assignments]
            t0 = time.monotonic()
            await c.send(P.RolloutSubmission(node_id=kp.public_hex, version=0, gen_seconds=0.1,
                                             rollouts=[P.Rollout(a.assignment_id, [], e)
                                                       for a, e in zip(work.assignments, bomb, strict=True)]))
            res = await c.recv(timeout=60)
            spent = time.monotonic() - t0
            assert set(res.refused.values()) == {"replay_budget"}, res
            assert spent < 2 * 1.5 + 2 * 3.0 + 2  # the budget, and at most one call past it per group
            assert srv.guard.strikes[kp.public_hex] == 0 and kp.public_hex in srv.guard.suspects
        finally:
            c.close()
            await srv.stop()

    asyncio.run(go())
