"""Every message between peers and the tracker, as msgspec structs (decoded with bounds, never trusted)."""

from __future__ import annotations

from typing import Annotated, Literal

import msgspec

MAX_TRACKER_MESSAGE_BYTES = 1 << 20  # tracker messages are small; anything bigger is refused unread


class Join(msgspec.Struct, forbid_unknown_fields=True):
    url: str | None  # None for a --no-relay peer: it serves no one
    relay: bool
    name: str = ""


class Joined(msgspec.Struct):
    peer_id: str
    token: str  # proves later heartbeats/reports come from the same peer
    trees: int
    heartbeat_interval: float


class Received(msgspec.Struct, array_like=True, forbid_unknown_fields=True):
    """What this peer got from one source since its last heartbeat: the tracker's only uplink evidence."""

    bytes: Annotated[int, msgspec.Meta(ge=0, le=1 << 40)]  # of verified pieces
    seconds: Annotated[float, msgspec.Meta(ge=0, le=3600)]  # spent receiving from it (overlaps counted once)


class PeerHeartbeat(msgspec.Struct, forbid_unknown_fields=True):
    peer_id: str
    token: str
    complete: list[int] = []  # verified complete versions held
    progress: dict[int, int] = {}  # version -> verified pieces, for versions in flight
    received: Annotated[dict[str, Received], msgspec.Meta(max_length=64)] = {}  # source url -> what came


class TreeSources(msgspec.Struct):
    """For each tree, the ancestors to fetch from: parent first, origin last."""

    latest: int | None
    sources: list[list[str]]


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


class Banned(msgspec.Struct):
    peer_id: str
    url: str | None
    reason: str
    reporter: str
    at: float


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


def decode(data: bytes, typ: type):
    if len(data) > MAX_TRACKER_MESSAGE_BYTES:
        raise ValueError(f"message of {len(data)} bytes is too large")
    return msgspec.json.decode(data, type=typ)
