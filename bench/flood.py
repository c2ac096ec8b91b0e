"""Strangers cost what they take: a run's pace, its API and a new honest key under a flood of throwaway keys.

    python bench/flood.py [--keys 2000] [--addresses 100] [--window 60] [--active] [--json FILE]

Starts `swarm train configs/demo.toml` with one trusted vLLM node of the operator's. Then:
  before  --window seconds of the run alone: steps per minute, /api/summary latency (median of 20)
  during  --keys keys from --addresses source addresses (127.1.i.1, each in a /24 of its own: the budget
          per prefix does not help here) register as fast as the trainer lets them, each asks for work once
          (and, with --active, heartbeats and asks again every 2 s), and never answers; 20 s in, a new honest
          key (an HF sampler with the published weights, tests/adversarial/evil_node.py) registers and asks
          for work like a node: seconds until it gets work, and until it is released by the paired test
  after   the flood's keys go silent: --window seconds more, the same figures
Goals (issue 27): steps per minute during and after >= 90% of before, /api/summary under 20 ms, the new
key gets work within 10 s and is released.
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
import tempfile
import threading
import time
import urllib.request
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))

import zmq  # noqa: E402

from swarm_common import protocol as P  # noqa: E402
from swarm_common.keys import KeyPair  # noqa: E402
from tests.adversarial.evil_node import EvilNode, Sampler  # noqa: E402
from tests.conftest import Procs, free_port, get_json, wait_json  # noqa: E402


def summary_ms(url: str, n: int = 20) -> float:
    times = []
    for _ in range(n):
        t0 = time.perf_counter()
        with urllib.request.urlopen(url, timeout=10) as r:
            r.read()
        times.append(1000 * (time.perf_counter() - t0))
        time.sleep(0.05)
    return round(statistics.median(times), 1)


def pace(url: str, seconds: float) -> float:
    """Steps per minute over the next `seconds`."""
    s0, t0 = get_json(url)["step"], time.monotonic()
    time.sleep(seconds)
    return round(60 * (get_json(url)["step"] - s0) / (time.monotonic() - t0), 1)


class Flood(threading.Thread):
    """Keys spread over source addresses; each address registers its keys one at a time (a refusal is
    retried after a second), and every registered key asks for work once (--active: again every 2 s)."""

    def __init__(self, port: int, keys: int, addresses: int, active: bool):
        super().__init__(daemon=True)
        self.ctx = zmq.Context()
        self.socks = []
        self.todo: list[list[KeyPair]] = []
        for i in range(addresses):
            s = self.ctx.socket(zmq.DEALER)
            s.setsockopt(zmq.LINGER, 0)
            s.connect(f"tcp://127.1.{i}.1:0;127.0.0.1:{port}")
            self.socks.append(s)
            self.todo.append([KeyPair.generate() for _ in range(keys // addresses + (i < keys % addresses))])
        self.active, self.stop = active, threading.Event()
        self.registered = self.refused = self.work_held = 0
        # Per registered key, its heartbeat and work request, signed once: the flood's own CPU (signing) is
        # spent on these 2 cores too, and an attacker's would be spent elsewhere.
        self.frames: list[tuple[int, list[bytes], list[bytes]]] = []

    def run(self) -> None:
        poller = zmq.Poller()
        for s in self.socks:
            poller.register(s, zmq.POLLIN)
        pending = [False] * len(self.socks)
        retry_at = [0.0] * len(self.socks)
        last_ask = 0.0
        while not self.stop.is_set():
            now = time.monotonic()
            for i, s in enumerate(self.socks):
                if not pending[i] and self.todo[i] and now >= retry_at[i]:
                    kp = self.todo[i][-1]
                    s.send_multipart(P.sign(P.Register(node_id=kp.public_hex, name=f"flood{i}",
                                                       time_ms=int(time.time() * 1000)), kp))
                    pending[i] = True
            for sock, _ in poller.poll(50):
                i = self.socks.index(sock)
                msg = P.decode(sock.recv())
                if isinstance(msg, P.Registered):
                    kp = self.todo[i].pop()
                    pending[i] = False
                    self.registered += 1
                    ask = P.sign(P.WorkRequest(node_id=kp.public_hex, version_loaded=msg.weights.version,
                                               max_prompts=4), kp)
                    beat = P.sign(P.Heartbeat(node_id=kp.public_hex, version_loaded=0, tokens_per_s=0.0), kp)
                    self.frames.append((i, beat, ask))
                    sock.send_multipart(ask)
                elif isinstance(msg, P.Error) and pending[i]:
                    pending[i] = False
                    self.refused += 1
                    retry_at[i] = time.monotonic() + 1.0
                elif isinstance(msg, P.WorkAssignment):
                    self.work_held += len(msg.assignments)
            if self.active and time.monotonic() > last_ask + 2.0:
                last_ask = time.monotonic()
                for i, beat, ask in self.frames:
                    self.socks[i].send_multipart(beat)
                    self.socks[i].send_multipart(ask)

    def close(self) -> None:
        self.stop.set()
        self.join(5)
        for s in self.socks:
            s.close(0)
        self.ctx.term()


def newcomer(port: int, run_dir: Path, url: str, out: dict, stop: threading.Event) -> None:
    """An honest key that joins during the flood: time to its first work, and to its release."""
    ev = EvilNode(port, "newcomer")
    sampler = Sampler(run_dir, max_tokens=6, seed=1)
    try:
        t0 = time.monotonic()
        ev.register()
        while not stop.is_set():
            if (work := ev.ask(4)) is None:
                continue
            out.setdefault("first_work_s", round(time.monotonic() - t0, 1))
            v = work.weights.version
            ev.submit(v, [P.Rollout(a.assignment_id, sampler.sample(v, a.prompt_token_ids, 8))
                          for a in work.assignments])
            row = next((n for n in get_json(url)["nodes"] if n["node_id"] == ev.node_id), {})
            if row.get("standing") == "established":
                out["released_s"] = round(time.monotonic() - t0, 1)
                out["refused"] = row.get("refused", {})
                return
    finally:
        ev.close()


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--keys", type=int, default=2000)
    ap.add_argument("--addresses", type=int, default=100)
    ap.add_argument("--window", type=float, default=60.0)
    ap.add_argument("--active", action="store_true", help="the flood's keys heartbeat and ask for work every 2 s")
    ap.add_argument("--json")
    args = ap.parse_args()
    with tempfile.TemporaryDirectory(prefix="bench-flood-") as tmp:
        root = Path(tmp)
        procs = Procs(root)
        zport, hport, tport = free_port(), free_port(), free_port()
        own = KeyPair.load_or_create(root / "own" / "node.key").public_hex
        url = f"http://127.0.0.1:{hport}/api/summary"
        res: dict = {"keys": args.keys, "addresses": args.addresses, "active": args.active}
        try:
            trainer = procs.start("trainer", "train", "configs/demo.toml", "--run-dir", str(root / "run"), "--port",
                                  str(zport), "--http-port", str(hport), "--max-steps", "1000000", "--trust", own,
                                  "--set", f"server.tracker_port={tport}", "--set", "server.web_port=-1",
                                  "--set", "train.checkpoint_every=0", "--set", "train.eval_every=1000000",
                                  "--set", "train.keep_versions=40")
            wait_json(url, timeout=300, proc=trainer)
            procs.start("own", "node", "--trainer", f"127.0.0.1:{zport}", "--data-dir", str(root / "own"))
            wait_json(url, lambda s: s["step"] >= 20, timeout=300, proc=trainer)
            res["before"] = {"steps_per_min": pace(url, args.window), "summary_ms": summary_ms(url)}
            print("before", res["before"], flush=True)

            flood = Flood(zport, args.keys, args.addresses, args.active)
            flood.start()
            new: dict = {}
            stop = threading.Event()
            joiner = threading.Timer(20.0, newcomer, (zport, root / "run", url, new, stop))
            joiner.start()
            during = pace(url, args.window)
            res["during"] = {"steps_per_min": during, "summary_ms": summary_ms(url),
                             "registered": flood.registered, "refused": flood.refused, "work_held": flood.work_held}
            print("during", res["during"], flush=True)
            flood.close()
            res["after"] = {"steps_per_min": pace(url, args.window), "summary_ms": summary_ms(url)}
            joiner.join(timeout=max(1.0, 120 - args.window))
            stop.set()
            res["newcomer"] = new
            s = get_json(url)
            res["after"].update(listed_nodes=len(s["nodes"]), silent_keys=s["silent_keys"])
            print("after", res["after"], "newcomer", new, flush=True)
        finally:
            procs.stop_all()
    b = res["before"]["steps_per_min"]
    print(f"\n{'phase':<8}{'steps/min':>10}{'vs before':>11}{'summary ms':>12}")
    for phase in ("before", "during", "after"):
        r = res[phase]
        print(f"{phase:<8}{r['steps_per_min']:>10}{r['steps_per_min'] / b:>11.2f}{r['summary_ms']:>12}")
    print(f"flood: {res['during']['registered']} keys registered, {res['during']['refused']} registrations refused; "
          f"new honest key: work after {new.get('first_work_s', '-')} s, released after {new.get('released_s', '-')} s")
    if args.json:
        Path(args.json).write_text(json.dumps(res, indent=1))


if __name__ == "__main__":
    main()
