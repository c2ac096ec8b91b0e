"""Who may register: a rate per source address, and the optional cost of a fresh identity.

Identities are free (a key is one call), so nothing about a new key is trusted; this only bounds how fast
new keys can arrive from one address, and, for open runs, makes each one cost a proof of work or an invite.
"""

from __future__ import annotations

import json
import time
from pathlib import Path

from swarm_common import proof_of_work
from swarm_common import protocol as P
from swarm_common.atomic import write_atomic
from trainer.guard import GuardConfig

MAX_ADDRESSES = 100_000  # token buckets kept at once; the oldest go first


class Admission:
    def __init__(self, run_dir: str | Path, cfg: GuardConfig, open_to_strangers: bool = True):
        """`open_to_strangers` False: only guard.trusted keys register (task.open_to_strangers: episodes of
        an environment the trainer cannot replay go to the operator's own nodes only)."""
        self.cfg, self.open_to_strangers = cfg, open_to_strangers
        self.buckets: dict[str, tuple[float, float]] = {}  # source address -> (tokens, last update)
        self.path = Path(run_dir) / "invites.json"
        # invite token -> the key it admitted: a token admits one key, again and again.
        self.used: dict[str, str] = json.loads(self.path.read_text()) if self.path.exists() else {}

    def register_allowed(self, source: str) -> bool:
        """One registration from `source` (an IP address) now: within its token bucket?"""
        now = time.monotonic()
        tokens, last = self.buckets.pop(source, (float(self.cfg.register_burst), now))
        tokens = min(self.cfg.register_burst, tokens + (now - last) * self.cfg.register_rate)
        ok = tokens >= 1.0
        self.buckets[source] = (tokens - 1.0 if ok else tokens, now)  # re-inserted: newest last
        while len(self.buckets) > MAX_ADDRESSES:
            self.buckets.pop(next(iter(self.buckets)))
        return ok

    def check(self, msg: P.Register, established: bool) -> P.Error | None:
        """The admission cost of a key that is not established: a proof of work, an invite, or both."""
        if not self.open_to_strangers and msg.node_id not in self.cfg.trusted:
            return P.Error(code="not_allowed", message="this run's environment cannot be replayed by the trainer: "
                           "only the operator's own nodes (guard.trusted) run its episodes")
        if established:
            return None
        bits = self.cfg.register_pow_bits
        if bits > 0 and not proof_of_work.check(msg.node_id, msg.time_ms, msg.pow_nonce, bits):
            return P.Error(code="pow_required", message=f"registration needs a proof of work of {bits} bits",
                           pow_bits=bits)
        if self.cfg.invites:
            holder = self.used.get(msg.invite)
            if msg.invite not in self.cfg.invites or holder not in (None, msg.node_id):
                return P.Error(code="invite_required", message="this run admits new keys by invite only: "
                               "ask its operator for a token (swarm node --invite TOKEN)")
            if holder is None:
                self.used[msg.invite] = msg.node_id
                write_atomic(self.path, json.dumps(self.used, indent=1, sort_keys=True))
        return None
