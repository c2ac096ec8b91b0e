"""Test harness: an Origin in the test's event loop, peers as real processes on 127.0.0.1."""

from __future__ import annotations

import asyncio
import os
import signal
import sys
import time
from pathlib import Path

from broadcast.config import OriginConfig
from broadcast.origin import Origin
from swarm_common.keys import KeyPair

REPO = Path(__file__).resolve().parents[2]
HB = 0.3  # fast heartbeats keep the suite short


def make_version(d: Path, seed: int, size: int = 1 << 20) -> Path:
    """A fake HF checkpoint: two safetensors shards and an index json."""
    d.mkdir(parents=True, exist_ok=True)
    rnd = __import__("random").Random(seed)
    (d / "model-00001-of-00002.safetensors").write_bytes(rnd.randbytes(size))
    (d / "model-00002-of-00002.safetensors").write_bytes(rnd.randbytes(size // 3 + 17))
    (d / "model.safetensors.index.json").write_text(f'{{"weight_map": {{}}, "seed": {seed}}}')
    return d


def write_pieces(st, src: Path, indices=None, mark: bool = True) -> None:
    """Copy a partial version's pieces (all, or `indices`) from the directory its manifest was built from,
    as a peer that fetched them would; `mark`: log each as verified."""
    for i in range(len(st.pieces)) if indices is None else indices:
        ref = st.pieces[i]
        with open(src / ref.path, "rb") as f:
            f.seek(ref.offset)
            st.write_piece(i, f.read(ref.size))
        if mark:
            st.mark(i)


def same_files(a: Path, b: Path) -> bool:
    names = sorted(p.name for p in a.iterdir() if p.name != "manifest.json")
    if names != sorted(p.name for p in b.iterdir() if p.name != "manifest.json"):
        return False
    return all((a / n).read_bytes() == (b / n).read_bytes() for n in names)


class Cluster:
    def __init__(self, tmp: Path, **origin_kw):
        self.tmp = tmp
        self.key = KeyPair.generate()
        self.keep = origin_kw.pop("keep", 3)
        self.origin_cfg = OriginConfig(**(dict(fanout=2, piece_bytes=64 << 10, heartbeat_s=HB) | origin_kw))
        self.origin: Origin | None = None
        self.procs: dict[str, asyncio.subprocess.Process] = {}

    async def __aenter__(self) -> Cluster:
        self.origin = Origin(self.tmp / "origin", self.key, self.origin_cfg, keep=self.keep)
        await self.origin.start()
        return self

    async def __aexit__(self, *exc) -> None:
        for p in self.procs.values():
            if p.returncode is None:
                p.kill()
        for p in self.procs.values():
            await p.wait()
        if self.origin:
            await self.origin.stop()

    def data_dir(self, name: str) -> Path:
        return self.tmp / "peers" / name

    async def spawn(self, name: str, *extra: str, rate: float | None = None, key: str | None = None,
                    script: str = "-m swarm relay", wait_join: bool = True) -> asyncio.subprocess.Process:
        assert self.origin
        args = [*script.split(), "--tracker", self.origin.url, "--trainer-key", key or self.key.public_hex,
                "--data-dir", str(self.data_dir(name)), "--name", name, "--stall-timeout", "4", *extra]
        if rate:
            args += ["--upload-rate", str(rate)]
        env = dict(os.environ, PYTHONPATH=str(REPO))
        log = open(self.tmp / f"{name}.log", "ab")
        proc = await asyncio.create_subprocess_exec(sys.executable, *args, cwd=REPO, env=env,
                                                    stdout=log, stderr=log)
        self.procs[name] = proc
        if wait_join:
            await self.wait(lambda: name in self.names(), 20, f"{name} to join")
        return proc

    def log(self, name: str) -> str:
        return (self.tmp / f"{name}.log").read_text(errors="replace")

    def names(self) -> dict[str, object]:
        assert self.origin and self.origin.tracker
        return {p.name: p for p in self.origin.tracker.peers.values()}

    def holders(self, version: int) -> set[str]:
        return {n for n, p in self.names().items() if version in p.complete}  # type: ignore[attr-defined]

    async def wait(self, cond, timeout: float, what: str) -> None:
        end = time.monotonic() + timeout
        while not cond():
            if time.monotonic() > end:
                raise AssertionError(f"timed out waiting for {what}; tree: {self.tree_text()}")
            for n, p in self.procs.items():
                if p.returncode not in (None, -signal.SIGKILL):
                    raise AssertionError(f"{n} exited {p.returncode}:\n{self.log(n)[-3000:]}")
            await asyncio.sleep(0.1)

    def tree_text(self) -> str:
        from broadcast.tree_view import render

        assert self.origin and self.origin.tracker
        return render(self.origin.tracker.view(self.origin.latest, sorted(self.origin.versions)))

    async def publish(self, version: int, size: int = 1 << 20) -> Path:
        assert self.origin
        d = make_version(self.tmp / "origin" / f"v{version}", version, size)
        await self.origin.publish(d, version, version - 1 if version > 1 else None)
        return d
