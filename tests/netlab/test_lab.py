"""The network lab itself: hosts reach each other only over the bridge, and tbf shapes what they send."""

from __future__ import annotations

import os
import subprocess
import sys
import time
import urllib.request

import pytest

from tests.netlab.lab import Lab, sweep_leftovers, unavailable

pytestmark = pytest.mark.timeout(120)


def serve(lab: Lab, host, bind: str, port: int, directory) -> subprocess.Popen:
    return lab.popen(host, [sys.executable, "-m", "http.server", "--bind", bind, "--directory", str(directory),
                            str(port)], log=f"{host.name}-http-{bind}")


def wait_curl(lab: Lab, host, url: str, timeout: float = 20) -> None:
    end = time.monotonic() + timeout
    while lab.run(host, ["curl", "-sf", "-o", "/dev/null", url]).returncode != 0:
        if time.monotonic() > end:
            raise AssertionError(f"{url} never answered inside {host.name}")
        time.sleep(0.2)


def test_hosts_reach_each_other_by_address_not_loopback(netlab, tmp_path):
    (tmp_path / "www").mkdir()
    (tmp_path / "www" / "hello.txt").write_text("hello from a")
    a, b = netlab.add_host("a"), netlab.add_host("b")
    assert a.ip != b.ip and a.ip.startswith("10.213.")
    serve(netlab, a, a.ip, 8000, tmp_path / "www")
    serve(netlab, a, "127.0.0.1", 8001, tmp_path / "www")  # a's own loopback: only a can reach it
    wait_curl(netlab, a, f"http://{a.ip}:8000/hello.txt")
    wait_curl(netlab, a, "http://127.0.0.1:8001/hello.txt")

    r = netlab.run(b, ["curl", "-sf", f"http://{a.ip}:8000/hello.txt"])
    assert r.returncode == 0 and r.stdout == "hello from a"
    r = netlab.run(b, ["curl", "-s", "-m", "3", "http://127.0.0.1:8001/hello.txt"])
    assert r.returncode == 7, "b's 127.0.0.1 is b's own: a's loopback server must be out of reach"
    r = netlab.run(b, ["curl", "-s", "-m", "3", "http://127.0.0.1:8000/hello.txt"])
    assert r.returncode == 7
    # The test process reaches lab hosts through its own address on the bridge.
    with urllib.request.urlopen(f"http://{a.ip}:8000/hello.txt", timeout=5) as resp:
        assert resp.read() == b"hello from a"
    # No route out of the lab: an address beyond the subnet is unreachable from inside.
    r = netlab.run(b, ["ip", "route", "get", "192.0.2.1"])
    assert r.returncode != 0


def test_a_natted_host_and_a_firewalled_host_reach_out_but_cannot_be_reached(netlab, tmp_path):
    """Behind a NAT (nftables masquerade in a gateway namespace) a host reaches others, who see the gateway's
    address and cannot connect back; a firewall that drops inbound SYNs lets out what the host opens."""
    (tmp_path / "www").mkdir()
    (tmp_path / "www" / "hello.txt").write_text("hello")
    srv, natted, shut = netlab.add_host("srv"), netlab.add_natted_host("home"), netlab.add_host("shut")
    netlab.firewall_inbound(shut)
    gw = netlab.hosts["home-gw"]
    assert natted.ip.startswith("192.168.") and gw.ip.startswith("10.213.")
    serve(netlab, srv, srv.ip, 8000, tmp_path / "www")
    for h in (natted, shut):
        wait_curl(netlab, h, f"http://{srv.ip}:8000/hello.txt")  # they reach out
        serve(netlab, h, "0.0.0.0", 8001, tmp_path / "www")
    wait_curl(netlab, shut, "http://127.0.0.1:8001/hello.txt")
    log = (netlab.log_dir / "srv-http-" f"{srv.ip}.log").read_text()
    assert gw.ip in log and natted.ip not in log, "the server sees the gateway's address, not the host's"
    for target in (f"http://{gw.ip}:8001/hello.txt", f"http://{natted.ip}:8001/hello.txt",
                   f"http://{shut.ip}:8001/hello.txt"):
        r = netlab.run(srv, ["curl", "-s", "-m", "3", target])
        assert r.returncode in (7, 28), (target, r.returncode)  # refused or timed out: nobody gets in
    r = netlab.run(srv, ["curl", "-s", "-m", "3", f"http://{shut.ip}:8001/hello.txt"])
    assert r.returncode == 28, "a dropped SYN times out, as on a home link"


@pytest.mark.parametrize("direction", ["up", "down"])
def test_tbf_shapes_the_host_link(netlab, tmp_path, direction):
    """A host's uplink (tbf on its own side) or downlink (tbf on the bridge side) runs near its rate."""
    rate = 20e6  # bits/s
    size = 6 << 20
    (tmp_path / "www").mkdir()
    (tmp_path / "www" / "blob").write_bytes(os.urandom(size))
    server = netlab.add_host("srv", up="20mbit" if direction == "up" else None)
    client = netlab.add_host("cli", down="20mbit" if direction == "down" else None)
    free = netlab.add_host("free")  # unshaped both ways: the baseline in the same run
    serve(netlab, server, server.ip, 8000, tmp_path / "www")
    wait_curl(netlab, client, f"http://{server.ip}:8000/")
    sent0 = server.sent_bytes()

    def fetch(host) -> float:
        r = netlab.run(host, ["curl", "-sf", "-o", "/dev/null", "-w", "%{speed_download}",
                              f"http://{server.ip}:8000/blob"], timeout=60)
        assert r.returncode == 0, r.stderr
        return float(r.stdout) * 8  # bits/s

    got = fetch(client)
    print(f"{direction}link shaped to {rate / 1e6:.0f} Mbit/s: {got / 1e6:.2f} Mbit/s")
    assert 0.75 * rate < got < 1.25 * rate, f"{direction}link shaped to {rate / 1e6:.0f} Mbit/s ran at {got / 1e6:.1f}"
    assert server.sent_bytes() - sent0 >= size, "the kernel's counters see what the server sent"
    if direction == "down":
        assert fetch(free) > 3 * rate, "only the shaped host's downlink is slow"


def test_close_removes_everything_and_a_new_lab_sweeps_dead_labs(tmp_path):
    why = unavailable()
    if why:
        pytest.skip(why)
    lab = Lab(log_dir=tmp_path)
    h = lab.add_host("x", up="10mbit")
    p = lab.popen(h, ["sleep", "60"])
    names = {h.ns, h.veth, lab.bridge}
    lab.close()
    assert p.poll() is not None
    assert not names & _existing()
    # What a crashed run (a pid no longer alive) leaves behind is removed by the next lab.
    dead = subprocess.Popen(["true"])
    dead.wait()
    ns, link = f"nlab{dead.pid}-h", f"nlab{dead.pid}v2"
    try:
        subprocess.run(["ip", "netns", "add", ns], check=True)
        subprocess.run(["ip", "link", "add", link, "type", "bridge"], check=True)
        gone = sweep_leftovers()
        assert {ns, link} <= set(gone) and not {ns, link} & _existing()
    finally:
        subprocess.run(["ip", "netns", "del", ns], capture_output=True)
        subprocess.run(["ip", "link", "del", link], capture_output=True)


def _existing() -> set[str]:
    ns = subprocess.run(["ip", "netns", "list"], capture_output=True, text=True).stdout.split()
    links = subprocess.run(["ip", "-o", "link", "show"], capture_output=True, text=True).stdout
    return set(ns) | {line.split(":")[1].strip().split("@")[0] for line in links.splitlines()}
