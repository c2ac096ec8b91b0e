"""bench/probation_sim.py (the figures in docs/benchmarks.md come from it) at a smaller size: with the
trainer's own hand-out, paired test and verdicts, in a run whose policy improves steadily, no honest
newcomer is banned and no best-of-2 or best-of-4 newcomer is released, while the rule before issue 27
(compare any versions, oldest shared prompt first) bans honest newcomers that join late."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

REPO = Path(__file__).resolve().parents[2]


def test_late_honest_newcomers_pass_and_cherry_pickers_do_not(tmp_path):
    out = tmp_path / "sim.json"
    subprocess.run([sys.executable, "bench/probation_sim.py", "--seeds", "40", "--old-rule-seeds", "10",
                    "--slope", "1", "3", "--json", str(out)], cwd=REPO, check=True, timeout=300)
    rows = json.loads(out.read_text())["rows"]
    for r in rows:
        print(r["rule"], r["slope"], {k: r[k] for k in ("honest", "best_of_2", "best_of_4")})
    now = [r for r in rows if r["rule"] == "window"]
    old = [r for r in rows if r["rule"] == "old rule"]
    assert len(now) == 2 and len(old) == 2
    for r in now:
        assert r["honest"]["banned"] == 0 and r["honest"]["released"] >= 0.98 * r["honest"]["probations"], r
        for kind in ("best_of_2", "best_of_4"):
            assert r[kind]["released"] == 0 and r[kind]["banned"] >= 0.98 * r[kind]["probations"], r
    slow = next(r for r in old if r["slope"] == 1.0)
    assert slow["honest"]["banned"] >= 5, slow  # the old rule: 12% of late honest newcomers banned
