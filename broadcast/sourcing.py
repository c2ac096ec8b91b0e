"""What a peer knows of its sources, and the rules it fetches by: which source to ask, how long a source may
stay silent, whom to avoid and for how long (sans-I/O: fed events with the time they happened).

Piece i comes down tree i mod k from the peer's parent in that tree; the chain for a piece is the tree's
relays above this peer, parent first, then the origin (ORIGIN: each peer reaches it at its tracker URL).
A source is gone around when it stays silent (piece_race.py): unanswered for the answer deadline while it
sent us nothing else, or answered but sending no bytes while several pieces per tree came from elsewhere.
The deadline is never under the first-byte timeout: across namespaces with tbf uplinks, deadlines of a few
answer times (0.3-0.6 s) went around honest parents 60-95 times per version at N = 32, each a piece from
an ancestor's uplink, mostly the origin's (docs/network-lab.md).

The aiohttp peer (fetcher.py) and the simulator (bench/simlib) both feed this very object.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

from .config import PeerConfig
from .messages import ORIGIN
from .receive_meter import ReceiveMeter

MAX_FAILURES_PER_PIECE = 20
AVOID_S = 30.0  # a source reported dead or stalling, or that cut a piece short: avoided this long
SILENT_AVOID_S = 5.0  # a source silent through one race: avoided this long (a loaded honest one recovers)
IDLE_ROUNDS = 4  # an answered source may send nothing while this many pieces per tree come from elsewhere
SLOW_FACTOR = 4  # a source sending a piece this many times slower than our usual pieces come is gone around
MIN_RATE = 16 << 10  # bytes/s: slower than this a source is gone around whatever we usually see
# A source's pace is judged once its bytes have come for this many answer deadlines: across namespaces
# (tbf uplinks at 3.4 Mbit/s, 32 KiB pieces) honest parents' answers stalled for a second after their first
# segments (TCP waiting out a loss in a full uplink queue), and judged after one deadline 42-46 pieces a
# version were asked of an ancestor, most of the origin (docs/benchmarks.md).
PACE_AFTER = 2
POLL_S = 0.2  # how often a race looks again whether its newest request has fallen that far behind
MAX_KNOWN = 256  # sources remembered per peer (the least recently heard are forgotten)
HELPER_S = AVOID_S  # a source that delivered us a verified piece this recently may help with other trees
HELPERS = 3  # the most recent such sources a race draws its helpers from, in turn
MAX_HELPERS = 3  # helpers a race asks at most, one after another


def other_parents(sources: list[list[str]], tree: int) -> list[str]:
    """Our parents in the trees other than `tree` (`sources`: per tree, the relays above us, parent first)."""
    return [chain[0] for t, chain in enumerate(sources) if t != tree % len(sources) and chain]


def backoff_s(failures: int) -> float:
    """The wait before asking again for a piece after `failures` failed races."""
    return min(0.1 * failures, 2.0)


@dataclass(eq=False)  # one object per request: compared (and hashed) by identity
class Try:
    """One request for one piece from one source, as the race sees it."""

    src: str
    started: float
    pieces_at_start: int  # the peer's verified-piece count when it was sent
    answered: bool = False  # response headers came
    answered_at: float = 0.0
    got: int = 0  # body bytes so far
    unread: int = 0  # more bytes that reached us and wait to be read (the aiohttp peer reads in batches)
    size: int = 0  # the piece's (0: not known)
    first_at: float = 0.0  # when its first body bytes came (0: none yet)
    slow: bool = False  # gone around for sending far slower than our pieces usually come
    outcome: str = ""  # ok | absent | dead | failed | released (let go before a byte: asked again)
    gone_around_at: float = 0.0  # when the race judged it silent and asked the next ancestor (0: never)
    hold: bool = True  # False: a helper's (SourceBook.helper): the source answers 404 unless it has the piece

    @property
    def delivered(self) -> int:
        """Body bytes that reached us: read, or waiting to be read."""
        return self.got + self.unread


class SourceBook:
    """Per peer: the avoid list, the smoothed answer time and piece latency, when each source was last
    heard from, and what came from each (placement's evidence)."""

    def __init__(self, cfg: PeerConfig):
        self.cfg = cfg
        self.trees = 1  # as the tracker says
        self.avoid: dict[str, float] = {}  # source -> until when it is left out of chains
        self.answer_s: float | None = None  # smoothed time to a source's answer
        self.answer_var = 0.0  # and its smoothed deviation
        self.latency_s: float | None = None  # smoothed time from asking for a piece to holding it
        self.pieces_in = 0  # verified pieces received, from anyone
        self.bypasses = 0  # pieces for which an ancestor was asked in parallel
        self.last_heard: dict[str, float] = {}  # per source: when it last answered or sent us bytes
        self.last_bytes: dict[str, tuple[float, int]] = {}  # per source: when it last sent bytes, pieces_in then
        self.received: dict[str, int] = {}  # per source: verified bytes since start (standing's evidence)
        self.meter = ReceiveMeter()  # per source: what came and how long it took (placement's evidence)
        self.silences: dict[str, int] = {}  # per source: races it was silent through since it last delivered
        self.on_trial: frozenset[str] = frozenset()  # our sources on trial (broadcast/trials.py), as the tracker says
        self.delivered_at: dict[str, float] = {}  # per source: when it last delivered us a verified piece
        self.unhelpful: dict[str, float] = {}  # per helper: until when it is not asked to help again
        self.helped = 0  # races given a recent deliverer as a helper (turns the first of them round)
        self.stream_rate: dict[str, float] = {}  # per source: the smoothed rate its pieces streamed at

    # -- which source ----------------------------------------------------------------------------------
    def chain(self, relays: list[str], now: float) -> list[str]:
        """The sources to ask, in order: the relays above us in the piece's tree not avoided, the origin last."""
        return [u for u in relays if u != ORIGIN and self.avoid.get(u, -math.inf) < now] + [ORIGIN]

    def helpers(self, relays: list[str], chain: list[str], now: float, neighbours: list[str] = ()) -> list[str]:
        """Sources to ask before the origin once the chain's relays are silent, in turn: first those that
        delivered us a verified piece within HELPER_S (of another tree: not in this chain; the most recent
        first, rotated), then our parents in the other trees (`neighbours`: before anything was delivered,
        the first version, they are all we know); none avoided, none silent when it last helped, MAX_HELPERS
        at most. None where the origin is our placed parent in this tree (it is asked first: it has every
        piece). Among strangers a third of the relays may send nothing, and peers whose every ancestor in a
        tree was silent had that tree's pieces from the origin: 19.6 copies of the first version went
        through its one uplink, which set the version's time (bench/tree_attacks_sim.py --n 100 --strangers)."""
        if not any(u != ORIGIN for u in relays):
            return []

        def ok(u: str) -> bool:
            return (u != ORIGIN and u not in chain and self.avoid.get(u, -math.inf) < now
                    and self.unhelpful.get(u, -math.inf) < now)

        recent = [u for u, t in reversed(self.delivered_at.items()) if now - t <= HELPER_S and ok(u)][:HELPERS]
        if recent:
            self.helped += 1
            k = self.helped % len(recent)
            recent = recent[k:] + recent[:k]
        picks = recent + [u for u in neighbours if ok(u) and u not in recent]
        return picks[:MAX_HELPERS]

    def unhelped(self, src: str, now: float) -> None:
        """A helper that did not deliver: not asked to help for SILENT_AVOID_S. Nothing else: it was never
        placed to send us this tree's pieces, and it may be our parent in its own tree."""
        _note(self.unhelpful, src, now + SILENT_AVOID_S)

    def deadline(self) -> float:
        """How long a source may leave us unanswered before the next ancestor is asked too: the first-byte
        timeout, or longer where answers are routinely slower (the usual answer time and four times its
        spread, TCP's retransmission timeout, RFC 6298), never past the stall timeout."""
        if self.answer_s is None:
            return self.cfg.first_byte_timeout
        rto = self.answer_s + 4 * self.answer_var
        return min(self.cfg.stall_timeout, max(self.cfg.first_byte_timeout, rto))

    def _deadline(self, tr: Try) -> float:
        """The answer deadline for this try: a source on trial gets no more than our usual piece latency (a
        receiver waiting on it is what its trial costs; in the attack lab the 1 s deadline alone made each
        version 4x slower)."""
        deadline = self.deadline()
        if tr.src in self.on_trial and self.latency_s is not None:
            return min(deadline, self.latency_s)
        return deadline

    def put_off(self, src: str, now: float, for_s: float) -> None:
        """Leave `src` out of chains for `for_s` seconds (inf: for good, it served corrupt data)."""
        if src == ORIGIN:  # never: the origin is the root of every tree
            return
        self.avoid[src] = max(self.avoid.get(src, 0.0), now + for_s)
        if len(self.avoid) > MAX_KNOWN:
            self.avoid = {u: t for u, t in self.avoid.items() if t > now}

    # -- events --------------------------------------------------------------------------------------
    def heard(self, src: str, now: float, body: bool) -> None:
        """`src` showed it is alive: it answered a request, or (`body`) sent piece bytes."""
        _note(self.last_heard, src, now)
        if body:
            _note(self.last_bytes, src, (now, self.pieces_in))

    def answered(self, tr: Try, now: float) -> None:
        tr.answered, tr.answered_at = True, now
        self.heard(tr.src, now, body=False)
        lat = now - tr.started
        if self.answer_s is None:
            self.answer_s, self.answer_var = lat, lat / 2
        else:
            self.answer_var = 0.75 * self.answer_var + 0.25 * abs(self.answer_s - lat)
            self.answer_s = 0.875 * self.answer_s + 0.125 * lat

    def body(self, tr: Try, n: int, now: float) -> None:
        self.heard(tr.src, now, body=True)
        if n and not tr.first_at:
            tr.first_at = now
        tr.got += n
        tr.unread = 0

    def waiting(self, tr: Try, n: int, now: float) -> None:
        """`n` bytes of tr's body have reached us and wait to be read: delivered, as far as its pace and its
        silence go (the aiohttp peer is woken for a piece's bytes in batches, fetcher.py: at 3.4 Mbit/s
        across namespaces, 32 KiB pieces, the batch was the piece's rest; judged on the bytes read, 87-99
        pieces a version went around honest parents, on these too 42-46). Heard from only if more came."""
        n = max(0, n)
        if n > tr.unread:
            self.heard(tr.src, now, body=True)
            tr.first_at = tr.first_at or now
        tr.unread = n

    def streaming(self, tr: Try, got: int, first_at: float, now: float) -> None:
        """A stream in progress has brought `got` bytes so far, the first at `first_at` (the simulator's
        view of a transfer; the aiohttp peer calls `body` per chunk). Heard from only if a byte came since
        the last look, as `body` is only called with bytes: a fluid stream's fraction of a byte is none (a
        simulated key sending 1 B/s over many requests kept its children's silence yardstick waiting)."""
        if got <= tr.got:
            return
        self.heard(tr.src, now, body=True)
        tr.got, tr.first_at = got, tr.first_at or first_at

    def sending_span(self, tr: Try, start: float, end: float) -> None:
        """tr's source was sending it to us over [start, end]: placement's evidence of its uplink, unless it
        was helping (it sends a helper's answer from what its own children leave, not at its uplink's pace)."""
        if tr.hold:
            self.meter.span(tr.src, start, end)

    def slow_evidence(self, tr: Try, now: float) -> None:
        """A source gone around for its pace: what it sent us, over how long, counts in our receive report
        (placement's evidence, placement.py), so the tracker sees the rate we saw and places it lower."""
        if tr.got and tr.first_at:
            self.meter.span(tr.src, tr.first_at, now)
            self.meter.credit(tr.src, tr.got)

    def silent_through(self, src: str, now: float) -> None:
        """It answered and sent nothing while another source delivered the piece: avoided SILENT_AVOID_S, twice
        that each time again until it delivers a piece, up to AVOID_S (a loaded honest relay recovers; one
        that answers everyone and sends no one anything is asked about once per AVOID_S, issue 29)."""
        n = self.silences.pop(src, 0) + 1
        self.silences[src] = n
        if len(self.silences) > MAX_KNOWN:
            del self.silences[next(iter(self.silences))]
        self.put_off(src, now, min(SILENT_AVOID_S * 2 ** (n - 1), AVOID_S))

    def piece_in(self, tr: Try, size: int, now: float, sent_from: float | None) -> None:
        """A verified piece from tr.src: `sent_from` is when its source began sending it (None: unknown)."""
        self.silences.pop(tr.src, None)
        tr.outcome = "ok"
        self.pieces_in += 1
        took = now - tr.started  # held, then streamed
        self.latency_s = took if self.latency_s is None else 0.8 * self.latency_s + 0.2 * took
        if sent_from is not None and tr.hold:  # (as sending_span)
            self.meter.credit(tr.src, size)
        self.received[tr.src] = self.received.pop(tr.src, 0) + size
        rate = size / (now - sent_from) if sent_from is not None and now > sent_from else None
        if rate is not None:  # from its first byte to its last (holds and turns not counted)
            old = self.stream_rate.get(tr.src)
            _note(self.stream_rate, tr.src, rate if old is None else 0.7 * old + 0.3 * rate)
        if rate is None or rate >= self.usual_rate(tr.src, size):
            _note(self.delivered_at, tr.src, now)  # not far slower than the others: it may help
        if len(self.received) > 64:
            del self.received[next(iter(self.received))]

    # -- silence -------------------------------------------------------------------------------------
    def silent(self, tr: Try, now: float) -> float:
        """0 when this try counts as silent, else a time to look again. Unanswered: its source has not been
        heard from, on any request, for the answer deadline (a parent streaming us other pieces is alive,
        however long a new connection's answer waits in its uplink queue). Answered, never sooner than the
        answer deadline: silent once IDLE_ROUNDS pieces per tree came from elsewhere, or IDLE_ROUNDS of our
        usual piece latencies passed, while its source sent us nothing (it may be pipelining: across
        namespaces at 32 KiB pieces, counting from the request instead went around honest parents 97-309
        times a version at N = 32); and, whatever bytes came, once this piece has taken IDLE_ROUNDS^2 usual
        latencies (before any latency is known, the stall timeout): a relay that trickles held its whole
        subtree back (docs/tree-simulation.md). And one byte is not progress: a source whose bytes come far
        slower than our pieces usually do (`pace`) is gone around too (issue 29: slow-loris). A source on
        trial (placed over us to be judged, trials.py) gets one usual piece latency where others get
        IDLE_ROUNDS, and no longer than that for its answer."""
        deadline = self._deadline(tr)
        rounds = 1 if tr.src in self.on_trial else IDLE_ROUNDS
        if not tr.answered:
            return max(0.0, max(tr.started, self.last_heard.get(tr.src, 0.0)) + deadline - now)
        usual = self.cfg.stall_timeout if self.latency_s is None else rounds ** 2 * self.latency_s
        cap = tr.started + max(deadline, usual)
        if now >= cap:
            return 0.0
        pace = self.pace(tr, now) if tr.delivered else math.inf
        if pace == 0:
            tr.slow = True
            return 0.0
        since, count = max((tr.started, tr.pieces_at_start), self.last_bytes.get(tr.src, (0.0, 0)))
        if (left := since + deadline - now) > 0:  # never sooner than had it not answered
            return min(left, cap - now, pace)
        if self.pieces_in - count >= rounds * self.trees:
            return 0.0
        limit = self.cfg.stall_timeout if self.latency_s is None else rounds * self.latency_s
        left = min(since + limit, cap) - now
        return 0.0 if left <= 0 else min(left, POLL_S, pace)

    def pace(self, tr: Try, now: float) -> float:
        """0 when a streaming try's bytes come far too slowly (below `usual_rate`) and it would not be done
        within the answer deadline at that rate; else when to judge again. Judged once its bytes have come
        for PACE_AFTER answer deadlines, on the bytes that reached us (read, or waiting: `waiting`)."""
        deadline = self._deadline(tr)
        if (left := tr.first_at + PACE_AFTER * deadline - now) > 0:  # a look at now + left judges
            return left
        rate = tr.delivered / max(now - tr.first_at, 1e-9)
        if tr.size and tr.size - tr.delivered <= rate * deadline:
            return deadline  # nearly there
        return 0.0 if rate < self.usual_rate(tr.src, tr.size) else deadline

    def usual_rate(self, src: str, size: int) -> float:
        """The slowest pace at which `src` is not far too slow: MIN_RATE, and SLOW_FACTOR times below the
        rate our pieces usually arrive at (their size over our usual piece latency, which counts holds and
        turns, so an honest parent sends faster than that) and below the rate the other sources' pieces
        streamed at, first byte to last (the lower median of theirs). The first alone was dragged down by
        the slow source itself: a child whose parent sent every piece at MIN_RATE had a usual latency of
        16 s and took 14 pieces so, 112 s (slow-loris among strangers, bench/tree_attacks_sim.py --n 100)."""
        expect = MIN_RATE
        if size and self.latency_s:
            expect = max(expect, size / self.latency_s / SLOW_FACTOR)
        others = sorted(r for u, r in self.stream_rate.items() if u != src)
        if others:
            expect = max(expect, others[(len(others) - 1) // 2] / SLOW_FACTOR)
        return expect

    def still_silent(self, tr: Try, now: float) -> bool:
        """Silent now, or gone around as silent and not heard from since. The verdict at the bypass stands:
        the yardsticks move while the race goes on (the winner's own answer time raises the deadline on a
        loaded machine), and a source silent then and since is silent."""
        if tr.gone_around_at:
            if tr.slow:  # gone around for its pace: however fast it went since, it was that slow
                return True
            # Answered by then: silent means no bytes; unanswered: not even an answer.
            answered_by_then = tr.answered and tr.answered_at <= tr.gone_around_at
            last = self.last_bytes.get(tr.src, (0.0, 0))[0] if answered_by_then else self.last_heard.get(tr.src, 0.0)
            if last < tr.gone_around_at:
                return True
        return self.silent(tr, now) == 0


def _note(seen: dict, src: str, mark) -> None:
    seen.pop(src, None)  # re-inserted last: the bound forgets the sources quiet the longest
    seen[src] = mark
    if len(seen) > MAX_KNOWN:
        del seen[next(iter(seen))]
