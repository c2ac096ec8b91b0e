"""Leeching and telling the origin's checks apart (issue 29), over real HTTP against the real origin and a
real peer: fetching pieces from the origin without joining made delivery 2.72x, and keys served the
origin's one-piece check correctly (its requests carried no X-Peer) while lying to everyone else. Both
tests fail on the code before broadcast/piece_pass.py."""

from __future__ import annotations

import asyncio
import random
from pathlib import Path

import aiohttp
import pytest
from aiohttp import web

from broadcast.config import OriginConfig
from broadcast.messages import ORIGIN, Join
from broadcast.origin import Origin
from broadcast.peer import Peer, PeerConfig
from broadcast.piece_pass import PASS_HEADER, PEER_HEADER, TRIAL, file_name, headers, pass_for, piece_name
from broadcast.verdicts import prove
from swarm_common.keys import KeyPair
from tests.loopback_http import serve_loopback

pytestmark = pytest.mark.timeout(60)
PIECE = 64 << 10


def version_dir(d: Path) -> Path:
    d.mkdir(parents=True)
    (d / "model.safetensors").write_bytes(random.Random(1).randbytes(8 * PIECE))
    return d


async def origin(tmp_path: Path) -> Origin:
    o = Origin(tmp_path / "origin", KeyPair.generate(), OriginConfig(heartbeat_s=0.3, piece_bytes=PIECE))
    await o.start()
    await o.publish(version_dir(tmp_path / "origin" / "v1"), 1, None)
    return o


def test_the_origin_serves_pieces_to_members_and_a_stranger_only_a_trial(tmp_path):
    """A stranger gets the trial's few pieces (the doctor's download check) and then 403, however it names
    itself, and no whole file; a member, with its pass, gets every piece and file."""

    async def main() -> tuple[list[int], list[int], list[int], list[tuple[int, int]]]:
        o = await origin(tmp_path)
        try:
            assert o.tracker
            j = o.tracker.join(Join(None, False, "member"), key="m" * 64)
            n = len(o.versions[1].pieces)
            async with aiohttp.ClientSession() as s:
                async def get(i: int, hdrs: dict[str, str]) -> int:
                    async with s.get(f"{o.url}/v/1/piece/{i}", headers=hdrs) as r:
                        await r.read()
                        return r.status
                stranger = [await get(i, {}) for i in range(n)]
                posing = [await get(i, {PEER_HEADER: j.peer_id, PASS_HEADER: "0" * 32}) for i in range(n)]
                member = [await get(i, headers(j.peer_id, j.token, piece_name(1, i))) for i in range(n)]
                files = []  # a version's files whole: members only, no trial
                for hdrs in ({}, headers(j.peer_id, j.token, file_name(1, "model.safetensors"))):
                    async with s.get(f"{o.url}/v/1/file/model.safetensors", headers=hdrs) as r:
                        files.append((r.status, len(await r.read())))
            return stranger, posing, member, files
        finally:
            await o.stop()

    stranger, posing, member, files = asyncio.run(main())
    assert files[0][0] == 403 and files[1] == (200, 8 * PIECE), files
    trial = int(TRIAL[1])
    assert stranger == [200] * trial + [403] * (len(stranger) - trial), stranger
    assert set(posing) == {403}, posing  # a member's id without its pass is a stranger (its trial is spent)
    assert set(member) == {200}, member


class Recorder:
    """A relay that serves the origin's real pieces and writes down every request's headers."""

    def __init__(self, o: Origin):
        self.o, self.seen = o, []
        self.runner: web.AppRunner | None = None
        self.url = ""

    async def piece(self, request: web.Request) -> web.Response:
        v, i = int(request.match_info["v"]), int(request.match_info["i"])
        self.seen.append(dict(request.headers))
        return web.Response(body=b"".join(self.o.versions[v].read_chunks(i)))

    async def start(self) -> None:
        app = web.Application()
        app.add_routes([web.get("/v/{v}/piece/{i}", self.piece)])
        self.runner, port = await serve_loopback(app)
        self.url = f"http://127.0.0.1:{port}"


def test_the_origins_check_of_a_relay_looks_like_its_childs_request(tmp_path):
    """A real peer fetches a piece from a relay, then the origin checks that relay (verdicts.prove, the
    judge's probe): the relay sees the same headers, the check naming the child with the child's valid
    pass for that piece. Nothing in the request says 'origin'."""

    async def main() -> tuple[list[dict], str, str]:
        o = await origin(tmp_path)
        rec = Recorder(o)
        await rec.start()
        peer = Peer(o.url, tmp_path / "p", o.keypair.public_bytes,
                    PeerConfig(relay=False, first_byte_timeout=2.0), follow=False)
        try:
            assert o.tracker and o.judge
            relay = o.tracker.peers[o.tracker.join(Join(rec.url, True, "relay"), key="r" * 64).peer_id]
            await peer.start()
            st = await asyncio.to_thread(peer.store.open_partial, await peer.downloads.manifest(1))
            assert await peer.fetcher.race(st, 3, [rec.url, ORIGIN]) == "ok"
            assert await o.judge.run(prove(o.tracker, relay, 1, 3)) == "ok"
            return rec.seen, peer.tracker.peer_id or "", peer.tracker.token
        finally:
            await peer.stop()
            await rec.runner.cleanup()  # type: ignore[union-attr]
            await o.stop()

    (child, check), peer_id, token = asyncio.run(main())
    assert child[PEER_HEADER] == check[PEER_HEADER] == peer_id
    assert child[PASS_HEADER] == check[PASS_HEADER] == pass_for(token, piece_name(1, 3))
    assert {k.lower(): v for k, v in child.items() if k != "Host"} == \
        {k.lower(): v for k, v in check.items() if k != "Host"}


def test_the_origin_sends_to_members_with_standing_first(tmp_path):
    """Two members the trainer trusts and six fresh keys fetch a whole version from the origin at once: the
    fresh keys together get what one trusted member gets (a third here) until those are done
    (broadcast/uplink_share.py), then the rest. Fails before: each of the eight got an eighth, the fresh keys
    three quarters together (ten fresh keys hung from the origin made the first version 3.5x slower for
    everyone else, bench/tree_attacks_sim.py)."""
    n_pieces, rate, n_fresh = 16, 2e6, 6
    size = n_pieces * PIECE

    async def main() -> tuple[int, int, float]:
        d = tmp_path / "origin"
        o = Origin(d, KeyPair.generate(), OriginConfig(heartbeat_s=10.0, piece_bytes=PIECE, upload_rate=rate))
        await o.start()
        d.joinpath("v1").mkdir(parents=True)
        (d / "v1" / "model.safetensors").write_bytes(random.Random(1).randbytes(size))
        await o.publish(d / "v1", 1, None)
        try:
            assert o.tracker
            first = []
            for i in range(2):
                first.append(o.tracker.join(Join(None, False, f"trusted{i}"), key=f"{i}" * 64))
                o.tracker.set_trusted(f"{i}" * 64)
            fresh = [o.tracker.join(Join(None, False, f"fresh{i}"), key=f"f{i}" * 32) for i in range(n_fresh)]
            got = {j.peer_id: 0 for j in first + fresh}
            async with aiohttp.ClientSession() as s:
                async def fetch_all(j) -> None:
                    for i in range(n_pieces):
                        hdrs = headers(j.peer_id, j.token, piece_name(1, i))
                        async with s.get(f"{o.url}/v/1/piece/{i}", headers=hdrs) as r:
                            assert r.status == 200
                            got[j.peer_id] += len(await r.read())

                t0 = asyncio.get_running_loop().time()
                rest = [asyncio.create_task(fetch_all(j)) for j in fresh]
                await asyncio.gather(*(fetch_all(j) for j in first))
                first_took = asyncio.get_running_loop().time() - t0
                fresh_then = sum(got[j.peer_id] for j in fresh)
                await asyncio.gather(*rest)
            return fresh_then, sum(got[j.peer_id] for j in fresh), first_took
        finally:
            await o.stop()

    fresh_then, fresh_all, first_took = asyncio.run(main())
    assert fresh_all == n_fresh * size  # never starved: the whole version once the others were done
    # A third of the uplink while the trusted two fetched their 2 MiB (~1.6 s): ~1 MiB of the fresh keys' 6.
    assert fresh_then < 0.4 * n_fresh * size, (fresh_then, first_took)  # equal shares: ~all of it
    assert first_took < 0.6 * (2 + n_fresh) * size / rate, first_took  # equal shares: ~4.2 s
