"""A network lab on one machine: hosts as Linux network namespaces on one bridge, each with its own address
and optionally a kernel-shaped uplink (tc tbf), so processes reach each other only over the bridge.

Every name starts with `nlab<pid>` and the subnet is a free 10.213.X.0/24, so parallel runs don't collide;
`close()` (also run at exit) removes what this lab made, and a new lab first removes what labs of dead
processes left behind. Needs root and iproute2 (`ip`, `tc`). Nothing gets a default route: a process in a
lab host can reach only the lab's own addresses.
"""

from __future__ import annotations

import atexit
import ipaddress
import json
import os
import re
import shutil
import signal
import subprocess
import sys
import time
import weakref
from dataclasses import dataclass, field
from pathlib import Path

PREFIX = "nlab"
SUBNET_BASE = "10.213"  # an unusual range; the third octet is picked per lab
_live: weakref.WeakSet[Lab] = weakref.WeakSet()


class LabError(RuntimeError):
    pass


def unavailable() -> str | None:
    """Why a lab can't be built here (None: it can)."""
    if sys.platform != "linux":
        return "the network lab needs Linux network namespaces"
    if os.geteuid() != 0:
        return "the network lab needs root (ip netns, veth, bridge, tc)"
    for tool in ("ip", "tc"):
        if shutil.which(tool) is None:
            return f"the network lab needs iproute2's `{tool}`, which is not installed"
    probe = f"{PREFIX}{os.getpid()}-probe"
    r = subprocess.run(["ip", "netns", "add", probe], capture_output=True, text=True)
    if r.returncode != 0:
        return f"cannot create a network namespace here: {r.stderr.strip()}"
    subprocess.run(["ip", "netns", "del", probe], capture_output=True)
    return None


def _ip(*args: str, check: bool = True) -> subprocess.CompletedProcess:
    r = subprocess.run(["ip", *args], capture_output=True, text=True)
    if check and r.returncode != 0:
        raise LabError(f"ip {' '.join(args)}: {r.stderr.strip()}")
    return r


def _alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:
        return True
    return True


def _owner(name: str) -> int | None:
    m = re.match(rf"{PREFIX}(\d+)", name)
    return int(m.group(1)) if m else None


def sweep_leftovers() -> list[str]:
    """Delete namespaces and links that labs of processes no longer running left behind."""
    gone = []
    for line in _ip("netns", "list", check=False).stdout.splitlines():
        ns = line.split()[0] if line.strip() else ""
        pid = _owner(ns)
        if pid is not None and not _alive(pid):
            _kill_pids_in(ns)
            _ip("netns", "del", ns, check=False)
            gone.append(ns)
    for link in json.loads(_ip("-j", "link", "show", check=False).stdout or "[]"):
        name = link.get("ifname", "")
        pid = _owner(name)
        if pid is not None and not _alive(pid):
            _ip("link", "del", name, check=False)
            gone.append(name)
    return gone


def _kill_pids_in(ns: str) -> None:
    """End the processes still inside one of our namespaces (only labs' own processes are ever there)."""
    pids = [int(p) for p in _ip("netns", "pids", ns, check=False).stdout.split() if p.isdigit()]
    for pid in pids:
        try:
            os.kill(pid, signal.SIGKILL)
        except ProcessLookupError:
            pass


def rate_bits(rate: str | float) -> int:
    """'20mbit', '1gbit', '500kbit' or a number of bits/s -> bits/s."""
    if isinstance(rate, (int, float)):
        return int(rate)
    m = re.fullmatch(r"\s*([\d.]+)\s*([kmg]?)bit\s*", rate.lower())
    if not m:
        raise ValueError(f"rate {rate!r}: write e.g. 20mbit")
    return int(float(m.group(1)) * {"": 1, "k": 1e3, "m": 1e6, "g": 1e9}[m.group(2)])


@dataclass
class Host:
    name: str
    ns: str  # the namespace
    ip: str
    veth: str  # the bridge-side end, in the root namespace
    dev: str = "eth0"  # its end inside the namespace
    up_bits: int | None = None
    down_bits: int | None = None
    procs: list[subprocess.Popen] = field(default_factory=list)

    def sent_bytes(self) -> int:
        """Bytes this host sent onto the bridge (its uplink), from the kernel's counters."""
        return int(Path(f"/sys/class/net/{self.veth}/statistics/rx_bytes").read_text())

    def received_bytes(self) -> int:
        return int(Path(f"/sys/class/net/{self.veth}/statistics/tx_bytes").read_text())


class Lab:
    """`lab.add_host("a", up="20mbit")`, then `lab.popen(host, [...])`; `lab.close()` undoes everything."""

    def __init__(self, log_dir: Path | str | None = None, tbf_latency_ms: int = 100):
        self.tag = f"{PREFIX}{os.getpid()}"
        if len(self.tag) + 4 > 15:
            raise LabError(f"pid too long for interface names: {self.tag}")
        self.log_dir = Path(log_dir) if log_dir else Path(f"/tmp/{self.tag}-logs")
        self.log_dir.mkdir(parents=True, exist_ok=True)
        self.tbf_latency_ms = tbf_latency_ms
        self.hosts: dict[str, Host] = {}
        self.bridge = f"{self.tag}br"
        self._closed = False
        self._files: list = []
        _exit_on_sigterm()
        sweep_leftovers()
        if any(link.get("ifname") == self.bridge for link in json.loads(_ip("-j", "link", "show").stdout)):
            raise LabError(f"{self.bridge} exists: one lab per process at a time")
        self.net = self._free_subnet()
        self.bridge_ip = str(self.net.network_address + 1)  # this process's own address in the lab
        _live.add(self)
        try:
            _ip("link", "add", self.bridge, "type", "bridge")
            _ip("addr", "add", f"{self.bridge_ip}/{self.net.prefixlen}", "dev", self.bridge)
            _ip("link", "set", self.bridge, "up")
        except Exception:
            self.close()
            raise

    @staticmethod
    def _free_subnet() -> ipaddress.IPv4Network:
        used = [ipaddress.ip_network(r["dst"], strict=False)
                for r in json.loads(_ip("-j", "-4", "route", "show", "table", "all").stdout or "[]")
                if r.get("dst", "default") not in ("default",) and r["dst"][0].isdigit()]
        start = os.getpid() % 250
        for k in range(250):
            net = ipaddress.ip_network(f"{SUBNET_BASE}.{(start + k) % 250 + 1}.0/24")
            if not any(net.overlaps(u) for u in used):
                return net
        raise LabError(f"no free /24 left in {SUBNET_BASE}.0.0/16")

    # -- hosts ------------------------------------------------------------------------------------------
    def add_host(self, name: str, up: str | float | None = None, down: str | float | None = None) -> Host:
        """A namespace with its own address on the bridge; `up`/`down`: its uplink/downlink rate (tbf)."""
        if self._closed:
            raise LabError("lab is closed")
        if not re.fullmatch(r"[A-Za-z0-9_-]{1,40}", name) or name in self.hosts:
            raise ValueError(f"bad or duplicate host name {name!r}")
        i = len(self.hosts) + 2
        if i >= self.net.num_addresses - 1:
            raise LabError("subnet full")
        h = Host(name, f"{self.tag}-{name}", str(self.net.network_address + i), f"{self.tag}v{i}")
        self.hosts[name] = h  # registered first, so close() removes a half-made host
        _ip("netns", "add", h.ns)
        _ip("link", "add", h.veth, "type", "veth", "peer", "name", h.dev, "netns", h.ns)
        _ip("link", "set", h.veth, "master", self.bridge, "up")
        _ip("-n", h.ns, "addr", "add", f"{h.ip}/{self.net.prefixlen}", "dev", h.dev)
        _ip("-n", h.ns, "link", "set", "lo", "up")
        _ip("-n", h.ns, "link", "set", h.dev, "up")
        self.shape(h, up=up, down=down)
        return h

    def add_natted_host(self, name: str, up: str | float | None = None) -> Host:
        """A host behind a home router: a gateway namespace NAME-gw with one leg on the bridge (the address
        everyone else sees) and a private /24 inside, where this host sits with a default route through it;
        nftables masquerades what leaves. It reaches everyone, nobody can open a connection to it. `up`
        shapes its uplink (the gateway's bridge leg, which carries all it sends)."""
        gw = self.add_host(f"{name}-gw", up=up)
        lan = f"192.168.{len(self.hosts) % 250 + 1}"
        h = Host(name, f"{self.tag}-{name}", f"{lan}.2", gw.veth)
        self.hosts[name] = h
        inner = f"{self.tag}n{len(self.hosts)}"
        _ip("netns", "add", h.ns)
        _ip("link", "add", inner, "type", "veth", "peer", "name", h.dev, "netns", h.ns)
        _ip("link", "set", inner, "netns", gw.ns)
        _ip("-n", gw.ns, "link", "set", inner, "name", "lan0")
        _ip("-n", gw.ns, "addr", "add", f"{lan}.1/24", "dev", "lan0")
        _ip("-n", gw.ns, "link", "set", "lan0", "up")
        _ip("-n", h.ns, "addr", "add", f"{h.ip}/24", "dev", h.dev)
        _ip("-n", h.ns, "link", "set", "lo", "up")
        _ip("-n", h.ns, "link", "set", h.dev, "up")
        _ip("-n", h.ns, "route", "add", "default", "via", f"{lan}.1")
        self.run(gw, ["sysctl", "-qw", "net.ipv4.ip_forward=1"]).check_returncode()
        self._nft(gw, "table ip nat {\n chain pre {\n  type nat hook prerouting priority -100;\n }\n"
                      " chain post {\n  type nat hook postrouting priority 100;\n  oifname \"eth0\" masquerade\n"
                      " }\n}\n")
        return h

    def firewall_inbound(self, h: Host | str) -> None:
        """Drop every connection attempt to host `h` (a TCP SYN without ACK), as most home links do:
        connections it opens still work; one to it times out instead of being refused."""
        self._nft(self._host(h), "table inet fw {\n chain input {\n  type filter hook input priority 0;\n"
                                 "  iifname \"eth0\" tcp flags & (syn | ack) == syn drop\n }\n}\n")

    def _nft(self, h: Host, rules: str) -> None:
        if shutil.which("nft") is None:
            raise LabError("NAT and firewalls in the lab need nftables's `nft` (apt-get install -y nftables)")
        r = self.run(h, ["nft", "-f", "-"], input=rules)
        if r.returncode != 0:
            raise LabError(f"nft in {h.name}: {r.stderr.strip()}")

    def shape(self, h: Host, up: str | float | None = None, down: str | float | None = None) -> None:
        """tbf on the namespace's side shapes what the host sends (its uplink); on the bridge side, what
        it receives (its downlink). None leaves that direction at veth speed."""
        if up is not None:
            h.up_bits = rate_bits(up)
            self._tbf(["ip", "netns", "exec", h.ns, "tc"], h.dev, h.up_bits)
        if down is not None:
            h.down_bits = rate_bits(down)
            self._tbf(["tc"], h.veth, h.down_bits)

    def shape_own(self, up: str | float) -> None:
        """Shape what this process (in the root namespace) sends into the lab: tbf on the bridge device."""
        self._tbf(["tc"], self.bridge, rate_bits(up))

    def _tbf(self, tc: list[str], dev: str, bits: int) -> None:
        # Burst: about 10 ms of tokens (at least 32 KiB, more than one 64 KiB GSO packet needs re-segmenting).
        burst = max(32 << 10, bits // 8 // 100)
        r = subprocess.run([*tc, "qdisc", "replace", "dev", dev, "root", "tbf", "rate", f"{bits}bit",
                            "burst", str(burst), "latency", f"{self.tbf_latency_ms}ms"],
                           capture_output=True, text=True)
        if r.returncode != 0:
            raise LabError(f"tc tbf on {dev}: {r.stderr.strip()}")

    def own_sent_bytes(self) -> int:
        """Bytes this (root-namespace) process side sent into the lab through its bridge address."""
        return int(Path(f"/sys/class/net/{self.bridge}/statistics/tx_bytes").read_text())

    # -- processes --------------------------------------------------------------------------------------
    def cmd(self, h: Host | str, argv: list[str]) -> list[str]:
        return ["ip", "netns", "exec", self._host(h).ns, *argv]

    def popen(self, h: Host | str, argv: list[str], *, log: str | None = None, env: dict | None = None,
              cwd: Path | str | None = None, **kw) -> subprocess.Popen:
        """Start `argv` inside host `h` (ip netns exec runs it as that very process, so its pid is ours).
        Output goes to LOG_DIR/<log or host name>.log unless stdout is given."""
        host = self._host(h)
        if "stdout" not in kw:
            f = open(self.log_dir / f"{log or host.name}.log", "ab")
            self._files.append(f)
            kw["stdout"] = f
            kw.setdefault("stderr", subprocess.STDOUT)
        p = subprocess.Popen(self.cmd(host, argv), env=env, cwd=cwd, **kw)
        p.log_path = self.log_dir / f"{log or host.name}.log"  # type: ignore[attr-defined]
        host.procs.append(p)
        return p

    def run(self, h: Host | str, argv: list[str], timeout: float = 60, **kw) -> subprocess.CompletedProcess:
        kw.setdefault("capture_output", True)
        kw.setdefault("text", True)
        return subprocess.run(self.cmd(h, argv), timeout=timeout, **kw)

    def _host(self, h: Host | str) -> Host:
        return self.hosts[h] if isinstance(h, str) else h

    # -- teardown ---------------------------------------------------------------------------------------
    def stop_procs(self, grace: float = 5.0) -> None:
        procs = [p for h in self.hosts.values() for p in h.procs if p.poll() is None]
        for p in procs:
            p.send_signal(signal.SIGTERM)
        end = time.monotonic() + grace
        for p in procs:
            try:
                p.wait(max(0.0, end - time.monotonic()))
            except subprocess.TimeoutExpired:
                p.kill()
                p.wait()

    def close(self) -> None:
        if self._closed:
            return
        self._closed = True
        self.stop_procs()
        for f in self._files:
            f.close()
        for h in self.hosts.values():
            _kill_pids_in(h.ns)
            _ip("link", "del", h.veth, check=False)
            _ip("netns", "del", h.ns, check=False)
        _ip("link", "del", self.bridge, check=False)

    def __enter__(self) -> Lab:
        return self

    def __exit__(self, *exc) -> None:
        self.close()


def _exit_on_sigterm() -> None:
    """A plain SIGTERM would skip atexit and every finally: make it an exit, unless someone handles it."""
    import threading

    if threading.current_thread() is threading.main_thread() and \
            signal.getsignal(signal.SIGTERM) is signal.SIG_DFL:
        signal.signal(signal.SIGTERM, lambda *_: sys.exit(128 + signal.SIGTERM))


@atexit.register
def _close_all() -> None:
    for lab in list(_live):
        lab.close()
