"""Delta versions end to end: an origin in this process, relays as real processes on 127.0.0.1."""

from __future__ import annotations

import asyncio
import signal

import msgspec
import pytest
from bc_helpers import Cluster
from delta_helpers import model_version, same_model

from broadcast import delta
from broadcast.manifest import build_manifest
from broadcast.store import VersionState
from swarm_common.keys import KeyPair

pytestmark = pytest.mark.timeout(120)


def run(coro):
    return asyncio.run(coro)


async def publish(c: Cluster, v: int, full: bool | None = None):
    d = model_version(c.tmp / "trainer" / f"v{v}", v)
    m = await c.origin.publish(d, v, v - 1 if v > 1 else None, full=full)
    return d, m


def held(c: Cluster, name: str, v: int):
    return c.data_dir(name) / "versions" / f"v{v}"


async def install(c: Cluster, m, served, full_dir) -> None:
    """Serve a version the origin did not make itself (a buggy trainer's), as publish would."""
    o = c.origin
    o.versions[m.version] = VersionState(m, served, complete=True)
    o.full_dirs[m.version] = full_dir
    o.latest = m.version
    async with o.new_version:
        o.new_version.notify_all()


def test_deltas_flow_through_the_tree_and_rebuild_exactly(tmp_path):
    async def scenario():
        async with Cluster(tmp_path, fanout=2, full_every=4, keep=6) as c:
            for i in range(4):
                await c.spawn(f"p{i}", wait_join=False)
            await c.wait(lambda: len(c.names()) == 4, 30, "4 peers to join")
            kinds = []
            for v in range(1, 7):
                src, m = await publish(c, v, full=True if v == 6 else None)
                kinds.append(m.base)
                await c.wait(lambda v=v: len(c.holders(v)) == 4, 30, f"v{v}")
                for i in range(4):
                    assert same_model(held(c, f"p{i}", v), src)
                if m.base is not None:
                    assert m.total_size < sum(t.size for t in m.target) / 10
            # v1 whole (nothing before it), v2-v4 deltas, v5 whole (every 4th), v6 whole (asked for).
            assert kinds == [None, 1, 2, 3, None, None]
            logs = "".join(c.log(f"p{i}") for i in range(4))
            assert logs.count("rebuilt from v") == 3 * 4 and "fetched whole" not in logs

    run(scenario())


def test_relay_corrupting_delta_pieces_is_caught_and_banned(tmp_path, monkeypatch):
    monkeypatch.setenv("EVIL_FROM_VERSION", "2")  # honest with v1 (whole), corrupts the deltas after it
    async def scenario():
        async with Cluster(tmp_path, fanout=2, full_every=10, piece_bytes=4 << 10) as c:
            c.origin.tracker.forest.order_key = b""  # join order, not the tracker's keyed shuffle:
            await c.spawn("evil", script="tests/broadcast/evil_relay.py")  # first, so it heads tree 0
            for i in range(4):
                await c.spawn(f"p{i}", wait_join=False)
            await c.wait(lambda: len(c.names()) == 5, 30, "peers to join")
            await publish(c, 1)
            await c.wait(lambda: len(c.holders(1)) == 5, 30, "v1 everywhere")
            src, m = await publish(c, 2)
            assert m.base == 1 and m.n_pieces >= 2
            honest = {f"p{i}" for i in range(4)}
            await c.wait(lambda: honest <= c.holders(2), 40, "honest peers to rebuild v2")
            for n in honest:
                assert same_model(held(c, n, 2), src)
            # The origin confirms a report by probing the piece itself: the ban follows the bypass.
            await c.wait(lambda: "evil" not in c.names(), 30, "the corrupting relay to be banned")
            assert [b for b in c.origin.tracker.banned.values() if "corrupt piece" in b.reason]
            assert sum(c.log(n).count("as corrupt") for n in honest) >= 1

    run(scenario())


def test_a_delta_that_does_not_rebuild_the_signed_files_is_refused(tmp_path):
    """Two ways a delta's result can be wrong although every piece matches the signed manifest: the base
    on a peer's disk was damaged, or the trainer signed a payload made against other weights. Either way
    the result is refused and the version fetched whole, and that is what gets loaded."""

    async def scenario():
        async with Cluster(tmp_path, fanout=2, full_every=10) as c:
            await c.spawn("p0")
            await c.spawn("p1")
            await publish(c, 1)
            await c.wait(lambda: c.holders(1) == {"p0", "p1"}, 30, "v1")
            with open(held(c, "p0", 1) / "model.safetensors", "r+b") as f:  # bit rot on p0 only
                f.seek(5000)
                f.write(b"\xde\xad")
            src2, m2 = await publish(c, 2)
            assert m2.base == 1
            await c.wait(lambda: c.holders(2) == {"p0", "p1"}, 30, "v2")
            assert same_model(held(c, "p0", 2), src2) and same_model(held(c, "p1", 2), src2)
            assert "REFUSED the delta against v1" in c.log("p0") and "REFUSED" not in c.log("p1")
            # A payload encoded against other weights, under a correctly signed manifest.
            src3 = model_version(tmp_path / "trainer" / "v3", 3)
            wrong = model_version(tmp_path / "wrong", 7)
            served = tmp_path / "origin" / "deltas" / "v3"
            target, _ = delta.encode(wrong, 2, src3, served)
            m3 = build_manifest(served, 3, 2, c.key, c.origin.cfg.piece_bytes, base=2, target=target)
            await install(c, m3, served, src3)
            await c.wait(lambda: c.holders(3) == {"p0", "p1"}, 30, "v3")
            for n in ("p0", "p1"):
                assert same_model(held(c, n, 3), src3)
                assert "v3: REFUSED the delta against v2" in c.log(n) and "v3: fetched whole" in c.log(n)

    run(scenario())


def test_peers_without_the_base_take_the_cheaper_way(tmp_path):
    """A peer that missed one version fetches it as a delta too (the chain is small); a late joiner, whose
    chain goes back to a full version, fetches the version whole."""

    async def scenario():
        async with Cluster(tmp_path, fanout=2, full_every=10, keep=4) as c:
            await c.spawn("p0")
            await c.spawn("back")
            await publish(c, 1)
            await c.wait(lambda: c.holders(1) == {"p0", "back"}, 30, "v1")
            c.procs["back"].send_signal(signal.SIGKILL)
            await c.procs["back"].wait()
            c.origin.tracker.remove(c.names()["back"].peer_id, "test: killed")
            for v in (2, 3):
                await publish(c, v)
                await c.wait(lambda v=v: c.holders(v) == {"p0"}, 30, f"v{v} on p0")
            await c.spawn("back")  # holds v1: v3's base v2 is one small delta away
            await c.spawn("late")  # holds nothing: v1 whole plus two deltas is more than v3 whole
            src4, m4 = await publish(c, 4)
            await c.wait(lambda: {"back", "late", "p0"} <= c.holders(4), 40, "catch-up")
            assert same_model(held(c, "back", 4), src4) and same_model(held(c, "late", 4), src4)
            back, late = c.log("back"), c.log("late")
            assert "v3: base v2 not held; the chain v2 is" in back and "fetched whole" not in back
            assert "v3: rebuilt from v2" in back and "v2: rebuilt from v1" in back
            assert "v3: base v2 not held; the chain v1,v2 is" in late and "v3: fetched whole" in late
            assert "v4: rebuilt from v3" in late

    run(scenario())


def test_a_chain_to_a_missing_or_unsigned_base_is_refused(tmp_path):
    async def scenario():
        async with Cluster(tmp_path, fanout=2, full_every=10, keep=2) as c:
            await c.spawn("p0")
            for v in (1, 2, 3, 4):
                src, _ = await publish(c, v)
                await c.wait(lambda v=v: "p0" in c.holders(v), 30, f"v{v}")
            assert sorted(c.origin.versions) == [3, 4]
            # Missing: the origin retired v2, which v3 (v4's base) needs.
            await c.spawn("late")
            await c.wait(lambda: "late" in c.holders(4), 30, "late to hold v4")
            assert same_model(held(c, "late", 4), src)
            # Broken where no peer or origin holds a manifest any more (peers serve the ones they hold).
            assert "v4: the chain to its base breaks at v" in c.log("late")
            # Unsigned: the base's manifest comes signed by another key.
            impostor = KeyPair.generate()
            src5, m5 = await publish(c, 5)
            await c.wait(lambda: {"p0", "late"} <= c.holders(5), 30, "v5")
            src6, _ = await publish(c, 6)
            st5 = c.origin.versions[5]
            st5.manifest = msgspec.structs.replace(m5, signature=impostor.sign(m5.signing_payload()).hex())
            await c.spawn("late2")
            await c.wait(lambda: "late2" in c.holders(6), 30, "late2 to hold v6")
            assert same_model(held(c, "late2", 6), src6)
            log = c.log("late2")
            # Peers serve the manifests they hold (signed copies): v5's may come from one of them, and
            # then the chain breaks further down. Whatever is asked of the origin is its tampered copy.
            if "REFUSED manifest for v5" in log:
                assert "v6: the chain to its base breaks at v5" in log
            assert "v6: fetched whole" in log or "v6: rebuilt from v" in log

    run(scenario())
