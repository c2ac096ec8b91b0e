"""Who may fetch pieces from the origin, and how every piece request looks (sans-I/O).

The origin serves pieces to members only (issue 29: fetching from it without joining made delivery 2.72x):
each request names the member (X-Peer) and carries a pass only that member and the tracker can make (an
HMAC of its token over the piece's name, so a source that sees it can use it for that one piece and no
other, and learns nothing of the token). Anyone else gets a small trial budget of pieces per address
prefix (one now and then: `swarm doctor`'s download check), then 403; a delta version's whole files
(GET /v/N/file/PATH) are members' only.

Every peer sends these two headers to every source, and the origin's own checks of a relay (judge.py) are
sent as one of the relay's receivers would send them, with that receiver's id and pass: by its headers a
relay cannot tell the origin's check from a child's request (issue 29: keys served the origin's one piece
and lied to everyone else). The source address still tells where the origin's address is known; what the
tree believes of a relay therefore also comes from its receivers' confirmations (standing.py).
"""

from __future__ import annotations

import hashlib
import hmac

from .admission import prefix
from .buckets import KeyedBuckets
from .peer_rec import PeerRec

PEER_HEADER = "X-Peer"
PASS_HEADER = "X-Peer-Pass"
HOLD_HEADER = "X-Hold"  # "0": answer 404 unless the piece is held here now (a helper's request)
TRIAL = (1 / 60, 2.0)  # a non-member's address prefix: pieces per second, and at once


def piece_name(version: int | str, index: int | str) -> str:
    return f"piece {version}/{index}"


def file_name(version: int | str, path: str) -> str:
    """A delta version's file whole (GET /v/N/file/PATH): members only, no trial (a file is a whole shard)."""
    return f"file {version}/{path}"


def pass_for(token: str, name: str) -> str:
    return hmac.new(token.encode(), name.encode(), hashlib.sha256).hexdigest()[:32]


def headers(peer_id: str | None, token: str, name: str, hold: bool = True) -> dict[str, str]:
    """What a member sends with each request for `name` (piece_name, file_name), to any source; `hold`
    False: only if the source has it now (HOLD_HEADER)."""
    out = {PEER_HEADER: peer_id or "", PASS_HEADER: pass_for(token, name) if peer_id else ""}
    if not hold:
        out[HOLD_HEADER] = "0"
    return out


def posing_as(peers: dict[str, PeerRec], accused: PeerRec) -> PeerRec | None:
    """Whose request the origin's check of `accused` looks like: the member given it as a source most lately
    (its child), else another member; None when it is alone."""
    best, at = None, -1.0
    for rec in peers.values():
        if rec is accused:
            continue
        given = rec.given.get(accused.url or "", -0.5)
        if given > at:
            best, at = rec, given
    return best


class PieceGate:
    def __init__(self) -> None:
        self.trial = KeyedBuckets(*TRIAL)

    def admits(self, peers: dict[str, PeerRec], peer_id: str, given: str, name: str, src: str, now: float,
               trial: bool = True) -> str:
        """'member', 'trial' (a non-member within its prefix's budget), or '' (refused)."""
        rec = peers.get(peer_id) if peer_id else None
        if rec is not None and given and hmac.compare_digest(given, pass_for(rec.token, name)):
            return "member"
        return "trial" if trial and self.trial.take(prefix(src), now) == 0 else ""
