"""Where a peer gets each piece: its parent in that piece's tree, and around a parent that stalls.

A parent that does not answer is bypassed quickly: when the newest request for a piece gets no answer
(headers) before the first-byte deadline, and its source sent nothing else meanwhile, the next ancestor is
asked for the same piece in parallel, and the first intact copy wins. A parent that answered is alive, and
may hold the request until the piece reaches it (pipelining): it is gone around only once it has sent us
nothing, on any request, while 4 pieces per tree came from elsewhere (it lags its peers in the other trees
by 4 rounds, whatever the rates), or for 4 of our usual piece latencies (the stall timeout before one has
been measured), and never sooner than had it not answered. Deadlines of a few answer times, per request,
went around honest parents still receiving a piece, mostly to the origin: across namespaces at N = 8 the
origin sent 4.8 S and a version took 4.9x S/B.
A source silent through the whole race is avoided for a while, and reported if it never answered; the
tracker's own probes decide what happens to it. A parent that is gone (connection refused or reset) is
reported, and the piece is asked of the parents the heartbeat after the report brings, not of the next
ancestor: a relay's death orphans all its children at once, and all of them asking its parent piled onto
one uplink (the origin's, under a relay at the top). Simulated at 1000 peers with 10% churn, a delta took
2.32x the fluid bound on average over five draws that way, 1.76x this way (both before the origin's
uplink probes; docs/tree-simulation.md).
Mixed into `Peer` (peer.py).
"""

from __future__ import annotations

import asyncio
import logging
import time
from typing import TYPE_CHECKING

import aiohttp

from .membership import Evicted, FetchError
from .receive_meter import sending_started

if TYPE_CHECKING:
    from .peer import Peer
    from .store import VersionState

log = logging.getLogger("broadcast.peer")
MAX_FAILURES_PER_PIECE = 20
TEMP_BLACKLIST_S = 30.0
SILENT_AVOID_S = 5.0  # a source silent through one race: avoided this long (a loaded honest one recovers)
RECV_CHUNK = 1 << 20  # a piece arrives in a few reads, not one per 64 KiB
IDLE_ROUNDS = 4  # an answered source may send nothing while this many pieces per tree come from elsewhere
POLL_S = 0.2  # how often a race looks again whether its newest request has fallen that far behind


class _Try:
    """One request for one piece from one source, as the race sees it."""

    def __init__(self, src: str, pieces_at_start: int):
        self.src = src
        self.answered = False  # response headers came
        self.answered_at = 0.0
        self.got = 0  # body bytes so far
        self.started = time.monotonic()
        self.outcome = ""
        self.pieces_at_start = pieces_at_start  # the peer's verified-piece count when it was sent
        self.gone_around_at = 0.0  # when the race judged it silent and asked the next ancestor (0: never)


class Sourcing:
    def _chain(self: Peer, tree: int) -> list[str]:
        now = time.monotonic()
        chain = [u for u in self.sources[tree % len(self.sources)] if self._blacklist.get(u, 0) < now]
        if not chain or chain[-1] != self.tracker_url:
            chain.append(self.tracker_url)  # the origin is the root of every tree
        return chain

    def _deadline(self: Peer) -> float:
        """How long a source may leave us unanswered before the next ancestor is asked too: the first-byte
        timeout, or longer where answers are routinely slower (the usual time to an answer and four times
        its spread, TCP's retransmission timeout, RFC 6298). Never shorter: across namespaces with tbf
        uplinks, deadlines of a few answer times (0.3-0.6 s) went around honest parents 60-95 times per
        version at N = 32, each a piece from an ancestor's uplink, mostly the origin's."""
        if self._answer_s is None:
            return self.first_byte_timeout
        rto = self._answer_s + 4 * self._answer_var
        return min(self.stall_timeout, max(self.first_byte_timeout, rto))

    def _heard(self: Peer, src: str, now: float, body: bool) -> None:
        """`src` showed it is alive: it answered a request, or (`body`) sent piece bytes."""

        def note(seen: dict, mark) -> None:
            seen.pop(src, None)  # re-inserted last: the bound forgets the sources quiet the longest
            seen[src] = mark
            if len(seen) > 256:
                del seen[next(iter(seen))]

        note(self._last_heard, now)
        if body:
            note(self._last_bytes, (now, self._pieces_in))

    def _avoid_quietly(self: Peer, tr: _Try, st: VersionState, index: int) -> None:
        """It answered, then sent nothing: avoided for a while, not reported. It may be an honest relay whose
        own parent stalls (a report the origin's probe cannot confirm would cost us standing, and the
        staller nothing)."""
        self._blacklist[tr.src] = time.monotonic() + SILENT_AVOID_S
        log.info("%s sent nothing for v%d piece %d in %.2fs; avoiding it %.0fs", tr.src, st.version, index,
                 time.monotonic() - tr.started, SILENT_AVOID_S)

    def _silent(self: Peer, tr: _Try) -> float:
        """0 when this try counts as silent, else a time to look again. Unanswered: its source has not
        been heard from, on any request, for the answer deadline (a parent streaming us other pieces is
        alive, however long a new connection's answer waits in its uplink queue). Answered: its source has
        sent no bytes for the answer deadline and either IDLE_ROUNDS pieces per tree came from elsewhere
        meanwhile, or IDLE_ROUNDS of our usual piece latencies passed."""
        now = time.monotonic()
        if not tr.answered:
            return max(0.0, max(tr.started, self._last_heard.get(tr.src, 0.0)) + self._deadline() - now)
        since, count = max((tr.started, tr.pieces_at_start), self._last_bytes.get(tr.src, (0.0, 0)))
        if (left := since + self._deadline() - now) > 0:  # never sooner than had it not answered
            return left
        if self._pieces_in - count >= IDLE_ROUNDS * self.trees:
            return 0.0
        limit = self.stall_timeout if self._latency_s is None else IDLE_ROUNDS * self._latency_s
        left = since + limit - now
        return 0.0 if left <= 0 else min(left, POLL_S)

    async def _fetch_piece(self: Peer, st: VersionState, index: int, tree: int) -> None:
        failures = 0
        while True:
            if self.evicted:
                raise Evicted(self.evicted)
            outcome = await self._race(st, index, self._chain(tree))
            if outcome == "ok":
                return
            if outcome == "gone":
                raise FetchError(f"v{st.version} is no longer served by the origin")
            failures += 1
            if failures >= MAX_FAILURES_PER_PIECE:
                raise FetchError(f"v{st.version} piece {index}: {failures} failed attempts, giving up")
            backoff = asyncio.sleep(min(0.1 * failures, 2.0))
            if outcome == "dead":  # reported, so the tracker has given us new parents: ask them, not ours
                await asyncio.gather(backoff, self._fresh_sources(self._deadline()))
            else:
                await backoff

    async def _race(self: Peer, st: VersionState, index: int, chain: list[str]) -> str:
        """Ask the chain's first source; whenever the newest request stays silent past the deadline, ask
        the next ancestor in parallel. 'ok' (the first intact copy), 'gone' (the origin has no such
        version), 'dead' (the last source asked could not be reached, and was reported) or 'failed' (every
        source asked failed)."""
        tries: dict[asyncio.Task, _Try] = {}
        pos = 0

        def ask_next() -> None:
            nonlocal pos
            tr = _Try(chain[pos], self._pieces_in)
            pos += 1
            tries[asyncio.create_task(self._try_source(tr, st, index))] = tr

        ask_next()
        try:
            while tries:
                newest = next(reversed(tries.values()))
                wait = self._silent(newest) if pos < len(chain) else None
                if wait == 0:  # the newest request is silent: go around it
                    self.bypasses += 1
                    newest.gone_around_at = time.monotonic()
                    ask_next()
                    continue
                done, _ = await asyncio.wait(tries, timeout=wait, return_when=asyncio.FIRST_COMPLETED)
                for task in done:
                    tr = tries.pop(task)
                    if task.exception() is not None:
                        log.warning("v%d piece %d from %s: %r", st.version, index, tr.src, task.exception())
                    if tr.outcome == "ok":
                        self._silent_through(tries.values(), st, index)
                        return "ok"
                    if tr.outcome == "absent" and tr.src == self.tracker_url:
                        return "gone"
                    if tr.outcome == "dead" and not tries:
                        return "dead"
                if not tries and pos < len(chain):
                    ask_next()  # absent or failed there: the next ancestor, now
            return "failed"
        finally:
            for task in tries:
                task.cancel()
            await asyncio.gather(*tries, return_exceptions=True)

    def _silent_through(self: Peer, losers, st: VersionState, index: int) -> None:
        """Sources silent while another delivered the piece: avoided for a while, and reported if they
        never answered."""
        for tr in losers:
            if tr.src == self.tracker_url or not self._still_silent(tr):
                continue
            if tr.answered:
                self._avoid_quietly(tr, st, index)
                continue
            self._blacklist[tr.src] = time.monotonic() + SILENT_AVOID_S
            detail = f"no answer in {time.monotonic() - tr.started:.2f}s; fetched elsewhere"
            task = asyncio.create_task(self._report(tr.src, "stall", st.version, index, detail))
            self._bg.add(task)
            task.add_done_callback(self._bg.discard)

    def _still_silent(self: Peer, tr: _Try) -> bool:
        """Silent now, or gone around as silent and not heard from since. The verdict at the bypass stands:
        the yardsticks move while the race goes on (the winner's own answer time raises the deadline on a
        loaded machine), and a source silent then and since is silent."""
        if tr.gone_around_at:
            # Answered by then: silent means no bytes; unanswered: not even an answer.
            answered_by_then = tr.answered and tr.answered_at <= tr.gone_around_at
            last = (self._last_bytes.get(tr.src, (0.0, 0))[0] if answered_by_then
                    else self._last_heard.get(tr.src, 0.0))
            if last < tr.gone_around_at:
                return True
        return self._silent(tr) == 0

    async def _try_source(self: Peer, tr: _Try, st: VersionState, index: int) -> None:
        """Fetch one piece from one source; sets tr.outcome: 'ok', 'absent' (404), 'dead' (unreachable,
        reported and avoided) or 'failed' (reported and avoided, or cut short)."""
        assert self._session
        src = tr.src
        ref = st.pieces[index]
        reason, detail = "dead", ""
        try:
            async with self._session.get(f"{src}/v/{st.version}/piece/{index}",
                                         headers={"X-Peer": self.peer_id or ""}) as r:
                tr.answered, tr.answered_at = True, time.monotonic()
                self._heard(src, tr.answered_at, body=False)
                lat = tr.answered_at - tr.started
                if self._answer_s is None:
                    self._answer_s, self._answer_var = lat, lat / 2
                else:
                    self._answer_var = 0.75 * self._answer_var + 0.25 * abs(self._answer_s - lat)
                    self._answer_s = 0.875 * self._answer_s + 0.125 * lat
                if r.status == 404:
                    tr.outcome = "absent"
                    return
                if r.status != 200:
                    reason, detail = ("stall" if r.status == 503 else "dead"), f"HTTP {r.status}"
                elif r.content_length is not None and r.content_length != ref.size:
                    reason, detail = "corrupt", f"length {r.content_length} != {ref.size}"
                else:
                    chunks = []
                    first_at = now = time.monotonic()
                    try:
                        async for chunk in r.content.iter_chunked(RECV_CHUNK):
                            now = time.monotonic()
                            if not chunks:
                                first_at = now
                            self._heard(src, now, body=True)
                            chunks.append(chunk)
                            tr.got += len(chunk)
                            if tr.got > ref.size:
                                break
                    finally:
                        # Placement's evidence: how long it was sending, not holding (None: no way to tell).
                        sent_from = (sending_started(tr.answered_at, first_at, now, len(chunks[0]), tr.got)
                                     if chunks else None)
                        if sent_from is not None:
                            self._received.span(src, sent_from, now)
                    buf = b"".join(chunks)
                    if len(buf) != ref.size:
                        reason, detail = "corrupt", f"{len(buf)} bytes, expected {ref.size}"
                    # Hashing in a thread (hashlib lets go of the GIL): the loop goes on receiving meanwhile.
                    elif not await asyncio.to_thread(ref.matches, buf):
                        reason, detail = "corrupt", "sha256 mismatch"
                    else:
                        tr.outcome = "ok"
                        self._pieces_in += 1
                        took = time.monotonic() - tr.started  # held, then streamed
                        old = self._latency_s
                        self._latency_s = took if old is None else 0.8 * old + 0.2 * took
                        if sent_from is not None:
                            self._received.credit(src, ref.size)
                        self.received[src] = self.received.pop(src, 0) + ref.size
                        if len(self.received) > 64:
                            del self.received[next(iter(self.received))]
                        if not st.abandoned and not st.have[index]:
                            st.write_piece(index, buf)  # on the loop: abandon() closes these files there
                            st.mark(index)
                        return
        except TimeoutError:
            if tr.answered and src != self.tracker_url:
                tr.outcome = "failed"
                self._avoid_quietly(tr, st, index)
                return
            reason, detail = "stall", f"no data for {self.stall_timeout}s"
        except aiohttp.ClientPayloadError as e:
            # Cut off after the answer began: a parent that gave up waiting for the piece itself, or a
            # crash. Avoided for a while; not reported (the tracker would find it alive and well).
            tr.outcome = "failed"
            self._blacklist[src] = time.monotonic() + TEMP_BLACKLIST_S
            log.info("%s cut v%d piece %d short (%s); trying elsewhere", src, st.version, index, e)
            return
        except (aiohttp.ClientError, OSError) as e:
            reason, detail = "dead", f"{type(e).__name__}: {e}"
        tr.outcome = "failed"
        if src == self.tracker_url:
            log.warning("origin failed for v%d piece %d (%s): retrying", st.version, index, detail)
            return
        self._blacklist[src] = float("inf") if reason == "corrupt" else time.monotonic() + TEMP_BLACKLIST_S
        await self._report(src, reason, st.version, index, detail)
        if reason == "dead":
            tr.outcome = "dead"

