import pytest

from rewards.arithmetic import ArithmeticTask, correct, digits_match, final_integer, format_ok
from rewards.base import Rubric, TaskItem
from rewards.registry import make_task

ITEM = TaskItem(id="x", prompt="12+34", answer="46")


@pytest.mark.parametrize("text,value", [("46", 46), (" 4 6", 6), ("-3", -3), ("abc", None), ("1, 2, 46.", 46)])
def test_final_integer(text, value):
    assert final_integer(text) == value


@pytest.mark.parametrize("text,c,d,f", [
    ("46", 1.0, 1.0, 1.0),
    ("46.", 1.0, 1.0, 1.0),
    ("the answer is 46", 1.0, 1.0, 0.0),
    ("47", 0.0, 0.5, 1.0),
    ("146", 0.0, 2 / 3, 1.0),
    ("", 0.0, 0.0, 0.0),
    ("x", 0.0, 0.0, 0.0),
])
def test_reward_functions(text, c, d, f):
    assert correct(ITEM, text) == c
    assert digits_match(ITEM, text) == pytest.approx(d)
    assert format_ok(ITEM, text) == f


def test_rubric_weighted_mean_and_range_check():
    r = Rubric([("a", lambda i, t: 1.0, 3.0), ("b", lambda i, t: 0.0, 1.0)])
    s = r.score(ITEM, "")
    assert s.reward == 0.75 and s.metrics == {"a": 1.0, "b": 0.0}
    bad = Rubric([("a", lambda i, t: 2.0, 1.0)])
    with pytest.raises(ValueError):
        bad.score(ITEM, "")


def test_task_is_deterministic_and_eval_is_held_out():
    t = ArithmeticTask(digits=2)
    a = [i.prompt for i, _ in zip(t.train_items(seed=3), range(500), strict=False)]
    b = [i.prompt for i, _ in zip(t.train_items(seed=3), range(500), strict=False)]
    assert a == b
    ev = t.eval_items(100)
    assert len(ev) == 100 and len({i.prompt for i in ev}) == 100
    assert not {i.prompt for i in ev} & set(a)
    for it in ev[:20]:
        assert t.score(it, it.answer).reward == 1.0
        assert eval(it.meta["expr"]) == int(it.answer)


def test_train_stream_resumes_at_cursor():
    t = ArithmeticTask(digits=2)
    full = [i.id for i, _ in zip(t.train_items(seed=1), range(30), strict=False)]
    rest = [i.id for i, _ in zip(t.train_items(seed=1, start=10), range(20), strict=False)]
    assert rest == full[10:]


def test_difficulty_knob_and_validation():
    t = ArithmeticTask(digits=1, ops="+-*", terms=3)
    for it, _ in zip(t.train_items(seed=0), range(50), strict=False):
        nums = [int(x) for x in it.meta["expr"].replace("-", " ").replace("+", " ").replace("*", " ").split()]
        assert len(nums) == 3 and all(0 <= n <= 9 for n in nums)
    with pytest.raises(ValueError):
        ArithmeticTask(digits=0)
    with pytest.raises(ValueError):
        make_task("nope")
