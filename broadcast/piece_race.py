"""One piece's race (sans-I/O): ask the chain's first source; whenever the newest request stays silent past
the deadline, ask the next ancestor in parallel; the first intact copy wins.

The driver sends each new `Try` (the aiohttp peer as an HTTP request, the simulator as a simulated one),
feeds what happens to it (`SourceBook.answered`, `.body`, `.piece_in`, or `concluded` with how it failed),
calls `ended` once a try is over, sends the `Report`s the race makes, cancels the tries `ended` returns, and
calls `look` at the time it asks for. After a race, `retry_plan` says when to ask again.

A dead source's piece is asked anew of the parents the tracker gives once it has heard the report, not of
the dead source's own parent: a relay's death orphans all its children at once, and all of them asking its
parent piled onto one uplink (the origin's, under a relay at the top). Simulated at 1000 peers with 10%
churn, a delta took 2.32x the fluid bound on average over five draws that way, 1.76x this way (both before
the origin's uplink probes; docs/tree-simulation.md). A stalled parent (alive, holding) is gone around to
the next ancestor at once.
"""

from __future__ import annotations

import logging
import math
from dataclasses import dataclass

from .messages import ORIGIN
from .sourcing import AVOID_S, MAX_FAILURES_PER_PIECE, SILENT_AVOID_S, SourceBook, Try, backoff_s

log = logging.getLogger("broadcast.peer")
LOOK_MIN_S = 0.001  # a race looks again no sooner than this


@dataclass
class Report:
    """Tell the tracker about a source: 'dead', 'stall' or 'corrupt'."""

    src: str
    reason: str
    detail: str


@dataclass
class RetryPlan:
    wait_s: float  # the usual backoff before the next race
    fresh_within: float  # > 0: first wait (at most this long) for the tracker's answer to our report
    give_up: str = ""  # why the piece is given up ('' : go on)


class PieceRace:
    def __init__(self, book: SourceBook, chain: list[str], now: float, size: int = 0, helpers: list[str] = (),
                 relays: list[str] | None = None):
        """`size`: the piece's bytes (0: not known; its pace is then judged only against MIN_RATE); `helpers`
        (SourceBook.helpers): asked after the chain's relays, before the origin; `relays`: the tree's relays
        above us, parent first, as the tracker gave them (`chain` less those avoided; None: the chain's)."""
        relays = [u for u in chain if u != ORIGIN] if relays is None else [u for u in relays if u != ORIGIN]
        self.parent_of = {u: (relays[i + 1] if i + 1 < len(relays) else ORIGIN) for i, u in enumerate(relays)}
        helpers = [h for h in helpers if h not in chain]
        if helpers and chain and chain[-1] == ORIGIN:
            chain = [*chain[:-1], *helpers, ORIGIN]
        self.book, self.chain, self.size, self.helpers = book, chain, size, frozenset(helpers)
        self.tries: list[Try] = []  # in flight, oldest first
        self.pos = 0
        self.result = ""  # ok | gone (the origin has no such version) | dead | failed
        self.reports: list[Report] = []  # made along the way (sources silent through the race): to send
        self.reasked: set[str] = set()  # sources asked again after they let a request go (`concluded`)

    def start(self, now: float) -> Try:
        return self._ask_next(now)

    def _ask_next(self, now: float) -> Try:
        src = self.chain[self.pos]
        tr = Try(src, now, self.book.pieces_in, size=self.size, hold=src not in self.helpers)
        self.pos += 1
        self.tries.append(tr)
        return tr

    def look(self, now: float) -> tuple[list[Try], float | None]:
        """Go around the newest request if it is silent. -> (tries to send, when to look again; None: only
        once a try ends)."""
        new: list[Try] = []
        while not self.result and self.tries and self.pos < len(self.chain):
            newest = self.tries[-1]
            # Asked again after it let our request go: its answer says it is alive, not that it has the piece
            # (it held it for hold_s already), so the next ancestor is asked once it answers or by its deadline.
            wait = 0.0 if newest.src in self.reasked and newest.answered else self.book.silent(newest, now)
            if wait > 0:  # never sooner than LOOK_MIN_S: a float's rounding must not loop a look at one instant
                return new, now + max(wait, LOOK_MIN_S)
            self.book.bypasses += 1
            newest.gone_around_at = now
            new.append(self._ask_next(now))
        return new, None

    def concluded(self, tr: Try, how: str, now: float, detail: str = "") -> Report | None:
        """tr failed: 'absent' (404), 'http' (another status: 503 is a stall), 'corrupt' (wrong length or
        hash), 'timeout' (no data for the stall timeout), 'cut' (cut short after the answer began: a parent
        that gave up waiting for the piece itself, or a crash; before any byte, asked again first),
        'unreachable'. Sets tr.outcome and the avoid list; -> the report to send (and wait for) before
        `ended`, if any."""
        src, reason = tr.src, how
        if how == "absent":
            tr.outcome = "absent"
            return None
        if src in self.helpers and how != "corrupt":  # not placed to send us this piece: no fault of its own
            tr.outcome = "failed"
            self.book.unhelped(src, now)
            return None
        if how == "http":
            reason = "stall" if detail == "HTTP 503" else "dead"
        elif how == "unreachable":
            reason = "dead"
        elif how == "timeout":
            if tr.answered and src != ORIGIN:  # it answered: maybe honest, behind a parent that stalls
                tr.outcome = "failed"
                self._avoid_quietly(tr, now)
                return None
            reason, detail = "stall", f"no data for {self.book.cfg.stall_timeout}s"
        elif how == "cut" and not tr.got and src != ORIGIN:
            # Let go before a byte came: it gave up holding our request (its own parent slow: an honest relay
            # does after hold_s), or it died. Only a new request tells which: asked again at once, a dead one
            # refuses it (reported then); a live one answers, and the next ancestor is asked beside it (`look`).
            # Reporting at once cost honest children their standing: across namespaces at 4 Mbit/s, 104 such
            # reports in 6 versions, none confirmed.
            if src in self.reasked:
                tr.outcome = "failed"
                self._avoid_quietly(tr, now)
            else:
                tr.outcome = "released"
            return None
        elif how == "cut":  # after some bytes: it died mid-piece, or its file went (retention)
            reason, detail = "dead", f"cut short after its answer ({detail})" if detail else "cut short after its answer"
        tr.outcome = "failed"
        if src == ORIGIN:
            return None
        self.book.put_off(src, now, math.inf if reason == "corrupt" else AVOID_S)
        if reason == "dead":
            tr.outcome = "dead"
        return Report(src, reason, detail)

    def ended(self, tr: Try, now: float) -> tuple[list[Try], list[Try]]:
        """tr is over (its outcome set). -> (tries to send, tries to cancel); `result` once the race is."""
        self.tries.remove(tr)
        if tr.outcome == "ok":
            self.result = "ok"
            self._silent_through(now)
        elif tr.outcome == "absent" and tr.src == ORIGIN:
            self.result = "gone"
        elif tr.outcome == "dead" and not self.tries:
            self.result = "dead"
        elif tr.outcome == "released":  # asked again (once a race), unless another request is out already
            self.reasked.add(tr.src)
            if self.tries:
                return [], []
            again = Try(tr.src, now, self.book.pieces_in, size=self.size)
            self.tries.append(again)
            return [again], []
        elif not self.tries:
            if self.pos < len(self.chain):
                return [self._ask_next(now)], []  # absent or failed there: the next ancestor, now
            self.result = "failed"
        if self.result:
            cancel, self.tries = self.tries, []
            return [], cancel
        return [], []

    def _silent_through(self, now: float) -> None:
        """Sources silent while another delivered the piece: avoided for a while, and reported if they
        never answered."""
        for tr in self.tries:
            if tr.src == ORIGIN or not self.book.still_silent(tr, now):
                continue
            if tr.src in self.helpers:
                self.book.unhelped(tr.src, now)
                continue
            if tr.slow:  # too slow: the rate we saw goes to the tracker (placed lower), not a report, and it
                self.book.slow_evidence(tr, now)  # is left out as long as a source reported dead would be
                self.book.put_off(tr.src, now, AVOID_S)
                continue
            if tr.answered:
                self._avoid_quietly(tr, now, blame=not self._starved(tr.src, now))
                continue
            self.book.put_off(tr.src, now, SILENT_AVOID_S)
            self.reports.append(Report(tr.src, "stall", f"no answer in {now - tr.started:.2f}s; fetched elsewhere"))

    def _starved(self, src: str, now: float) -> bool:
        """Was `src`'s own source in the tree silent to us too (in this race, or avoided for it already)?
        Then `src` held our request waiting for the piece itself, as we waited: the silence is its source's.
        Counted against both, a third of the relays silent among strangers sank 18 of 67 honest relays by the
        fifth version, each a leaf for good once its children had seen nothing from it while its parent
        starved it (bench/tree_attacks_sim.py --n 100 --strangers --versions 5)."""
        above = self.parent_of.get(src)
        if above is None or above == ORIGIN:  # a helper's, or the origin had the piece all along
            return False
        if self.book.avoid.get(above, -math.inf) >= now:
            return True
        return any(t.src == above and self.book.still_silent(t, now) for t in self.tries)

    def _avoid_quietly(self, tr: Try, now: float, blame: bool = True) -> None:
        """It answered, then sent nothing: avoided for a while, not reported. It may be an honest relay whose
        own parent stalls (a report the origin's probe cannot confirm would cost us standing, and the
        staller nothing); `blame`: what placement sees of it is that nothing, unless its own source was
        silent to us too (`_starved`)."""
        self.book.silent_through(tr.src, now)
        if tr.answered_at and blame:  # what placement sees of it: nothing, over that long
            self.book.meter.silent(tr.src, now - tr.answered_at)
        log.info("%s sent nothing in %.2fs; avoiding it %.0fs", tr.src, now - tr.started,
                 self.book.avoid.get(tr.src, now) - now)


def retry_plan(outcome: str, failures: int, book: SourceBook) -> RetryPlan:
    """After a race that did not deliver (`failures` counts it): when to race again, and whether to wait
    for the tracker's new parents first (after a dead source, which was reported)."""
    if outcome == "gone":
        return RetryPlan(0.0, 0.0, "the version is no longer served by the origin")
    if failures >= MAX_FAILURES_PER_PIECE:
        return RetryPlan(0.0, 0.0, f"{failures} failed attempts, giving up")
    return RetryPlan(backoff_s(failures), book.deadline() if outcome == "dead" else 0.0)
