"""`swarm demo`: a trainer and N inference nodes as separate processes on 127.0.0.1, watched live.

The processes talk only over the network (zmq for work, HTTP for weights); the demo itself reads the
trainer's /api/summary to print progress, then the run's summary.json for the final table.
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import signal
import socket
import subprocess
import sys
import time
import urllib.request
from pathlib import Path

from swarm.flags import run_overrides
from swarm_common.keys import KeyPair
from trainer.config import RunConfig, dump_config, load_config


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _port_free(port: int) -> bool:
    with socket.socket() as s:
        try:
            s.bind(("127.0.0.1", port))
            return True
        except OSError:
            return False


def node_threads(cfg: RunConfig, nodes: int) -> int:
    """Threads for a node's engine on the trainer's machine. On-policy (max_lag 0) a lone node and the
    learner take turns, so the engine may use every core the learner does; otherwise they all run at
    once and each node keeps to one."""
    return max(1, cfg.train.torch_threads) if cfg.train.max_lag == 0 and nodes == 1 else 1


def _summary(url: str) -> dict | None:
    try:
        with urllib.request.urlopen(url, timeout=2) as r:
            return json.loads(r.read())
    except (OSError, ValueError):
        return None


def stop_processes(procs: list[subprocess.Popen], timeout: float = 15.0) -> None:
    for p in procs:
        if p.poll() is None:
            p.send_signal(signal.SIGTERM)
    end = time.monotonic() + timeout
    for p in procs:
        try:
            p.wait(max(0.1, end - time.monotonic()))
        except subprocess.TimeoutExpired:
            p.kill()
            p.wait()


def _fmt_progress(s: dict, t0: float) -> str:
    last = s["steps"][-1] if s["steps"] else None
    ev = s["evals"][-1] if s["evals"] else None
    nodes = " ".join(f"{n['name']}:{n['tokens_per_s']:.0f}tok/s(v{n['version_loaded']})" for n in s["nodes"])
    parts = [f"[{time.monotonic() - t0:6.0f}s] step {s['step']}/{s['max_steps']}"]
    if last:
        parts.append(f"reward {last['reward_mean']:.3f} correct {last['correct_mean']:.3f} lag {last['lag_mean']:.2f}")
    if ev:
        parts.append(f"eval acc {ev['accuracy']:.3f} @step {ev['step']}")
    parts.append(f"swarm {s['tokens_per_s']:.0f} tok/s | {nodes}")
    eps = [n for n in s["nodes"] if n.get("mean_turns")]
    if eps:  # multi-turn work: episodes/s, and per episode its turns and tool calls
        parts.append(f"{s.get('episodes_per_s', 0):.1f} episodes/s, "
                     f"{sum(n['mean_turns'] for n in eps) / len(eps):.2f} turns and "
                     f"{sum(n['tool_calls_per_episode'] for n in eps) / len(eps):.2f} tool calls per episode")
    return " | ".join(parts)


def demo_config(args) -> None:
    """The demo's config unless one is given: configs/demo.toml (its warm-up stops at a target accuracy, so
    the run starts alike on any machine), or with `--task ENV` the environment's (configs/ENV.toml); and its
    target gain."""
    path = Path(__file__).resolve().parent.parent / "configs" / f"{args.task or 'demo'}.toml"
    if args.task and not args.config and not path.exists():
        raise ValueError(f"no demo config for {args.task!r} ({path}); pass a config and --set task.name=...")
    if not args.config and path.exists():
        args.config = str(path)
    if args.min_gain is None:
        args.min_gain = 0.20 if args.task else 0.30


def start_afresh(run_dir: Path, node_dirs: list[Path]) -> None:
    """A demo is a fresh run each time: only the (cached) base model and the keys are kept."""
    run_dir.mkdir(parents=True, exist_ok=True)
    for old in ("versions", "checkpoints", "broadcast"):
        shutil.rmtree(run_dir / old, ignore_errors=True)
    for old in ("summary.json", "accepted.jsonl", "batches.jsonl", "dropped.jsonl", "bans.json"):
        (run_dir / old).unlink(missing_ok=True)
    for d in node_dirs:  # the nodes' versions of an earlier demo (its numbers are below this one's: trainer.py)
        shutil.rmtree(d / "tree", ignore_errors=True)


def run_demo(args) -> int:
    demo_config(args)
    # The ports are picked below (free ones when the defaults are taken), not passed through as overrides.
    flags = argparse.Namespace(**{**vars(args), "port": None, "http_port": None, "web_port": None})
    cfg = load_config(args.config, [*run_overrides(flags), f"train.max_minutes={args.minutes}"])
    # The demo's nodes are the operator's own: trusted, so they train without probation.
    node_dirs = [Path(cfg.run_dir) / f"node{i}" for i in range(args.nodes)]
    cfg.guard.trusted = cfg.guard.trusted | {KeyPair.load_or_create(d / "node.key").public_hex for d in node_dirs}
    # Pick free ports when the defaults are taken, so a second demo or a stale process cannot collide.
    if args.port is None and not _port_free(cfg.server.port):
        cfg.server.port = free_port()
    elif args.port is not None:
        cfg.server.port = args.port
    if args.http_port is None and not _port_free(cfg.server.http_port):
        cfg.server.http_port = free_port()
    elif args.http_port is not None:
        cfg.server.http_port = args.http_port
    if args.web_port is not None:
        cfg.server.web_port = args.web_port
    elif cfg.server.web_port > 0 and not _port_free(cfg.server.web_port):
        cfg.server.web_port = free_port()
    web_host = "127.0.0.1" if cfg.server.web_host in ("", "0.0.0.0") else cfg.server.web_host
    web_url = f"http://{web_host}:{cfg.server.web_port}/" if cfg.server.web_port > 0 else None
    run_dir = Path(cfg.run_dir)
    start_afresh(run_dir, node_dirs)
    cfg_path = run_dir / "demo.toml"
    cfg_path.write_text(dump_config(cfg))

    env = {**os.environ, "OMP_NUM_THREADS": "1", "PYTHONUNBUFFERED": "1", "TOKENIZERS_PARALLELISM": "false"}
    node_env = {**env, "OMP_NUM_THREADS": str(node_threads(cfg, args.nodes))}
    py = [sys.executable, "-m", "swarm.cli"]
    t0 = time.monotonic()
    print(f"demo: run dir {run_dir}, trainer on tcp://127.0.0.1:{cfg.server.port}, "
          f"status http://127.0.0.1:{cfg.server.http_port}/api/summary")
    print(f"demo: logs in {run_dir}/trainer.log and {run_dir}/node*.log")
    if web_url:
        print(f"demo: live web view at {web_url} (in a terminal: swarm status --trainer {web_url})")
    procs: list[subprocess.Popen] = []
    logs = []
    try:
        log = open(run_dir / "trainer.log", "w")
        logs.append(log)
        trainer = subprocess.Popen([*py, "train", str(cfg_path)], stdout=log, stderr=subprocess.STDOUT, env=env)
        procs.append(trainer)
        for i in range(args.nodes):
            log = open(run_dir / f"node{i}.log", "w")
            logs.append(log)
            procs.append(subprocess.Popen(
                [*py, "node", "--trainer", f"tcp://127.0.0.1:{cfg.server.port}", "--data-dir",
                 str(node_dirs[i]), "--name", f"node{i}", "--seed", str(i)],
                stdout=log, stderr=subprocess.STDOUT, env=node_env))
        url = f"http://127.0.0.1:{cfg.server.http_port}/api/summary"
        last_print = 0.0
        announced = False
        while trainer.poll() is None:
            time.sleep(1.0)
            for p in procs[1:]:
                if p.poll() is not None:
                    print(f"demo: a node exited with code {p.returncode}; see its log")
                    procs.remove(p)
            s = _summary(url)
            if s is None:
                if time.monotonic() - last_print > 15:
                    print(f"[{time.monotonic() - t0:6.0f}s] starting: building/warming the model, loading engines...")
                    last_print = time.monotonic()
                continue
            if not announced:
                print(f"[{time.monotonic() - t0:6.0f}s] trainer up; RL runs for {args.minutes:g} min "
                      f"or {cfg.train.max_steps} steps" + (f"; watch it at {web_url}" if web_url else ""))
                announced = True
            if time.monotonic() - last_print >= 5:
                print(_fmt_progress(s, t0), flush=True)
                last_print = time.monotonic()
        rc = trainer.returncode
    finally:
        stop_processes(procs)
        for f in logs:
            f.close()
    total = time.monotonic() - t0
    summary_file = run_dir / "summary.json"
    if rc != 0 or not summary_file.exists():
        print(f"demo: the trainer failed (exit code {rc}); see {run_dir}/trainer.log")
        return 1
    s = json.loads(summary_file.read_text())
    return _report(s, total, args)


def _report(s: dict, total: float, args) -> int:
    evals = s["evals"]
    start, best, final = evals[0]["accuracy"], max(e["accuracy"] for e in evals), evals[-1]["accuracy"]
    print("\nheld-out greedy accuracy (the eval curve)")
    print(f"{'step':>6} {'RL time s':>10} {'accuracy':>9}")
    stride = max(1, len(evals) // 24)  # a readable table; --json has every point
    for i, e in enumerate(evals):
        if i % stride == 0 or i == len(evals) - 1:
            print(f"{e['step']:>6} {e['time']:>10.1f} {e['accuracy']:>9.3f}")
    print("\nnodes")
    print(f"{'name':<8} {'state':<8} {'version':>7} {'tok/s':>8} {'groups':>7} refused")
    for n in s["nodes"]:
        print(f"{n['name']:<8} {n['state']:<8} {n['version_loaded']:>7} {n['tokens_per_s']:>8.0f} "
              f"{n['accepted_groups']:>7} {n['refused'] or '-'}")
    lags = [r["lag_mean"] for r in s["steps"]]
    print("\nsummary")
    rows = [
        ("steps", s["step"]),
        ("wall time incl. start-up (s)", round(total, 1)),
        ("RL time (s)", s["elapsed_s"]),
        ("groups accepted / trained", f"{s['accepted_groups']} / {s['trained_groups']}"),
        ("groups dropped", s["dropped"] or "-"),
        ("submissions refused", s["refused"] or "-"),
        ("tokens generated", s["tokens_generated"]),
        ("mean lag (versions)", round(sum(lags) / len(lags), 3) if lags else "-"),
        ("accuracy start -> final (best)", f"{start:.3f} -> {final:.3f} ({best:.3f})"),
        ("gain (final - start)", f"{final - start:+.3f}"),
    ]
    for k, v in rows:
        print(f"  {k:<32} {v}")
    learned = final - start >= args.min_gain
    print(f"\ndemo: {'LEARNED' if learned else 'did not reach'} the target gain of {args.min_gain:+.2f}")
    if args.json:
        out = {"wall_seconds": total, "start_accuracy": start, "final_accuracy": final, "best_accuracy": best,
               "gain": final - start, "learned": learned, "summary": s}
        Path(args.json).write_text(json.dumps(out, indent=2))
    return 0 if learned else 1
