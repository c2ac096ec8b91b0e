"""Free identities against the trainer's node service, over a real zmq socket: fresh keys earn their share
of work, are paired only with established nodes, and registering costs what the operator asks."""

from __future__ import annotations

import asyncio
import time

import msgspec
import pytest

from rewards.registry import make_task
from swarm_common import proof_of_work
from swarm_common import protocol as P
from swarm_common.keys import KeyPair
from tests.conftest import free_port
from tests.test_server_work import TOK, Client, Ledger
from trainer.config import RunConfig
from trainer.guard import Guard
from trainer.node_registry import NodeRegistry
from trainer.node_service import NodeService
from trainer.stats import RunStats

pytestmark = pytest.mark.timeout(60)


async def _serve(tmp_path, trusted: list[str] = (), train: dict | None = None, **guard) -> NodeService:
    train = {"inflight_groups": 16, "group_size": 2, "max_tokens": 4, "max_lag": 1, **(train or {})}
    cfg = msgspec.convert({"run_dir": str(tmp_path), "train": train, "server": {"port": free_port()},
                           "guard": {"trusted": list(trusted), **guard}}, RunConfig)
    task = make_task("arithmetic")
    registry = NodeRegistry(cfg.server.heartbeat_s)
    srv = NodeService(cfg, task, TOK, len(TOK), RunStats(str(tmp_path), 10, registry), registry,
                      lambda v: f"http://x/v/{v}", task.train_items(seed=0), tracker_url="http://x",
                      trainer_key="00" * 32, guard=Guard(tmp_path, cfg.guard), auditor=None, ledger=Ledger())
    await srv.start()
    return srv


async def _register(srv: NodeService, kp: KeyPair, **fields) -> tuple[Client, P.Message]:
    c = Client(srv.cfg.server.port, kp)
    await c.send(P.Register(node_id=kp.public_hex, name="n", time_ms=fields.pop("time_ms", int(time.time() * 1000)),
                            **fields))
    return c, await c.recv()


async def _work(c: Client, n: int = 16) -> list[P.Assignment]:
    await c.ask(n)
    reply = await c.recv(timeout=3.0)
    assert isinstance(reply, P.WorkAssignment), reply
    return reply.assignments


def _answer(c: Client, work: list[P.Assignment]) -> P.RolloutSubmission:
    eos = TOK.eos_token_id
    return P.RolloutSubmission(node_id=c.kp.public_hex, version=0, gen_seconds=0.1, rollouts=[
        P.Rollout(a.assignment_id, [P.Sample([5, eos], [-1.0, -0.5], "stop")] * 2) for a in work])


def test_fresh_keys_earn_their_share_and_cannot_starve_a_batch(tmp_path):
    """A fresh key gets new_key_held assignments, more as its groups are accepted; fresh keys together
    hold at most new_keys_share of the in-flight groups; a trusted node still gets a batch's worth."""

    async def go():
        honest = KeyPair.generate()
        srv = await _serve(tmp_path, trusted=[honest.public_hex], new_key_held=2, new_keys_share=0.25,
                           release_unpaired=True, probation_groups=64)
        clients = []
        try:
            hoarders = [await _register(srv, KeyPair.generate()) for _ in range(4)]
            clients += [c for c, _ in hoarders]
            held = [len(await _work(c)) for c, _ in hoarders]
            assert held == [2, 2, 0, 0]  # 2 each, and 4 (a quarter of 16) for all fresh keys together

            hc, reply = await _register(srv, honest)
            clients.append(hc)
            assert isinstance(reply, P.Registered)
            assert len(await _work(hc)) == 12  # everything the fresh keys could not take

            # A fresh key that delivers earns more: 2 accepted groups -> up to 4 held.
            first = hoarders[0][0]
            result = await asyncio.wait_for(_submit(first, srv, await _current(srv, first)), 5)
            assert len(result.accepted) == 2
            assert srv.share.allowance(first.kp.public_hex, established=False) == 4
        finally:
            for c in clients:
                c.close()
            await srv.stop()

    asyncio.run(go())


async def _current(srv: NodeService, c: Client) -> list[P.Assignment]:
    return [P.Assignment(assignment_id=h.assignment_id, prompt_token_ids=h.prompt_ids)
            for h in srv.work.held.values() if h.node_id == c.kp.public_hex]


async def _submit(c: Client, srv: NodeService, work: list[P.Assignment]) -> P.SubmissionResult:
    await c.send(_answer(c, work))
    return await c.recv()


async def _until(cond, timeout: float = 5.0) -> None:
    end = time.monotonic() + timeout
    while not cond():
        assert time.monotonic() < end, "condition not reached in time"
        await asyncio.sleep(0.05)


def test_a_key_whose_work_keeps_expiring_is_paused_then_dropped(tmp_path):
    async def go():
        srv = await _serve(tmp_path, release_unpaired=True, expiries_to_pause=2, expiries_to_drop=3, pause_s=2.0)
        srv.work.assignment_timeout_s = 0.3  # the hand-out's deadline for new work
        kp = KeyPair.generate()
        c, reply = await _register(srv, kp)
        key = kp.public_hex
        try:
            assert isinstance(reply, P.Registered)
            for expiry in (1, 2):
                assert await _work(c)
                await _until(lambda e=expiry: srv.share.keys[key].expired_in_row == e)
            assert srv.share.allowance(key, False) == 0  # paused: no work at all
            assert srv._room(key) <= 0
            await _until(lambda: srv.share.allowance(key, False) > 0, timeout=5.0)  # the pause is over
            assert await _work(c)
            await _until(lambda: key not in srv.idents)  # the third expiry in a row drops its registration
            await c.ask(1)
            assert (await c.recv()).code == "unknown_node"
        finally:
            c.close()
            await srv.stop()

    asyncio.run(go())


def test_registrations_are_rate_limited_per_address(tmp_path):
    async def go():
        srv = await _serve(tmp_path, register_rate=0.01, register_burst=3)
        clients = []
        try:
            codes = []
            for _ in range(5):
                c, reply = await _register(srv, KeyPair.generate())
                clients.append(c)
                codes.append(type(reply).__name__ if isinstance(reply, P.Registered) else reply.code)
            assert codes == ["Registered"] * 3 + ["rate_limited"] * 2
            assert srv.stats.refused["register_rate"] == 2
        finally:
            for c in clients:
                c.close()
            await srv.stop()

    asyncio.run(go())


def test_proof_of_work_and_invites_are_the_price_of_a_new_key(tmp_path):
    async def go():
        srv = await _serve(tmp_path, register_pow_bits=12, invites=["tok-1"])
        kp, other = KeyPair.generate(), KeyPair.generate()
        clients = []
        try:
            c, reply = await _register(srv, kp)
            clients.append(c)
            assert reply.code == "pow_required" and reply.pow_bits == 12
            t = int(time.time() * 1000)
            nonce = proof_of_work.solve(kp.public_hex, t, 12)
            c, reply = await _register(srv, kp, time_ms=t, pow_nonce=nonce)
            clients.append(c)
            assert reply.code == "invite_required"
            c, reply = await _register(srv, kp, time_ms=t + 1, pow_nonce=proof_of_work.solve(kp.public_hex, t + 1, 12),
                                       invite="tok-1")
            clients.append(c)
            assert isinstance(reply, P.Registered)
            # The token is bound to the first key that used it.
            t2 = int(time.time() * 1000) + 5
            c, reply = await _register(srv, other, time_ms=t2, invite="tok-1",
                                       pow_nonce=proof_of_work.solve(other.public_hex, t2, 12))
            clients.append(c)
            assert reply.code == "invite_required"
            assert not proof_of_work.check(kp.public_hex, t, nonce, 40)  # a proof is for its own bits
        finally:
            for c in clients:
                c.close()
            await srv.stop()

    asyncio.run(go())


def test_new_keys_are_paired_only_with_established_ones(tmp_path):
    """Two keys on probation never get each other's shared prompts (colluders would vouch for each other),
    and with nobody established to pair with they stay on probation: no release for being alone."""

    async def go():
        srv = await _serve(tmp_path, probation_groups=2)
        a, b = KeyPair.generate(), KeyPair.generate()
        ca, _ = await _register(srv, a)
        cb, _ = await _register(srv, b)
        try:
            wa = await _work(ca, 2)
            wb = await _work(cb, 2)
            items_a = {srv.work.held[x.assignment_id].item.id for x in wa}
            items_b = {srv.work.held[x.assignment_id].item.id for x in wb}
            assert not items_a & items_b
            for c, w in ((ca, wa), (cb, wb)):
                assert len((await _submit(c, srv, w)).accepted) == 2
            srv._review_probation()
            assert srv.probation.holds(a.public_hex) and srv.probation.holds(b.public_hex)
            assert len(srv.probation.quarantine) == 4 and len(srv.buffer) == 0
        finally:
            ca.close()
            cb.close()
            await srv.stop()

    asyncio.run(go())
