"""broadcast/uplink_share.py: while members first in line are being sent to, the others together get a
small share of what goes out, never less than a floor; alone, they get everything."""

from __future__ import annotations

import pytest

from broadcast.uplink_share import LOW_SHARE, MIN_LOW_RATE, UplinkShare


class Clock:
    def __init__(self) -> None:
        self.now = 100.0

    def __call__(self) -> float:
        return self.now


def test_the_rest_are_paced_to_their_share_of_what_the_first_receive():
    clock = Clock()
    share = UplinkShare(clock)
    first_rate = 4e6  # bytes/s going to members first in line
    slice_ = 16 << 10
    low_sent = 0
    low_free_at = clock.now
    while clock.now < 110.0:
        clock.now += slice_ / first_rate
        share.first_sent(slice_)
        if clock.now >= low_free_at:  # the low sender sends a slice whenever its wait is over
            low_free_at = clock.now + share.low_sent(slice_)
            low_sent += slice_
    low_rate = low_sent / 10.0
    expected = first_rate * LOW_SHARE / (1 - LOW_SHARE)
    assert low_rate == pytest.approx(expected, rel=0.1)


def test_alone_the_rest_are_not_paced_and_never_starve():
    clock = Clock()
    share = UplinkShare(clock)
    assert share.low_sent(1 << 20) == 0.0  # nobody first in line is being sent to
    share.first_sent(1)  # a trickle to the first: the floor holds
    assert share.low_sent(MIN_LOW_RATE) == pytest.approx(1.0)
    clock.now += 5.0  # the first are done: what they got has left the window
    assert share.low_sent(1 << 20) == 0.0
