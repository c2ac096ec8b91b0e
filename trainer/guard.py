"""Who may talk to the trainer, how much, and what happens to those who cheat.

- Admission: open, or an allowlist of keys; bans are by key, kept in RUN/bans.json so they survive a
  restart. Keys that passed probation are kept in RUN/established.json for the same reason.
- Limits per key: a token bucket on messages, and a cap on assignments held at once.
- Consequences: every fraud is a strike; `strikes_to_ban` strikes ban the key. A node with a strike is
  a suspect: all of its groups are audited from then on.
- Cherry-picking: a node that samples many completions and returns its best G sends honest-looking
  log-probs, so no audit of its tokens can see it. Now and then the same prompt goes to two nodes; over
  M shared prompts a one-sided paired z-test compares each node's mean reward with a reference's on the
  same prompt at a close policy version (trainer/pairing.py). An honest node's differences average zero;
  a cherry-picker's are positive.
- Probation: a new key's groups wait in a quarantine, every one of its prompts also goes to another node
  (and to the trainer's own reference sampler with `reference` on), and only once at least `pair_min`
  shared prompts show a small reward excess (z <= `pair_release_z` at `pair_min` prompts, a bar that
  rises as sqrt(n / pair_min) after) is it established and its groups released to the learner; z >
  `pair_z` catches it, and in between more shared prompts decide (a sequential test: releasing on "not
  yet significant" let a best-of-4 node through). So a cherry-picker is caught before any of its work
  is trained on. With no reference at all a node waits on probation, unless `release_unpaired`.
"""

from __future__ import annotations

import json
import math
import time
from collections import Counter
from pathlib import Path

import msgspec

from swarm_common.atomic import write_atomic
from trainer.pairing import PairedRewards

# The node id under which the trainer's own reference samples enter the paired test (never a real key:
# keys are 64 hex digits).
REFERENCE = "reference"

# Reasons that mean the node lied or broke the protocol on purpose; `stale` and `late` are honest.
FRAUD = frozenset({
    "bad_length", "bad_token", "bad_logprob", "bad_finish", "wrong_group_size", "unassigned",
    "future_version", "unknown_version", "logprob_mismatch", "implausible_token", "outside_top_p",
    "cherry_picking",
    # an episode the trainer's replay does not reproduce (trainer/episode_check.py)
    "bad_episode", "bad_mask", "observation_mismatch", "missing_observation", "unexpected_observation",
    "cut_short",
})


class GuardConfig(msgspec.Struct, forbid_unknown_fields=True, kw_only=True):
    """The run config's [guard] section: who may take part, how much, and the cherry-picking test."""

    allowlist: frozenset[str] = frozenset()  # hex node keys allowed to join; empty = open to anyone
    # Hex keys of nodes the operator runs itself: no probation (their groups train at once), audited as
    # any new key is (their first audit.new_node_groups groups, then audit.rate), banned as anyone on fraud.
    trusted: frozenset[str] = frozenset()
    strikes_to_ban: int = 3
    msg_rate: float = 50.0  # messages per second per node key, sustained
    msg_burst: int = 200
    max_held: int = 128  # assignments one node may hold at once
    duplicate_share: float = 0.05  # prompts also given to a second node, for the cherry-picking test
    # z above which a node's reward excess over its references is cherry-picking, and the shared prompts
    # that carry evidence (not both groups alike and all alike) needed before any verdict. Chosen by
    # simulation (bench/probation_sim.py, docs/benchmarks.md): 0 of 6,000 honest newcomers banned, 0 of
    # 12,000 best-of-2 and best-of-4 newcomers released, in runs that learn.
    pair_z: float = 4.5
    pair_min: int = 16
    # Two answers to a shared prompt are compared only when their policy versions are at most this far
    # apart: a policy that improves makes the newer answer better without any cheating. The default is
    # train.max_lag's: the drift over 2 versions is a few hundredths of a difference's noise even while
    # the demo learns fastest (docs/benchmarks.md, "The paired test while the policy improves").
    pair_window: int = 2
    # Probation ends in release only once the excess is small (z at most this at pair_min shared prompts,
    # times sqrt(n / pair_min) at n): between it and pair_z the node stays on probation and more decide.
    pair_release_z: float = 1.0
    # A new key's groups wait in quarantine, its prompts all shared with another node, until pair_min shared
    # prompts clear it of cherry-picking (or, when it is alone, until it delivered this many audited groups).
    # It may have this many out or in quarantine at once, one more for each shared prompt that carried no
    # evidence (trainer/work.py).
    probation_groups: int = 16
    # Without an established or trusted node to be paired with, a node on probation stays on it (audited,
    # its groups in quarantine): two new keys pairing with each other could be one cheater's. True releases
    # a node that delivered probation_groups audited groups with no established partner live (a lab).
    release_unpaired: bool = False
    # The trainer as the reference for keys on probation (swarm train --reference): it samples each of their
    # prompts itself with the same weights and settings, so strangers are paired even when no node of the
    # operator's is live. It spends at most reference_budget of one thread's time (trainer/reference.py).
    reference: bool = False
    reference_budget: float = 0.25
    # Work share is earned. A key with no accepted work may hold new_key_held assignments; each accepted
    # group adds one (up to max_held), each expiry halves it. Keys that are not established hold together
    # at most new_keys_share of train.inflight_groups (held or waiting in quarantine), so established nodes
    # always have room for a batch.
    new_key_held: int = 2
    new_keys_share: float = 0.25
    expiries_to_pause: int = 2  # expiries in a row (no accepted group between) that pause a key ...
    pause_s: float = 60.0  # ... for this long
    expiries_to_drop: int = 4  # ... and that drop its registration (it must register again)
    # A key that is not established, silent this long and holding nothing (no work, nothing in quarantine),
    # is forgotten: it registers again if it comes back. Past the 5 minutes a registration is valid for.
    forget_after_s: float = 600.0
    # Registrations per second per source address (a token bucket of register_burst), and per address
    # prefix (/24 of IPv4, /64 of IPv6): a block of addresses buys a few times one address's budget, not
    # hundreds of times. Established and trusted keys register without spending either.
    register_rate: float = 0.2
    register_burst: int = 10
    register_prefix_rate: float = 0.5
    register_prefix_burst: int = 30
    # Admission cost for open runs: a Register must carry a proof of work of this many leading zero bits
    # (sha256 of key, time and nonce; 20 bits is about a second of one core), and/or one of these invite
    # tokens (each binds to the first key that uses it). 0 and [] admit anyone.
    register_pow_bits: int = 0
    invites: list[str] = []

    def __post_init__(self) -> None:
        self.allowlist = frozenset(k.lower() for k in self.allowlist)
        self.trusted = frozenset(k.lower() for k in self.trusted)


class Guard:
    def __init__(self, run_dir: str | Path, cfg: GuardConfig):
        self.cfg = cfg
        self.path = Path(run_dir) / "bans.json"
        self.bans: dict[str, str] = json.loads(self.path.read_text()) if self.path.exists() else {}
        self.established_path = Path(run_dir) / "established.json"
        self.established: set[str] = (set(json.loads(self.established_path.read_text()))
                                      if self.established_path.exists() else set())
        # Keys released by release_unpaired, with nobody to compare them with: established, never a reference
        # (two colluding keys released that way would otherwise vouch for each other).
        self.unchecked_path = Path(run_dir) / "unchecked.json"
        self.unchecked: set[str] = (set(json.loads(self.unchecked_path.read_text()))
                                    if self.unchecked_path.exists() else set())
        self.strikes: Counter = Counter()
        self.suspects: set[str] = set()
        # A difference counts toward a node's test only against a reference: an established or trusted
        # key, or the trainer's own samples (trainer/reference.py).
        self.pairs = PairedRewards(cfg.pair_window, self.is_reference)
        self._buckets: dict[str, tuple[float, float]] = {}
        self.last_register_ms: dict[str, int] = {}

    def admit(self, node_id: str) -> str | None:
        if node_id in self.bans:
            return "banned"
        if self.cfg.allowlist and node_id not in self.cfg.allowlist:
            return "not_allowed"
        return None

    def within_rate(self, node_id: str) -> bool:
        now = time.monotonic()
        tokens, last = self._buckets.get(node_id, (float(self.cfg.msg_burst), now))
        tokens = min(self.cfg.msg_burst, tokens + (now - last) * self.cfg.msg_rate)
        if tokens < 1.0:
            self._buckets[node_id] = (tokens, now)
            return False
        self._buckets[node_id] = (tokens - 1.0, now)
        return True

    def fresh_register(self, node_id: str, time_ms: int) -> bool:
        """A registration must be newer than the last one seen from this key, and roughly now."""
        now_ms = int(time.time() * 1000)
        if time_ms <= self.last_register_ms.get(node_id, 0) or abs(now_ms - time_ms) > 300_000:
            return False
        self.last_register_ms[node_id] = time_ms
        return True

    def forget(self, node_id: str) -> None:
        """A silent key the trainer forgets: its message budget, evidence and last registration go (bans
        and strikes stay). Forgotten only after forget_after_s > 5 minutes, so a replay of its old
        registration is refused anyway, as too old."""
        self._buckets.pop(node_id, None)
        self.last_register_ms.pop(node_id, None)
        self.pairs.forget_node(node_id)

    def strike(self, node_id: str, reason: str) -> bool:
        """Record a fraud; returns True when it bans the node."""
        self.strikes[node_id] += 1
        self.suspects.add(node_id)
        if self.strikes[node_id] >= self.cfg.strikes_to_ban:
            self.ban(node_id, reason)
            return True
        return False

    def ban(self, node_id: str, reason: str) -> None:
        self.bans[node_id] = reason
        _write_json(self.path, self.bans)

    def is_established(self, node_id: str) -> bool:
        return node_id in self.established or node_id in self.cfg.trusted

    def is_reference(self, node_id: str) -> bool:
        """Do this node's answers count as the yardstick of the paired test? (Not a key released unchecked.)"""
        return node_id == REFERENCE or (self.is_established(node_id) and node_id not in self.unchecked)

    def probation_verdict(self, node_id: str, delivered: int, has_partner: bool) -> str | None:
        """"cherry_picking", "released", "released_unchecked" (release_unpaired, nobody to compare with), or
        None while the evidence is not in yet, for a node on probation that has delivered `delivered` audited
        groups."""
        n, z = self.pairs.z(node_id)
        if n >= self.cfg.pair_min and z > self.cfg.pair_z:
            return "cherry_picking"
        # Enough evidence, or so many shared prompts alike on both sides (a task the policy has mastered:
        # picking the best of k changes nothing there) that waiting for more would never end.
        if n >= self.cfg.pair_min or self.pairs.compared[node_id] >= 4 * self.cfg.pair_min:
            # The bar rises as sqrt(n / pair_min): what it bounds is the reward excess per shared prompt in
            # standard deviations (z / sqrt(n)), so an honest node (z ~ N(0, 1) at every n) is soon released,
            # while a cherry-picker's z grows as sqrt(n) times its excess and meets pair_z first.
            if z <= self.cfg.pair_release_z * math.sqrt(max(n, 1) / self.cfg.pair_min):
                return "released"
            return None  # not clean enough to release, not enough to convict: more shared prompts
        if not has_partner and self.cfg.release_unpaired and delivered >= self.cfg.probation_groups:
            return "released_unchecked"  # nobody to compare with, and the operator accepts that; all audited
        return None

    def establish(self, node_id: str, checked: bool = True) -> None:
        """The key passed probation (`checked`: by the paired test): remembered across restarts."""
        self.established.add(node_id)
        _write_json(self.established_path, sorted(self.established))
        if not checked:
            self.unchecked.add(node_id)
            _write_json(self.unchecked_path, sorted(self.unchecked))

    def blank_comparisons(self, node_id: str) -> int:
        """Shared prompts of this node's compared with a reference that carried no evidence either way."""
        return self.pairs.compared[node_id] - self.pairs.n[node_id]

    def cherry_picking(self, node_id: str) -> bool:
        n, z = self.pairs.z(node_id)
        return n >= self.cfg.pair_min and z > self.cfg.pair_z


def _write_json(path: Path, obj) -> None:
    """Whole or not at all: a crash mid-write leaves the previous file."""
    write_atomic(path, json.dumps(obj, indent=1, sort_keys=True))
