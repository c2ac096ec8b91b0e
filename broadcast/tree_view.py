"""`swarm tree`: who serves whom in each tree, and who holds which version, from the tracker's /tree."""

from __future__ import annotations

import asyncio

import aiohttp
import msgspec

from swarm_common.http import read_capped

from .messages import TreeView, decode


async def fetch_tree(tracker: str) -> TreeView:
    async with aiohttp.ClientSession(timeout=aiohttp.ClientTimeout(total=10)) as s:
        async with s.get(tracker.rstrip("/") + "/tree") as r:
            r.raise_for_status()
            return decode(await read_capped(r.content, 1 << 20), TreeView)


def render(tv: TreeView) -> str:
    peers = {p.peer_id: p for p in tv.peers}

    def label(pid: str) -> str:
        p = peers[pid]
        held = ",".join(f"v{v}" for v in p.complete) or "-"
        prog = " ".join(f"v{v}:{n}pc" for v, n in p.progress.items())
        tags = [] if p.relay else ["no-relay" if p.reachable is not False else "download-only: not reachable"]
        if p.tier == 1 and any(p.children):
            tags.append("on trial")
        if p.uplink:
            tags.append(f"up {p.uplink * 8 / 1e6:.1f} Mbit/s" + (" (probed)" if p.uplink_probed else ""))
        return f"{p.name or pid} [{held}{' ' + prog if prog else ''}]{' ' + ','.join(tags) if tags else ''}"

    lines = [f"origin {tv.origin}  latest=v{tv.latest}  serving={tv.versions}  trees={tv.trees} fanout={tv.fanout}"]
    for t in range(tv.trees):
        lines.append(f"tree {t} (pieces i with i mod {tv.trees} == {t}):")

        def walk(pid: str, depth: int, t: int = t) -> None:
            lines.append("  " * depth + "└─ " + label(pid))
            for c in peers[pid].children[t]:
                walk(c, depth + 1)

        for c in tv.origin_children[t]:
            walk(c, 1)
    for b in tv.banned:
        lines.append(f"BANNED {b.peer_id} {b.url}: {b.reason} (reported by {b.reporter})")
    return "\n".join(lines)


async def watch_tree(tracker: str, every: float = 0.0) -> int:
    """Print the tree once (every > 0: again every `every` seconds until stopped); returns an exit code."""
    while True:
        try:
            print(render(await fetch_tree(tracker)), flush=True)
        except (TimeoutError, aiohttp.ClientError, msgspec.DecodeError) as e:
            print(f"error: cannot read {tracker}/tree: {e}", flush=True)
            if not every:
                return 1
        if not every:
            return 0
        await asyncio.sleep(every)
        print()
