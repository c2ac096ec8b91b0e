"""The relay tree under attack by many fresh identities: an origin in this process, six honest `swarm relay`
processes, and the attacker as a process of its own (tests/adversarial/tree_attacker.py: it speaks only the
documented HTTP protocol and imports nothing of ours). Shared by tests/adversarial/test_tree_attacks.py and
bench/adversarial.py.

Each attack gives a row: what was attempted, what the tracker refused or contained, honest relays banned,
evicted or demoted (goal 0), and the time a version takes to reach every honest relay while the attack
runs, against the same lab unattacked (goal <= 1.5x).
"""

from __future__ import annotations

import asyncio
import json
import os
import statistics
import sys
import time
from pathlib import Path

REPO = Path(__file__).resolve().parents[2]
ATTACKER = Path(__file__).resolve().parent / "tree_attacker.py"
HONEST = 6
SIZE = 2 << 20  # one version
RATE = 4 << 20  # every uplink, origin's included, bytes/s
PIECE = 64 << 10
HB = 0.3


# -- the lab: an origin in this process, honest relays as processes -----------------------------------
class TreeLab:
    def __init__(self, tmp: Path, before: tuple[str, ...] = (), trusted: bool = False):
        """`before`: an attack (the attacker's arguments) started before the honest relays join; `trusted`:
        the trainer calls the honest relays established (as it does its own nodes), else they earn the
        origin's proof like anyone."""
        self.tmp, self.trusted = tmp, trusted
        self.procs: list[asyncio.subprocess.Process] = []
        self.version = 0
        self.before = before
        self.attacker: asyncio.subprocess.Process | None = None
        self.first_s = 0.0  # how long v1, the first version the honest relays fetch, took

    async def __aenter__(self) -> TreeLab:
        from broadcast.config import OriginConfig
        from broadcast.origin import Origin
        from swarm_common.keys import KeyPair

        self.key = KeyPair.generate()
        self.origin = Origin(self.tmp / "origin", self.key, OriginConfig(
            fanout=2, piece_bytes=PIECE, heartbeat_s=HB, upload_rate=RATE), keep=3)
        await self.origin.start()
        self.tracker = self.origin.url
        if self.before:
            self.attacker = await start_attacker(self, *self.before)
        env = dict(os.environ, PYTHONPATH=str(REPO))
        for i in range(HONEST):
            log = open(self.tmp / f"honest{i}.log", "ab")
            self.procs.append(await asyncio.create_subprocess_exec(
                sys.executable, "-m", "swarm", "relay", "--tracker", self.tracker, "--trainer-key",
                self.key.public_hex, "--data-dir", str(self.tmp / f"honest{i}"), "--name", f"honest{i}",
                "--relay-host", "127.0.0.1", "--upload-rate", str(RATE), "--stall-timeout", "4",
                cwd=REPO, env=env, stdout=log, stderr=log))
        await self.until(lambda: len(self.honest()) == HONEST, 30, "honest relays to join")
        for p in self.honest().values() if self.trusted else ():
            self.origin.set_standing(p.key)
        self.first_s = await self.deliver()  # v1: the honest relays hold it, and show the origin they upload
        await self.until(lambda: all(p.key in self.origin.tracker.proven for p in self.honest().values()), 20,
                         "honest relays to show they upload")
        self.ids = {n: p.peer_id for n, p in self.honest().items()}
        return self

    async def __aexit__(self, *exc) -> None:
        for p in [*self.procs, *([self.attacker] if self.attacker else [])]:
            if p.returncode is None:
                p.kill()
            await p.wait()
        await self.origin.stop()

    def honest(self) -> dict:
        return {p.name: p for p in self.origin.tracker.peers.values() if p.name.startswith("honest")}

    async def until(self, cond, timeout: float, what: str) -> None:
        end = time.monotonic() + timeout
        while not cond():
            if time.monotonic() > end:
                raise AssertionError(f"timed out waiting for {what}")
            await asyncio.sleep(0.02)

    async def deliver(self, timeout: float = 60) -> float:
        """Publish the next version; seconds until every honest relay holds it (its directory is renamed
        complete only once every piece is verified)."""
        self.version += 1
        v = self.version
        d = self.tmp / "origin" / f"v{v}"
        d.mkdir(parents=True)
        (d / "model.safetensors").write_bytes(os.urandom(SIZE))
        t0 = time.monotonic()
        await self.origin.publish(d, v, v - 1 if v > 1 else None)
        await self.until(lambda: all((self.tmp / f"honest{i}" / "versions" / f"v{v}").is_dir()
                                     for i in range(HONEST)), timeout, f"v{v} on every honest relay")
        return time.monotonic() - t0

    def harm(self) -> dict:
        """Honest relays banned, evicted (their membership gone or replaced) or demoted, so far."""
        tr = self.origin.tracker
        now = self.honest()
        banned = sum(pid in tr.banned or p.key in tr.banned_keys for pid, p in
                     ((pid, tr.peers.get(pid) or _Gone) for pid in self.ids.values()))
        evicted = sum(now.get(n) is None or now[n].peer_id != pid for n, pid in self.ids.items())
        demoted = sum(p.demoted or p.reachable is False or p.key not in tr.proven for p in now.values())
        return {"honest_banned": banned, "honest_evicted": evicted, "honest_demoted": demoted}

    def under_fresh(self) -> int:
        """Honest relays with a fresh (attacker) key between them and the origin, in any tree."""
        parents, _ = self.origin.tracker.topology()
        honest = {p.peer_id for p in self.honest().values()}
        bad = 0
        for pid in honest:
            for t in range(len(parents)):
                cur = parents[t].get(pid)
                while cur is not None:
                    bad += cur not in honest
                    cur = parents[t].get(cur)
        return bad


class _Gone:
    key = ""


def row(name: str, attempted: str, attempts: int, detected: int, lab: TreeLab, base: float, t: float | None,
        **extra) -> dict:
    return {"attack": name, "attempted": attempted, "attempts": attempts, "detected": detected, **lab.harm(),
            "honest_under_attacker": lab.under_fresh(), "delivery_s": t, "unattacked_s": base,
            "delivery_ratio": None if t is None else t / base, **extra}


# -- the attacks ------------------------------------------------------------------------------------------
async def start_attacker(lab: TreeLab, *args: str) -> asyncio.subprocess.Process:
    """The attacker process, once it says READY."""
    proc = await asyncio.create_subprocess_exec(sys.executable, str(ATTACKER), args[0], lab.tracker, *args[1:],
                                                stdin=asyncio.subprocess.PIPE, stdout=asyncio.subprocess.PIPE,
                                                stderr=open(lab.tmp / f"attacker-{args[0]}.log", "ab"))
    assert proc.stdout
    line = await asyncio.wait_for(proc.stdout.readline(), 120)
    assert line.strip() == b"READY", line
    return proc


async def stop_attacker(proc: asyncio.subprocess.Process) -> dict:
    """Tell it to stop; its report."""
    assert proc.stdin and proc.stdout
    try:
        proc.stdin.write(b"stop\n")
        await proc.stdin.drain()
        return json.loads(await asyncio.wait_for(proc.stdout.readline(), 120))
    finally:
        if proc.returncode is None:
            proc.kill()
        await proc.wait()


async def attack(lab: TreeLab, *args: str, versions: int = 3) -> tuple[float, float, dict]:
    """Publish `versions` versions unattacked; start the attacker process, publish as many once it says
    READY, stop it: (the median delivery time unattacked, and attacked; its report). The machine is shared,
    so the baseline is measured right before each attack."""
    base = statistics.median([await lab.deliver() for _ in range(versions)])
    proc = await start_attacker(lab, *args)
    try:
        await asyncio.sleep(3 * HB)
        t = statistics.median([await lab.deliver() for _ in range(versions)])
        await asyncio.sleep(3 * HB)  # let reports and probes settle before the harm is counted
    finally:
        out = await stop_attacker(proc)
    return base, t, out


async def stalling_relays(lab: TreeLab, n: int = 24) -> dict:
    box: dict = {}
    base, t, out = await attack(lab, "stall", str(n))
    tr = lab.origin.tracker
    stallers = [p for p in tr.peers.values() if p.name == "staller"]
    sources = {u for p in lab.honest().values() for chain in tr.sources(p.peer_id) for u in chain}
    _, children = tr.topology()
    box.update(joined=out["joined"], stallers_with_children=sum(any(kids.get(p.peer_id) for kids in children)
                                                                 for p in stallers),
               piece_requests_held=out["held"])
    # Contained: not a source of any honest relay (a fresh key never sits above a peer with standing).
    contained = sum(p.url not in sources for p in stallers) + (n - len(stallers))
    return row("stalling_relays", f"{n} fresh relays pass the connect-back, then hold every piece request "
               "(half of them answering first)", n, contained, lab, base, t, **box)


async def false_reports(lab: TreeLab, n: int = 20) -> dict:
    urls = [p.url for p in lab.honest().values()]
    base, t, out = await attack(lab, "reports", str(n), str(lab.version), *urls)
    acted = sum(c for a, c in out["answers"].items() if a in ("banned", "removed", "demoted", "leaf: not reachable"))
    return row("false_reports", f"{n} fresh keys report the {len(urls)} honest relays corrupt, stalled, dead",
               out["sent"], out["sent"] - acted, lab, base, t, answers=out["answers"])


async def url_hijack(lab: TreeLab) -> dict:
    base, t, out = await attack(lab, "hijack", *[p.url for p in lab.honest().values()])
    codes = out["codes"]
    return row("url_hijack", "fresh keys join with the honest relays' addresses", sum(codes.values()),
               sum(c for k, c in codes.items() if k in ("403", "409", "429")), lab, base, t, codes=codes)


async def join_flood(lab: TreeLab, n: int = 3000) -> dict:
    base, t, out = await attack(lab, "flood", str(n))
    codes = out["codes"]
    return row("join_flood", f"{n} signed joins with fresh keys from one address", n,
               sum(c for k, c in codes.items() if k.isdigit() and k != "200"), lab, base, t, seconds=out["seconds"],
               accepted=codes.get("200", 0), peers_held=len(lab.origin.tracker.peers), codes=codes)


async def stallers_first(tmp: Path, n: int = 8, versions: int = 3) -> dict:
    """Everyone fresh: n stalling relays join before the honest ones. Nothing is measured and nobody has
    standing yet, so the join-order layout puts stallers above honest relays for the first version; it must
    still reach them (first-byte deadlines, then the ancestor; reports the origin confirms with its own
    probe), and once the honest relays have shown they upload they rank above the stallers. The row:
    versions while the stallers stay, against the same lab after they left."""
    async with TreeLab(tmp, before=("stall", str(n))) as lab:
        assert lab.attacker
        tr = lab.origin.tracker
        t = statistics.median([await lab.deliver() for _ in range(versions)])
        await asyncio.sleep(3 * HB)
        stallers = [p for p in tr.peers.values() if p.name == "staller"]
        demoted = sum(p.demoted for p in stallers)
        sources = {u for p in lab.honest().values() for chain in tr.sources(p.peer_id) for u in chain}
        contained = sum(p.url not in sources for p in stallers) + (n - len(stallers))
        harm, under = lab.harm(), lab.under_fresh()
        out = await stop_attacker(lab.attacker)
        await lab.until(lambda: not any(p.name == "staller" for p in tr.peers.values()), 30, "stallers to go")
        base = statistics.median([await lab.deliver() for _ in range(versions)])
        r = row("stallers_first", f"{n} fresh relays join before the honest ones and hold every piece request "
                "(half of them answering first)", n, contained, lab, base, t, first_version_s=lab.first_s, stallers_demoted=demoted,
                piece_requests_held=out["held"], refused=dict(tr.refused))
        return r | harm | {"honest_under_attacker": under}  # counted while the stallers were there


async def run_all(tmp: Path) -> list[dict]:
    async with TreeLab(tmp) as lab:
        rows = [await stalling_relays(lab), await false_reports(lab), await url_hijack(lab), await join_flood(lab)]
        for r in rows:
            r["refused"] = dict(lab.origin.tracker.refused)
        lab.events = list(lab.origin.tracker.events)
        return rows


# -- issue 29's attacks: keys that pass the origin's checks and harm everyone else ------------------------
ATTACKERS = 3  # a third of the lab's peers


async def _median_within(lab: TreeLab, versions: int, timeout: float) -> float | None:
    """The median delivery time of `versions` versions; None once one has not reached every honest relay
    within `timeout` (the rest are not tried: a stopped broadcast)."""
    times = []
    for _ in range(versions):
        try:
            times.append(await lab.deliver(timeout))
        except AssertionError:
            return None
    return statistics.median(times)


async def _issue29(tmp: Path, name: str, attempted: str, mode: str, *args: str, versions: int = 3,
                   timeout: float = 60, trusted: bool = False) -> dict:
    """A fresh lab: versions unattacked, then attacked (the attacker's relays heartbeat, are checked and
    placed first). Attacker relays contained: none is a source of an honest relay by the end."""
    async with TreeLab(tmp, trusted=trusted) as lab:
        tr = lab.origin.tracker
        base = statistics.median([await lab.deliver() for _ in range(versions)])
        urls = [p.url for p in lab.honest().values()] if mode == "liars" else []
        proc = await start_attacker(lab, mode, str(ATTACKERS), *args, *urls)  # args: 'smart' or none
        try:
            await asyncio.sleep(2.0)
            t = await _median_within(lab, versions, timeout)
            await asyncio.sleep(3 * HB)
            bad = [p for p in tr.peers.values() if p.name == "twofaced"]
            sources = {u for p in lab.honest().values() for chain in tr.sources(p.peer_id) for u in chain}
            extra = {"attackers_with_standing": sum(tr.has_standing(p) for p in bad),
                     "honest_penalized": sum(tr.points(p.key) > 0 for p in lab.honest().values()),
                     "refused": dict(tr.refused)}
            harm, under = lab.harm(), lab.under_fresh()
        finally:
            out = await stop_attacker(proc)
        if mode == "leech":
            attempts = sum(c for k, c in out["codes"].items() if k.isdigit())
            detected = out["codes"].get("403", 0)
        else:
            attempts, detected = ATTACKERS, sum(p.url not in sources for p in bad) + ATTACKERS - len(bad)
        return row(name, attempted, attempts, detected, lab, base, t, **extra, **out) | harm | {
            "honest_under_attacker": under}


async def issue29_rows(tmp: Path) -> list[dict]:
    """Issue 29's attacks, each in a lab of its own: 3 attacker keys beside 6 honest relays."""
    return [
        await _issue29(tmp / "liars", "bought_standing_reports", "keys serve the origin's check, then report the "
                       "honest relays stalling", "liars"),
        await _issue29(tmp / "loris", "slow_loris", "keys serve the origin's check, everyone else 8 KiB/s",
                       "loris"),
        await _issue29(tmp / "friends", "credit_from_friends", "keys serve the origin's check and confirm each "
                       "other's uploads at 12.5 GB/s", "friends"),
        await _issue29(tmp / "leech", "leeching", "loops fetch every piece from the origin without joining",
                       "leech"),
    ]


async def issue29_smart_rows(tmp: Path, trusted: bool = False) -> list[dict]:
    """The same two-faced keys, smarter: while they have no children they serve every request in full (only
    the origin asks a leaf for pieces), so they do earn the origin's one-piece proof whatever its headers.
    `trusted`: the honest relays are the trainer's established nodes (their keys trusted)."""
    tag = "_trusted" if trusted else ""
    return [
        await _issue29(tmp / f"liars-smart{tag}", f"smart_bought_standing_reports{tag}", "as a leaf serve every "
                       "request, then report the honest relays stalling", "liars", "smart", trusted=trusted),
        await _issue29(tmp / f"loris-smart{tag}", f"smart_slow_loris{tag}", "as a leaf serve every request, with "
                       "children send everyone 8 KiB/s", "loris", "smart", trusted=trusted),
        await _issue29(tmp / f"friends-smart{tag}", f"smart_credit_from_friends{tag}", "as a leaf serve every "
                       "request, and confirm each other's uploads at 12.5 GB/s", "friends", "smart", trusted=trusted),
    ]
