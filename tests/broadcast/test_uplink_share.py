"""broadcast/uplink_share.py: while answers to members first in line are being sent, the others together get
one such member's share of what goes out (at least a tenth, never less than a floor); when none is being
sent, the others are not paced at all."""

from __future__ import annotations

import pytest

from broadcast.uplink_share import LOW_SHARE, MIN_LOW_RATE, FirstAnswer, UplinkShare, low_share


class Clock:
    def __init__(self) -> None:
        self.now = 100.0

    def __call__(self) -> float:
        return self.now


@pytest.mark.parametrize("members", [1, 3, 20])
def test_the_rest_together_are_paced_to_one_first_members_share_at_least_a_tenth(members):
    clock = Clock()
    share = UplinkShare(clock)
    answers = [FirstAnswer(share, f"m{i}") for i in range(members)]
    first_rate = 4e6  # bytes/s going to the members first in line, together
    slice_ = 16 << 10
    low_sent, low_free_at, k = 0, clock.now, 0
    while clock.now < 110.0:
        clock.now += slice_ / first_rate
        answers[k % members](slice_)
        k += 1
        if clock.now >= low_free_at:  # the low senders send a slice whenever their wait is over
            low_free_at = clock.now + share.low_sent(slice_)
            low_sent += slice_
    part = max(LOW_SHARE, 1 / (members + 1))
    assert part == low_share(members)
    assert low_sent / 10.0 == pytest.approx(first_rate * part / (1 - part), rel=0.1)


def test_the_rest_are_paced_only_while_an_answer_to_the_first_is_being_sent():
    clock = Clock()
    share = UplinkShare(clock)
    assert share.low_sent(1 << 20) == 0.0  # nobody first in line is being sent to
    answer = FirstAnswer(share, "a")
    answer(1)  # a trickle to the first: the floor holds
    assert share.low_sent(MIN_LOW_RATE) == pytest.approx(1.0)
    answer.done()  # its answer ended: what it got is still in the window, but nobody waits on it
    assert share.low_sent(1 << 20) == 0.0
