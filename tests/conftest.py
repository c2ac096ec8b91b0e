"""Shared helpers: free ports, real subprocesses with logs, HTTP polling."""

from __future__ import annotations

import json
import os
import signal
import socket
import subprocess
import sys
import time
import urllib.request
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parent.parent
# The task of the tests that check a run learns: sums of two one-digit numbers, which RL lifts within a few
# steps (0.77 -> 0.88 by step 8 measured). The demo's three-term sums first collapse to the commonest answer
# ("15": 0.134 -> 0.06-0.09 over the first 10-30 steps, any lr from 5e-5 to 5e-4, with or without lag) and
# rise only later, too late for a short run; and their warm-up lands anywhere from 0.07 to 0.52 held out
# (model seeds 0-7), so another machine's float path starts them elsewhere (CI: 0.134; docs/benchmarks.md).
TWO_TERM_SUMS = 'task.params={digits=1, terms=2, ops="+", eval_share=0.15}'


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def get_json(url: str, timeout: float = 2.0):
    with urllib.request.urlopen(url, timeout=timeout) as r:
        return json.loads(r.read())


def wait_json(url: str, pred=lambda d: True, timeout: float = 120.0, proc: subprocess.Popen | None = None):
    end = time.monotonic() + timeout
    last = None
    while time.monotonic() < end:
        if proc is not None and proc.poll() is not None and last is None:
            raise RuntimeError(f"process exited with {proc.returncode} before {url} answered")
        try:
            last = get_json(url)
            if pred(last):
                return last
        except OSError:
            pass
        time.sleep(0.5)
    raise TimeoutError(f"{url} did not reach the expected state; last: {str(last)[:500]}")


class Procs:
    """Starts `python -m swarm.cli ...` processes, logging to files; kills what is left at the end."""

    def __init__(self, log_dir: Path):
        self.log_dir = log_dir
        self.procs: list[subprocess.Popen] = []

    def start(self, name: str, *args: str, env: dict[str, str] | None = None) -> subprocess.Popen:
        env = {**os.environ, "OMP_NUM_THREADS": "1", "PYTHONUNBUFFERED": "1", "TOKENIZERS_PARALLELISM": "false",
               **(env or {})}
        log = open(self.log_dir / f"{name}.log", "w")
        p = subprocess.Popen([sys.executable, "-m", "swarm.cli", *args], stdout=log, stderr=subprocess.STDOUT,
                             env=env, cwd=ROOT)
        p.log_path = self.log_dir / f"{name}.log"
        self.procs.append(p)
        return p

    def stop_all(self):
        for p in self.procs:
            if p.poll() is None:
                p.send_signal(signal.SIGTERM)
        for p in self.procs:
            try:
                p.wait(15)
            except subprocess.TimeoutExpired:
                p.kill()
                p.wait()


@pytest.fixture
def procs(tmp_path):
    ps = Procs(tmp_path)
    yield ps
    ps.stop_all()
    for p in ps.procs:  # show the logs of what ran, on failure
        print(f"==== {p.log_path.name} (exit {p.returncode})\n{p.log_path.read_text()[-3000:]}")


@pytest.fixture
def netlab(tmp_path):
    """A network lab (tests/netlab/lab.py): `netlab.add_host(name, up="20mbit")` gives a host with its own
    namespace and address; `netlab.popen(host, argv)` runs a process there, logging to tmp_path. Skips where
    it can't be built (not root, no iproute2). Everything it made is removed afterwards, failed or not."""
    from tests.netlab.lab import Lab, unavailable

    why = unavailable()
    if why:
        pytest.skip(why)
    lab = Lab(log_dir=tmp_path / "netlab")
    try:
        yield lab
    finally:
        lab.close()
        for f in sorted(lab.log_dir.glob("*.log")):  # shown by pytest for a failed test
            print(f"==== {f.name}\n{f.read_text(errors='replace')[-2000:]}")
