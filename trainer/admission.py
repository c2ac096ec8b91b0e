"""Who may register: a rate per source address and per address prefix, and the optional cost of a fresh
identity.

Identities are free (a key is one call), so nothing about a new key is trusted; this only bounds how fast
new keys can arrive from one address and from one network (a /24 of IPv4, a /64 of IPv6: what one
machine or one customer of a provider usually holds, so a block of addresses buys no more than a few),
and, for open runs, makes each one cost a proof of work or an invite.
"""

from __future__ import annotations

import ipaddress
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
        """One registration from `source` (an IP address) now: within its address's token bucket and its
        prefix's? Both are spent only when both allow it."""
        now = time.monotonic()
        cfg = self.cfg
        keys = [(source, cfg.register_burst, cfg.register_rate)]
        prefix = address_prefix(source)
        if prefix is not None:
            keys.append((prefix, cfg.register_prefix_burst, cfg.register_prefix_rate))
        levels = [self._level(key, burst, rate, now) for key, burst, rate in keys]
        ok = all(tokens >= 1.0 for tokens in levels)
        for (key, *_), tokens in zip(keys, levels, strict=True):
            self.buckets[key] = (tokens - 1.0 if ok else tokens, now)  # re-inserted: newest last
        while len(self.buckets) > MAX_ADDRESSES:
            self.buckets.pop(next(iter(self.buckets)))
        return ok

    def _level(self, key: str, burst: int, rate: float, now: float) -> float:
        tokens, last = self.buckets.pop(key, (float(burst), now))
        return min(burst, tokens + (now - last) * rate)

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


def address_prefix(source: str) -> str | None:
    """The network `source` belongs to for the registration budget: its /24 (IPv4) or /64 (IPv6); None
    when it is not an IP address (then only its own bucket applies)."""
    try:
        ip = ipaddress.ip_address(source)
    except ValueError:
        return None
    if ip.version == 6 and ip.ipv4_mapped is not None:
        ip = ip.ipv4_mapped
    return str(ipaddress.ip_network(f"{ip}/{24 if ip.version == 4 else 64}", strict=False))
