"""Work share is earned: how many assignments a key may hold, from what it has delivered.

A key with no accepted work holds at most `new_key_held`; each accepted group adds one (up to `max_held`),
each expiry halves it. A key whose work expires `expiries_to_pause` times in a row (no accepted group
between) gets no work for `pause_s`; at `expiries_to_drop` its registration is dropped. Keys that are not
established hold together at most `new_keys_share` of the in-flight groups. So four fresh keys that take
work and never answer hold a few assignments for one timeout, then nothing, and a batch always has room.
"""

from __future__ import annotations

import time
from dataclasses import dataclass

from trainer.guard import GuardConfig


@dataclass
class KeyShare:
    credit: int
    expired_in_row: int = 0
    paused_until: float = 0.0


class WorkShare:
    def __init__(self, cfg: GuardConfig, inflight_groups: int):
        self.cfg = cfg
        self.newcomer_cap = max(1, int(cfg.new_keys_share * inflight_groups))
        self.keys: dict[str, KeyShare] = {}

    def _key(self, node_id: str, established: bool) -> KeyShare:
        ks = self.keys.get(node_id)
        if ks is None:
            start = self.cfg.max_held if established else self.cfg.new_key_held
            ks = self.keys[node_id] = KeyShare(credit=start)
        return ks

    def allowance(self, node_id: str, established: bool) -> int:
        """How many assignments `node_id` may hold now (0 while paused)."""
        ks = self._key(node_id, established)
        return 0 if time.monotonic() < ks.paused_until else ks.credit

    def accepted(self, node_id: str, groups: int, established: bool) -> None:
        ks = self._key(node_id, established)
        ks.credit = min(self.cfg.max_held, ks.credit + groups)
        ks.expired_in_row = 0

    def expired(self, node_id: str, established: bool) -> str | None:
        """One assignment of `node_id`'s expired: returns "pause" or "drop" when that is what follows."""
        ks = self._key(node_id, established)
        ks.credit = max(1, ks.credit // 2)
        ks.expired_in_row += 1
        if ks.expired_in_row >= self.cfg.expiries_to_drop:
            ks.expired_in_row = 0
            ks.paused_until = time.monotonic() + self.cfg.pause_s
            return "drop"
        if ks.expired_in_row == self.cfg.expiries_to_pause:
            ks.paused_until = time.monotonic() + self.cfg.pause_s
            return "pause"
        return None

    def forget(self, node_id: str) -> None:
        self.keys.pop(node_id, None)
