"""The run's figures, kept in one place: Prometheus metrics plus a short history for the API and views."""

from __future__ import annotations

import time
from collections import Counter, deque
from dataclasses import dataclass, field

import msgspec
from prometheus_client import CollectorRegistry, Gauge, Histogram
from prometheus_client import Counter as PCounter


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


@dataclass
class NodeStats:
    node_id: str
    name: str
    status_url: str = ""
    version_loaded: int = -1
    tokens_per_s: float = 0.0
    last_seen: float = field(default_factory=time.monotonic)
    accepted_groups: int = 0
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
        self.banned: set[str] = set()
        self.calibration = None  # set by the trainer to the auditor's Calibration

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
        self.nodes[node_id].accepted_groups += 1
        name = self.nodes[node_id].name
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
        return Summary(self.run_dir, self.step, self.version, self.max_steps, round(self.elapsed(), 2), self.done,
                       self.accepted_groups, self.trained_groups, dict(self.dropped), dict(self.refused),
                       self.tokens, round(self.tokens_per_s(), 1), rows, self.steps, self.evals,
                       self.audits, self.calibration.summary() if self.calibration else {},
                       sorted(self.banned))
