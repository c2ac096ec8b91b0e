"""Structural checks on submitted rollouts (trainer/intake.py)."""

import time

from rewards.arithmetic import ArithmeticTask
from rewards.base import TaskItem
from swarm_common import protocol as P
from trainer.intake import Held, Limits, check_rollout, check_sample, check_version, score_group

LIM = Limits(group_size=2, max_tokens=4, vocab_size=100, eos_id=0, max_lag=2)
ITEM = TaskItem(id="i", prompt="1+2", answer="3")


def _held(node="n", deadline=None):
    return Held("a", node, ITEM, [1, 2], version=5, deadline=deadline or time.monotonic() + 60)


def S(ids, lps=None, fin="stop"):
    return P.Sample(ids, lps or [-0.5] * len(ids), fin)


def test_good_samples_pass():
    assert check_sample(S([7, 0]), LIM) is None
    assert check_sample(S([7, 8, 9, 10], fin="length"), LIM) is None


def test_sample_refusals():
    assert check_sample(S([7, 8, 9, 10, 0]), LIM) == "bad_length"
    assert check_sample(S([100, 0]), LIM) == "bad_token"
    assert check_sample(S([-1, 0]), LIM) == "bad_token"
    assert check_sample(S([7, 0], [-0.1, 0.5]), LIM) == "bad_logprob"
    assert check_sample(S([7, 0], [float("nan"), -0.1]), LIM) == "bad_logprob"
    assert check_sample(S([7, 8]), LIM) == "bad_finish"  # "stop" without the stop token
    assert check_sample(S([0, 7, 0]), LIM) == "bad_finish"  # stop token before the end
    assert check_sample(S([7, 8], fin="length"), LIM) == "bad_finish"  # length stop before max_tokens
    assert check_sample(S([7, 0, 8, 9], fin="length"), LIM) == "bad_finish"


def test_version_window():
    assert check_version(5, 5, LIM) is None
    assert check_version(3, 5, LIM) is None
    assert check_version(2, 5, LIM) == "stale"
    assert check_version(6, 5, LIM) == "future_version"


def test_rollout_refusals():
    good = P.Rollout("a", [S([7, 0]), S([8, 0])])
    assert check_rollout(good, _held(), "n", 5, LIM) is None
    assert check_rollout(good, None, "n", 5, LIM) == "unassigned"
    assert check_rollout(good, _held(node="other"), "n", 5, LIM) == "unassigned"
    assert check_rollout(good, _held(deadline=time.monotonic() - 1), "n", 5, LIM) == "late"
    assert check_rollout(P.Rollout("a", [S([7, 0])]), _held(), "n", 5, LIM) == "wrong_group_size"
    assert check_rollout(P.Rollout("a", [S([7, 0])] * 3), _held(), "n", 5, LIM) == "wrong_group_size"


def test_rewards_are_recomputed_from_text():
    task = ArithmeticTask(digits=1)
    g = score_group(task, _held(), [S([51, 0]), S([52, 0])], 5, "n", lambda ids: "".join(chr(i) for i in ids),
                    Limits(2, 4, 100, 0, 2))
    assert g.correct == [1.0, 0.0]  # chr(51) == "3"
    assert g.rewards[0] == 1.0 and g.rewards[1] < 0.2
