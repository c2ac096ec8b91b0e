"""`swarm status --trainer HOST:PORT`: the trainer's web view, as text in the terminal.

It reads the trainer's /api/view JSON (served on the web port and on the HTTP port), so it needs
nothing of the trainer's code and works from any machine that can reach it.
"""

from __future__ import annotations

import json
import time
import urllib.error
import urllib.request


def _relay(n: dict) -> str:
    """The tracker's connect-back verdict on the node's relay."""
    reachable = n.get("relay_reachable")
    return "reachable" if reachable else "leaf" if reachable is False else "-"


def view_url(trainer: str) -> str:
    base = trainer if trainer.startswith(("http://", "https://")) else f"http://{trainer}"
    return base.rstrip("/") + "/api/view"


def fetch_view(trainer: str, timeout: float = 5.0) -> dict:
    with urllib.request.urlopen(view_url(trainer), timeout=timeout) as r:
        return json.loads(r.read())


def _dur(s: float) -> str:
    s = int(max(0, s))
    return f"{s // 3600}h{s % 3600 // 60:02d}m" if s >= 3600 else f"{s // 60}m{s % 60:02d}s"


def _counts(d: dict[str, int]) -> str:
    return ", ".join(f"{k} {v}" for k, v in sorted(d.items(), key=lambda kv: -kv[1])) or "-"


def _spark(values: list[float], width: int = 40) -> str:
    """The last `width` values as a one-line bar chart, scaled to their maximum."""
    vals = values[-width:]
    top = max(vals, default=0.0)
    if top <= 0:
        return "(nothing accepted yet)"
    blocks = " ▁▂▃▄▅▆▇█"
    return "".join(blocks[min(8, round(8 * v / top))] for v in vals)


def render(v: dict) -> str:
    ov, tp = v["overview"], v["throughput"]
    lines = []
    state = "finished" if ov["done"] else "running"
    lines.append(f"trainer: {state}, step {ov['step']}/{ov['max_steps']}, policy v{ov['version']}, "
                 f"RL time {_dur(ov['elapsed_s'])}")
    pg = ov.get("pairing") or {}
    if pg.get("waiting_keys"):
        lines.append(f"WAITING: {pg['waiting_keys']} node(s) on probation with nobody to pair them with; "
                     f"{pg['waiting_groups']} group(s) wait in quarantine. Fix: swarm train --reference, or "
                     "--trust KEY of a node you run")
    if pg.get("release_unpaired"):
        lines.append("NOTE: guard.release_unpaired is on: nodes with no reference are released unchecked")
    lines.append(f"throughput: {ov['tokens_per_s']:.0f} tokens/s, {ov['rollouts_per_s']:.2f} rollouts/s "
                 f"(accepted, last {tp['window_s']:g} s)")
    if tp["tokens_per_s"]:
        lines.append(f"  tokens/s, last {min(40, len(tp['tokens_per_s']))} s: {_spark(tp['tokens_per_s'])}")
    steps, evals = v["steps"], v["evals"]
    if steps:
        s = steps[-1]
        lines.append(f"learning: step {s['step']} mean reward {s['reward_mean']:.3f}, correct {s['correct_mean']:.3f}, "
                     f"lag {s['lag_mean']:.2f}")
    if evals:
        curve = " ".join(f"{e['step']}:{e['accuracy']:.2f}" for e in evals[-8:])
        lines.append(f"held-out accuracy (step:acc): {curve}")
    lines.append(f"groups: {ov['accepted_groups']} accepted, {ov['trained_groups']} trained on, "
                 f"{ov['tokens_generated']} tokens")
    lines.append(f"lag of accepted groups: {_counts({f'lag {k}': n for k, n in ov['lag_counts'].items()})}")
    lines.append(f"refused: {_counts(ov['refused'])}")
    lines.append(f"dropped after acceptance: {_counts(ov['dropped'])}")
    lines.append("")
    hdr = f"{'node':<12} {'id':<12} {'state':<8} {'standing':<11} {'version':>7} {'tok/s':>7} {'roll/s':>7} {'share':>6} " \
          f"{'heartbeat':>9} {'relay':<10} refused"
    lines.append(hdr)
    for n in v["overview"]["nodes"]:
        ver = f"v{n['version_loaded']}" if n["version_loaded"] >= 0 else "-"
        lines.append(f"{n['name'][:12]:<12} {n['node_id'][:12]:<12} {n['state']:<8} {n.get('standing', ''):<11} {ver:>7} "
                     f"{n['tokens_per_s']:>7.0f} {n['rollouts_per_s']:>7.2f} {100 * n['share']:>5.1f}% "
                     f"{n['last_heartbeat_age_s']:>7.1f}s  {_relay(n):<10} {_counts(n['refused'])}")
    if not ov["nodes"]:
        lines.append("(no node has registered yet)")
    tree = ov.get("tree")
    lines.append("")
    if not tree:
        lines.append("relay tree: none yet")
    else:
        held = [max(p["complete"]) for p in tree["peers"] if p["complete"]]
        current = sum(1 for h in held if h == tree["latest"])
        lines.append(f"relay tree: {len(tree['peers'])} peers, {tree['trees']} trees, fanout {tree['fanout']}, "
                     f"latest v{tree['latest']}; {current} peers hold it")
    return "\n".join(lines)


def run(trainer: str, watch: float = 0.0, as_json: bool = False) -> int:
    while True:
        try:
            v = fetch_view(trainer)
        except (urllib.error.URLError, OSError, ValueError) as e:
            print(f"swarm status: cannot read {view_url(trainer)}: {e}", flush=True)
            if not watch:
                return 1
        else:
            print(json.dumps(v, indent=2) if as_json else render(v), flush=True)
        if not watch:
            return 0
        time.sleep(watch)
        print()
