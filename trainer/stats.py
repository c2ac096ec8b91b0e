"""The run's figures, kept in one place: Prometheus metrics plus a short history for the API and views."""

from __future__ import annotations

import time
from collections import Counter, deque
from collections.abc import Callable
from typing import Any

import msgspec
from prometheus_client import CollectorRegistry, Gauge, Histogram
from prometheus_client import Counter as PCounter

from trainer.node_registry import NodeRecord, NodeRegistry

RATE_WINDOW_S = 10.0  # throughput rates are averaged over this many seconds
# Live keys with nothing accepted yet that the views list (the newest); the rest are counted: a crowd of
# throwaway keys must not make every view a thousand rows long.
MAX_UNPROVEN = 50


class NodeRow(msgspec.Struct):
    """One node as every view shows it (web page, /api, summary.json, `swarm status`)."""

    node_id: str
    name: str
    state: str  # healthy, slow, gone, banned
    version_loaded: int
    tokens_per_s: float  # accepted completion tokens/s over the rate window, measured by the trainer
    rollouts_per_s: float  # accepted groups (one prompt's G completions) per second
    reported_tokens_per_s: float  # what the node says its engine does (untrusted)
    accepted_groups: int
    share: float  # of all accepted groups
    refused: dict[str, int]
    last_heartbeat_age_s: float
    status_url: str
    relay_url: str = ""  # where its relay serves the tree ("": no relay, or not in the tree)
    relay_reachable: bool | None = None  # the tracker's connect-back check; False: a download-only leaf
    standing: str = ""  # trusted, established, probation or open (trainer/node_registry.py)
    # Multi-turn work (0 otherwise): accepted episodes/s, and per accepted episode its mean turns, tool
    # calls, and the share of tool calls that failed.
    episodes_per_s: float = 0.0
    mean_turns: float = 0.0
    tool_calls_per_episode: float = 0.0
    tool_error_rate: float = 0.0


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


class Overview(msgspec.Struct, kw_only=True):
    """The run's figures now: what the live views show."""

    time: float  # unix time of this view
    step: int
    max_steps: int
    version: int
    elapsed_s: float
    done: bool
    accepted_groups: int
    trained_groups: int
    tokens_generated: int
    tokens_per_s: float
    rollouts_per_s: float
    refused: dict[str, int]
    dropped: dict[str, int]
    lag_counts: dict[str, int]  # accepted groups by version lag ("0", "1", ...)
    nodes: list[NodeRow]  # every key but the silent ones
    tree: Any  # the relay tree (broadcast TreeView) or None
    episodes_per_s: float = 0.0  # multi-turn work: accepted episodes/s over the rate window, all nodes
    # Keys on probation and whether anyone can be paired with them (trainer/newcomers.py's Pairing), or None.
    pairing: Any = None
    silent_keys: int = 0  # registered keys, silent past gone_after_s, that never had work accepted (not listed)
    unlisted_keys: int = 0  # live keys with nothing accepted beyond the MAX_UNPROVEN listed (the newest are)


class Summary(Overview, kw_only=True):
    """The overview plus the run's history and audit figures: /api/summary and RUN/summary.json."""

    run_dir: str
    steps: list[StepRow]
    evals: list[EvalRow]
    audits: int = 0
    audit_calibration: dict[str, float] = {}  # honest audits' largest |dlogp|: median, p99, max
    banned: list[str] = []
    audit_seconds: float = 0.0  # wall time spent in computation audits
    quarantined: int = 0  # groups of nodes on probation, waiting to be released to the learner
    snapshots: list[SnapshotRow] = []  # kept copies of the policy (train.snapshot_every)
    first_work_s: float | None = None  # RL seconds when a node first got work (it had weights loaded)
    episodes: int = 0  # accepted episodes (multi-turn work)
    replay_seconds: float = 0.0  # wall time spent replaying episodes (trainer/episode_check.py)


class RunStats:
    """Counts, histories and Prometheus metrics of a run. Per-node figures live in the node registry's
    records (trainer/node_registry.py), which this reads and counts into."""

    def __init__(self, run_dir: str, max_steps: int, registry: NodeRegistry):
        self.run_dir, self.max_steps, self.registry = run_dir, max_steps, registry
        self.t0 = time.time()
        self.step = 0
        self.version = 0
        self.done = False
        self.accepted_groups = 0
        self.trained_groups = 0
        self.dropped: Counter = Counter()
        self.refused: Counter = Counter()
        self.tokens = 0
        self.steps: list[StepRow] = []
        self.evals: list[EvalRow] = []
        self.audits = 0
        self.audit_seconds = 0.0
        self.quarantined = 0
        self.snapshots: list[SnapshotRow] = []
        self.first_work_at: float | None = None  # unix time a node first got work
        self.calibration = None  # set by the trainer to the auditor's Calibration
        self.lag_counts: Counter = Counter()  # accepted groups by policy-version lag
        self.episodes = 0
        self.replay_seconds = 0.0
        # One sample a second (taken by the web view's ticker) for the throughput charts: an hour's worth.
        self.history: deque[ThroughputSample] = deque(maxlen=3600)
        # Returns the relay tree (a msgspec struct or dict) for the views; None until a tree exists.
        self.tree_provider: Callable[[], Any] | None = None
        # Returns the newcomers' Pairing (trainer/newcomers.py) for the views and the banners.
        self.pairing_provider: Callable[[], Any] | None = None

        r = self.prom_registry = CollectorRegistry()
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
        self.m_episodes = PCounter("swarm_episodes", "accepted episodes (multi-turn work)", ["node"], registry=r)
        self.m_turns = PCounter("swarm_episode_turns", "model turns in accepted episodes", ["node"], registry=r)
        self.m_tool_calls = PCounter("swarm_tool_calls", "tool calls in accepted episodes", ["node"], registry=r)
        self.m_tool_errors = PCounter("swarm_tool_errors", "tool calls in accepted episodes that failed",
                                      ["node"], registry=r)
        self.m_replay_s = PCounter("swarm_replay_seconds", "seconds spent replaying episodes", registry=r)
        self.m_node_age = Gauge("swarm_node_heartbeat_age_seconds", "seconds since the node was last heard",
                                ["node"], registry=r)
        self.m_probation = Gauge("swarm_probation_keys", "keys on probation: all, and those with nobody to be "
                                 "paired with (their work waits)", ["waiting"], registry=r)
        self.m_waiting_groups = Gauge("swarm_probation_waiting_groups", "groups in quarantine of keys with "
                                      "nobody to be paired with", registry=r)
        self.m_release_unpaired = Gauge("swarm_release_unpaired", "1 while guard.release_unpaired is on: keys "
                                        "with no reference are released unchecked for cherry-picking", registry=r)
        self.m_reference_groups = Gauge("swarm_reference_groups", "groups the trainer sampled itself as the "
                                        "paired test's reference (guard.reference)", registry=r)
        self.m_silent = Gauge("swarm_silent_keys", "registered keys, silent, never accepted (not listed)",
                              registry=r)

    def elapsed(self) -> float:
        return time.time() - self.t0

    def restore(self, st) -> None:
        """A resumed run's figures, from its checkpoint's TrainerState."""
        self.step, self.steps, self.evals = st.step, st.steps, st.evals
        self.accepted_groups, self.tokens = st.accepted_groups, st.tokens
        self.dropped.update(st.dropped)
        self.refused.update(st.refused)
        self.trained_groups = sum(r.groups - r.zero_adv_groups for r in st.steps)

    def record_step(self, row: StepRow) -> None:
        self.steps.append(row)
        self.m_steps.inc()
        self.m_version.set(row.version)
        self.m_reward.set(row.reward_mean)
        self.m_step_s.observe(row.step_seconds)

    def record_eval(self, row: EvalRow) -> None:
        self.evals.append(row)
        self.m_eval.set(row.accuracy)

    def accepted(self, rec: NodeRecord, tokens: int, lag: int) -> None:
        self.accepted_groups += 1
        self.tokens += tokens
        rec.accepted_groups += 1
        rec.accepted_tokens += tokens
        self.lag_counts[lag] += 1
        self.m_accepted.labels(rec.name).inc()
        self.m_tokens.labels(rec.name).inc(tokens)
        self.m_lag.observe(lag)

    def refuse(self, rec: NodeRecord | None, reason: str) -> None:
        """A refusal, of a registered node's (`rec`) or of an unknown sender's (None)."""
        self.refused[reason] += 1
        if rec is not None:
            rec.refused[reason] += 1
        self.m_refused.labels(rec.name if rec else "unknown", reason).inc()

    def forget(self, rec: NodeRecord | None) -> None:
        """A forgotten key's per-node gauges go (its counters stay: they are the run's history)."""
        if rec is None or any(r.name == rec.name for r in self.registry.nodes.values()):
            return
        for gauge in (self.m_node_tps, self.m_node_version, self.m_node_age):
            try:
                gauge.remove(rec.name)
            except KeyError:
                pass

    def episodes_accepted(self, rec: NodeRecord, n: int, turns: int, tool_calls: int, tool_errors: int) -> None:
        """An accepted group of `n` episodes with these totals."""
        self.episodes += n
        rec.episodes += n
        rec.turns += turns
        rec.tool_calls += tool_calls
        rec.tool_errors += tool_errors
        for m, v in ((self.m_episodes, n), (self.m_turns, turns), (self.m_tool_calls, tool_calls),
                     (self.m_tool_errors, tool_errors)):
            m.labels(rec.name).inc(v)

    def replayed(self, seconds: float) -> None:
        self.replay_seconds += seconds
        self.m_replay_s.inc(seconds)

    def audited(self, seconds: float) -> None:
        self.audits += 1
        self.audit_seconds += seconds

    def drop(self, reason: str, n: int = 1) -> None:
        self.dropped[reason] += n
        self.m_dropped.labels(reason).inc(n)

    def sample(self, now: float | None = None) -> ThroughputSample:
        """Record the cumulative counts now (called once a second by the web view)."""
        s = ThroughputSample(time.time() if now is None else now, self.tokens, self.accepted_groups,
                             {n.node_id: (n.accepted_tokens, n.accepted_groups)
                              for n in self.registry.nodes.values()
                              if n.accepted_groups or self.registry.state(n) != "gone"})  # not the silent keys
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

    def _figures(self, window_s: float) -> dict[str, Any]:
        """The overview's fields, with rates over the window_s before the newest throughput sample; also
        refreshes the per-node Prometheus gauges."""
        last = self.rates(len(self.history) - 1, window_s) if self.history else (0.0, 0.0, {})
        total = max(self.accepted_groups, 1)
        now = time.monotonic()
        nodes, states = [], Counter()
        tree = self.tree()
        peers = {p.get("key"): p for p in (msgspec.to_builtins(tree) or {}).get("peers", []) if p.get("key")}
        silent = unlisted = 0
        unproven = [r for r in self.registry.nodes.values() if not r.accepted_groups and r.standing == "probation"
                    and r.node_id not in self.registry.banned]  # bans are always listed
        hidden = {r.node_id for r in sorted(unproven, key=lambda r: r.last_seen)[:-MAX_UNPROVEN]}  # all but the newest
        for rec in self.registry.nodes.values():
            state = self.registry.state(rec)
            states[state] += 1
            if state == "gone" and rec.accepted_groups == 0:
                silent += 1  # a key that registered and went quiet: counted, not listed
                continue
            if rec.node_id in hidden:
                unlisted += 1
                continue
            peer = peers.get(rec.node_id, {})
            tok, grp = last[2].get(rec.node_id, (0.0, 0.0))
            nodes.append(NodeRow(rec.node_id, rec.name, state, rec.version_loaded, round3(tok), round3(grp),
                                 round(rec.tokens_per_s, 1), rec.accepted_groups, round3(rec.accepted_groups / total),
                                 dict(rec.refused), round(now - rec.last_seen, 2), rec.status_url,
                                 peer.get("url") or "", peer.get("reachable"), rec.standing,
                                 *episode_figures(rec, grp)))
            self.m_node_tps.labels(rec.name).set(round3(tok))
            self.m_node_version.labels(rec.name).set(rec.version_loaded)
            self.m_node_age.labels(rec.name).set(round(now - rec.last_seen, 2))
        for st in ("healthy", "slow", "gone", "banned"):
            self.m_nodes.labels(st).set(states[st])
        self.m_silent.set(silent)
        pairing = self.pairing_provider() if self.pairing_provider is not None else None
        if pairing is not None:
            self.m_probation.labels("all").set(pairing.on_probation)
            self.m_probation.labels("unpaired").set(pairing.waiting_keys)
            self.m_waiting_groups.set(pairing.waiting_groups)
            self.m_release_unpaired.set(int(pairing.release_unpaired))
            self.m_reference_groups.set(pairing.reference_groups)
        return dict(time=time.time(), step=self.step, max_steps=self.max_steps, version=self.version,
                    elapsed_s=round(self.elapsed(), 2), done=self.done, accepted_groups=self.accepted_groups,
                    trained_groups=self.trained_groups, tokens_generated=self.tokens, tokens_per_s=round3(last[0]),
                    rollouts_per_s=round3(last[1]), refused=dict(self.refused), dropped=dict(self.dropped),
                    lag_counts={str(k): v for k, v in sorted(self.lag_counts.items())}, nodes=nodes,
                    tree=tree, pairing=pairing, silent_keys=silent, unlisted_keys=unlisted,
                    episodes_per_s=round3(sum(n.episodes_per_s for n in nodes)))

    def overview(self, window_s: float = RATE_WINDOW_S) -> Overview:
        return Overview(**self._figures(window_s))

    def summary(self, window_s: float = RATE_WINDOW_S) -> Summary:
        first = None if self.first_work_at is None else round(max(0.0, self.first_work_at - self.t0), 3)
        return Summary(**self._figures(window_s), run_dir=self.run_dir, steps=self.steps, evals=self.evals,
                       episodes=self.episodes, replay_seconds=round(self.replay_seconds, 3),
                       audits=self.audits,
                       audit_calibration=self.calibration.summary() if self.calibration else {},
                       banned=sorted(self.registry.banned), audit_seconds=round(self.audit_seconds, 3),
                       quarantined=self.quarantined, snapshots=self.snapshots, first_work_s=first)


def round3(x: float) -> float:
    return round(x, 3)


def episode_figures(rec: NodeRecord, groups_per_s: float) -> tuple[float, float, float, float]:
    """(episodes/s, mean turns, tool calls per episode, tool-error rate) of a node's accepted episodes."""
    if not rec.episodes:
        return 0.0, 0.0, 0.0, 0.0
    per_group = rec.episodes / max(rec.accepted_groups, 1)
    return (round3(groups_per_s * per_group), round3(rec.turns / rec.episodes),
            round3(rec.tool_calls / rec.episodes), round3(rec.tool_errors / max(rec.tool_calls, 1)))
