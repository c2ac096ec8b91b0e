"""What a peer raises when a version cannot be had."""

from __future__ import annotations


class FetchError(RuntimeError):
    """A version could not be fetched and verified; nothing partial is ever returned."""


class Evicted(FetchError):
    """The tracker removed this peer (e.g. it was caught serving corrupt data)."""
