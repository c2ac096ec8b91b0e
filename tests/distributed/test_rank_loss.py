"""A rank that hangs or dies: the others stop with a clear error within the collective timeout, no hang.
Real rank processes over gloo, real signals (SIGSTOP for a hung rank, SIGKILL for a dead one)."""

from __future__ import annotations

import signal
import subprocess
import time
from pathlib import Path

import pytest

from model_builders.default_model import build_default_model
from tests.distributed.ranks import logs, start_ranks

TIMEOUT = 8.0  # the collective timeout of these runs, in seconds


@pytest.fixture(scope="module")
def model_dir(tmp_path_factory) -> Path:
    return build_default_model(tmp_path_factory.mktemp("tiny"), seed=0)


def _ready(out: Path, procs: list[subprocess.Popen]) -> None:
    end = time.monotonic() + 150
    while not (out / "ready").exists():
        assert all(p.poll() is None for p in procs), logs(out, len(procs))
        assert time.monotonic() < end, logs(out, len(procs))
        time.sleep(0.2)


def _reap(procs: list[subprocess.Popen]) -> None:
    for p in procs:
        if p.poll() is None:
            p.kill()
            p.wait()


def test_a_hung_rank_stops_rank_0_within_the_timeout(model_dir, tmp_path):
    procs = start_ranks(2, "idle", str(model_dir), str(tmp_path), log_dir=tmp_path, timeout_s=TIMEOUT)
    try:
        _ready(tmp_path, procs)
        time.sleep(1.5 * TIMEOUT)  # rank 0 idle past the timeout: its pings keep rank 1 waiting, not failing
        assert [p.poll() for p in procs] == [None, None], logs(tmp_path, 2)
        procs[1].send_signal(signal.SIGSTOP)
        t0 = time.monotonic()
        (tmp_path / "go").write_text("")
        code = procs[0].wait(3 * TIMEOUT + 20)
        elapsed = time.monotonic() - t0
    finally:
        _reap(procs)
    out = (tmp_path / "rank0.log").read_text()
    print(f"\nrank 1 hung: rank 0 stopped after {elapsed:.1f} s (timeout {TIMEOUT:g} s)")
    # The step fails, or the keep-alive ping just before it did and the step says so.
    assert code == 3 and "RANK LOST: step:" in out and "a collective failed" in out, logs(tmp_path, 2)
    assert elapsed < TIMEOUT + 10


def test_a_dead_rank_0_stops_the_others(model_dir, tmp_path):
    procs = start_ranks(2, "idle", str(model_dir), str(tmp_path), log_dir=tmp_path, timeout_s=TIMEOUT)
    try:
        _ready(tmp_path, procs)
        procs[0].send_signal(signal.SIGKILL)
        t0 = time.monotonic()
        code = procs[1].wait(3 * TIMEOUT + 20)
        elapsed = time.monotonic() - t0
    finally:
        _reap(procs)
    out = (tmp_path / "rank1.log").read_text()
    print(f"\nrank 0 killed: rank 1 stopped after {elapsed:.1f} s (timeout {TIMEOUT:g} s)")
    assert code == 3 and "RANK LOST: waiting for rank 0: a collective failed" in out, logs(tmp_path, 2)
    assert elapsed < TIMEOUT + 10
