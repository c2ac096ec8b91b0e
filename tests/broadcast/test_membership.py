"""Keyed membership over real HTTP on 127.0.0.1: signed joins, the observed address, the connect-back,
bad addresses, one key per URL, rate limits, bans shared with the trainer, the doctor's connect-back test."""

from __future__ import annotations

import asyncio
import logging
import time

import aiohttp
import msgspec
import pytest
from aiohttp import web
from bc_helpers import make_version

from broadcast import verdicts
from broadcast.buckets import KeyedBuckets
from broadcast.config import OriginConfig
from broadcast.identity import reach_answer, sign_join
from broadcast.messages import Join, Joined, PeerHeartbeat, ReachTest, TreeSources, TreeView
from broadcast.origin import Origin
from broadcast.peer import Peer, PeerConfig
from swarm_common.http import start_site
from swarm_common.keys import KeyPair
from tests.conftest import free_port

pytestmark = pytest.mark.timeout(60)


def run(coro):
    return asyncio.run(coro)


async def post_join(origin: Origin, msg: Join) -> tuple[int, bytes]:
    async with aiohttp.ClientSession() as s, s.post(origin.url + "/join", data=msgspec.json.encode(msg)) as r:
        return r.status, await r.read()


async def tree(origin: Origin) -> TreeView:
    async with aiohttp.ClientSession() as s, s.get(origin.url + "/tree") as r:
        return msgspec.json.decode(await r.read(), type=TreeView)


async def reach_server(key: KeyPair, answer=None) -> tuple[web.AppRunner, int]:
    """A relay's /reach as the protocol says (answer: a fixed reply instead, for a liar)."""
    async def reach(request: web.Request) -> web.Response:
        ans = answer or reach_answer(request.query["nonce"], key)
        return web.Response(body=msgspec.json.encode(ans), content_type="application/json")

    app = web.Application()
    app.router.add_get("/reach", reach)
    return await start_site(app, "127.0.0.1", 0)


class Lab:
    def __init__(self, tmp, **kw):
        self.tmp, self.kw = tmp, kw
        self.key = KeyPair.generate()
        self.cleanup: list = []

    async def __aenter__(self) -> Lab:
        self.origin = Origin(self.tmp / "origin", self.key,
                             OriginConfig(heartbeat_s=0.3, piece_bytes=64 << 10, fanout=2, **self.kw))
        await self.origin.start()
        return self

    async def __aexit__(self, *exc) -> None:
        for c in reversed(self.cleanup):
            await c()
        await self.origin.stop()

    async def peer(self, name: str, **kw) -> Peer:
        cfg = PeerConfig(relay_host="127.0.0.1", name=name, stall_timeout=4, advertise=kw.pop("advertise", None))
        p = Peer(self.origin.url, self.tmp / name, self.key.public_bytes, cfg, **kw)
        await p.start()
        self.cleanup.append(p.stop)
        return p

    async def server(self, key: KeyPair, answer=None) -> int:
        runner, port = await reach_server(key, answer)
        self.cleanup.append(runner.cleanup)
        return port


def test_signed_join_observed_address_and_connect_back(tmp_path):
    async def scenario():
        async with Lab(tmp_path) as lab:
            k = KeyPair.generate()
            port = await lab.server(k)
            status, body = await post_join(lab.origin, sign_join(Join(None, True, "stun", port=port), k))
            assert status == 200, body
            j = msgspec.json.decode(body, type=Joined)
            # No address given: the tracker pairs the port with the source address it saw, and checks it.
            assert (j.observed_host, j.url, j.reachable) == ("127.0.0.1", f"http://127.0.0.1:{port}", True)
            rec = lab.origin.tracker.peers[j.peer_id]
            assert rec.key == k.public_hex and rec.group is not None
            # Unsigned (the old format), a bad signature, a replay: refused with a clear error, counted.
            assert (await post_join(lab.origin, Join(None, False, "old")))[0] == 400
            forged = msgspec.structs.replace(sign_join(Join(None, False, "x"), k), name="y")
            status, body = await post_join(lab.origin, forged)
            assert status == 403 and b"bad signature" in body
            signed = sign_join(Join(None, False, "once"), KeyPair.generate())
            assert (await post_join(lab.origin, signed))[0] == 200
            status, body = await post_join(lab.origin, signed)
            assert status == 400 and b"replay" in body
            refused = (await tree(lab.origin)).refused
            assert refused["bad_join"] == 1 and refused["bad_signature"] == 1 and refused["replayed_join"] == 1

    run(scenario())


@pytest.mark.parametrize("url, why", [
    ("ftp://127.0.0.1:9", "scheme"), ("http://127.0.0.1:9/x", "path"), ("http://u@127.0.0.1:9", "user"),
    ("http://127.0.0.1", "port"), ("http://0.0.0.0:9", "connect"), ("http://127.0.0.1:9?a=1", "query"),
    ("http://" + "a" * 300 + ":9", "characters"),
])
def test_bad_advertised_addresses_are_refused(tmp_path, url, why):
    async def scenario():
        async with Lab(tmp_path) as lab:
            status, body = await post_join(lab.origin, sign_join(Join(url, True, "bad"), KeyPair.generate()))
            assert status == 400 and why.encode() in body, body
            assert (await tree(lab.origin)).refused["bad_url"] == 1
            assert not lab.origin.tracker.peers

    run(scenario())


def test_private_address_refused_by_a_public_tracker_and_the_peer_downloads_anyway(tmp_path, caplog):
    caplog.set_level(logging.INFO)

    async def scenario():
        async with Lab(tmp_path, allow_private="never") as lab:  # as if the tracker were on a public address
            p = await lab.peer("p")
            assert p.url is None and p.peer_id in lab.origin.tracker.peers  # joined again as a leaf
            assert lab.origin.tracker.refused["private_url"] == 1
            src = make_version(tmp_path / "origin" / "v1", 1, 100_000)
            await lab.origin.publish(src, 1, None)
            assert (await p.fetch(1, timeout=20)).exists()
        assert "private or loopback address" in caplog.text and "downloading only" in caplog.text

    run(scenario())


def test_unreachable_relay_is_a_leaf_and_keeps_working(tmp_path, caplog):
    caplog.set_level(logging.INFO)

    async def scenario():
        async with Lab(tmp_path) as lab:
            closed = free_port()  # nothing listens there: the connect-back fails
            p = await lab.peer("nat", advertise=f"http://127.0.0.1:{closed}")
            r = await lab.peer("open")
            view = {v.name: v for v in (await tree(lab.origin)).peers}
            assert view["nat"].reachable is False and view["nat"].group is None and "connect-back" in view["nat"].reach_error
            assert view["open"].reachable is True and view["open"].group is not None
            assert not any(view["nat"].children)
            await lab.origin.publish(make_version(tmp_path / "origin" / "v1", 1, 200_000), 1, None)
            await asyncio.wait_for(p.wait_version(1), 20)
            await asyncio.wait_for(r.wait_version(1), 20)
            assert lab.origin.tracker.refused["unreachable"] == 1
        assert "relay not reachable from the tracker: downloading only; open port" in caplog.text
        assert f"relay reachable at {r.url}" in caplog.text

    run(scenario())


def test_a_url_is_held_by_one_key(tmp_path):
    async def scenario():
        async with Lab(tmp_path) as lab:
            honest = await lab.peer("honest")
            before = lab.origin.tracker.by_url(honest.url).peer_id
            # Another key claims the honest relay's address: the connect-back reaches the honest relay.
            status, body = await post_join(lab.origin, sign_join(Join(honest.url, True, "thief"), KeyPair.generate()))
            assert status == 403 and b"another key" in body, body
            # A liar's server answering with a signature it replayed (the wrong nonce): refused too.
            k = KeyPair.generate()
            port = await lab.server(k, answer=reach_answer("00" * 16, k))
            status, body = await post_join(lab.origin, sign_join(Join(None, True, "liar", port=port), k))
            assert status == 403 and b"nonce" in body, body
            # An unreachable address held by a live member: a second key can't prove it, so it is refused.
            closed = f"http://127.0.0.1:{free_port()}"
            assert (await post_join(lab.origin, sign_join(Join(closed, True, "a"), KeyPair.generate())))[0] == 200
            status, body = await post_join(lab.origin, sign_join(Join(closed, True, "b"), KeyPair.generate()))
            assert status == 409 and b"held by another live peer" in body
            assert lab.origin.tracker.by_url(honest.url).peer_id == before
            refused = (await tree(lab.origin)).refused
            assert refused["connect_back_mismatch"] == 2 and refused["url_taken"] == 1

    run(scenario())


def test_join_rate_limits_and_capacity(tmp_path):
    async def scenario():
        async with Lab(tmp_path, max_peers=8, joins_per_address=(1.0, 20.0), reserved_share=0.0) as lab:
            codes = []
            for i in range(40):
                codes.append((await post_join(lab.origin, sign_join(Join(None, False, f"f{i}"), KeyPair.generate())))[0])
            assert codes.count(200) == 8 and codes.count(503) >= 10 and codes.count(429) >= 15
            assert len(lab.origin.tracker.peers) == 8
            k = KeyPair.generate()  # one key joining again and again: at most its burst
            lab.origin.tracker.max_peers = lab.origin.tracker.fresh_room = 100
            lab.origin.routes.joins.per_address = KeyedBuckets(1000.0, 1000.0)  # only the per-key limit now
            per_key = [(await post_join(lab.origin, sign_join(Join(None, False, "k"), k)))[0] for _ in range(6)]
            assert per_key.count(200) == 3 and per_key.count(429) == 3
            assert sum(p.key == k.public_hex for p in lab.origin.tracker.peers.values()) == 1

    run(scenario())


def test_a_member_heartbeating_too_often_is_refused_cheaply(tmp_path):
    """Memberships are bounded, but each could heartbeat as fast as it likes: the origin (in the trainer's
    process) answers at most a burst, then about four an interval, with 429; other members are not slowed."""
    async def scenario():
        async with Lab(tmp_path) as lab:
            members = []
            for name in ("loud", "quiet"):
                code, body = await post_join(lab.origin, sign_join(Join(None, False, name), KeyPair.generate()))
                assert code == 200
                members.append(msgspec.json.decode(body, type=Joined))
            loud, quiet = members
            async with aiohttp.ClientSession() as s:
                async def beat(j: Joined) -> int:
                    async with s.post(lab.origin.url + "/heartbeat",
                                      data=msgspec.json.encode(PeerHeartbeat(j.peer_id, j.token))) as r:
                        return r.status

                t0 = time.monotonic()
                codes = list(await asyncio.gather(*(beat(loud) for _ in range(60))))  # at once
                allowed = 12 + 4 / 0.3 * (time.monotonic() - t0) + 1  # the burst, then 4 an interval
                assert 12 <= codes.count(200) <= allowed < 50, (codes, allowed)
                assert await beat(quiet) == 200
            assert loud.peer_id in lab.origin.tracker.peers  # refused, not removed

    run(scenario())


def test_a_member_is_sent_its_sources_only_when_they_change(tmp_path):
    """Every answer on the origin's uplink costs it: unchanged sources go as their tag alone, and a peer
    that holds them keeps them."""
    async def scenario():
        async with Lab(tmp_path) as lab:
            code, body = await post_join(lab.origin, sign_join(Join(None, False, "m"), KeyPair.generate()))
            j = msgspec.json.decode(body, type=Joined)
            async with aiohttp.ClientSession() as s:
                async def beat(tag: str) -> TreeSources:
                    msg = PeerHeartbeat(j.peer_id, j.token, sources_tag=tag)
                    async with s.post(lab.origin.url + "/heartbeat", data=msgspec.json.encode(msg)) as r:
                        assert r.status == 200
                        return msgspec.json.decode(await r.read(), type=TreeSources)

                first = await beat("")
                assert len(first.sources) == j.trees and first.tag
                again = await beat(first.tag)
                assert again.sources == [] and again.tag == first.tag
                assert (await beat("0" * 16)).sources == first.sources  # another tag: the sources in full
            p = await lab.peer("p")  # a real peer keeps its sources across answers that leave them out
            held = p.tracker.sources
            await p.tracker.heartbeat_once()
            await p.tracker.heartbeat_once()
            assert p.tracker.sources is held and len(held) == p.tracker.trees and p.tracker.sources_tag  # kept

    run(scenario())


def test_bans_are_shared_with_the_trainer_both_ways(tmp_path):
    async def scenario():
        async with Lab(tmp_path) as lab:
            node_key = KeyPair.generate()
            p = await lab.peer("node", keypair=node_key)
            lab.origin.set_standing(node_key.public_hex)
            rec = lab.origin.tracker.by_url(p.url)
            assert lab.origin.tracker.has_standing(rec)
            lab.origin.ban_key(node_key.public_hex, "fraud (trainer)")
            assert not lab.origin.tracker.peers
            await asyncio.wait_for(_until(lambda: p.evicted is not None), 10)
            status, body = await post_join(lab.origin, sign_join(Join(None, False, "again"), node_key))
            assert status == 403 and b"banned" in body
            seen = []
            lab.origin.on_ban = lambda key, reason: seen.append((key, reason))
            await lab.origin.judge.run(verdicts.ban(lab.origin.tracker, _Rec(), "test", "t"))  # confirmed corruption
            assert seen == [("cd" * 32, "test")]

    run(scenario())


class _Rec:
    peer_id, key, url = "x", "cd" * 32, None


async def _until(cond, every: float = 0.05) -> None:
    while not cond():
        await asyncio.sleep(every)


def test_doctor_connect_back_test(tmp_path):
    async def scenario():
        async with Lab(tmp_path) as lab:
            p = await lab.peer("relay")
            closed = free_port()
            async with aiohttp.ClientSession() as s:
                async def ask(port: int) -> tuple[int, ReachTest | bytes]:
                    async with s.get(f"{lab.origin.url}/reach-test", params={"port": str(port)}) as r:
                        body = await r.read()
                        return r.status, msgspec.json.decode(body, type=ReachTest) if r.status == 200 else body

                st, ok = await ask(p.port)
                assert st == 200 and ok.reachable and ok.answered_key == p.keypair.public_hex
                assert ok.observed_host == "127.0.0.1"
                st, no = await ask(closed)
                assert st == 200 and not no.reachable and "failed" in no.detail
                st, _ = await ask(p.port)
                st2, body = await ask(p.port)
                assert st2 == 429
                async with s.get(f"{lab.origin.url}/reach-test", params={"port": "x"}) as r:
                    assert r.status == 400

    run(scenario())


def test_the_tree_view_is_rate_limited_per_address(tmp_path):
    """/tree leaves on the origin's uplink, the one that feeds every tree: polled without bound from a few
    addresses it took most of a shaped origin's uplink (bench/tree_attacks_netns.py). A burst of 10, then 2 a
    second per address; the refusal says when to come back."""
    async def main():
        async with Lab(tmp_path) as lab:
            async with aiohttp.ClientSession() as s:
                codes = []
                for _ in range(14):
                    async with s.get(lab.origin.url + "/tree") as r:
                        codes.append(r.status)
                        retry = r.headers.get("Retry-After")
                assert codes[:10] == [200] * 10 and 429 in codes[10:], codes
                assert retry is not None and int(retry) >= 1
                await asyncio.sleep(0.6)
                async with s.get(lab.origin.url + "/tree") as r:
                    assert r.status == 200  # refilled
            assert lab.origin.tracker.refused["rate_limited"] >= 1

    run(main())
