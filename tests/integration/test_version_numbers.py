"""A trainer key never signs two different versions under one number.

The demo starts afresh each time: it empties the run's versions/ and broadcast/ but keeps trainer.key, which
its nodes have pinned. Numbered from 0 again, the second demo's v398 met the first demo's v398 (same key,
other weights) still held by both nodes, which loaded it and failed their audits until banned.
"""

from __future__ import annotations

from swarm.demo import start_afresh
from tests.conftest import free_port
from trainer.publisher import LAST_SIGNED


def _run(procs, run_dir, name: str) -> None:
    p = procs.start(name, "train", "--run-dir", str(run_dir), "--max-steps", "0", "--port", str(free_port()),
                    "--http-port", str(free_port()), "--set", f"server.tracker_port={free_port()}",
                    "--set", "model.sft_steps=0", "--set", "server.web_port=-1")
    assert p.wait(timeout=120) == 0, p.log_path.read_text()[-2000:]


def test_a_run_started_afresh_numbers_above_every_version_its_key_signed(tmp_path, procs):
    run_dir = tmp_path / "run"
    _run(procs, run_dir, "first")
    first = sorted(p.name for p in (run_dir / "versions").iterdir())
    assert first == ["v000000"] and (run_dir / LAST_SIGNED).read_text().strip() == "0"

    start_afresh(run_dir, [])  # what `swarm demo` does before each demo
    assert not (run_dir / "versions").exists()
    _run(procs, run_dir, "second")
    assert sorted(p.name for p in (run_dir / "versions").iterdir()) == ["v000001"]
    assert (run_dir / LAST_SIGNED).read_text().strip() == "1"
