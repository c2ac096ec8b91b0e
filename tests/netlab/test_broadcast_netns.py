"""The weight tree across hosts: an origin in this process (at its bridge address), `swarm relay` processes
each in its own namespace with a kernel-shaped uplink; every relay gets the version, mostly from peers."""

from __future__ import annotations

import asyncio
import json
import os
import sys
import time
import urllib.request
from pathlib import Path

import pytest

from broadcast.config import OriginConfig
from broadcast.origin import Origin
from swarm_common.keys import KeyPair

pytestmark = pytest.mark.timeout(150)
REPO = Path(__file__).resolve().parents[2]
N_RELAYS = 5
SIZE = 4 << 20  # 512 pieces: a 55 KB manifest, more than tbf lets out in one burst


def test_relays_in_namespaces_fetch_from_each_other(netlab, tmp_path):
    hosts = [netlab.add_host(f"r{i}", up="40mbit") for i in range(N_RELAYS)]
    netlab.shape_own(up="20mbit")  # the origin's uplink too: its answers arrive in MTU-sized segments
    key = KeyPair.generate()
    env = dict(os.environ, PYTHONPATH=str(REPO), PYTHONUNBUFFERED="1")

    async def scenario() -> None:
        origin = Origin(tmp_path / "origin", key, OriginConfig(fanout=2, piece_bytes=8 << 10, heartbeat_s=0.5),
                        host=netlab.bridge_ip)
        await origin.start()
        try:
            assert origin.tracker
            procs = [netlab.popen(h, [sys.executable, "-m", "swarm", "relay", "--tracker", origin.url,
                                      "--trainer-key", key.public_hex, "--data-dir", str(tmp_path / h.name),
                                      "--relay-host", h.ip, "--name", h.name, "--stall-timeout", "10"],
                                  env=env, cwd=REPO) for h in hosts]
            await until(lambda: len(origin.tracker.peers) == N_RELAYS, 60, "relays to join", procs)
            src = tmp_path / "origin" / "v1"
            src.mkdir(parents=True)
            (src / "model.safetensors").write_bytes(os.urandom(SIZE))
            sent0 = {h.name: h.sent_bytes() for h in hosts}
            origin0 = netlab.own_sent_bytes()
            await origin.publish(src, 1, None)
            await until(lambda: all(1 in p.complete for p in origin.tracker.peers.values()), 60,
                        "every relay to hold v1", procs)
            view = await asyncio.to_thread(lambda: json.loads(
                urllib.request.urlopen(origin.url + "/tree", timeout=5).read()))
        finally:
            await origin.stop()
        want = (src / "model.safetensors").read_bytes()
        for h in hosts:
            assert (tmp_path / h.name / "versions" / "v1" / "model.safetensors").read_bytes() == want
            assert "HAVE v1" in h.procs[0].log_path.read_text()
        # Each relay advertised its own lab address (not 127.0.0.1), and the tree has relays in it.
        assert sorted(p["url"].split(":")[1].strip("/") for p in view["peers"]) == sorted(h.ip for h in hosts)
        assert sum(bool(any(p["children"])) for p in view["peers"]) >= 3, view
        # The kernel's counters: relays uploaded to each other; the origin sent far less than N copies.
        relay_up = sum(h.sent_bytes() - sent0[h.name] for h in hosts)
        origin_up = netlab.own_sent_bytes() - origin0
        print(f"relays uploaded {relay_up / SIZE:.2f} x S, the origin {origin_up / SIZE:.2f} x S")
        assert relay_up > 2 * SIZE, f"relays uploaded only {relay_up} bytes: pieces came from the origin"
        assert origin_up < 0.5 * N_RELAYS * SIZE, f"origin sent {origin_up} bytes: the tree was not used"

    asyncio.run(scenario())


async def until(cond, timeout: float, what: str, procs) -> None:
    end = time.monotonic() + timeout
    while not cond():
        for p in procs:
            if p.poll() is not None:
                raise AssertionError(f"a relay exited {p.returncode}:\n{p.log_path.read_text()[-2000:]}")
        if time.monotonic() > end:
            raise AssertionError(f"timed out waiting for {what}")
        await asyncio.sleep(0.1)
