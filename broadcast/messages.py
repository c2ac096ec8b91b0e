"""Every message between peers and the tracker, as msgspec structs (decoded with bounds, never trusted)."""

from __future__ import annotations

import hashlib
from typing import Annotated, Literal

import msgspec

MAX_TRACKER_MESSAGE_BYTES = 1 << 20  # tracker messages are small; anything bigger is refused unread
# The origin's name in sources and receive reports. It is the root of every tree, and each peer reaches it
# at its own tracker URL: the origin's bind address (0.0.0.0 across machines) is no address to give anyone.
ORIGIN = "origin"


class Join(msgspec.Struct, forbid_unknown_fields=True):
    """A peer asks for a place in the tree, signed with its ed25519 key (see identity.py).

    `url` is the advertised address (--advertise, or the address a relay is bound to); None with `port`
    set: the tracker uses the source address it sees the join come from, with that port (as STUN does);
    None without a port: a --no-relay peer, which serves no one."""

    url: str | None
    relay: bool
    name: str = ""
    key: str = ""  # hex ed25519 public key: the identity this membership belongs to
    port: int | None = None  # the relay's bound port, for the tracker to pair with the observed host
    time_ms: int = 0  # signing time: a join is accepted only near it, and only once (nonce)
    nonce: str = ""
    signature: str = ""  # hex, over identity.join_payload(); empty only for in-process callers


class Joined(msgspec.Struct):
    peer_id: str
    token: str  # proves later heartbeats/reports come from the same peer
    trees: int
    heartbeat_interval: float
    url: str | None = None  # the address the tracker gives others for this peer (None: a leaf only)
    observed_host: str = ""  # the source address the join came from
    reachable: bool | None = None  # the tracker's connect-back found this peer at `url`
    reach_error: str = ""  # why not, for the peer's log


class Received(msgspec.Struct, array_like=True, forbid_unknown_fields=True):
    """What this peer got from one source since its last heartbeat: the tracker's only uplink evidence."""

    bytes: Annotated[int, msgspec.Meta(ge=0, le=1 << 40)]  # of verified pieces (0: it answered, sent nothing)
    seconds: Annotated[float, msgspec.Meta(ge=0, le=3600)]  # spent receiving from it (overlaps counted once)


class PeerHeartbeat(msgspec.Struct, forbid_unknown_fields=True):
    peer_id: str
    token: str
    complete: list[int] = []  # verified complete versions held
    progress: dict[int, int] = {}  # version -> verified pieces, for versions in flight
    served_bytes: int = 0  # bytes this peer's relay has uploaded since it started
    received: dict[str, int] = {}  # source URL (ORIGIN: the origin) -> verified bytes received since start
    # What came from each source since the last heartbeat, and how long it took: uplink evidence for
    # bandwidth-aware placement (broadcast/placement.py; counted only from peers with standing).
    recent: Annotated[dict[str, Received], msgspec.Meta(max_length=64)] = {}
    sources_tag: Annotated[str, msgspec.Meta(max_length=32)] = ""  # TreeSources.tag of the sources it holds


class TreeSources(msgspec.Struct):
    """For each tree, the relays above this peer to fetch from, parent first; the origin, above them all,
    is not named (the peer reaches it at its tracker URL). Sent only when they changed
    since the peer's last heartbeat (otherwise `sources` is empty and `tag` the one it holds): every peer's
    answer, every heartbeat, on the origin's uplink was 5% of it at N = 32 with 1 s heartbeats."""

    latest: int | None
    sources: list[list[str]]
    reachable: bool | None = None  # the tracker's current view of this peer's relay
    tag: str = ""  # names `sources` and `low`
    low: list[str] = []  # addresses of the members below us not first in line (broadcast/uplink_share.py)
    trial: list[str] = []  # which of `sources` are on trial (broadcast/trials.py)

    def for_peer(self, held_tag: str) -> TreeSources:
        tag = hashlib.blake2b(msgspec.json.encode([self.sources, self.low, self.trial]), digest_size=8).hexdigest()
        if tag == held_tag:
            return TreeSources(self.latest, [], self.reachable, tag)
        return TreeSources(self.latest, self.sources, self.reachable, tag, self.low, self.trial)


class Report(msgspec.Struct, forbid_unknown_fields=True):
    peer_id: str
    token: str
    accused_url: str
    reason: Literal["dead", "stall", "corrupt"]
    version: int
    piece: int
    detail: str = ""


class Leave(msgspec.Struct, forbid_unknown_fields=True):
    peer_id: str
    token: str


class Latest(msgspec.Struct):
    latest: int | None
    versions: list[int]


class ReachAnswer(msgspec.Struct, forbid_unknown_fields=True):
    """A relay's answer to the tracker's connect-back: its key and its signature over the nonce."""

    key: str
    signature: str


class ReachTest(msgspec.Struct):
    """The tracker's answer to GET /reach-test?port=P (for `swarm doctor`)."""

    observed_host: str
    url: str
    reachable: bool
    answered_key: str | None  # the key that answered the connect-back, if it was one of ours
    detail: str


class PeerView(msgspec.Struct):
    peer_id: str
    name: str
    url: str | None
    relay: bool
    group: int | None  # the tree this peer is interior in
    complete: list[int]
    progress: dict[int, int]
    last_heartbeat_age: float
    strikes: int
    parents: list[str | None]  # per tree, the parent's peer_id (None = origin)
    children: list[list[str]]  # per tree, the children's peer_ids
    key: str = ""
    reachable: bool | None = None  # None: not checked (a --no-relay peer)
    reach_error: str = ""
    standing: bool = False  # its reports count: established with the trainer, or shown it uploads
    proven: bool = False  # has shown it uploads: placed above fresh peers
    uploaded: int = 0  # bytes its children with standing confirm receiving from it
    demoted: bool = False
    uplink: float | None = None  # bytes/s placement uses: what its children measured, else the origin's probe
    uplink_probed: bool = False  # the figure is the origin's probe (broadcast/uplink_probe.py)
    tier: int = 0  # 2 above the rest, 1 on trial (broadcast/trials.py), 0 a leaf once uplinks are measured


class Banned(msgspec.Struct):
    peer_id: str
    url: str | None
    reason: str
    reporter: str
    at: float
    key: str = ""


class TreeView(msgspec.Struct):
    origin: str
    trees: int
    fanout: int
    latest: int | None
    versions: list[int]
    origin_children: list[list[str]]
    peers: list[PeerView]
    banned: list[Banned]
    events: list[str]
    refused: dict[str, int] = {}  # refusals and detections by reason: bad_url, private_url, url_taken, ...


def decode(data: bytes, typ: type):
    if len(data) > MAX_TRACKER_MESSAGE_BYTES:
        raise ValueError(f"message of {len(data)} bytes is too large")
    return msgspec.json.decode(data, type=typ)
