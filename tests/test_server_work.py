"""The trainer's work hand-out over a real zmq socket: a request that finds no room is held (a long poll)
and answered as soon as room opens or a version is out, not on the node's next timer tick."""

from __future__ import annotations

import asyncio
import time

import msgspec
import pytest
import zmq
import zmq.asyncio

from model_builders.default_model import build_tokenizer
from rewards.registry import make_task
from swarm_common import protocol as P
from swarm_common.keys import KeyPair
from tests.conftest import free_port
from trainer import node_service as server_mod
from trainer.config import RunConfig
from trainer.guard import Guard
from trainer.node_registry import NodeRegistry
from trainer.node_service import NodeService
from trainer.stats import RunStats

pytestmark = pytest.mark.timeout(60)


class Client:
    def __init__(self, port: int, kp: KeyPair):
        self.kp = kp
        self.ctx = zmq.asyncio.Context()
        self.sock = self.ctx.socket(zmq.DEALER)
        self.sock.setsockopt(zmq.LINGER, 0)
        self.sock.connect(f"tcp://127.0.0.1:{port}")

    async def send(self, msg: P.Message) -> None:
        await self.sock.send_multipart(P.sign(msg, self.kp))

    async def recv(self, timeout: float = 5.0, skip=(P.VersionNotice,)) -> P.Message | None:
        """The next reply that is not a notice; None if none came within `timeout`."""
        end = time.monotonic() + timeout
        while (left := end - time.monotonic()) > 0:
            try:
                msg = P.decode(await asyncio.wait_for(self.sock.recv(), left))
            except TimeoutError:
                return None
            if not isinstance(msg, skip):
                return msg
        return None

    async def ask(self, n: int, version: int = 0) -> None:
        await self.send(P.WorkRequest(node_id=self.kp.public_hex, version_loaded=version, max_prompts=n))

    def close(self) -> None:
        self.sock.close(0)
        self.ctx.term()


class Ledger:
    """Records what the service tells the run's ledger (trainer/ledger.py has its own tests)."""

    def __init__(self):
        self.accepted_ids: list[str] = []
        self.drops: list[tuple[str, str]] = []

    def accepted(self, g) -> None:
        self.accepted_ids.append(g.assignment_id)

    def dropped(self, groups, reason: str, step: int) -> None:
        self.drops.extend((g.assignment_id, reason) for g in groups)


TOK = build_tokenizer()


async def serve_service(tmp_path, train: dict, guard: dict) -> NodeService:
    """A started NodeService on a free port with the tiny tokenizer, no auditor and a recording ledger."""
    cfg = msgspec.convert({"run_dir": str(tmp_path), "train": train, "server": {"port": free_port()},
                           "guard": guard}, RunConfig)
    task = make_task("arithmetic")
    registry = NodeRegistry(cfg.server.heartbeat_s)
    srv = NodeService(cfg, task, TOK, len(TOK), RunStats(str(tmp_path), 10, registry), registry,
                      lambda v: f"http://x/v/{v}", task.train_items(seed=0), tracker_url="http://x",
                      trainer_key="00" * 32, guard=Guard(tmp_path, cfg.guard), auditor=None, ledger=Ledger())
    await srv.start()
    return srv


async def _serve(tmp_path, client_key: str, **train) -> NodeService:
    train = {"inflight_groups": 2, "group_size": 2, "max_tokens": 4, "max_lag": 1, **train}
    return await serve_service(tmp_path, train, {"trusted": [client_key]})


def test_parked_request_is_answered_when_room_opens(tmp_path, monkeypatch):
    monkeypatch.setattr(server_mod, "PARK_S", 1.5)

    async def go():
        kp = KeyPair.generate()
        # A trusted key: no probation, no shared prompts. Its samples all score the same: keep them anyway.
        srv = await _serve(tmp_path, kp.public_hex, dynamic_sampling=False)
        c = Client(srv.cfg.server.port, kp)
        try:
            await c.send(P.Register(node_id=c.kp.public_hex, name="n", time_ms=int(time.time() * 1000)))
            assert isinstance(await c.recv(), P.Registered)

            await c.ask(4)
            work = await c.recv()
            assert isinstance(work, P.WorkAssignment) and len(work.assignments) == 2  # inflight_groups

            # No room: the request is held, not answered with "ask again later".
            t0 = time.monotonic()
            await c.ask(4)
            assert await c.recv(timeout=0.5) is None

            # The work comes back and the learner takes it: room opens and the held request gets work.
            eos = TOK.eos_token_id
            rollouts = [P.Rollout(a.assignment_id, [P.Sample([5, eos], [-1.0, -0.5], "stop")] * 2)
                        for a in work.assignments]
            await c.send(P.RolloutSubmission(node_id=c.kp.public_hex, version=0, rollouts=rollouts,
                                             gen_seconds=0.1))
            result = await c.recv()
            assert isinstance(result, P.SubmissionResult) and len(result.accepted) == 2, result
            assert len(await srv.take_batch(2)) == 2
            t_room = time.monotonic()
            again = await c.recv(timeout=1.0)
            assert isinstance(again, P.WorkAssignment) and len(again.assignments) == 2, again
            assert time.monotonic() - t_room < 0.5

            # Held again; a new version wakes it (the node should load it), with nothing to do yet.
            await c.ask(4)
            assert await c.recv(timeout=0.3) is None
            await srv.announce(1)
            woke = await c.recv(timeout=1.0)
            assert isinstance(woke, P.WorkAssignment) and not woke.assignments
            assert woke.weights.version == 1 and woke.retry_after_s == 0.0

            # Nothing changes: the request is answered, empty, when the long poll runs out.
            t1 = time.monotonic()
            await c.ask(4, version=1)
            late = await c.recv(timeout=3.0)
            assert isinstance(late, P.WorkAssignment) and not late.assignments
            assert 1.3 < time.monotonic() - t1 < 2.5
            assert time.monotonic() - t0 > 1.5
        finally:
            c.close()
            await srv.stop()

    asyncio.run(go())


async def _registered(srv: NodeService, kp: KeyPair) -> Client:
    c = Client(srv.cfg.server.port, kp)
    await c.send(P.Register(node_id=kp.public_hex, name="n", time_ms=int(time.time() * 1000)))
    assert isinstance(await c.recv(), P.Registered)
    return c


async def _held_until_announced(c: Client, srv: NodeService, version: int) -> None:
    """A request from a node at version - 1 gets no answer until `version` is announced, then an empty
    assignment that names it as the version to load."""
    await c.ask(2, version=version - 1)
    assert await c.recv(timeout=0.5) is None
    await srv.announce(version)
    woke = await c.recv(timeout=1.0)
    assert isinstance(woke, P.WorkAssignment) and not woke.assignments
    assert woke.min_version == version and woke.weights.version == version


async def _expect_work(c: Client, n: int, version: int) -> None:
    await c.ask(n, version=version)
    work = await c.recv(timeout=1.0)
    assert isinstance(work, P.WorkAssignment) and len(work.assignments) == n


def test_work_lag_zero_waits_for_the_newest_version(tmp_path, monkeypatch):
    """work_lag 0: once the learner has made a version, new work goes only to a node that has loaded it; a
    request that comes before it is out is held until the announcement, then told which version to load."""
    monkeypatch.setattr(server_mod, "PARK_S", 3.0)

    async def go():
        kp = KeyPair.generate()
        srv = await _serve(tmp_path, kp.public_hex, work_lag=0)
        c = await _registered(srv, kp)
        try:
            srv.end_step(1)  # the learner made version 1; it is still being published
            await _held_until_announced(c, srv, 1)  # there is room, but not the policy to use
            await c.ask(2, version=0)  # a node that asks without loading it gets no work either
            stale = await c.recv(timeout=1.0)
            assert isinstance(stale, P.WorkAssignment) and not stale.assignments and stale.min_version == 1
            await _expect_work(c, 2, version=1)
        finally:
            c.close()
            await srv.stop()

    asyncio.run(go())


def test_on_policy_hands_out_no_work_during_a_step(tmp_path, monkeypatch):
    """max_lag 0: work given out while the learner is making the next version would be stale before it
    could be trained on, so none is; with max_lag 1 the same request gets work at once (the pipeline)."""
    monkeypatch.setattr(server_mod, "PARK_S", 3.0)

    async def go(max_lag: int) -> None:
        kp = KeyPair.generate()
        srv = await _serve(tmp_path, kp.public_hex, max_lag=max_lag, work_lag=max_lag)
        c = await _registered(srv, kp)
        try:
            srv.begin_step()  # the learner took a batch and is making version 1
            if max_lag > 0:
                await _expect_work(c, 2, version=0)
                return
            # Held: there is room, but any sample made now would come too early. The step ends (version 1
            # made) while the request waits; the announcement answers it.
            asked = asyncio.create_task(_held_until_announced(c, srv, 1))
            await asyncio.sleep(0.2)
            srv.end_step(1)
            await asked
            await _expect_work(c, 2, version=1)
        finally:
            c.close()
            await srv.stop()

    asyncio.run(go(0))
    asyncio.run(go(1))


def test_dynamic_sampling_keeps_flat_groups_out_of_the_batch(tmp_path):
    """A group whose samples all score the same is accepted (the node hears so, the ledger has it) but
    dropped as zero_advantage instead of entering the buffer, and its room goes back to the node at once;
    a group with a right and a wrong answer is what the learner gets."""

    async def go():
        kp = KeyPair.generate()
        srv = await _serve(tmp_path, kp.public_hex, dynamic_sampling=True)
        c = Client(srv.cfg.server.port, kp)
        tok, eos = TOK, TOK.eos_token_id

        def sample(text: str) -> P.Sample:
            ids = tok.encode(text, add_special_tokens=False) + [eos]
            return P.Sample(ids, [-1.0] * len(ids), "stop")

        try:
            await c.send(P.Register(node_id=c.kp.public_hex, name="n", time_ms=int(time.time() * 1000)))
            assert isinstance(await c.recv(), P.Registered)
            await c.ask(2)
            work = await c.recv()
            assert isinstance(work, P.WorkAssignment) and len(work.assignments) == 2
            flat_id, mixed_id = (a.assignment_id for a in work.assignments)
            right = srv.work.held[mixed_id].item.answer
            wrong = str((int(right) + 1) % 10) if right.lstrip("-").isdigit() else right + "1"
            rollouts = [P.Rollout(flat_id, [sample("x"), sample("y")]),  # both wrong: all advantages zero
                        P.Rollout(mixed_id, [sample(right), sample(wrong)])]
            await c.send(P.RolloutSubmission(node_id=c.kp.public_hex, version=0, rollouts=rollouts,
                                             gen_seconds=0.1))
            result = await c.recv()
            assert isinstance(result, P.SubmissionResult) and sorted(result.accepted) == sorted([flat_id, mixed_id])
            assert srv.ledger.drops == [(flat_id, "zero_advantage")] and srv.stats.dropped["zero_advantage"] == 1
            assert [g.assignment_id for g in srv.buffer.groups] == [mixed_id]
            await c.ask(2)  # the flat group's slot is free again: one more prompt to generate
            more = await c.recv()
            assert isinstance(more, P.WorkAssignment) and len(more.assignments) == 1
            batch = await srv.take_batch(1)
            assert batch[0].assignment_id == mixed_id and batch[0].correct == [1.0, 0.0]
        finally:
            c.close()
            await srv.stop()

    asyncio.run(go())


def test_a_closed_server_takes_no_groups_and_hands_out_no_work(tmp_path):
    """Once the run is over (close), a group that arrives is refused as run_ended, not accepted into a
    buffer nobody trains from (that was accepted data lost), and a work request gets nothing. close()
    returns what was accepted and not trained on, for the ledger."""

    async def go():
        kp = KeyPair.generate()
        srv = await _serve(tmp_path, kp.public_hex, dynamic_sampling=False, inflight_groups=4)
        c = await _registered(srv, kp)
        eos = TOK.eos_token_id
        try:
            await c.ask(4)
            work = await c.recv()
            assert isinstance(work, P.WorkAssignment) and len(work.assignments) == 4
            rollouts = [P.Rollout(a.assignment_id, [P.Sample([5, eos], [-1.0, -0.5], "stop")] * 2)
                        for a in work.assignments]
            await c.send(P.RolloutSubmission(node_id=kp.public_hex, version=0, rollouts=rollouts[:2],
                                             gen_seconds=0.1))
            first = await c.recv()
            assert isinstance(first, P.SubmissionResult) and len(first.accepted) == 2

            leftover = srv.close()
            assert sorted(g.assignment_id for g in leftover) == sorted(first.accepted) and not srv.buffer

            await c.send(P.RolloutSubmission(node_id=kp.public_hex, version=0, rollouts=rollouts[2:],
                                             gen_seconds=0.1))
            late = await c.recv()
            assert isinstance(late, P.SubmissionResult) and not late.accepted
            assert late.refused == {r.assignment_id: "run_ended" for r in rollouts[2:]}
            assert sorted(srv.ledger.accepted_ids) == sorted(first.accepted) and not srv.buffer
            assert len(srv.work.retry) == 2  # the prompts are not lost either: a resumed run hands them out
            await c.ask(4)
            idle = await c.recv(timeout=3.0)
            assert isinstance(idle, P.WorkAssignment) and not idle.assignments
        finally:
            c.close()
            await srv.stop()

    asyncio.run(go())
