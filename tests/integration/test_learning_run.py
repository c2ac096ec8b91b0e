"""A trainer and a real vLLM node as separate processes over real sockets.

The trainer runs several GRPO steps from rollouts the node generates; the node follows every version
live (no engine restart) and, after each load, its greedy completion of a probe prompt equals the
trainer's own greedy completion with that version's published weights. Malformed traffic sent to the
running trainer gets error replies and does not disturb it.
"""

from __future__ import annotations

import os

import msgspec
import zmq

from swarm_common import protocol as P
from swarm_common.keys import KeyPair
from tests.conftest import free_port, get_json, wait_json

STEPS = 4
PROBE = "3+5+8"


def _poke_with_garbage(port: int) -> list[str]:
    """Send bad frames to the trainer's ROUTER; return the error codes it answered with."""
    ctx = zmq.Context()
    s = ctx.socket(zmq.DEALER)
    s.setsockopt(zmq.RCVTIMEO, 5000)
    s.setsockopt(zmq.LINGER, 0)
    s.connect(f"tcp://127.0.0.1:{port}")
    codes = []
    kp = KeyPair.generate()
    for frames in ([os.urandom(64)], [msgspec.msgpack.encode({"type": "register", "node_id": 5}), b"s" * 64],
                   P.sign(P.Register(node_id=kp.public_hex, name="y", max_prompts=0), kp),
                   P.sign(P.WorkRequest(node_id=kp.public_hex, version_loaded=0, max_prompts=1), kp)):
        s.send_multipart(frames)
        codes.append(P.decode(s.recv()).code)
    s.close(0)
    ctx.term()
    return codes


def test_trainer_and_node_learn_and_reload_live(tmp_path, procs):
    run_dir = tmp_path / "run"
    zport, hport = free_port(), free_port()
    # The operator's own node: its key is made first and trusted (no probation, audited all the same).
    node_key = KeyPair.load_or_create(tmp_path / "node" / "node.key")
    trainer = procs.start(
        "trainer", "train", "--run-dir", str(run_dir), "--port", str(zport), "--http-port", str(hport),
        "--max-steps", str(STEPS), "--trust", node_key.public_hex,
        # max_lag 0: each step needs rollouts from the newest version, so the node must load every one.
        "--set", "train.max_lag=0", "--set", "train.prompts_per_step=4", "--set", "train.inflight_groups=4",
        "--set", "train.eval_every=2", "--set", f"train.keep_versions={STEPS + 1}",
        "--set", "server.heartbeat_s=0.5",
    )
    summary_url = f"http://127.0.0.1:{hport}/api/summary"
    wait_json(summary_url, timeout=180, proc=trainer)
    assert _poke_with_garbage(zport) == ["unsigned", "malformed", "invalid", "unknown_node"]

    status_port = free_port()
    procs.start("node", "node", "--trainer", f"127.0.0.1:{zport}", "--data-dir", str(tmp_path / "node"),
                "--name", "n0", "--status-port", str(status_port), "--probe-prompt", PROBE)
    trainer.wait(timeout=300)
    assert trainer.returncode == 0

    summary = msgspec.json.decode((run_dir / "summary.json").read_bytes())
    assert summary["step"] == STEPS
    assert summary["accepted_groups"] >= STEPS * 4
    assert summary["refused"] == {}
    # A new node's first groups are all audited against the trainer's own forward pass, and pass.
    assert summary["audits"] >= 8
    assert summary["audit_calibration"]["max"] < 1e-3, summary["audit_calibration"]
    assert [e["step"] for e in summary["evals"]] == [0, 2, 4]
    assert len(summary["nodes"]) == 1 and summary["nodes"][0]["accepted_groups"] >= STEPS * 4

    status_url = f"http://127.0.0.1:{status_port}/status"
    status = wait_json(status_url, lambda s: s["version_loaded"] >= STEPS - 1, timeout=60)
    assert status["restarts"] == 0
    assert status["versions_loaded"] >= 3  # version 0 at start, then at least two live reloads
    assert len(status["reload_seconds"]) == status["versions_loaded"] - 1

    # The trainer's own greedy completion for each version the node probed.
    import torch

    from trainer.policy import encode_prompt, greedy_complete, load_model, load_tokenizer

    torch.set_num_threads(1)
    compared = 0
    for version, node_ids in get_json(status_url)["probes"].items():
        vdir = run_dir / "versions" / f"v{int(version):06d}"
        model, tok = load_model(vdir), load_tokenizer(vdir)
        want = greedy_complete(model, tok, [encode_prompt(tok, PROBE)], 16)[0]
        assert node_ids == want, f"version {version}: node {node_ids} != trainer {want}"
        compared += int(version) > 0
    assert compared >= 2
