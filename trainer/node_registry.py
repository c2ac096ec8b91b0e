"""The nodes the trainer knows: one record per key, owned by the node service, read by stats and views."""

from __future__ import annotations

import time
from collections import Counter
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
    # Where the key stands with the trainer: "trusted" (guard.trusted), "established" (passed probation),
    # "probation" (its groups wait for the paired test), or "open" (probation off: guard.probation_groups 0).
    standing: str = "probation"
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
        return self.silent_for(self.gone_after_s)

    def silent_for(self, seconds: float) -> set[str]:
        now = time.monotonic()
        return {n for n, r in self.nodes.items() if now - r.last_seen > seconds}

    def forget(self, node_id: str) -> NodeRecord | None:
        return self.nodes.pop(node_id, None)

    def live(self, node_id: str) -> bool:
        """Registered, not banned, and heard from within gone_after_s."""
        rec = self.nodes.get(node_id)
        return (rec is not None and node_id not in self.banned
                and time.monotonic() - rec.last_seen <= self.gone_after_s)
