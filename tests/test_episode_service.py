"""Multi-turn work through the trainer's real node service (zmq), with clients that build episodes by the
node's rules: the hand-out names the environment and the item (never its answer); honest episodes are
accepted with their masks and counted; a forged observation is fraud; a replay bomb of the python tool
costs the trainer no more than its budget (tests/adversarial/test_replay_bomb.py); a run closed to strangers registers only trusted keys."""

from __future__ import annotations

import asyncio
import time

import msgspec
import pytest

from rewards.registry import make_task
from rewards.token_episode import TokenEpisode
from swarm_common import protocol as P
from swarm_common.keys import KeyPair
from tests.conftest import free_port
from tests.test_server_work import TOK, Client, Ledger
from trainer.config import RunConfig
from trainer.guard import Guard
from trainer.node_registry import NodeRegistry
from trainer.node_service import NodeService
from trainer.stats import RunStats

pytestmark = pytest.mark.timeout(120)


async def serve(tmp_path, task: str, trusted: list[str], **task_cfg) -> NodeService:
    cfg = msgspec.convert({"run_dir": str(tmp_path), "server": {"port": free_port()},
                           "task": {"name": task, **task_cfg},
                           "train": {"inflight_groups": 4, "group_size": 2, "max_tokens": 160, "max_lag": 1},
                           "guard": {"trusted": trusted}}, RunConfig)
    env = make_task(task)
    registry = NodeRegistry(cfg.server.heartbeat_s)
    srv = NodeService(cfg, env, TOK, len(TOK), RunStats(str(tmp_path), 10, registry), registry,
                      lambda v: f"http://x/v/{v}", env.train_items(seed=0), tracker_url="http://x",
                      trainer_key="00" * 32, guard=Guard(tmp_path, cfg.guard), auditor=None, ledger=Ledger())
    await srv.start()
    return srv


def episodes(work: P.WorkAssignment, a: P.Assignment, turns: list[str]) -> list[P.Episode]:
    """G episodes of an assignment whose turns are these texts, built from what the hand-out gave."""
    env = make_task(work.env.name, **work.env.params)
    item = msgspec.convert({"id": a.item.id, "prompt": a.item.prompt, "answer": "", "meta": a.item.meta},
                           type=type(env.eval_items(1)[0]))
    return [TokenEpisode(env, item, TOK, work.sampling.max_tokens, work.env.max_episode_tokens).play(turns, -0.7)
            for _ in range(work.sampling.n)]


async def _register(c: Client) -> P.Message:
    await c.send(P.Register(node_id=c.kp.public_hex, name="n", time_ms=int(time.time() * 1000)))
    return await c.recv()


def test_honest_episodes_are_accepted_and_a_forged_observation_is_fraud(tmp_path):
    async def go():
        kp = KeyPair.generate()
        srv = await serve(tmp_path, "calculator", [kp.public_hex])
        c = Client(srv.cfg.server.port, kp)
        try:
            assert isinstance(await _register(c), P.Registered)
            await c.ask(2)
            work = await c.recv()
            assert isinstance(work, P.WorkAssignment) and work.env.name == "calculator"
            a, b = work.assignments
            held = srv.work.held[a.assignment_id].item
            assert a.item.prompt == held.prompt and held.answer not in a.item.meta.values()
            assert TOK.decode(a.prompt_token_ids) == held.prompt + "="
            right, wrong = [f"[calc('{held.prompt}')]", held.answer], [f"[calc('{held.prompt}')]", "1"]
            honest = episodes(work, a, right)[:1] + episodes(work, a, wrong)[:1]
            # b's call, answered with a's result (the node's environment token edited), and that answer.
            forged = []
            for e in episodes(work, b, [f"[calc('{b.item.prompt}')]", held.answer]):
                start = e.mask.index(False)
                end = e.mask.index(True, start)
                obs = TOK(f"<|im_start|>{held.answer}<|im_end|>", add_special_tokens=False)["input_ids"]
                forged.append(P.Episode(e.token_ids[:start] + obs + e.token_ids[end:],
                                        e.mask[:start] + [False] * len(obs) + e.mask[end:], e.logprobs, "stop"))
            await c.send(P.RolloutSubmission(node_id=kp.public_hex, version=0, gen_seconds=0.1,
                                             rollouts=[P.Rollout(a.assignment_id, [], honest)]))
            res = await c.recv()
            assert res.accepted == [a.assignment_id], res
            g = srv.buffer.groups[0]
            assert g.masks == [e.mask for e in honest] and g.correct == [1.0, 0.0] and g.rewards[0] == 1.0
            assert srv.stats.episodes == 2 and srv.registry.get(kp.public_hex).tool_calls == 2
            await c.send(P.RolloutSubmission(node_id=kp.public_hex, version=0, gen_seconds=0.1,
                                             rollouts=[P.Rollout(b.assignment_id, [], forged)]))
            res = await c.recv()
            assert res.refused == {b.assignment_id: "observation_mismatch"}
            assert srv.guard.strikes[kp.public_hex] == 1
            # Samples where episodes are due (and the reverse) answer the wrong kind of work.
            await c.ask(1)
            w2 = await c.recv()
            s = P.Sample([5, TOK.eos_token_id], [-1.0, -1.0], "stop")
            await c.send(P.RolloutSubmission(node_id=kp.public_hex, version=0, gen_seconds=0.1,
                                             rollouts=[P.Rollout(w2.assignments[0].assignment_id, [s, s])]))
            assert (await c.recv()).refused == {w2.assignments[0].assignment_id: "wrong_group_size"}
        finally:
            c.close()
            await srv.stop()

    asyncio.run(go())


def test_a_run_closed_to_strangers_registers_only_trusted_keys(tmp_path):
    async def go():
        mine, stranger = KeyPair.generate(), KeyPair.generate()
        srv = await serve(tmp_path, "guess", [mine.public_hex], open_to_strangers=False)
        a, b = Client(srv.cfg.server.port, mine), Client(srv.cfg.server.port, stranger)
        try:
            assert isinstance(await _register(a), P.Registered)
            reply = await _register(b)
            assert isinstance(reply, P.Error) and reply.code == "not_allowed"
        finally:
            a.close()
            b.close()
            await srv.stop()

    asyncio.run(go())
