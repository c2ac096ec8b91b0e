"""`bench/broadcast.py --netns`: the same designs with every peer a separate process on its own host (a
network namespace of tests/netlab/lab.py, on one bridge), each host's uplink shaped by the kernel (tc tbf at
B), never by our code. Needs root and iproute2.

Measured per row: T (publish to the last receiver holding verified bytes) over S/B; per-peer completion
times; CPU: each process's user+system seconds from /proc/PID/stat over [publish, last done] (children it
waited for included), and the machine's idle share from /proc/stat over the same span (the kernel's
networking runs in softirq, charged to no process, so busy > the processes' sum). Bytes each host sent come
from the kernel's veth counters.
"""

from __future__ import annotations

import argparse
import asyncio
import math
import os
import subprocess
import sys
import threading
import time
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
BENCH = Path(__file__).resolve().parent / "broadcast.py"
MiB = 1 << 20
TICK = os.sysconf("SC_CLK_TCK")
PORT = 7000  # every host has its own namespace, so one fixed port serves all


def finish_row(results: dict, r: dict, n: int, design: str, t_start: float, floor: float) -> None:
    """A measured (or failed) row: its design, its wall time, T against the floor, into the table."""
    r.update(N=n, design=design, wall_s=time.monotonic() - t_start, design_floor=(n if design == "star" else 1) * floor)
    r["ratio"] = r["T"] / floor if r["T"] else None
    results["rows"].append(r)


def proc_cpu(pid: int) -> float:
    """utime+stime+cutime+cstime of a live process, in seconds (0 once it is gone)."""
    try:
        stat = Path(f"/proc/{pid}/stat").read_text()
    except (FileNotFoundError, ProcessLookupError):
        return 0.0
    f = stat.rsplit(")", 1)[1].split()
    return sum(int(x) for x in f[11:15]) / TICK


def machine_cpu() -> tuple[float, float]:
    """(busy, total) jiffies of all cores since boot."""
    f = [int(x) for x in Path("/proc/stat").read_text().splitlines()[0].split()[1:]]
    idle = f[3] + f[4]
    total = sum(f[:8])
    return total - idle, total


class Proc:
    """A process inside a lab host whose stdout lines are collected with their arrival time."""

    def __init__(self, lab, host, argv: list[str], env: dict):
        self.host = host
        self.p = lab.popen(host, argv, stdout=subprocess.PIPE, stderr=open(lab.log_dir / f"{host.name}.err", "ab"),
                           stdin=subprocess.PIPE, env=env, cwd=REPO)
        self.lines: list[tuple[float, str]] = []
        threading.Thread(target=self._read, daemon=True).start()

    def _read(self) -> None:
        assert self.p.stdout
        for raw in self.p.stdout:
            self.lines.append((time.time(), raw.decode(errors="replace").strip()))

    def has(self, prefix: str) -> str | None:
        return next((s for _, s in self.lines if s.startswith(prefix)), None)

    def send(self, text: str) -> None:
        try:
            assert self.p.stdin
            self.p.stdin.write(text.encode() + b"\n")
            self.p.stdin.flush()
        except (BrokenPipeError, OSError):
            pass


class Sampler:
    """Every host's sent bytes every 0.1 s (the kernel's counters): whose uplink idled, and when."""

    def __init__(self, hosts):
        self.hosts, self.series = hosts, {"t": [], **{h.name: [] for h in hosts}}
        self._stop = threading.Event()
        self._t0 = time.time()
        threading.Thread(target=self._run, daemon=True).start()

    def _run(self) -> None:
        while not self._stop.wait(0.1):
            try:
                row = [h.sent_bytes() for h in self.hosts]
            except OSError:  # the lab is being taken down
                return
            self.series["t"].append(round(time.time() - self._t0, 3))
            for h, x in zip(self.hosts, row, strict=True):
                self.series[h.name].append(x)

    def stop(self) -> None:
        self._stop.set()


def wait_for(cond, timeout: float, what: str, procs: list[Proc]) -> None:
    end = time.monotonic() + timeout
    while not cond():
        dead = [p for p in procs if p.p.poll() is not None]
        if dead:
            raise RuntimeError(f"{dead[0].host.name} exited {dead[0].p.returncode} while waiting for {what}")
        if time.monotonic() > end:
            raise TimeoutError(f"{what}: not within {timeout:.0f}s")
        time.sleep(0.05)


# ---------------------------------------------------------------------------------------------------------
def origin_role(args: argparse.Namespace) -> None:
    """Our origin+tracker on its host: prints READY, publishes on 'go' (T0 just before), stops on 'stop'."""
    from broadcast.config import OriginConfig
    from broadcast.origin import Origin
    from swarm_common.keys import KeyPair

    async def main() -> None:
        d = Path(args.dir)
        o = Origin(d, KeyPair.load_or_create(d / "key"), OriginConfig(
            fanout=args.trees, piece_bytes=args.piece_kib << 10, heartbeat_s=1.0), host=args.bind, port=PORT)
        await o.start()
        vdir = d / "v1"
        vdir.mkdir(parents=True, exist_ok=True)
        (vdir / "model.safetensors").write_bytes(os.urandom(int(args.size_mib * MiB)))
        print("READY", flush=True)
        loop = asyncio.get_running_loop()
        await loop.run_in_executor(None, sys.stdin.readline)
        print(f"T0 {time.time():.6f}", flush=True)
        await o.publish(vdir, 1, None)
        print("PUBLISHED", flush=True)
        await loop.run_in_executor(None, sys.stdin.readline)
        await o.stop()

    asyncio.run(main())


def run_row(design: str, n: int, args: argparse.Namespace, tmp: Path, timeout: float) -> dict:
    from tests.netlab.lab import Lab

    size, rate = int(args.size_mib * MiB), args.rate_mib * MiB
    env = dict(os.environ, PYTHONPATH=os.pathsep.join(filter(None, [str(REPO), os.environ.get("PYTHONPATH")])),
               PYTHONUNBUFFERED="1", OMP_NUM_THREADS="1",
               SHARDCAST_FAST_RETRY_INTERVAL="1", SHARDCAST_SLOW_RETRY_INTERVAL="1")
    py = [sys.executable, str(BENCH)]
    root = tmp / f"{design}{n}"
    root.mkdir(parents=True)
    up = int(rate * 8)
    with Lab(log_dir=root / "logs", tbf_latency_ms=args.tbf_latency_ms) as lab:
        origin = lab.add_host("origin", up=up)
        servers: list[Proc] = []  # what uploads: origin (+ shardcast's middle relays)
        receivers: list[Proc] = []
        if design in ("tree", "star"):
            o = Proc(lab, origin, [sys.executable, __file__, "--origin-role", "--bind", origin.ip, "--dir",
                                   str(root / "origin"), "--trees", str(args.trees), "--piece-kib",
                                   str(args.piece_kib), "--size-mib", str(args.size_mib)], env)
            servers.append(o)
            wait_for(lambda: o.has("READY"), 60, "origin", servers)
            key = (root / "origin" / "key.pub").read_text().strip()
            for i in range(n):
                h = lab.add_host(f"p{i}", up=up)
                argv = [*py, "--peer-worker", "--bind", h.ip, "--tracker", f"http://{origin.ip}:{PORT}",
                        "--key", key, "--dir", str(root), "--window", str(args.window), "--indices", str(i)]
                receivers.append(Proc(lab, h, argv + (["--no-relay"] if design == "star" else []), env))
        else:
            src = root / "model.bin"
            src.write_bytes(os.urandom(size))
            sc = [*py, "--rate", "0", "--sc-role"]
            o = Proc(lab, origin, [*sc, "origin", "--bind", origin.ip, "--dir", str(root / "origin"), "--port",
                                   str(PORT), "--file", str(src)], env)
            servers.append(o)
            wait_for(lambda: o.has("READY"), 60, "shardcast origin", servers)
            mids = []
            for j in range(math.ceil(math.sqrt(n))):
                h = lab.add_host(f"mid{j}", up=up)
                servers.append(Proc(lab, h, [*sc, "middle", "--bind", h.ip, "--dir", str(root / h.name), "--port",
                                             str(PORT), "--upstream", f"http://{origin.ip}:{PORT}"], env))
                mids.append(f"http://{h.ip}:{PORT}")
                # One at a time: each probes its upstream into the same /tmp/dummy.bin (shardcast's path).
                wait_for(lambda: servers[-1].has("READY"), 60, "a shardcast middle relay", servers)
            for i in range(n):
                h = lab.add_host(f"c{i}", up=up)
                receivers.append(Proc(lab, h, [*sc, "clients", "--bind", h.ip, "--dir", str(root / h.name), "--n",
                                               "1", "--upstream", *mids], env))
                wait_for(lambda: receivers[-1].has("READY"), 60, "a shardcast client", receivers)
        everyone = servers + receivers
        wait_for(lambda: all(p.has("READY") for p in everyone), 120, "every process to start", everyone)
        time.sleep(2.0)  # let joins settle into the tree and start-up CPU drain
        cpu0 = {id(p): proc_cpu(p.p.pid) for p in everyone}
        m0 = machine_cpu()
        sent0 = {p.host.name: p.host.sent_bytes() for p in everyone}
        o.send("go")
        timeline = Sampler([p.host for p in everyone])
        end = time.monotonic() + timeout
        while sum(bool(p.has("DONE")) for p in receivers) < n:
            if time.monotonic() > end or any(p.p.poll() is not None for p in everyone):
                timeline.stop()
                got = sum(bool(p.has("DONE")) for p in receivers)
                return {"T": None, "error": f"timeout after {timeout:.0f}s with {got}/{n} done"
                        if time.monotonic() > end else f"a process exited early ({got}/{n} done)"}
            time.sleep(0.02)
        cpu = {p.host.name: proc_cpu(p.p.pid) - cpu0[id(p)] for p in everyone}
        timeline.stop()
        m1 = machine_cpu()
        sent = {p.host.name: p.host.sent_bytes() - sent0[p.host.name] for p in everyone}
        t0 = float(o.has("T0").split()[1])
        done = sorted(float(p.has("DONE").split()[2]) - t0 for p in receivers)
        bypasses = sum(int(f[3]) for p in receivers if len(f := p.has("DONE").split()) > 3)
        for p in everyone:
            p.send("stop")
        # Let the receivers finish stopping (they print their CPU last; a profiled one dumps its profile
        # first: bench/relay_cpu.py) before the lab tears their hosts down.
        end = time.monotonic() + 10
        while time.monotonic() < end and not all(p.has("CPU ") for p in receivers):
            time.sleep(0.05)
        got = [_received(design, root, i) for i in range(n)]
        want = (root / "origin" / "v1" / "model.safetensors") if design != "shardcast" else root / "model.bin"
        if any(g != want.read_bytes() for g in got):
            return {"T": None, "error": "a receiver holds different bytes"}
    T = done[-1]
    busy = (m1[0] - m0[0]) / max(1, m1[1] - m0[1])
    return {"T": T, "first_s": done[0], "p50_s": done[len(done) // 2], "done_s": done,
            "cpu_s": sum(cpu.values()), "cpu_frac_of_2_cores": sum(cpu.values()) / T / 2,
            "cpu_max_proc_s": max(cpu.values()), "machine_idle": 1 - busy,
            "origin_sent_x_S": sent["origin"] / size, "bypasses": bypasses, "sent_by_host": sent,
            "timeline": timeline.series}


def _received(design: str, root: Path, i: int) -> bytes:
    if design == "shardcast":
        return (root / f"c{i}" / "c0" / "file.bin").read_bytes()
    return (root / f"p{i}" / "versions" / "v1" / "model.safetensors").read_bytes()


def bench_netns(args: argparse.Namespace) -> dict:
    import tempfile

    from tests.netlab.lab import unavailable

    why = unavailable()
    if why:
        sys.exit(f"--netns: {why}")
    size, rate = int(args.size_mib * MiB), args.rate_mib * MiB
    floor = size / rate
    results = {"mode": "netns", "S_bytes": size, "B_bytes_per_s": rate, "floor_s": floor,
               "piece_bytes": args.piece_kib << 10, "trees": args.trees, "window": args.window,
               "tbf_latency_ms": args.tbf_latency_ms, "rows": []}
    print(f"netns: S = {size / MiB:.1f} MiB, B = {rate * 8 / 1e6:.1f} Mbit/s (tbf on each host's uplink, "
          f"queue {args.tbf_latency_ms} ms), S/B = {floor:.2f} s, pieces of {args.piece_kib} KiB, {args.trees} "
          f"trees, window {args.window}; one process per host, {os.cpu_count()} cores")
    print(f"{'N':>3} {'design':<10} {'T (s)':>7} {'T/(S/B)':>8} {'floor':>6} {'first/p50 (s)':>14} "
          f"{'CPU: ours':>10} {'max proc':>8} {'idle':>5} {'origin sent':>11}  note")
    with tempfile.TemporaryDirectory(prefix="bcnetns-") as td:
        for n in args.n:
            for design in args.designs:
                budget = (4 * floor if design == "tree" else 2.5 * n * floor) + 60
                t_start = time.monotonic()
                try:
                    r = run_row(design, n, args, Path(td), budget)
                except Exception as e:  # a failed row is reported, not fatal to the table
                    r = {"T": None, "error": f"{type(e).__name__}: {e}"}
                finish_row(results, r, n, design, t_start, floor)
                print(_row(r, n, design), flush=True)
    return results


def _row(r: dict, n: int, design: str) -> str:
    if not r["T"]:
        return f"{n:>3} {design:<10} {'—':>7} {'—':>8}  {r.get('error', '')}"
    # Ours: these processes; the machine's busy share also holds other work on it and softirq networking.
    cpu_note = ("CPU-bound: " if r["cpu_frac_of_2_cores"] > 0.8 else
                "machine busy with other work too: " if r["machine_idle"] < 0.05 else "")
    return (f"{n:>3} {design:<10} {r['T']:>7.2f} {r['ratio']:>8.2f} {'N·S/B' if design == 'star' else 'S/B':>6} "
            f"{r['first_s']:>6.2f}/{r['p50_s']:<7.2f} {r['cpu_frac_of_2_cores'] * 100:>9.0f}% "
            f"{r['cpu_max_proc_s']:>7.1f}s {r['machine_idle'] * 100:>4.0f}% {r['origin_sent_x_S']:>9.2f} S  "
            f"{cpu_note}CPU {r['cpu_s']:.1f} core-s over all processes"
            + (f"; {r['bypasses']} pieces asked of an ancestor too" if design == "tree" else ""))


def main() -> None:
    ap = argparse.ArgumentParser(description="origin role of bench/broadcast.py --netns")
    ap.add_argument("--origin-role", action="store_true", required=True)
    ap.add_argument("--bind", required=True)
    ap.add_argument("--dir", required=True)
    ap.add_argument("--trees", type=int, required=True)
    ap.add_argument("--piece-kib", type=int, required=True)
    ap.add_argument("--size-mib", type=float, required=True)
    sys.path.insert(0, str(REPO))
    origin_role(ap.parse_args())


if __name__ == "__main__":
    main()
