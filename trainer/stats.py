"""The run's figures, kept in one place: Prometheus metrics plus a short history for the API and views."""

from __future__ import annotations

import time
from collections import Counter, deque
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

import msgspec
from prometheus_client import CollectorRegistry, Gauge, Histogram
from prometheus_client import Counter as PCounter

RATE_WINDOW_S = 10.0  # throughput rates are averaged over this many seconds


class NodeRow(msgspec.Struct):
    node_id: str
    name: str
    state: str  # healthy, slow, gone
    version_loaded: int
    tokens_per_s: float
    accepted_groups: int
    refused: dict[str, int]
    last_heartbeat_age_s: float
    status_url: str


class StepRow(msgspec.Struct):
    step: int
    version: int
    time: float  # seconds since the RL run started
    reward_mean: float
    correct_mean: float
    groups: int
    zero_adv_groups: int
    lag_mean: float
    loss: float
    clip_frac: float
    step_seconds: float


class EvalRow(msgspec.Struct):
    step: int
    time: float
    accuracy: float
    reward_mean: float


class SnapshotRow(msgspec.Struct):
    step: int
    version: int
    time: float  # RL seconds when the version was published
    path: str


class ThroughputSample(msgspec.Struct, array_like=True):
    """Cumulative accepted counts at one instant; rates are differences between samples."""

    t: float  # unix time
    tokens: int
    groups: int
    nodes: dict[str, tuple[int, int]]  # node_id -> (tokens, groups)


class Summary(msgspec.Struct):
    run_dir: str
    step: int
    version: int
    max_steps: int
    elapsed_s: float
    done: bool
    accepted_groups: int
    trained_groups: int
    dropped: dict[str, int]
    refused: dict[str, int]
    tokens_generated: int
    tokens_per_s: float
    nodes: list[NodeRow]
    steps: list[StepRow]
    evals: list[EvalRow]
    audits: int = 0
    audit_calibration: dict[str, float] = {}  # honest audits' largest |dlogp|: median, p99, max
    banned: list[str] = []
    audit_seconds: float = 0.0  # wall time spent in computation audits
    quarantined: int = 0  # groups of nodes on probation, waiting to be released to the learner
    snapshots: list[SnapshotRow] = []  # kept copies of the policy (train.snapshot_every)
    first_work_s: float | None = None  # RL seconds when a node first got work (it had weights loaded)


@dataclass
class NodeStats:
    node_id: str
    name: str
    status_url: str = ""
    version_loaded: int = -1
    tokens_per_s: float = 0.0
    last_seen: float = field(default_factory=time.monotonic)
    accepted_groups: int = 0
    accepted_tokens: int = 0
    refused: Counter = field(default_factory=Counter)


class RunStats:
    def __init__(self, run_dir: str, max_steps: int):
        self.run_dir, self.max_steps = run_dir, max_steps
        self.t0 = time.time()
        self.step = 0
        self.version = 0
        self.done = False
        self.accepted_groups = 0
        self.trained_groups = 0
        self.dropped: Counter = Counter()
        self.refused: Counter = Counter()
        self.tokens = 0
        self._token_times: deque[tuple[float, int]] = deque(maxlen=512)
        self.steps: list[StepRow] = []
        self.evals: list[EvalRow] = []
        self.nodes: dict[str, NodeStats] = {}
        self.audits = 0
        self.audit_seconds = 0.0
        self.quarantined = 0
        self.snapshots: list[SnapshotRow] = []
        self.first_work_at: float | None = None  # unix time a node first got work
        self.banned: set[str] = set()
        self.calibration = None  # set by the trainer to the auditor's Calibration
        self.lag_counts: Counter = Counter()  # accepted groups by policy-version lag
        # One sample a second (taken by the web view's ticker) for the throughput charts: an hour's worth.
        self.history: deque[ThroughputSample] = deque(maxlen=3600)
        # Returns the relay tree (a msgspec struct or dict) for the views; None until a tree exists.
        self.tree_provider: Callable[[], Any] | None = None

        r = self.registry = CollectorRegistry()
        self.m_steps = PCounter("swarm_trainer_steps", "optimizer steps taken", registry=r)
        self.m_version = Gauge("swarm_policy_version", "newest published policy version", registry=r)
        self.m_accepted = PCounter("swarm_groups_accepted", "rollout groups accepted", ["node"], registry=r)
        self.m_refused = PCounter("swarm_groups_refused", "rollout groups refused", ["node", "reason"], registry=r)
        self.m_dropped = PCounter("swarm_groups_dropped", "accepted groups not trained on", ["reason"], registry=r)
        self.m_tokens = PCounter("swarm_tokens_generated", "completion tokens accepted", ["node"], registry=r)
        self.m_reward = Gauge("swarm_reward_mean", "mean reward of the last training batch", registry=r)
        self.m_eval = Gauge("swarm_eval_accuracy", "held-out greedy accuracy at the last evaluation", registry=r)
        self.m_lag = Histogram("swarm_rollout_lag", "policy-version lag of accepted rollouts",
                               buckets=(0, 1, 2, 3, 4, 8), registry=r)
        self.m_step_s = Histogram("swarm_step_seconds", "optimizer step time", registry=r)
        self.m_nodes = Gauge("swarm_nodes", "registered nodes by state", ["state"], registry=r)
        self.m_node_tps = Gauge("swarm_node_tokens_per_second", "accepted completion tokens/s over the last "
                                "rate window", ["node"], registry=r)
        self.m_node_version = Gauge("swarm_node_version_loaded", "policy version the node has loaded",
                                    ["node"], registry=r)
        self.m_node_age = Gauge("swarm_node_heartbeat_age_seconds", "seconds since the node was last heard",
                                ["node"], registry=r)

    def elapsed(self) -> float:
        return time.time() - self.t0

    def node(self, node_id: str, name: str = "") -> NodeStats:
        if node_id not in self.nodes:
            self.nodes[node_id] = NodeStats(node_id, name or node_id[:8])
        return self.nodes[node_id]

    def accepted(self, node_id: str, tokens: int, lag: int) -> None:
        self.accepted_groups += 1
        self.tokens += tokens
        self._token_times.append((time.monotonic(), tokens))
        ns = self.nodes[node_id]
        ns.accepted_groups += 1
        ns.accepted_tokens += tokens
        self.lag_counts[lag] += 1
        name = ns.name
        self.m_accepted.labels(name).inc()
        self.m_tokens.labels(name).inc(tokens)
        self.m_lag.observe(lag)

    def refuse(self, node_id: str, reason: str) -> None:
        self.refused[reason] += 1
        ns = self.nodes.get(node_id)
        if ns is not None:
            ns.refused[reason] += 1
        self.m_refused.labels(ns.name if ns else "unknown", reason).inc()

    def drop(self, reason: str, n: int = 1) -> None:
        self.dropped[reason] += n
        self.m_dropped.labels(reason).inc(n)

    def tokens_per_s(self, window: float = 30.0) -> float:
        now = time.monotonic()
        recent = [(t, n) for t, n in self._token_times if now - t <= window]
        if len(recent) < 2:
            return 0.0
        return sum(n for _, n in recent[1:]) / max(now - recent[0][0], 1e-6)

    def sample(self, now: float | None = None) -> ThroughputSample:
        """Record the cumulative counts now (called once a second by the web view)."""
        s = ThroughputSample(time.time() if now is None else now, self.tokens, self.accepted_groups,
                             {n.node_id: (n.accepted_tokens, n.accepted_groups) for n in self.nodes.values()})
        self.history.append(s)
        return s

    def rates(self, i: int, window_s: float) -> tuple[float, float, dict[str, tuple[float, float]]]:
        """(tokens/s, groups/s, per node) at history[i], averaged over the window_s before it.

        Groups arrive in bursts (a node submits a whole batch at once), so a window of several seconds
        gives a readable curve where a per-second difference would be all spikes."""
        cur = self.history[i]
        j = i
        while j > 0 and cur.t - self.history[j - 1].t <= window_s + 1e-6:
            j -= 1
        if j == i:
            return 0.0, 0.0, {n: (0.0, 0.0) for n in cur.nodes}
        old = self.history[j]
        dt = cur.t - old.t
        nodes = {}
        for n, (tok, grp) in cur.nodes.items():
            otok, ogrp = old.nodes.get(n, (0, 0))
            nodes[n] = ((tok - otok) / dt, (grp - ogrp) / dt)
        return (cur.tokens - old.tokens) / dt, (cur.groups - old.groups) / dt, nodes

    def tree(self) -> Any:
        return self.tree_provider() if self.tree_provider is not None else None

    def node_state(self, ns: NodeStats, heartbeat_s: float) -> str:
        if ns.node_id in self.banned:
            return "banned"
        age = time.monotonic() - ns.last_seen
        return "healthy" if age <= 3 * heartbeat_s else "slow" if age <= 10 * heartbeat_s else "gone"

    def summary(self, heartbeat_s: float) -> Summary:
        rows = []
        states: Counter = Counter()
        for ns in self.nodes.values():
            st = self.node_state(ns, heartbeat_s)
            states[st] += 1
            rows.append(NodeRow(ns.node_id, ns.name, st, ns.version_loaded, round(ns.tokens_per_s, 1),
                                ns.accepted_groups, dict(ns.refused),
                                round(time.monotonic() - ns.last_seen, 2), ns.status_url))
        for st in ("healthy", "slow", "gone", "banned"):
            self.m_nodes.labels(st).set(states[st])
        node_rates = self.rates(len(self.history) - 1, RATE_WINDOW_S)[2] if self.history else {}
        for ns in self.nodes.values():
            self.m_node_tps.labels(ns.name).set(round(node_rates.get(ns.node_id, (0.0, 0.0))[0], 3))
            self.m_node_version.labels(ns.name).set(ns.version_loaded)
            self.m_node_age.labels(ns.name).set(round(time.monotonic() - ns.last_seen, 2))
        return Summary(self.run_dir, self.step, self.version, self.max_steps, round(self.elapsed(), 2), self.done,
                       self.accepted_groups, self.trained_groups, dict(self.dropped), dict(self.refused),
                       self.tokens, round(self.tokens_per_s(), 1), rows, self.steps, self.evals,
                       self.audits, self.calibration.summary() if self.calibration else {},
                       sorted(self.banned), round(self.audit_seconds, 3), self.quarantined, self.snapshots,
                       None if self.first_work_at is None else round(max(0.0, self.first_work_at - self.t0), 3))
