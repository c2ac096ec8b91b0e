"""The origin's verdicts on reports and its proof that a relay uploads: nothing is decided by count.

Reporters are untrusted like everyone else. A corrupt report is settled by fetching the whole piece from the
accused and hashing it; a dead or stall report by connecting back to the accused (it must sign our nonce)
and asking it for a piece it says it holds. What the origin confirms acts; what it cannot confirm costs the
reporter standing (whatever standing it has), never the accused its place. Two independent reporters who
vouch (standing.py) and were placed under the accused may demote a relay the origin's probes cannot catch
(their reports' cost is then given back); reports of anyone else never move anyone.

Sans-I/O: each verdict is a generator that yields what it needs done (a `Probe` of a peer, a `Pause`, the
`BanHook` that tells the trainer) and is sent back the result; it acts on the tracker itself. The origin
runs them with HTTP probes (judge.py), the simulator with simulated ones (bench/simlib), so both follow
the very same rules.
"""

from __future__ import annotations

import random
from collections.abc import Callable, Generator
from dataclasses import dataclass

from .buckets import KeyedBuckets
from .messages import Report
from .tracker import PeerRec, Tracker

PROBE_CACHE_S = 2.0  # one probe of a peer answers every report about it for this long
PROVE_RETRY_S = 10.0  # a relay whose proof failed is asked again no sooner
RETRY_S = 1.0  # a probe that fails is tried once more this much later before it counts
REPORTS_AGREE_S = 60.0  # independent stall reports about one relay agree when this close in time
REFUSED = "connection refused"  # in a reach probe's verdict: nothing listens there (not a missed deadline)


@dataclass
class Probe:
    """Ask `rec`: 'reach' (connect back: 'ok', else why not), 'answers' (a piece request gets any answer:
    'answers' | 'stall' | 'dead') or 'piece' (the whole piece, hashed: 'ok' | 'corrupt' | 'stall' | 'slow' |
    'dead' | 'unknown')."""

    kind: str
    rec: PeerRec
    version: int = 0
    index: int = 0


@dataclass
class Pause:
    seconds: float


@dataclass
class BanHook:
    """Confirmed corruption: the trainer bans the key too."""

    key: str
    reason: str


Flow = Generator[Probe | Pause | BanHook, str | None, str]


def recheck_reach(t: Tracker, rec: PeerRec) -> Flow:
    """Connect back to the relay (it must sign our nonce); not reachable makes it a leaf. 'ok' or why not.
    A loaded machine may miss one deadline: failing twice counts. A refused connection counts at once: nothing
    listens there (the relay's process is gone), and while the second probe waited the tracker kept handing
    the dead relay out as a parent to orphans (simulated at N = 1000, 10% churn: docs/tree-simulation.md)."""
    if rec.url is None:
        return "no address"
    verdict = ""
    for attempt in range(2):
        verdict = (yield Probe("reach", rec)) or ""
        if verdict == "ok" or attempt or REFUSED in verdict:
            break
        yield Pause(RETRY_S)
    if rec.peer_id in t.peers:
        t.set_reachable(rec, verdict == "ok", "" if verdict == "ok" else verdict)
    return verdict


def ban(t: Tracker, rec: PeerRec, reason: str, reporter: str) -> Flow:
    t.ban(rec.peer_id, reason, reporter)
    t.count("confirmed_corrupt")
    if rec.key and not rec.key.startswith("anon-"):
        yield BanHook(rec.key, reason)
    return "banned"


def judge_report(t: Tracker, reporter: PeerRec, accused: PeerRec, msg: Report,
                 pieces: Callable[[int], int | None]) -> Flow:
    """`pieces(version)`: how many pieces a version the origin serves has (None: not served)."""
    who = f"{reporter.peer_id} ({reporter.key[:12]})"
    if msg.reason == "corrupt":
        verdict = yield Probe("piece", accused, msg.version, msg.piece)
        if verdict == "corrupt":
            return (yield from ban(t, accused, f"served corrupt piece {msg.piece} of v{msg.version} (confirmed by "
                                   "origin)", reporter.peer_id))
        if verdict in ("dead", "stall") and (yield from recheck_reach(t, accused)) != "ok":
            return "leaf: not reachable"
        if verdict in ("slow", "dead", "stall"):
            t.event(f"corrupt report on {accused.peer_id} by {who}: inconclusive ({verdict})")
            return "inconclusive"
        t.penalize(reporter.key, f"corrupt report on {accused.peer_id}: origin's probe says {verdict}")
        return "not confirmed"
    if (yield from recheck_reach(t, accused)) != "ok":
        return "leaf: not reachable"
    n = pieces(msg.version)
    if n is not None and 0 <= msg.piece < n:
        verdict = yield Probe("answers", accused, msg.version, msg.piece)
        if verdict == "stall":
            yield Pause(RETRY_S)
            verdict = yield Probe("answers", accused, msg.version, msg.piece)
        if verdict == "stall":
            t.demote(accused.peer_id, f"left the origin's piece request unanswered ({who} reported)")
            t.count("confirmed_stall")
            return "demoted"
    # The origin reaches it and it answers: the origin's own measurement does not confirm the report. Only
    # independent reporters who vouch (standing.py: earned from receivers who vouch, or trusted), each
    # placed under the accused, can; until they do, the report costs its maker, whatever its standing (keys
    # that bought standing with one piece demoted all six honest relays this way, issue 29).
    independent = msg.reason == "stall" and t.vouches(reporter) and t.was_given(reporter, accused.url)
    if independent and t.tier(accused) == 1:
        # On trial, it is placed to be judged by these very receivers (trials.py): one who vouches ends it.
        t.end_trial(accused, f"stalls reported by {who}, placed under it")
        return "trial ended"
    t.penalize(reporter.key, f"{msg.reason} report on {accused.peer_id}: it answers the origin's probes")
    if not independent:
        return "not confirmed"
    now = t.clock.monotonic()
    accused.strikes += 1
    accused.reporters = {k: at for k, at in accused.reporters.items() if now - at <= REPORTS_AGREE_S}
    accused.reporters[reporter.key] = now
    if len(accused.reporters) < 2:
        return "not confirmed yet"
    for key in accused.reporters:
        t.standing.refund(key)  # confirmed: what the reports cost is given back
    t.demote(accused.peer_id, f"stalls reported by {len(accused.reporters)} independent peers placed under it")
    accused.reporters.clear()
    return "demoted"


def prove_target(t: Tracker, rec: PeerRec, pieces: dict[int, int], tried: dict[str, float],
                 rng: random.Random) -> tuple[int, int] | None:
    """A relay that reports a complete version the origin serves (`pieces`: version -> piece count), and has
    not shown it uploads: (version, piece) to fetch back from it, or None (`tried`: key -> when last asked)."""
    now = t.clock.monotonic()
    if (rec.key in t.proven or not rec.interior_capable or not rec.complete
            or now - tried.get(rec.key, -1e9) < PROVE_RETRY_S):
        return None
    held = [v for v in rec.complete if v in pieces]
    if not held:
        return None
    tried[rec.key] = now
    if len(tried) > 4096:
        for k in [k for k, at in tried.items() if now - at >= PROVE_RETRY_S]:
            del tried[k]
    v = held[-1]
    return v, rng.randrange(pieces[v])


def prove(t: Tracker, rec: PeerRec, version: int, index: int) -> Flow:
    """Fetch one piece back from the relay. Served in time and intact, it has shown it uploads (it rises
    above fresh peers); corrupt bans it; a stall of a piece it says it holds demotes it."""
    verdict = yield Probe("piece", rec, version, index)
    if rec.peer_id not in t.peers:
        return "gone"
    if verdict == "ok":
        t.prove(rec, f"served piece {index} of v{version} to the origin intact")
    elif verdict == "corrupt":
        return (yield from ban(t, rec, f"served corrupt piece {index} of v{version} to the origin's probe", "origin"))
    elif verdict == "stall" and (yield from recheck_reach(t, rec)) == "ok":
        t.demote(rec.peer_id, f"stalled the origin's request for piece {index} of v{version}, which it holds")
        t.count("confirmed_stall")
    elif verdict == "dead":
        yield from recheck_reach(t, rec)
    return verdict or ""


class ReportGate:
    """Which reports are judged at all: a key whose recent reports the origin could not confirm is ignored
    for a while, and reports are rate-limited per key (each costs the origin a probe): with standing 1 a
    second (5 at once), without 0.2 a second (3 at once)."""

    def __init__(self) -> None:
        self.with_standing, self.fresh = KeyedBuckets(1.0, 5.0), KeyedBuckets(0.2, 3.0)

    def refusal(self, t: Tracker, reporter: PeerRec) -> tuple[int, str] | None:
        """(HTTP status, why) to refuse this report with, or None to judge it."""
        if t.standing.reports_ignored(reporter.key):
            t.count("ignored_report")
            return 403, "your recent reports could not be confirmed: reports ignored for a while"
        limit = self.with_standing if t.has_standing(reporter) else self.fresh
        if wait := limit.take(reporter.key, t.clock.monotonic()):
            t.count("rate_limited")
            return 429, f"too many reports: retry in {wait:.1f}s"
        return None
