"""bench/tree_sim.py runs (the 1000-peer figures in docs/tree-simulation.md come from it), and at 200 peers
shows what the origin's uplink probes are for: a new swarm's first version laid out by them."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

REPO = Path(__file__).resolve().parents[2]


def _run(tmp_path: Path, *extra: str) -> dict:
    out = tmp_path / f"sim{len(list(tmp_path.iterdir()))}.json"
    subprocess.run([sys.executable, "bench/tree_sim.py", "--n", "200", "--versions", "delta", "--designs", "tree",
                    "--seed", "1", "--warmups", "2", "--churn", "0.1", "--first-version-s", "20", "--json", str(out),
                    *extra], cwd=REPO, check=True, capture_output=True, timeout=120)
    (row,) = json.loads(out.read_text())["rows"]
    return row


def test_a_new_swarms_first_version_is_laid_out_by_the_origins_probes(tmp_path):
    probed, blind = _run(tmp_path), _run(tmp_path, "--no-probes")
    print(f"first version: {probed['warmup_T'][0]} s with probes, {blind['warmup_T'][0]} s without")
    assert probed["probed_at_first"] == 200 and blind["probed_at_first"] == 0
    assert probed["warmup_T"][0] < 0.5 * blind["warmup_T"][0]  # seed 1: 4.6 s against 25.2 s
    for r in (probed, blind):  # the measured version, with churn, reaches everyone present
        assert r["missing"] == 0 and r["T"] < 5 * r["bound"]
