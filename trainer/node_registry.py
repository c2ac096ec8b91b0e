"""The nodes the trainer knows: one record per key, owned by the node service, read by stats and views."""

from __future__ import annotations

import time
from collections import Counter
from collections.abc import Callable
from dataclasses import dataclass, field


@dataclass
class NodeRecord:
    node_id: str
    name: str
    status_url: str = ""
    version_loaded: int = -1
    tokens_per_s: float = 0.0  # what the node says its engine does (untrusted: shown, never used)
    last_seen: float = field(default_factory=time.monotonic)
    accepted_groups: int = 0
    accepted_tokens: int = 0
    refused: Counter = field(default_factory=Counter)
    # Multi-turn work: accepted episodes, their turns, tool calls and tool calls that failed.
    episodes: int = 0
    turns: int = 0
    tool_calls: int = 0
    tool_errors: int = 0


class NodeRegistry:
    def __init__(self, heartbeat_s: float, gone_after_s: float = 0.0):
        self.heartbeat_s = heartbeat_s
        self.gone_after_s = gone_after_s or 10 * heartbeat_s
        self.nodes: dict[str, NodeRecord] = {}
        self.banned: set[str] = set()

    def get(self, node_id: str) -> NodeRecord | None:
        return self.nodes.get(node_id)

    def register(self, node_id: str, name: str, status_url: str = "") -> NodeRecord:
        rec = self.nodes.get(node_id)
        if rec is None:
            rec = self.nodes[node_id] = NodeRecord(node_id, name or node_id[:8])
        rec.name, rec.status_url, rec.last_seen = name or rec.name, status_url, time.monotonic()
        return rec

    def state(self, rec: NodeRecord) -> str:
        """banned, healthy (heard within 3 heartbeats), slow, or gone (silent past gone_after_s)."""
        if rec.node_id in self.banned:
            return "banned"
        age = time.monotonic() - rec.last_seen
        return "healthy" if age <= 3 * self.heartbeat_s else "slow" if age <= self.gone_after_s else "gone"

    def gone(self) -> set[str]:
        now = time.monotonic()
        return {n for n, r in self.nodes.items() if now - r.last_seen > self.gone_after_s}

    def has_live_other(self, node_id: str, pred: Callable[[str], bool] = lambda n: True) -> bool:
        """Is there another live, unbanned node, for which `pred` holds?"""
        now = time.monotonic()
        return any(n != node_id and n not in self.banned and now - r.last_seen <= self.gone_after_s and pred(n)
                   for n, r in self.nodes.items())
