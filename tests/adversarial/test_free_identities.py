"""Free identities against the trainer's node service, over a real zmq socket: fresh keys earn their share
of work, are paired only with established nodes, and registering costs what the operator asks."""

from __future__ import annotations

import asyncio
import contextlib
import time

import pytest

from swarm_common import proof_of_work
from swarm_common import protocol as P
from swarm_common.keys import KeyPair
from tests.test_server_work import TOK, Client, serve_service
from trainer.node_service import NodeService

pytestmark = pytest.mark.timeout(60)


async def _serve(tmp_path, trusted: list[str] = (), train: dict | None = None, **guard) -> NodeService:
    train = {"inflight_groups": 16, "group_size": 2, "max_tokens": 4, "max_lag": 1, **(train or {})}
    return await serve_service(tmp_path, train, {"trusted": list(trusted), **guard})


class Run:
    """A node service and the clients a test registered with it, all closed at the end."""

    def __init__(self, srv: NodeService):
        self.srv, self.clients = srv, []

    async def register(self, kp: KeyPair, **fields) -> tuple[Client, P.Message]:
        c = Client(self.srv.cfg.server.port, kp)
        self.clients.append(c)
        time_ms = fields.pop("time_ms", int(time.time() * 1000))
        await c.send(P.Register(node_id=kp.public_hex, name="n", time_ms=time_ms, **fields))
        return c, await c.recv()


@contextlib.asynccontextmanager
async def running(tmp_path, **kw):
    run = Run(await _serve(tmp_path, **kw))
    try:
        yield run
    finally:
        for c in run.clients:
            c.close()
        await run.srv.stop()


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
        async with running(tmp_path, trusted=[honest.public_hex], new_key_held=2, new_keys_share=0.25,
                           release_unpaired=True, probation_groups=64) as run:
            hoarders = [(await run.register(KeyPair.generate()))[0] for _ in range(4)]
            held = [len(await _work(c)) for c in hoarders]
            assert held == [2, 2, 0, 0]  # 2 each, and 4 (a quarter of 16) for all fresh keys together
            hc, reply = await run.register(honest)
            assert isinstance(reply, P.Registered)
            assert len(await _work(hc)) == 12  # everything the fresh keys could not take
            # A fresh key that delivers earns more: 2 accepted groups -> up to 4 held.
            first = hoarders[0]
            result = await _submit(first, _held_by(run.srv, first))
            assert len(result.accepted) == 2
            assert run.srv.share.allowance(first.kp.public_hex, established=False) == 4

    asyncio.run(go())


def _held_by(srv: NodeService, c: Client) -> list[P.Assignment]:
    return [P.Assignment(assignment_id=h.assignment_id, prompt_token_ids=h.prompt_ids)
            for h in srv.work.held.values() if h.node_id == c.kp.public_hex]


async def _submit(c: Client, work: list[P.Assignment]) -> P.SubmissionResult:
    await c.send(_answer(c, work))
    return await c.recv()


async def _until(cond, timeout: float = 5.0) -> None:
    end = time.monotonic() + timeout
    while not cond():
        assert time.monotonic() < end, "condition not reached in time"
        await asyncio.sleep(0.05)


def test_a_key_whose_work_keeps_expiring_is_paused_then_dropped(tmp_path):
    async def go():
        async with running(tmp_path, release_unpaired=True, expiries_to_pause=2, expiries_to_drop=3,
                           pause_s=2.0) as run:
            srv = run.srv
            srv.work.assignment_timeout_s = 0.3  # the hand-out's deadline for new work
            kp = KeyPair.generate()
            key = kp.public_hex
            c, reply = await run.register(kp)
            assert isinstance(reply, P.Registered)
            for expiry in (1, 2):
                assert await _work(c)
                await _until(lambda e=expiry: srv.share.keys[key].expired_in_row == e)
            assert srv.share.allowance(key, False) == 0 and srv._room(key) <= 0  # paused: no work at all
            await _until(lambda: srv.share.allowance(key, False) > 0, timeout=5.0)  # the pause is over
            assert await _work(c)
            await _until(lambda: key not in srv.idents)  # the third expiry in a row drops its registration
            await c.ask(1)
            assert (await c.recv()).code == "unknown_node"

    asyncio.run(go())


def test_registrations_are_rate_limited_per_address(tmp_path):
    async def go():
        async with running(tmp_path, register_rate=0.01, register_burst=3) as run:
            codes = []
            for _ in range(5):
                _, reply = await run.register(KeyPair.generate())
                codes.append(type(reply).__name__ if isinstance(reply, P.Registered) else reply.code)
            assert codes == ["Registered"] * 3 + ["rate_limited"] * 2
            assert run.srv.stats.refused["register_rate"] == 2

    asyncio.run(go())


def test_proof_of_work_and_invites_are_the_price_of_a_new_key(tmp_path):
    def proof(kp: KeyPair, t: int) -> dict:
        return {"time_ms": t, "pow_nonce": proof_of_work.solve(kp.public_hex, t, 12)}

    async def go():
        async with running(tmp_path, register_pow_bits=12, invites=["tok-1"]) as run:
            kp, other = KeyPair.generate(), KeyPair.generate()
            _, reply = await run.register(kp)
            assert reply.code == "pow_required" and reply.pow_bits == 12
            t = int(time.time() * 1000)
            assert (await run.register(kp, **proof(kp, t)))[1].code == "invite_required"
            _, reply = await run.register(kp, **proof(kp, t + 1), invite="tok-1")
            assert isinstance(reply, P.Registered)
            # The token is bound to the first key that used it.
            _, reply = await run.register(other, **proof(other, t + 5), invite="tok-1")
            assert reply.code == "invite_required"
            assert not proof_of_work.check(kp.public_hex, t, proof(kp, t)["pow_nonce"], 40)

    asyncio.run(go())


def test_new_keys_are_paired_only_with_established_ones(tmp_path):
    """Two keys on probation never get each other's shared prompts (colluders would vouch for each other),
    and with nobody established to pair with they stay on probation: no release for being alone."""

    async def go():
        async with running(tmp_path, probation_groups=2) as run:
            srv = run.srv
            (ca, _), (cb, _) = await run.register(KeyPair.generate()), await run.register(KeyPair.generate())
            wa, wb = await _work(ca, 2), await _work(cb, 2)
            items_a = {srv.work.held[x.assignment_id].item.id for x in wa}
            items_b = {srv.work.held[x.assignment_id].item.id for x in wb}
            assert not items_a & items_b
            for c, w in ((ca, wa), (cb, wb)):
                assert len((await _submit(c, w)).accepted) == 2
            srv.newcomers.review()
            assert srv.probation.holds(ca.kp.public_hex) and srv.probation.holds(cb.kp.public_hex)
            assert len(srv.probation.quarantine) == 4 and len(srv.buffer) == 0

    asyncio.run(go())


def test_unpaired_newcomers_are_said_where_the_operator_looks(tmp_path):
    """With nobody to pair them with, keys on probation wait: the summary (and so the web view's banner and
    /metrics) counts them and their groups, and a Hello from such a key is told so (`swarm doctor`). A live
    trusted node ends it."""
    from swarm.doctor import _probation

    async def go():
        own = KeyPair.generate()
        async with running(tmp_path, trusted=[own.public_hex]) as run:
            srv = run.srv
            stranger = KeyPair.generate()
            c, _ = await run.register(stranger)
            assert len((await _submit(c, await _work(c, 2))).accepted) == 2
            pg = srv.stats.summary().pairing
            assert (pg.on_probation, pg.waiting_keys, pg.waiting_groups, pg.reference) == (1, 1, 2, False)
            metrics = srv.stats.prom_registry.get_sample_value
            assert metrics("swarm_probation_keys", {"waiting": "unpaired"}) == 1
            await c.send(P.Hello(node_id=stranger.public_hex))
            hello = await c.recv()
            assert isinstance(hello, P.Welcome) and hello.standing == "probation" and hello.unpaired
            check = _probation(hello, own_key=True)
            assert check.ok is None and "--reference" in check.todo
            await run.register(own)  # the operator's own node is live: newcomers can be paired now
            assert srv.stats.summary().pairing.waiting_keys == 0
            await c.send(P.Hello(node_id=stranger.public_hex))
            hello = await c.recv()
            assert not hello.unpaired and _probation(hello, own_key=True).ok
            row = next(n for n in srv.stats.summary().nodes if n.node_id == stranger.public_hex)
            assert row.standing == "probation"

    asyncio.run(go())


def test_late_or_stale_work_shrinks_the_share_like_an_expiry(tmp_path):
    """A key whose answers always come too late holds less and less, then is paused: a refusal as
    'stale' or 'late' counts toward the expiry streak (it used to reset it)."""

    async def go():
        async with running(tmp_path, release_unpaired=True, expiries_to_pause=2, pause_s=30.0,
                           new_key_held=4) as run:
            srv = run.srv
            kp = KeyPair.generate()
            c, _ = await run.register(kp)
            for streak in (1, 2):
                work = await _work(c, 4)
                srv.work.version = srv.work.newest = 10  # the run moved on: these answers are stale
                result = await _submit(c, work)
                assert set(result.refused.values()) == {"stale"}, result
                assert srv.share.keys[kp.public_hex].expired_in_row == streak
                srv.work.version = srv.work.newest = 0
            assert srv.share.allowance(kp.public_hex, False) == 0  # paused

    asyncio.run(go())


def test_silent_keys_are_forgotten_and_get_no_notices(tmp_path):
    """A key that is not established, silent and holding nothing, is forgotten after guard.forget_after_s:
    registry, share, message budget and evidence go, and it registers again if it returns. Version notices
    go to live keys only."""

    async def go():
        own = KeyPair.generate()
        async with running(tmp_path, trusted=[own.public_hex], forget_after_s=1.0) as run:
            srv = run.srv
            quiet, _ = await run.register(KeyPair.generate())
            mine, _ = await run.register(own)
            key = quiet.kp.public_hex
            srv.registry.nodes[key].last_seen -= srv.registry.gone_after_s + 1  # silent since long ago
            await srv.announce(1)
            assert await quiet.recv(timeout=0.5, skip=()) is None  # no notice for a silent key
            assert isinstance(await mine.recv(timeout=2.0, skip=()), P.VersionNotice)
            assert srv.stats.summary().silent_keys == 1
            assert key not in {n.node_id for n in srv.stats.summary().nodes}
            await _until(lambda: key not in srv.registry.nodes, timeout=5.0)
            assert key not in srv.idents and key not in srv.share.keys and key not in srv.guard.last_register_ms
            assert own.public_hex in srv.registry.nodes  # trusted keys are never forgotten
            await quiet.ask(1)
            assert (await quiet.recv()).code == "unknown_node"
            await quiet.send(P.Register(node_id=key, name="n", time_ms=int(time.time() * 1000)))
            assert isinstance(await quiet.recv(), P.Registered)

    asyncio.run(go())


def test_registrations_are_budgeted_per_prefix_too(tmp_path):
    from trainer.admission import Admission, address_prefix
    from trainer.guard import GuardConfig

    assert address_prefix("203.0.113.77") == "203.0.113.0/24"
    assert address_prefix("2001:db8:1:2:3::9") == "2001:db8:1:2::/64"
    assert address_prefix("::ffff:198.51.100.4") == "198.51.100.0/24"
    assert address_prefix("not-an-address") is None
    adm = Admission(tmp_path, GuardConfig(register_rate=0.0, register_burst=2, register_prefix_rate=0.0,
                                          register_prefix_burst=5))
    got = [adm.register_allowed(f"203.0.113.{i // 2}") for i in range(10)]  # 2 per address, 5 per /24
    assert got == [True] * 5 + [False] * 5
    assert adm.register_allowed("198.51.100.1")  # another /24 has its own budget


def test_a_crowd_of_new_keys_waits_outside(tmp_path, monkeypatch):
    """Keys that are not established share new_keys_share of the work: as many of their requests wait for
    room (a long poll, woken at every pulse) as they have slots, the rest are told to ask again in a second;
    and a live key with nothing accepted gets no version notices (its work replies and the tree say)."""

    from trainer import node_service

    monkeypatch.setattr(node_service, "PARK_S", 10.0)

    async def go():
        own = KeyPair.generate()
        async with running(tmp_path, trusted=[own.public_hex], new_key_held=2, new_keys_share=0.25) as run:
            srv = run.srv
            crowd = [(await run.register(KeyPair.generate()))[0] for _ in range(8)]
            assert [len(await _work(c)) for c in crowd[:2]] == [2, 2]  # the newcomers' 4 slots are taken
            for c in crowd[2:]:
                await c.ask(2)
            replies = [await c.recv(timeout=0.3) for c in crowd[2:]]
            told = [r for r in replies if r is not None]
            assert len(srv.parked) == 4 and len(told) == 2  # 4 wait for room, 2 are told to come back
            assert all(not r.assignments and r.retry_after_s == 1.0 for r in told)
            mine, _ = await run.register(own)
            await srv.announce(1)
            assert isinstance(await mine.recv(timeout=2.0, skip=()), P.VersionNotice)
            assert await crowd[0].recv(timeout=0.5, skip=()) is None  # nothing accepted yet: no notice

    asyncio.run(go())
