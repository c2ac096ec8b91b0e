"""A reference of the operator's own for the paired test: a colocated node or the trainer's own samples?

    python bench/reference.py [--window 90] [--json FILE]

Three runs of `swarm train configs/demo.toml` on this machine, each joined by the same two honest
strangers (real `swarm node`s with fresh keys, started once the trainer is up):
  baseline   the strangers' keys are trusted: no probation, no reference (what each step costs anyway)
  colocated  the operator also runs a node of its own on the trainer's machine and trusts it: strangers
             share prompts with it (today's advice)
  reference  `--reference`: the trainer samples each prompt of a key on probation itself, with the same
             weights, within guard.reference_budget
Per run: seconds from a stranger's registration to its release, and the learner's steps meanwhile; over
the --window seconds after both strangers registered, steps per minute and the learner's mean step time
(both against the baseline run), and the share of the window the reference spent sampling.
On a 2-core machine every process shares the same cores, so the colocated node's cost is what its engine
takes from the learner; on a GPU it would be a memory fraction and time-slices of the same device.
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
import tempfile
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))

from swarm_common.keys import KeyPair  # noqa: E402
from tests.conftest import Procs, free_port, get_json, wait_json  # noqa: E402


def one_run(name: str, root: Path, window: float) -> dict:
    root.mkdir(parents=True)
    procs = Procs(root)
    zport, hport, tport = free_port(), free_port(), free_port()
    strangers = {f"s{i}": KeyPair.load_or_create(root / f"s{i}" / "node.key").public_hex for i in range(2)}
    own = KeyPair.load_or_create(root / "own" / "node.key").public_hex
    extra = {"baseline": [a for k in strangers.values() for a in ("--trust", k)],
             "colocated": ["--trust", own], "reference": ["--reference"]}[name]
    url = f"http://127.0.0.1:{hport}/api/summary"
    node = ["node", "--trainer", f"127.0.0.1:{zport}"]
    try:
        trainer = procs.start("trainer", "train", "configs/demo.toml", "--run-dir", str(root / "run"), "--port",
                              str(zport), "--http-port", str(hport), "--max-steps", "100000", "--set",
                              f"server.tracker_port={tport}", "--set", "server.web_port=-1", "--set",
                              "train.checkpoint_every=0", "--set", "train.eval_every=100000", *extra)
        wait_json(url, timeout=300, proc=trainer)
        if name == "colocated":
            procs.start("own", *node, "--data-dir", str(root / "own"), "--name", "own")
            wait_json(url, lambda s: s["accepted_groups"] > 0, timeout=300, proc=trainer)
        for s in strangers:
            procs.start(s, *node, "--data-dir", str(root / s), "--name", s)
        registered: dict[str, tuple[float, int]] = {}
        released: dict[str, tuple[float, int]] = {}
        t_all = None
        end = time.monotonic() + 600
        while time.monotonic() < end:
            s = get_json(url, timeout=10)
            now = time.monotonic()
            rows = {n["node_id"]: n for n in s["nodes"]}
            for n, key in strangers.items():
                row = rows.get(key)
                if row is not None and n not in registered:
                    registered[n] = (now, s["step"])
                if row is not None and row["standing"] in ("established", "trusted") and n not in released:
                    released[n] = (now, s["step"])
            if t_all is None and len(registered) == len(strangers):
                t_all, step0, ref0 = now, s["step"], (s.get("pairing") or {}).get("reference_seconds", 0.0)
            if t_all is not None and now >= t_all + window and len(released) == len(strangers):
                break
            time.sleep(0.5)
        s = get_json(url, timeout=10)
        span = [r["step_seconds"] for r in s["steps"] if r["step"] > step0]
        ref = (s.get("pairing") or {}).get("reference_seconds", 0.0) - ref0
        elapsed = time.monotonic() - t_all
        return {
            "run": name,
            "release_s": {n: round(released[n][0] - registered[n][0], 1) for n in released},
            "release_steps": {n: released[n][1] - registered[n][1] for n in released},
            "steps_per_min": round(60 * (s["step"] - step0) / elapsed, 1),
            "step_s_mean": round(statistics.mean(span), 4) if span else None,
            "reference_share": round(ref / elapsed, 4),
            "reference_groups": (s.get("pairing") or {}).get("reference_groups", 0),
            "banned": s["banned"],
        }
    finally:
        procs.stop_all()


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--window", type=float, default=90.0, help="seconds measured after both strangers registered")
    ap.add_argument("--runs", nargs="+", default=["baseline", "colocated", "reference"])
    ap.add_argument("--json", help="write the figures here")
    args = ap.parse_args()
    rows = []
    with tempfile.TemporaryDirectory(prefix="bench-reference-") as tmp:
        for name in args.runs:
            rows.append(one_run(name, Path(tmp) / name, args.window))
            print(json.dumps(rows[-1]), flush=True)
    base = next((r for r in rows if r["run"] == "baseline"), None)
    print(f"\n{'run':<11}{'release s (s0, s1)':>22}{'steps meanwhile':>17}{'steps/min':>11}{'vs base':>9}"
          f"{'step s':>9}{'vs base':>9}{'reference':>11}")
    for r in rows:
        rel = ", ".join(f"{v:g}" for v in r["release_s"].values()) or "-"
        steps = ", ".join(str(v) for v in r["release_steps"].values()) or "-"
        ratio = f"{r['steps_per_min'] / base['steps_per_min']:.2f}" if base and base["steps_per_min"] else "-"
        sratio = (f"{r['step_s_mean'] / base['step_s_mean']:.2f}" if base and base["step_s_mean"]
                  and r["step_s_mean"] else "-")
        print(f"{r['run']:<11}{rel:>22}{steps:>17}{r['steps_per_min']:>11}{ratio:>9}{r['step_s_mean'] or '-':>9}"
              f"{sratio:>9}{100 * r['reference_share']:>10.1f}%")
    if args.json:
        Path(args.json).write_text(json.dumps({"rows": rows}, indent=1))


if __name__ == "__main__":
    main()
