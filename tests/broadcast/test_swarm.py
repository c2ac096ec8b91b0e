"""End to end with real processes on 127.0.0.1: an origin in this process, peers as subprocesses."""

from __future__ import annotations

import asyncio
import json
import os
import signal

import aiohttp
import pytest
from bc_helpers import Cluster, make_version, same_files, write_pieces

from broadcast.config import OriginConfig
from broadcast.origin import Origin
from broadcast.peer import FetchError, Peer, PeerConfig
from broadcast.store import Store
from swarm_common.keys import KeyPair

pytestmark = pytest.mark.timeout(90)


def run(coro):
    return asyncio.run(coro)


def test_origin_and_ten_peers_end_identical(tmp_path):
    async def scenario():
        async with Cluster(tmp_path, fanout=3, upload_rate=4 << 20) as c:
            for i in range(10):
                await c.spawn(f"p{i}", rate=4 << 20, wait_join=False)
            await c.wait(lambda: len(c.names()) == 10, 30, "10 peers to join")
            src = await c.publish(1, size=1 << 20)
            await c.wait(lambda: len(c.holders(1)) == 10, 40, "all 10 peers to hold v1")
            for i in range(10):
                assert same_files(c.data_dir(f"p{i}") / "versions" / "v1", src)
                assert not any((c.data_dir(f"p{i}") / "partial").iterdir())
            # The tracker's JSON view, as the web view and `swarm tree` read it.
            async with aiohttp.ClientSession() as s, s.get(c.origin.url + "/tree") as r:
                tree = json.loads(await r.read())
            assert len(tree["peers"]) == 10 and tree["latest"] == 1
            assert all(p["complete"] == [1] for p in tree["peers"])
            relayed = [p for p in tree["peers"] if any(p["children"])]
            assert len(relayed) >= 3, "peers relay to each other, not only the origin"

    run(scenario())


def test_relay_killed_mid_transfer(tmp_path):
    async def scenario():
        async with Cluster(tmp_path, fanout=2, upload_rate=1 << 20) as c:
            for i in range(6):
                await c.spawn(f"p{i}", rate=1 << 20, wait_join=False)
            await c.wait(lambda: len(c.names()) == 6, 30, "6 peers to join")
            src = await c.publish(1, size=3 << 20)
            _, children = c.origin.tracker.topology()
            names = c.names()
            victim = next(n for n, p in names.items() if children[p.group].get(p.peer_id))
            # Kill once some pieces have flowed, well before the end.
            await c.wait(lambda: sum(p.progress.get(1, 0) for p in c.names().values()) > 20, 20, "progress")
            c.procs[victim].send_signal(signal.SIGKILL)
            survivors = {f"p{i}" for i in range(6)} - {victim}
            await c.wait(lambda: survivors <= c.holders(1), 60, "survivors to finish")
            assert victim not in c.names()
            assert not (c.data_dir(victim) / "versions" / "v1").exists()
            for n in survivors:
                assert same_files(c.data_dir(n) / "versions" / "v1", src)

    run(scenario())


def test_corrupting_relay_is_caught_bypassed_and_banned(tmp_path):
    async def scenario():
        async with Cluster(tmp_path, fanout=2, upload_rate=4 << 20) as c:
            # Joins first and the tracker lays out in join order (not its keyed shuffle), so it heads tree 0:
            # every peer's even pieces would come through it.
            c.origin.tracker.forest.order_key = b""
            await c.spawn("evil", script="tests/broadcast/evil_relay.py")
            for i in range(4):
                await c.spawn(f"p{i}", rate=4 << 20, wait_join=False)
            await c.wait(lambda: len(c.names()) == 5, 30, "peers to join")
            src = await c.publish(1, size=1 << 20)
            honest = {f"p{i}" for i in range(4)}
            await c.wait(lambda: honest <= c.holders(1), 40, "honest peers to finish")
            for n in honest:
                assert same_files(c.data_dir(n) / "versions" / "v1", src)
            tr = c.origin.tracker
            assert "evil" not in c.names()
            assert [b.reason for b in tr.banned.values() if "corrupt" in b.reason], tr.banned
            reports = sum(c.log(n).count("as corrupt") for n in honest)
            assert reports >= 1
            # A banned relay cannot rejoin under the same address.
            assert any("banned" in e for e in tr.events)

    run(scenario())


def test_forged_manifest_is_refused(tmp_path):
    async def scenario():
        trainer, impostor = KeyPair.generate(), KeyPair.generate()
        o = Origin(tmp_path / "origin", impostor, OriginConfig(heartbeat_s=0.3, piece_bytes=64 << 10))
        await o.start()
        peer = Peer(o.url, tmp_path / "p", trainer.public_bytes, PeerConfig(stall_timeout=4), follow=False)
        try:
            await peer.start()
            await o.publish(make_version(tmp_path / "origin" / "v1", 1, 100_000), 1, None)
            with pytest.raises(FetchError, match="refused the v1 manifest"):
                await peer.fetch(1, timeout=20)
            assert not (tmp_path / "p" / "versions" / "v1").exists()
            assert not (tmp_path / "p" / "partial" / "v1").exists()
        finally:
            await peer.stop()
            await o.stop()

    run(scenario())


def test_forged_manifest_refused_by_relay_process(tmp_path):
    async def scenario():
        async with Cluster(tmp_path) as c:
            await c.spawn("p0", key=KeyPair.generate().public_hex)
            await c.publish(1, size=100_000)
            await c.wait(lambda: "REFUSED manifest for v1" in c.log("p0"), 20, "refusal")
            assert not (c.data_dir("p0") / "versions" / "v1").exists()
            assert c.holders(1) == set()

    run(scenario())


def test_late_joiner_and_returning_peer_catch_up(tmp_path):
    async def scenario():
        async with Cluster(tmp_path, fanout=2) as c:
            for i in range(3):
                await c.spawn(f"p{i}")
            for v in (1, 2, 3):
                await c.publish(v, size=200_000)
                await c.wait(lambda v=v: len(c.holders(v)) == 3, 30, f"v{v}")
            # p2 goes away, v4 is published meanwhile, a new peer joins late.
            c.procs["p2"].send_signal(signal.SIGKILL)
            await c.procs["p2"].wait()
            c.origin.tracker.remove(c.names()["p2"].peer_id, "test: killed")
            v4 = await c.publish(4, size=200_000)
            await c.wait(lambda: len(c.holders(4)) == 2, 30, "v4 on p0, p1")
            await c.spawn("late")
            await c.spawn("p2")  # same data dir: comes back holding v1..v3
            await c.wait(lambda: {"late", "p2"} <= c.holders(4), 30, "catch-up")
            late = c.data_dir("late") / "versions"
            assert sorted(p.name for p in late.iterdir()) == ["v4"], "fetches the newest, not the history"
            assert same_files(late / "v4", v4)
            assert same_files(c.data_dir("p2") / "versions" / "v4", v4)

    run(scenario())


def test_retention_keeps_last_k_and_nothing_else_is_touched(tmp_path):
    async def scenario():
        async with Cluster(tmp_path, fanout=2, keep=2) as c:
            # The trainer's own files outside the origin's root are never deleted, only retired.
            outside = make_version(tmp_path / "trainer_out" / "v1", 1, 50_000)
            await c.origin.publish(outside, 1, None)
            dd = c.data_dir("p0")
            (dd / "versions").mkdir(parents=True)
            (dd / "notes.txt").write_text("mine")
            (dd / "versions" / "keepme").mkdir()
            (dd / "versions" / "v1.bak").write_text("not ours")
            await c.spawn("p0", "--keep", "2")
            await c.wait(lambda: "p0" in c.holders(1), 20, "v1")
            for v in (2, 3, 4):
                await c.publish(v, size=50_000)
                await c.wait(lambda v=v: c.holders(v) == {"p0"}, 20, f"v{v}")
            await c.wait(lambda: c.names()["p0"].complete == [3, 4], 10, "retention on p0")
            assert sorted(p.name for p in (dd / "versions").iterdir()) == ["keepme", "v1.bak", "v3", "v4"]
            assert (dd / "notes.txt").read_text() == "mine"
            assert sorted(c.origin.versions) == [3, 4]
            assert outside.exists(), "origin must not delete directories outside its root"
            assert not (tmp_path / "origin" / "v2").exists() and (tmp_path / "origin" / "v4").exists()

    run(scenario())


def test_resume_rechecks_logged_pieces(tmp_path):
    kp = KeyPair.generate()
    from broadcast.manifest import build_manifest

    m = build_manifest(make_version(tmp_path / "src", 1, 300_000), 1, None, kp, piece_size=64 << 10)
    store = Store(tmp_path / "peer")
    st = store.open_partial(m)
    write_pieces(st, tmp_path / "src", (0, 1, 2), mark=False)
    st.close_fds()
    # Piece 1 is damaged on disk after being logged: resume must re-hash and drop it.
    ref1 = st.pieces[1]
    with open(st.path_of(ref1), "r+b") as f:
        f.seek(ref1.offset + 5)
        f.write(b"\xff\xff")
    st2 = Store(tmp_path / "peer").open_partial(m)
    assert [i for i in range(len(st2.pieces)) if st2.have[i]] == [0, 2]
    assert os.path.exists(tmp_path / "peer" / "partial" / "v1")


def test_peer_without_relay_serves_no_one(tmp_path):
    async def scenario():
        async with Cluster(tmp_path, fanout=2) as c:
            await c.spawn("relay0")
            await c.spawn("quiet", "--no-relay")
            src = await c.publish(1, size=200_000)
            await c.wait(lambda: c.holders(1) == {"relay0", "quiet"}, 20, "both")
            quiet = c.names()["quiet"]
            assert quiet.url is None
            _, children = c.origin.tracker.topology()
            assert not any(children[t].get(quiet.peer_id) for t in range(2))
            assert same_files(c.data_dir("quiet") / "versions" / "v1", src)

    run(scenario())


def test_missing_version_is_a_clear_error(tmp_path):
    async def scenario():
        kp = KeyPair.generate()
        o = Origin(tmp_path / "o", kp, OriginConfig(heartbeat_s=0.3))
        await o.start()
        p = Peer(o.url, tmp_path / "p", kp.public_bytes, follow=False)
        try:
            await p.start()
            with pytest.raises(FetchError, match="nothing has been published"):
                await p.fetch()
            with pytest.raises(FetchError, match="not available"):
                await p.fetch(7, timeout=10)
        finally:
            await p.stop()
            await o.stop()

    run(scenario())


def test_relay_cli_parses(tmp_path):
    from swarm.cli import build_parser

    p = build_parser()
    a = p.parse_args(["relay", "--tracker", "http://127.0.0.1:1", "--trainer-key", "ab" * 32,
                      "--data-dir", str(tmp_path)])
    assert a.data_dir == str(tmp_path) and not a.no_relay and a.trainer_key == "ab" * 32
    assert a.relay_host == "127.0.0.1" and a.relay_port == 0
    # The old names are still read: --trusted-key, and the relay's own --host / --port.
    old = p.parse_args(["relay", "--tracker", "http://127.0.0.1:1", "--trusted-key", "cd" * 32,
                        "--data-dir", str(tmp_path), "--host", "127.0.0.2", "--port", "9"])
    assert (old.trainer_key, old.relay_host, old.relay_port) == ("cd" * 32, "127.0.0.2", 9)
    assert p.parse_args(["tree", "--tracker", "http://x:1"]).watch == 0


def test_relay_exits_once_it_holds_the_version_asked_for(tmp_path):
    """`--exit-after N`: the process leaves the tree and exits 0 once it holds vN. It used to hang in
    Peer.stop: asyncio.wait_for (Python 3.11) swallowed the heartbeat loop's cancellation when the loop's
    wake-up event was set in the same tick, so stop() waited for that task for ever."""

    async def scenario():
        async with Cluster(tmp_path, fanout=2) as c:
            proc = await c.spawn("once", "--exit-after", "2")
            for v in (1, 2):
                await c.publish(v, size=300_000)
            await asyncio.wait_for(proc.wait(), 20)
            assert proc.returncode == 0, c.log("once")[-2000:]
            assert "HAVE v2" in c.log("once")
            await c.wait(lambda: "once" not in c.names(), 10, "the relay to leave the tree")

    run(scenario())


def test_a_damaged_complete_version_is_dropped_on_restart(tmp_path):
    """Versions are renamed complete without an fsync; on restart every piece is re-hashed, so a version
    with a torn or altered page is deleted and fetched again, never served or loaded."""
    kp = KeyPair.generate()
    from broadcast.manifest import build_manifest

    src = make_version(tmp_path / "src", 1, 300_000)
    m = build_manifest(src, 1, None, kp, piece_size=64 << 10)
    for damage in (False, True):
        store = Store(tmp_path / f"peer{damage}")
        st = store.open_partial(m)
        write_pieces(st, src)
        path = store.finalize(st)
        if damage:
            ref = st.pieces[3]
            with open(path / ref.path, "r+b") as f:
                f.seek(ref.offset + 100)
                f.write(b"\x00\x01")
        found = Store(tmp_path / f"peer{damage}").scan_complete(kp.public_bytes)
        assert (1 in found) is not damage and path.exists() is not damage
        if not damage:
            assert same_files(found[1].dir, src)
