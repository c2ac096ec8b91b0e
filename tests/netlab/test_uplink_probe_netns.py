"""The origin's uplink probe over real TCP and kernel-shaped links: relays in their own namespaces, with
tbf uplinks of 8 and 24 Mbit/s; the origin's figure for each is close to its link's rate (how it places
them: tests/broadcast/test_placement.py)."""

from __future__ import annotations

import asyncio
import os
import sys

import pytest

from broadcast.config import OriginConfig
from broadcast.origin import Origin
from swarm_common.keys import KeyPair
from tests.netlab.test_broadcast_netns import REPO, until

pytestmark = pytest.mark.timeout(90)
UPLINKS = {"slow": "8mbit", "fast": "24mbit"}


def test_probes_measure_kernel_shaped_uplinks(netlab, tmp_path):
    hosts = {name: netlab.add_host(name, up=up) for name, up in UPLINKS.items()}
    key = KeyPair.generate()
    env = dict(os.environ, PYTHONPATH=str(REPO), PYTHONUNBUFFERED="1")

    async def scenario() -> None:
        origin = Origin(tmp_path / "origin", key, OriginConfig(fanout=2, heartbeat_s=0.5), host=netlab.bridge_ip)
        await origin.start()
        try:
            assert origin.tracker
            tr = origin.tracker
            for h in hosts.values():  # the operator's own relays
                origin.set_standing(KeyPair.load_or_create(tmp_path / h.name / "relay.key").public_hex)
            procs = [netlab.popen(h, [sys.executable, "-m", "swarm", "relay", "--tracker", origin.url,
                                      "--trainer-key", key.public_hex, "--data-dir", str(tmp_path / h.name),
                                      "--relay-host", h.ip, "--name", h.name], env=env, cwd=REPO)
                     for h in hosts.values()]
            await until(lambda: len(tr.uploads.probed) == len(hosts), 60, "both relays probed", procs)
            by_name = {p.name: p for p in tr.peers.values()}
            for name, h in hosts.items():
                got = tr.uploads.probed[by_name[name].url] * 8
                print(f"{name}: tbf {h.up_bits / 1e6:.0f} Mbit/s, probed {got / 1e6:.2f} Mbit/s")
                assert 0.5 * h.up_bits < got < 1.1 * h.up_bits  # a lower bound: a busy machine lowers it
        finally:
            await origin.stop()

    asyncio.run(scenario())
