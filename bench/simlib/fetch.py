"""Pieces in simulated time: each piece's race (broadcast/piece_race.PieceRace, the real one) with its tries
as simulated requests, and the sources' side of them (held until the piece is here, then sent in turns,
broadcast/turns.TurnQueue). What the race is fed, and when, follows broadcast/fetcher.py:

  fetcher.py (aiohttp)                         here
  GET sent                                     Req reaches the source after the path latency
  response headers                             book.answered, one latency after the request arrived
  a chunk of the body                          book.heard(body) whenever the race looks, while it streams
  body complete and hashed                     book.body + meter span + book.piece_in, one latency after
                                               the source's last byte
  ClientConnectorError / reset before headers  concluded('unreachable'): a dead report, then ended
  ClientPayloadError (cut short after headers) concluded('cut')
"""

from __future__ import annotations

from typing import TYPE_CHECKING

from broadcast.messages import ORIGIN
from broadcast.piece_race import PieceRace, retry_plan
from broadcast.sourcing import Try, other_parents

from .peers import RaceState, Req, SimPeer

if TYPE_CHECKING:
    from .world import World


class Fetching:
    def __init__(self, sw: World):
        self.sw = sw
        self.gave_up = 0  # pieces a real peer would have given up (its download fails and starts again)

    def _lat(self, req: Req) -> float:
        return self.sw.to_origin(req.peer) if req.src is None else self.sw.lat(req.peer, req.src)

    # -- the child's side -----------------------------------------------------------------------------
    def race(self, p: SimPeer, tree: int, index: int, failures: int) -> None:
        if not p.host.alive or p.have[index]:
            p.next_piece(tree)
            return
        now = self.sw.sim.now
        relays = p.relays(tree)
        chain = p.book.chain(relays, now)
        others = other_parents(p.sources, tree)
        race = PieceRace(p.book, chain, now, self.sw.piece_size(p.version, index),
                         p.book.helpers(relays, chain, now, others), relays)
        rs = RaceState(race, tree, index, failures, p.version)
        self._ask(p, rs, race.start(now))
        self._look(p, rs)

    def _ask(self, p: SimPeer, rs: RaceState, tr: Try) -> None:
        src = None if tr.src == ORIGIN else self.sw.peers.get(tr.src)
        req = Req(p, rs, tr, rs.index, src)
        rs.reqs[tr] = req
        self.sw.sim.after(self._lat(req), self._at_source, req)

    def _look(self, p: SimPeer, rs: RaceState, gen: int | None = None) -> None:
        if gen is not None and gen != rs.look_gen or rs.race.result or not self._current(p, rs):
            return
        now = self.sw.sim.now
        for r in p.sending:  # streams in progress: what they brought so far (less what is still on its way)
            x, lat = r.xfer, self._lat(r)
            if x is not None and now > r.sent_from + lat:
                got = min(x.done + x.rate * (now - lat - x.t), x.size) if now - lat > x.t else x.done
                p.book.streaming(r.tr, int(got), r.sent_from + lat, now)
            else:
                p.book.heard(r.tr.src, now, body=True)
        new, at = rs.race.look(now)
        for tr in new:
            self._ask(p, rs, tr)
        rs.look_gen += 1
        if at is not None:
            self.sw.sim.at(at, self._look, p, rs, rs.look_gen)

    def _current(self, p: SimPeer, rs: RaceState) -> bool:
        return p.host.alive and p.version == rs.version

    def _answered(self, req: Req) -> None:
        if req.tr in req.rs.reqs and self._current(req.peer, req.rs):
            req.peer.book.answered(req.tr, self.sw.sim.now)

    def _arrived(self, req: Req, size: int) -> None:
        p, now = req.peer, self.sw.sim.now
        if req.tr not in req.rs.reqs or not self._current(p, req.rs):
            return
        p.book.body(req.tr, size - req.tr.got, now)
        sent_from = req.sent_from + self._lat(req)
        p.book.sending_span(req.tr, sent_from, now)
        p.book.piece_in(req.tr, size, now, sent_from)
        p.got_piece(req.index)
        self._ended(req)

    def _conclude(self, req: Req, how: str, detail: str) -> None:
        p = req.peer
        if req.tr not in req.rs.reqs or not self._current(p, req.rs):
            return
        if how == "cut" and not req.tr.answered:  # reset before the headers came: a refused connection
            how = "unreachable"
        report = req.rs.race.concluded(req.tr, how, self.sw.sim.now, detail)
        if report is None:
            self._ended(req)
        else:  # awaited, as fetcher.py awaits it: the try ends once the tracker has answered
            p.report(report, req.rs.version, req.index, lambda: self._ended(req))

    def _ended(self, req: Req) -> None:
        p, rs = req.peer, req.rs
        if rs.reqs.pop(req.tr, None) is None or not self._current(p, rs):
            return
        req.state = "over"
        p.sending.pop(req, None)
        now = self.sw.sim.now
        new, cancel = rs.race.ended(req.tr, now)
        for tr in cancel:
            self._cancel(rs.reqs.pop(tr))
        for r in rs.race.reports:  # silent through the race: reported in the background
            p.report(r, rs.version, rs.index)
        rs.race.reports.clear()
        for tr in new:
            self._ask(p, rs, tr)
        if rs.race.result:
            self._race_done(p, rs)
        else:
            self._look(p, rs)

    def _race_done(self, p: SimPeer, rs: RaceState) -> None:
        outcome = rs.race.result
        if outcome == "ok":
            p.next_piece(rs.tree)
            return
        failures = rs.failures + (outcome != "gone")
        plan = retry_plan(outcome, failures, p.book)
        wait = plan.wait_s
        if plan.give_up:
            self.gave_up += 1
            failures, wait = 0, self.sw.origin_cfg.heartbeat_s  # the download starts again after a heartbeat
        elif plan.fresh_within:  # the tracker's answer to our report: a heartbeat begun now
            p.heartbeat()
            wait = max(wait, min(plan.fresh_within, 2 * self.sw.to_origin(p)))
        self.sw.sim.after(wait, self._retry, p, rs, failures)

    def _retry(self, p: SimPeer, rs: RaceState, failures: int) -> None:
        if self._current(p, rs):
            self.race(p, rs.tree, rs.index, failures)

    def _cancel(self, req: Req) -> None:
        """The race is over: this try's task is cancelled (its connection closed)."""
        state, req.state = req.state, "over"
        req.peer.sending.pop(req, None)
        src = req.src
        if src is not None:
            src.serving.pop(req, None)
            if state == "held" and req in src.held.get(req.index, ()):
                src.held[req.index].remove(req)
        if state == "queued":
            self._turns(req).leave(req.key, req)
        elif state == "sending" and req.xfer is not None:
            self.sw.net.cancel(req.xfer)

    # -- the source's side ----------------------------------------------------------------------------
    def _turns(self, req: Req):
        return self.sw.origin.turns if req.src is None else req.src.turns

    def _at_source(self, req: Req) -> None:
        if req.state != "asked" or not req.peer.host.alive:
            return
        src, back = req.src, self._lat(req)
        if src is not None and not src.host.alive or req.tr.src != ORIGIN and src is None:
            req.state = "over"
            self.sw.sim.after(back, self._conclude, req, "unreachable", "connection refused")
            return
        self.sw.sim.after(back, self._answered, req)  # answered at once, even for a piece on its way here
        v = req.rs.version
        if src is None or src.holds(v, req.index) or v in src.complete:
            self.serve(req)
        elif not req.tr.hold:  # a helper without it: 404 (serving.py)
            req.state = "over"
            self.sw.sim.after(back, self._conclude, req, "absent", "not here yet")
        else:
            req.state = "held"
            src.held[req.index].append(req)
            src.serving[req] = None
            self.sw.sim.after(self.sw.peer_cfg.hold_s, self._hold_over, req)

    def _hold_over(self, req: Req) -> None:
        src = req.src
        if req.state == "held" and src is not None and src.host.alive:  # serving.py: cut the answer short
            src.held[req.index].remove(req)
            self.cut(req)

    def serve(self, req: Req) -> None:
        """The piece is here: the request waits its turn among the child's on that tree."""
        req.state = "queued"
        if req.src is not None:
            req.src.serving[req] = None
        if self._turns(req).arrive(req.key, req):
            self._start(req)

    def _start(self, req: Req | None) -> None:
        sw = self.sw
        while req is not None and not req.peer.host.alive:  # the child is gone: nothing to send it
            req.state = "over"
            if req.src is not None:
                req.src.serving.pop(req, None)
            nxt = self._turns(req).leave(req.key, req)
            req = nxt if isinstance(nxt, Req) and nxt.state == "queued" else None
        if req is None:
            return
        req.state, req.sent_from = "sending", sw.sim.now
        req.peer.sending[req] = None
        size = sw.piece_size(req.rs.version, req.index)
        src_host = sw.origin.host if req.src is None else req.src.host
        # Sent after others (broadcast/uplink_share.py): by the origin to members not first in line, by a
        # relay to the members below it that the tracker named to it (TreeSources.low).
        low = (not sw.origin.tracker.line.first(req.peer.pid, req.index) if req.src is None
               else req.peer.host.name in req.src.low or not req.tr.hold)  # a helper's request: low too
        req.xfer = sw.net.start(src_host, req.peer.host, size, lambda x, ok: self._sent(req, ok, size), low=low)

    def _sent(self, req: Req, ok: bool, size: int) -> None:
        nxt = self._turns(req).leave(req.key, req)
        if isinstance(nxt, Req) and nxt.state == "queued":
            self._start(nxt)
        if req.src is not None:
            req.src.serving.pop(req, None)
            req.src.served_bytes += size if ok else 0
        if req.state == "sending" and ok:
            self.sw.sim.after(self._lat(req), self._arrived, req, size)

    def cut(self, req: Req) -> None:
        """The source cut this answered request short (it gave up holding it, or went away)."""
        if req.state in ("held", "queued", "sending"):
            if req.state == "queued":
                self._turns(req).leave(req.key, req)
            req.state = "over"
            req.peer.sending.pop(req, None)
            if req.src is not None:
                req.src.serving.pop(req, None)
            self.sw.sim.after(self._lat(req), self._conclude, req, "cut", "cut short")
