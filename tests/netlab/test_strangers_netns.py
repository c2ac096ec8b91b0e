"""Strangers alone, across hosts, as the README's "Running across machines" says: the operator starts
`swarm train --host 0.0.0.0 --reference` and runs no node; two GPU owners run `swarm node --trainer
ADDR:5555` and nothing else, one behind a home router (a NAT made with nftables masquerade), one whose
firewall drops inbound connections.

Nobody is trusted, so both start on probation; the trainer samples their prompts itself as the paired
test's reference, both are released, their groups are trained on, and the run learns. Both are
download-only leaves of the relay tree (nobody can connect to them), and nobody is removed for it."""

from __future__ import annotations

import json
import os
import sys
from pathlib import Path

import pytest

from swarm_common.keys import KeyPair
from tests.conftest import TWO_TERM_SUMS, wait_json

pytestmark = pytest.mark.timeout(600)
REPO = Path(__file__).resolve().parents[2]
STEPS = 50
# Two-term sums: RL lifts them within a few steps (tests/conftest.py). Many of its groups are all right, so
# their shared prompts carry no evidence: probation must not wait on them for ever.
TASK = TWO_TERM_SUMS


def test_two_strangers_behind_nat_and_firewall_are_released_by_the_trainers_reference(netlab, tmp_path):
    trainer_host = netlab.add_host("trainer", up="200mbit")
    natted = netlab.add_natted_host("home", up="100mbit")
    shut = netlab.add_host("shut", up="100mbit")
    netlab.firewall_inbound(shut)
    env = dict(os.environ, PYTHONPATH=str(REPO), PYTHONUNBUFFERED="1", OMP_NUM_THREADS="1")
    swarm = [sys.executable, "-m", "swarm"]
    run_dir = tmp_path / "run"
    trainer = netlab.popen(trainer_host, [
        *swarm, "train", "configs/demo.toml", "--host", "0.0.0.0", "--reference", "--run-dir", str(run_dir),
        "--max-steps", str(STEPS), "--set", "train.eval_every=25", "--set", "server.heartbeat_s=0.5",
        "--set", "server.web_port=-1", "--set", "train.checkpoint_every=0", "--set", TASK,
        # The fixed warm-up this test was made with. The demo's target (0.4 on training items) stops it within
        # a few dozen steps on these sums: held-out 0.235 at the start, and 50 steps did not lift it in 2 runs
        # of 3 (0.176, 0.235); with 150 steps, 0.706 -> 0.882.
        "--set", "model.sft_until=0", "--set", "model.sft_steps=150"],
        env=env, cwd=REPO, log="trainer")
    api = f"http://{trainer_host.ip}:5556/api/summary"
    wait_json(api, timeout=240, proc=trainer)
    keys = {h.name: KeyPair.load_or_create(tmp_path / h.name / "node.key").public_hex for h in (natted, shut)}
    for h in (natted, shut):  # as the README says, and nothing else (a data dir of its own: they share a disk)
        netlab.popen(h, [*swarm, "node", "--trainer", f"{trainer_host.ip}:5555", "--data-dir", str(tmp_path / h.name)],
                     env=env, cwd=REPO, log=h.name)

    trainer.wait(timeout=480)
    assert trainer.returncode == 0, "the trainer failed; see its log"
    summary = json.loads((run_dir / "summary.json").read_text())
    assert summary["step"] == STEPS
    evals = summary["evals"]
    # It learns, from strangers' work alone (as test_swarm_across_hosts.py judges it: on 17 held-out sums the
    # last eval came back to the start's 0.706 once here, after 0.9 at step 25 and 0.96 training reward).
    assert max(e["accuracy"] for e in evals[1:]) > evals[0]["accuracy"], evals
    by_key = {n["node_id"]: n for n in summary["nodes"]}
    assert set(by_key) == set(keys.values()), by_key
    rows = {name: by_key[key] for name, key in keys.items()}
    trained = {g[0] for line in (run_dir / "batches.jsonl").read_text().splitlines() if line.strip()
               for g in json.loads(line)["groups"]}
    gw = netlab.hosts["home-gw"]
    for name, row in rows.items():
        assert row["standing"] == "established", row  # released by the paired test against the reference
        assert row["node_id"] in trained, name
        assert row["relay_reachable"] is False, row  # nobody can connect to either: leaves that still train
    assert rows["home"]["status_url"].startswith(f"http://{gw.ip}:"), rows["home"]  # seen at its router
    assert summary["pairing"]["reference"] and summary["pairing"]["reference_groups"] > 0, summary["pairing"]
    assert summary["banned"] == [] and "cherry_picking" not in summary["refused"], summary["refused"]
    print({k: summary["pairing"][k] for k in ("reference_groups", "reference_seconds")},
          [(e["step"], e["accuracy"]) for e in evals])
    assert not summary["tree"]["banned"]
