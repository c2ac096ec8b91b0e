"""A whole run with the learner sharded over 2 CPU ranks (gloo), as torchrun starts `swarm train`, and a real
vLLM node: rank 0 serves the node and publishes, rank 1 only learns; the run learns and its ledger
balances. Then rank 1 is killed mid-run: rank 0 stops with a clear error within the collective timeout."""

from __future__ import annotations

import json
import signal
import time

import pytest

from swarm_common.keys import KeyPair
from tests.conftest import TWO_TERM_SUMS, free_port, wait_json
from trainer.ledger import accounting

pytestmark = pytest.mark.timeout(600)
STEPS = 16
TASK = TWO_TERM_SUMS  # RL lifts them within a few steps (tests/conftest.py)


def _rank_env(rank: int, port: int) -> dict[str, str]:
    return {"RANK": str(rank), "WORLD_SIZE": "2", "LOCAL_RANK": str(rank), "MASTER_ADDR": "127.0.0.1",
            "MASTER_PORT": str(port), "SWARM_DIST_DEVICE": "cpu", "GLOO_SOCKET_IFNAME": "lo"}


def test_two_ranks_and_a_node_learn_then_a_lost_rank_stops_the_run(tmp_path, procs):
    run_dir = tmp_path / "run"
    zport, hport, tport, mport = free_port(), free_port(), free_port(), free_port()
    node_key = KeyPair.load_or_create(tmp_path / "node" / "node.key")
    args = ["train", "--run-dir", str(run_dir), "--port", str(zport), "--http-port", str(hport),
            "--max-steps", str(STEPS), "--trust", node_key.public_hex, "--set", f"server.tracker_port={tport}",
            "--set", "server.web_port=-1", "--set", "train.prompts_per_step=4", "--set", "train.inflight_groups=8",
            "--set", "train.eval_every=8", "--set", "train.checkpoint_every=8", "--set", "train.dist_timeout_s=20",
            "--set", "server.heartbeat_s=0.5", "--set", TASK]
    rank0 = procs.start("rank0", *args, env=_rank_env(0, mport))
    rank1 = procs.start("rank1", *args, env=_rank_env(1, mport))
    wait_json(f"http://127.0.0.1:{hport}/api/summary", timeout=240, proc=rank0)
    procs.start("node", "node", "--trainer", f"127.0.0.1:{zport}", "--data-dir", str(tmp_path / "node"),
                "--name", "n0")
    rank0.wait(timeout=400)
    rank1.wait(timeout=60)
    assert rank0.returncode == 0 and rank1.returncode == 0
    summary = json.loads((run_dir / "summary.json").read_text())
    assert summary["step"] == STEPS
    evals = summary["evals"]
    assert max(e["accuracy"] for e in evals[1:]) > evals[0]["accuracy"], evals
    acc = accounting(run_dir)
    assert not (acc["twice"] or acc["unaccounted"] or acc["unknown"]), acc
    assert "rank 1 of 2: following rank 0" in rank1.log_path.read_text()

    # Resumed at 2 ranks; rank 1 dies: rank 0 says which collective failed and exits, no hang.
    mport = free_port()
    rank0 = procs.start("rank0-again", *args, "--resume", "--max-steps", str(STEPS + 50), env=_rank_env(0, mport))
    rank1 = procs.start("rank1-again", *args, "--resume", "--max-steps", str(STEPS + 50), env=_rank_env(1, mport))
    wait_json(f"http://127.0.0.1:{hport}/api/summary", lambda s: s["step"] > STEPS, timeout=240, proc=rank0)
    rank1.send_signal(signal.SIGKILL)
    t0 = time.monotonic()
    rank0.wait(timeout=120)
    assert rank0.returncode != 0
    assert time.monotonic() - t0 < 90
    assert "RankLost" in rank0.log_path.read_text() or "RANK LOST" in rank0.log_path.read_text()
