"""Issue 29's attacks on the relay tree across network namespaces: every honest relay, the origin and the
attackers on hosts of their own (tests/netlab/lab.py), every uplink shaped by the kernel (tc tbf).

Each attack gets a fresh lab: the origin, `--honest` `swarm relay` processes, then versions unattacked; then
`--attackers` two-faced keys (tests/adversarial/tree_attacker.py, two keys to a host: they speak only the
documented protocol) and as many versions attacked. A row: the median time until every honest relay holds a
version, attacked over unattacked (issue 29's goal: <= 1.5x), and honest relays demoted, banned, refused or
penalized by the end (goal 0). `smart` keys serve every request in full while they have no children (only
the origin asks a leaf for pieces); `--trusted`: the trainer calls the honest relays established, as it
does its own nodes. Needs root and iproute2.

  python bench/tree_attacks_netns.py                       # liars, loris, friends; smart keys
  python bench/tree_attacks_netns.py --trusted --attacks liars
"""

from __future__ import annotations

import argparse
import asyncio
import json
import logging
import os
import statistics
import sys
import tempfile
import time
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO))

from bench.broadcast_netns import Proc, wait_for  # noqa: E402

ATTACKER = REPO / "tests" / "adversarial" / "tree_attacker.py"
PORT = 7000
MiB = 1 << 20


# -- the origin, on its own host: commands on stdin, answers on stdout --------------------------------------
def log_layout(tr, v: int) -> None:
    """The layout version `v` flew in, to the origin's log (read from a kept lab): per member, its figure,
    whether measured idle, its group, children and parents per tree."""
    f = tr.forest
    parents, children = f.topology()

    def where(pid: str | None) -> str | None:  # a member's host:port (None: the origin)
        return (tr.peers[pid].url or "").split("//")[-1] if pid in tr.peers else pid

    dump = {}
    for p in tr.peers.values():
        fig = f.uploads.placed.get(p.url or "")
        dump[f"{p.name or '?'}@{where(p.peer_id)}"] = [
            None if fig is None else round(fig), f.uploads.idle(p.url or ""), p.group,
            [len(children[t].get(p.peer_id, ())) for t in range(f.k)],
            [where(parents[t].get(p.peer_id)) for t in range(f.k)]]
    logging.getLogger("bench.layout").info("LAYOUT v%d origin=%s %s", v, f.uploads.placed.get("origin"),
                                           json.dumps(dump))


def origin_role(args: argparse.Namespace) -> None:
    """`trust NAME...` (the trainer calls these members established), `publish` (the next version; prints
    `PUB v t0`), `state` (prints `STATE {json}`: what the tracker did to the honest relays and the attackers),
    `stop`."""
    from broadcast.config import OriginConfig
    from broadcast.origin import Origin
    from swarm_common.keys import KeyPair

    logging.basicConfig(level=logging.INFO, format="%(asctime)s %(levelname)s %(name)s: %(message)s",
                        datefmt="%H:%M:%S")

    async def main() -> None:
        d = Path(args.dir)
        o = Origin(d, KeyPair.load_or_create(d / "key"), OriginConfig(
            piece_bytes=args.piece_kib << 10, heartbeat_s=0.5), host=args.bind, port=PORT)
        await o.start()
        tr = o.tracker
        print("READY", flush=True)
        loop, v = asyncio.get_running_loop(), 0
        while (line := (await loop.run_in_executor(None, sys.stdin.readline)).split()) and line[0] != "stop":
            if line[0] == "trust":
                for p in list(tr.peers.values()):
                    if p.name in line[1:]:
                        o.set_standing(p.key)
                print("OK", flush=True)
            elif line[0] == "publish":
                log_layout(tr, v)
                v += 1
                vdir = d / f"v{v}"
                vdir.mkdir(parents=True)
                (vdir / "model.safetensors").write_bytes(os.urandom(int(args.size_mib * MiB)))
                t0 = time.time()
                await o.publish(vdir, v, None, full=True)
                print(f"PUB {v} {t0:.6f}", flush=True)
            elif line[0] == "state":
                honest = [p for p in tr.peers.values() if p.name.startswith("honest")]
                bad = [p for p in tr.peers.values() if p.name == "twofaced"]
                print("STATE " + json.dumps({
                    "honest": len(honest),
                    "honest_proven": sum(p.key in tr.proven for p in honest),
                    "honest_demoted": sum(p.demoted or p.reachable is False or p.key not in tr.proven for p in honest),
                    "honest_banned": sum(p.key in tr.banned_keys for p in honest),
                    "honest_penalized": sum(tr.points(p.key) > 0 for p in honest),
                    "attackers": len(bad), "attackers_with_standing": sum(tr.has_standing(p) for p in bad),
                    "refused": dict(tr.refused), "urls": [p.url for p in honest]}), flush=True)
        await o.stop()

    asyncio.run(main())


# -- one attack, one lab ------------------------------------------------------------------------------------
def run_attack(mode: str, args: argparse.Namespace, root: Path) -> dict:
    from tests.netlab.lab import Lab

    env = dict(os.environ, PYTHONPATH=str(REPO), PYTHONUNBUFFERED="1", OMP_NUM_THREADS="1")
    up = int(args.rate_mib * MiB * 8)
    with Lab(log_dir=root / "logs") as lab:
        oh = lab.add_host("origin", up=up)
        o = Proc(lab, oh, [sys.executable, __file__, "--origin-role", "--bind", oh.ip, "--dir", str(root / "origin"),
                           "--piece-kib", str(args.piece_kib), "--size-mib", str(args.size_mib)], env)
        wait_for(lambda: o.has("READY"), 60, "the origin", [o])
        key = (root / "origin" / "key.pub").read_text().strip()
        tracker = f"http://{oh.ip}:{PORT}"
        relays = []
        for i in range(args.honest):
            h = lab.add_host(f"honest{i}", up=up)
            relays.append(lab.popen(h, [sys.executable, "-m", "swarm", "relay", "--tracker", tracker, "--trainer-key",
                                        key, "--data-dir", str(root / h.name), "--name", h.name, "--relay-host", h.ip],
                                    env=env, cwd=REPO))
        asked = [0]

        def state() -> dict:
            asked[0] += 1
            o.send("state")
            wait_for(lambda: sum(s.startswith("STATE") for _, s in o.lines) >= asked[0], 30, "the origin's state", [o])
            return json.loads([s for _, s in o.lines if s.startswith("STATE")][-1][6:])

        wait_for(lambda: state()["honest"] == args.honest, 120, "the honest relays to join", [o])
        if args.trusted:
            o.send("trust " + " ".join(f"honest{i}" for i in range(args.honest)))
        published = [0]

        def deliver(timeout: float) -> float | None:
            published[0] += 1
            v = published[0]
            o.send("publish")
            wait_for(lambda: o.has(f"PUB {v} "), 60, f"v{v} published", [o])
            t0 = float(o.has(f"PUB {v} ").split()[2])
            dirs = [root / f"honest{i}" / "versions" / f"v{v}" for i in range(args.honest)]
            end = time.monotonic() + timeout
            while not all(d.is_dir() for d in dirs):
                if time.monotonic() > end:
                    return None
                time.sleep(0.02)
            return time.time() - t0

        first = deliver(args.timeout)  # v1: the honest relays hold it, and show the origin they upload
        wait_for(lambda: state()["honest_proven"] == args.honest, 60, "the honest relays to show they upload", [o])
        base = [deliver(args.timeout) for _ in range(args.versions)]
        urls = state()["urls"] if mode == "liars" else []
        attackers = []
        for j in range(-(-args.attackers // 2)):
            h = lab.add_host(f"attacker{j}", up=up)
            n = min(2, args.attackers - 2 * j)
            argv = [sys.executable, str(ATTACKER), mode, tracker, str(n), *(["smart"] if args.smart else []), *urls]
            attackers.append(Proc(lab, h, argv, dict(env, ATTACKER_HOST=h.ip)))
        wait_for(lambda: all(a.has("READY") for a in attackers), 120, "the attackers", attackers)
        time.sleep(2.0)
        hit: list[float | None] = []
        for _ in range(args.versions):
            hit.append(deliver(args.timeout))
            if hit[-1] is None:  # a stopped broadcast: the rest are not tried
                break
        time.sleep(1.5)
        end = state()
        for a in attackers:
            a.send("stop")
        o.send("stop")
        for p in relays:
            p.terminate()
    b = None if None in base else statistics.median(base)  # None: an unattacked version stopped too
    t = None if None in hit else statistics.median(hit)
    return {"attack": mode, "smart": args.smart, "trusted": args.trusted, "first_s": first, "unattacked_s": base,
            "attacked_s": hit, "ratio": None if t is None or b is None else t / b,
            **{k: v for k, v in end.items() if k != "urls"}}


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--origin-role", action="store_true", help=argparse.SUPPRESS)
    ap.add_argument("--bind", help=argparse.SUPPRESS)
    ap.add_argument("--dir", help=argparse.SUPPRESS)
    ap.add_argument("--attacks", nargs="+", default=["liars", "loris", "friends"],
                    choices=["liars", "loris", "friends"])
    ap.add_argument("--honest", type=int, default=22)
    ap.add_argument("--attackers", type=int, default=10, help="attacker keys (two to a host)")
    ap.add_argument("--no-smart", dest="smart", action="store_false",
                    help="attackers that do not tell a leaf's requests apart")
    ap.add_argument("--trusted", action="store_true", help="the trainer calls the honest relays established")
    ap.add_argument("--size-mib", type=float, default=4.0)
    ap.add_argument("--rate-mib", type=float, default=0.5, help="every host's uplink (tbf), MiB/s")
    ap.add_argument("--piece-kib", type=int, default=256)
    ap.add_argument("--versions", type=int, default=3, help="versions unattacked, then as many attacked")
    ap.add_argument("--timeout", type=float, default=90.0, help="seconds a version may take")
    ap.add_argument("--json", type=Path)
    ap.add_argument("--keep", type=Path, help="run the labs in this directory and keep it (logs, data)")
    args = ap.parse_args()
    if args.origin_role:
        return origin_role(args)
    from tests.netlab.lab import unavailable

    if why := unavailable():
        sys.exit(why)
    print(f"N = {args.honest + args.attackers} ({args.attackers} attacker keys), S = {args.size_mib} MiB, "
          f"{args.rate_mib * 8.39:.1f} Mbit/s uplinks, {args.piece_kib} KiB pieces; smart {args.smart}, honest "
          f"relays trusted {args.trusted}")
    print(f"{'attack':<8} {'unattacked (s)':>15} {'attacked (s)':>22} {'ratio':>6}  honest demoted/banned/penalized, "
          "attackers with standing")
    rows = []
    with tempfile.TemporaryDirectory(prefix="attacks-netns-") as td:
        for mode in args.attacks:
            r = run_attack(mode, args, (args.keep or Path(td)) / mode)
            rows.append(r)
            base, fmt = (", ".join("-" if x is None else f"{x:.1f}" for x in r[k]) for k in ("unattacked_s", "attacked_s"))
            print(f"{mode:<8} {base:>15} {fmt:>22} "
                  f"{'-' if r['ratio'] is None else format(r['ratio'], '.2f'):>6}  {r['honest_demoted']}/"
                  f"{r['honest_banned']}/{r['honest_penalized']}, {r['attackers_with_standing']} of "
                  f"{r['attackers']}", flush=True)
    if args.json:
        args.json.write_text(json.dumps({"args": {k: str(v) for k, v in vars(args).items()}, "rows": rows}, indent=2))


if __name__ == "__main__":
    main()
