"""Attacks with free identities on the trainer's node service: many fresh keys from one attacker.

Shared by the tests and bench/adversarial.py, like tests/adversarial/attacks.py. Each returns an Outcome;
`steps_kept` is the trainer's steps per minute while the attack ran over the same measure just before it.
"""

from __future__ import annotations

import threading
import time
from collections.abc import Callable

from swarm_common import protocol as P
from tests.adversarial.attacks import Ctx, Outcome, _code, _fresh, best_of_k, together
from tests.adversarial.evil_node import EvilNode


def _steps_per_min(ctx: Ctx, seconds: float, during: Callable[[], None] | None = None) -> float:
    """The trainer's steps per minute over `seconds`, while `during` runs (in a thread) if given."""
    start, t0 = ctx.summary()["step"], time.monotonic()
    worker = threading.Thread(target=during, daemon=True) if during else None
    if worker:
        worker.start()
    time.sleep(seconds)
    steps = ctx.summary()["step"] - start
    if worker:
        worker.join()
    return 60.0 * steps / (time.monotonic() - t0)


def work_hoarding(ctx: Ctx, keys: int = 4, seconds: float = 20.0) -> Outcome:
    """Fresh keys that take all the work they can and never answer, keeping their heartbeats up.
    Attempts: assignments asked for; detected: those the trainer did not hand out."""
    out = Outcome()
    hoarders = [_fresh(ctx, f"hoarder-{i}", out) for i in range(keys)]
    granted = 0

    def hoard() -> None:
        nonlocal granted
        end = time.monotonic() + seconds
        while time.monotonic() < end:
            for ev in hoarders:
                ev.send(P.WorkRequest(node_id=ev.node_id, version_loaded=ev.version, max_prompts=16))
                reply = ev.recv(3.0)
                out.attempts += 16
                if isinstance(reply, P.WorkAssignment):
                    granted += len(reply.assignments)
                    ev.version = max(ev.version, reply.weights.version)  # it claims to load what is out
                ev.send(P.Heartbeat(node_id=ev.node_id, version_loaded=ev.version))
            time.sleep(0.5)

    try:
        before = _steps_per_min(ctx, seconds)
        during = _steps_per_min(ctx, seconds, hoard)
        out.detected = out.attempts - granted
        out.codes.update(granted=granted, held_cap=granted <= keys * 2 * (1 + seconds // 60))
        out.steps_kept = during / before if before else None
    finally:
        for ev in hoarders:
            ev.close()
    return out


def register_flood(ctx: Ctx, n: int = 200) -> Outcome:
    """One client registers fresh keys as fast as it can: past the burst, each is refused as rate_limited."""
    out = Outcome()
    evs = []

    def flood() -> None:
        for i in range(n):
            ev = EvilNode(ctx.port, f"flood-{i}", timeout_s=3.0)
            evs.append(ev)
            ev.send(P.Register(node_id=ev.node_id, name=ev.name, time_ms=int(time.time() * 1000)))
            out.saw(_code(ev.recv()), {"rate_limited"})
            out.node_ids.append(ev.node_id)

    try:
        before = _steps_per_min(ctx, 15.0)
        during = _steps_per_min(ctx, 15.0, flood)
        out.steps_kept = during / before if before else None
        out.detected = out.codes["rate_limited"]
    finally:
        for ev in evs:
            ev.close()
    return out


def colluding_best_of_k(ctx: Ctx, k: int = 4) -> Outcome:
    """Two best-of-k cherry-pickers that join together: paired only with established nodes, never with
    each other, both are caught on probation."""
    return together(lambda: best_of_k(ctx, k))


IDENTITY_ATTACKS: dict[str, Callable[[Ctx], Outcome]] = {
    "work_hoarding": work_hoarding,
    "register_flood": register_flood,
    "colluding_best_of_4": colluding_best_of_k,
}
