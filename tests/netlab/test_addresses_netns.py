"""A trainer bound to every interface (`swarm train --host 0.0.0.0`, as across machines) tells each node
addresses it can dial: the tracker where the node reached the trainer, the manifest relative to it, and in
the tree's sources no bind address at all (the origin is each peer's own tracker URL). Before, nodes were
told the manifest was at http://0.0.0.0:5557, and every relay asked 0.0.0.0 (its own loopback) for pieces,
reported the origin dead and avoided it."""

from __future__ import annotations

import json
import os
import sys
import time
from pathlib import Path

import pytest

from swarm_common import protocol as P
from tests.conftest import get_json, wait_json

pytestmark = pytest.mark.timeout(400)
REPO = Path(__file__).resolve().parents[2]

# Registers as `swarm node` does (a signed Register naming the host it dialled) and prints the reply.
REGISTER = """
import sys, time, zmq, msgspec
from swarm_common import protocol as P
from swarm_common.keys import KeyPair
host = sys.argv[1]
key = KeyPair.generate()
ctx = zmq.Context(); s = ctx.socket(zmq.DEALER); s.setsockopt(zmq.RCVTIMEO, 20000); s.setsockopt(zmq.LINGER, 0)
s.connect(f"tcp://{host}:5555")
s.send_multipart(P.sign(P.Register(node_id=key.public_hex, name="probe", time_ms=int(time.time() * 1000),
                                   trainer_host=host), key))
while True:
    reply = P.decode(s.recv())
    if not isinstance(reply, P.VersionNotice):
        break
print(msgspec.json.encode(reply).decode())
"""


def test_a_trainer_on_all_interfaces_gives_each_node_addresses_it_can_dial(netlab, tmp_path):
    trainer_host = netlab.add_host("trainer", up="100mbit")
    node_host = netlab.add_host("node0", up="100mbit")
    relays = [netlab.add_host(f"relay{i}", up="50mbit") for i in range(3)]
    env = dict(os.environ, PYTHONPATH=str(REPO), PYTHONUNBUFFERED="1", OMP_NUM_THREADS="1")
    swarm = [sys.executable, "-m", "swarm"]
    run_dir = tmp_path / "run"
    trainer = netlab.popen(trainer_host, [
        *swarm, "train", "--host", "0.0.0.0", "--run-dir", str(run_dir), "--max-steps", "5",
        "--set", "model.sft_steps=0", "--set", "server.web_port=-1"], env=env, cwd=REPO, log="trainer")
    ip = trainer_host.ip
    summary = wait_json(f"http://{ip}:5556/api/summary", timeout=240, proc=trainer)
    version = summary["version"]

    # What a node is told, from its own host.
    out = netlab.run(node_host, [sys.executable, "-c", REGISTER, ip], env=env, cwd=REPO, timeout=60)
    assert out.returncode == 0, out.stderr
    reg = json.loads(out.stdout.strip().splitlines()[-1])
    assert reg["tracker_url"] == f"http://{ip}:5557", reg
    manifest = P.WeightsInfo(**reg["weights"]).manifest_at(reg["tracker_url"])
    assert manifest == f"http://{ip}:5557/v/{version}/manifest", reg["weights"]
    fetched = netlab.run(node_host, ["curl", "-sf", "-o", "/dev/null", "-w", "%{http_code}", manifest])
    assert fetched.stdout == "200", fetched

    # Relays on hosts of their own fetch the version through the tree; nobody is sent to 0.0.0.0.
    pub = (run_dir / "trainer.pub").read_text().strip()
    procs = [netlab.popen(h, [*swarm, "relay", "--tracker", f"http://{ip}:5557", "--trainer-key", pub,
                              "--data-dir", str(tmp_path / h.name), "--relay-host", "0.0.0.0", "--name", h.name],
                          env=env, cwd=REPO) for h in relays]
    end = time.monotonic() + 120
    tree = get_json(f"http://{ip}:5557/tree")
    while time.monotonic() < end and not (
            len(tree["peers"]) == len(relays) and all(version in p["complete"] for p in tree["peers"])):
        assert all(p.poll() is None for p in procs), "a relay exited"
        time.sleep(0.5)
        tree = get_json(f"http://{ip}:5557/tree")
    for p in procs:
        log = p.log_path.read_text()  # type: ignore[attr-defined]
        assert f"HAVE v{version}" in log, log[-2000:]
        assert "0.0.0.0:5557" not in log, log[-2000:]
        assert "reporting" not in log, log[-2000:]  # no source was reported dead or stalling
    trainer.terminate()
