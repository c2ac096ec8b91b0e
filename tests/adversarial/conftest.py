"""One trainer and one honest vLLM node for the whole module (engine start-up is the expensive part).

The honest node is the operator's own (its key trusted) and joins first; every attacker then gets a fresh
key and meets the trainer as a new node, on probation, paired with the honest node.
"""

from __future__ import annotations

import json
import time
from dataclasses import dataclass
from pathlib import Path

import pytest

from swarm_common.keys import KeyPair
from tests.conftest import Procs, free_port, get_json, wait_json

HONEST = "honest"
MAX_MESSAGE_BYTES = 1 << 20  # small, so the oversized attack is cheap to send
# The learner steps every 4 groups here, a few times a second: a lag window of 4 versions keeps the honest
# node (which pipelines requests) from ever going stale, so any refusal of it would be a false positive.
MAX_LAG = 4
REGISTER_BURST = 40


@dataclass
class Swarm:
    run_dir: Path
    zport: int
    url: str  # /api/summary
    procs: Procs

    def summary(self) -> dict:
        return get_json(self.url)

    def honest_row(self) -> dict:
        return next(n for n in self.summary()["nodes"] if n["name"] == HONEST)

    def node_row(self, node_id: str) -> dict | None:
        return next((n for n in self.summary()["nodes"] if n["node_id"] == node_id), None)

    def trained_node_ids(self) -> set[str]:
        """Every node id that appears in a trained batch (RUN/batches.jsonl)."""
        path = self.run_dir / "batches.jsonl"
        if not path.exists():
            return set()
        return {g[0] for line in path.read_text().splitlines() if line.strip() for g in json.loads(line)["groups"]}

    def wait_carry_on(self, steps: int = 2, timeout: float = 120) -> dict:
        """Wait until `steps` more optimizer steps are done and the honest node has had more groups accepted.

        Both, not "accepted within the steps": the trainer holds up to train.inflight_groups accepted groups,
        so its next steps may all come from groups accepted before the wait began."""
        summary = self.summary()
        start = summary["step"]
        before = next(n for n in summary["nodes"] if n["name"] == HONEST)["accepted_groups"]

        def carried_on(s: dict) -> bool:
            row = next((n for n in s["nodes"] if n["name"] == HONEST), None)
            return s["step"] >= start + steps and row is not None and row["accepted_groups"] > before

        return wait_json(self.url, carried_on, timeout=timeout)


def swarm_args(run_dir: Path, zport: int, hport: int, tport: int, honest_key: str, extra: list[str] = ()) -> list[str]:
    return [
        "train", "--run-dir", str(run_dir), "--port", str(zport), "--http-port", str(hport), "--max-steps", "100000",
        "--set", f"server.tracker_port={tport}", "--set", "server.web_port=-1",
        "--set", "train.prompts_per_step=4", "--set", "train.inflight_groups=16",
        "--set", f"train.max_lag={MAX_LAG}",
        "--set", "train.eval_every=100000", "--set", "train.checkpoint_every=0",
        # Attackers sample from published versions (the newest, and up to max_lag + 1 back): keep enough
        # on disk that none is removed while an attacker loads it (steps take a fraction of a second).
        "--set", "train.keep_versions=40",
        "--set", "server.heartbeat_s=0.5", "--set", f"server.max_message_bytes={MAX_MESSAGE_BYTES}",
        # The honest node is the operator's own, trusted: attackers are paired with it (never with each other).
        "--trust", honest_key,
        # Every attacker registers a fresh key from 127.0.0.1: a bucket that lasts the module (the flood
        # test, last, still meets its limit).
        "--set", f"guard.register_burst={REGISTER_BURST}", "--set", "guard.register_rate=0.5",
        *extra,
    ]


@pytest.fixture(scope="module")
def swarm(tmp_path_factory) -> Swarm:
    root = tmp_path_factory.mktemp("adv")
    run_dir = root / "run"
    zport, hport, tport = free_port(), free_port(), free_port()
    procs = Procs(root)
    try:
        honest_key = KeyPair.load_or_create(root / "node" / "node.key").public_hex
        trainer = procs.start("trainer", *swarm_args(run_dir, zport, hport, tport, honest_key))
        url = f"http://127.0.0.1:{hport}/api/summary"
        wait_json(url, timeout=240, proc=trainer)
        procs.start("node", "node", "--trainer", f"127.0.0.1:{zport}", "--data-dir", str(root / "node"),
                    "--name", HONEST, "--max-prompts", "4")
        sw = Swarm(run_dir, zport, url, procs)
        # The honest node, trusted, trains a few steps.
        wait_json(url, lambda s: s["step"] >= 3, timeout=240, proc=trainer)
        yield sw
        # Honest nodes lose nothing: no refusal in the whole module, still accepted to the end.
        row = sw.honest_row()
        assert row["refused"] == {}, row
        before = row["accepted_groups"]
        end = time.monotonic() + 60
        while sw.honest_row()["accepted_groups"] <= before and time.monotonic() < end:
            time.sleep(0.5)
        assert sw.honest_row()["accepted_groups"] > before
    finally:
        procs.stop_all()
        for p in procs.procs:
            print(f"==== {p.log_path.name} (exit {p.returncode})\n{p.log_path.read_text()[-4000:]}")
