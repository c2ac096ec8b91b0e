"""Honest nodes that join a run that has learned are released, not banned as cherry-pickers.

The operator's own node (trusted) starts the run; a second and a third honest `swarm node`, fresh keys,
join 60 s and 120 s in, when the policy already answers far better than it did at the start. Their
probation compares their rewards only with answers of close policy versions (trainer/pairing.py): both
are released, nothing of theirs is refused as cherry-picking, and their groups are trained on. (Before
issue 27 the shared prompts handed to a newcomer were the oldest, answered hundreds of versions earlier,
and every late honest node was banned.)
"""

from __future__ import annotations

import json
import time

import pytest

from swarm_common.keys import KeyPair
from tests.conftest import free_port, get_json, wait_json

pytestmark = pytest.mark.timeout(600)

JOIN_AT = (60.0, 120.0)  # seconds after the trusted node's first accepted group


def test_honest_nodes_joining_late_are_released(tmp_path, procs):
    run_dir = tmp_path / "run"
    zport, hport, tport = free_port(), free_port(), free_port()
    own = KeyPair.load_or_create(tmp_path / "own" / "node.key").public_hex
    trainer = procs.start(
        "trainer", "train", "--run-dir", str(run_dir), "--port", str(zport), "--http-port", str(hport),
        "--max-steps", "100000", "--trust", own, "--set", f"server.tracker_port={tport}",
        "--set", "server.web_port=-1", "--set", "server.heartbeat_s=0.5", "--set", "train.eval_every=40",
        "--set", "train.checkpoint_every=0")
    url = f"http://127.0.0.1:{hport}/api/summary"
    wait_json(url, timeout=240, proc=trainer)
    node = ["node", "--trainer", f"127.0.0.1:{zport}", "--max-prompts", "4"]
    procs.start("own", *node, "--data-dir", str(tmp_path / "own"), "--name", "own")
    wait_json(url, lambda s: s["accepted_groups"] > 0, timeout=240, proc=trainer)
    t0 = time.monotonic()

    late = []
    for i, at in enumerate(JOIN_AT, start=1):
        while time.monotonic() < t0 + at:
            time.sleep(1)
        s = get_json(url)
        rewards = [r["reward_mean"] for r in s["steps"]]
        print(f"late{i} joins at step {s['step']}: batch reward {rewards[-1] if rewards else '-'} "
              f"(first step {rewards[0] if rewards else '-'})")
        late.append(KeyPair.load_or_create(tmp_path / f"late{i}" / "node.key").public_hex)
        procs.start(f"late{i}", *node, "--data-dir", str(tmp_path / f"late{i}"), "--name", f"late{i}")

    def settled(s: dict) -> bool:
        rows = {n["node_id"]: n for n in s["nodes"]}
        return all(rows.get(k, {}).get("standing") == "established" or rows.get(k, {}).get("state") == "banned"
                   for k in late)

    s = wait_json(url, settled, timeout=300, proc=trainer)
    rows = {n["node_id"]: n for n in s["nodes"]}
    for k in late:
        print(rows[k]["name"], rows[k]["standing"], rows[k]["state"], rows[k]["accepted_groups"], rows[k]["refused"])
    assert s["banned"] == [], s["banned"]
    assert "cherry_picking" not in s["refused"] and "cherry_picking" not in s["dropped"], (s["refused"], s["dropped"])
    assert all(rows[k]["standing"] == "established" for k in late)
    # Released groups reach the learner: both late keys appear in trained batches.
    end = time.monotonic() + 120
    while time.monotonic() < end:
        trained = {g[0] for line in (run_dir / "batches.jsonl").read_text().splitlines() if line.strip()
                   for g in json.loads(line)["groups"]}
        if set(late) <= trained:
            break
        time.sleep(2)
    assert set(late) <= trained
