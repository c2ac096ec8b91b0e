"""reasoning-gym tasks behind the Task interface: seeded splits, the datasets' own verifiers, chat prompts."""

from __future__ import annotations

import itertools
import re

import msgspec
import pytest

from rewards.base import TaskItem
from rewards.registry import make_task

pytest.importorskip("reasoning_gym", reason="the gym extra (reasoning-gym) is not installed")

from rewards.gym import extract  # noqa: E402

REQUIRED = ["gym:single_digit", "gym:chain_sum", "gym:countdown", "gym:gsm_symbolic"]


@pytest.fixture(scope="module", params=REQUIRED)
def task(request):
    return make_task(request.param)


def test_splits_are_seeded_and_held_out(task):
    n = 10 if "countdown" in task.name else 40  # countdown's generator solves each puzzle: slower
    ev = task.eval_items(n)
    assert len(ev) == n and [i.prompt for i in ev] == [i.prompt for i in task.eval_items(n)]
    assert len({i.prompt for i in ev}) == n
    train = list(itertools.islice(task.train_items(seed=0), 300))
    assert not {i.prompt for i in ev} & {i.prompt for i in train}
    assert [i.prompt for i in itertools.islice(task.train_items(seed=0), 300)] == [i.prompt for i in train]
    # A resumed stream continues exactly where it stopped.
    assert [i.id for i in itertools.islice(task.train_items(seed=0, start=123), 5)] == [i.id for i in train[123:128]]
    assert [i.prompt for i in itertools.islice(task.train_items(seed=0, start=123), 5)] == [
        i.prompt for i in train[123:128]]
    other = [i.prompt for i in itertools.islice(task.train_items(seed=1), 50)]
    assert other != [i.prompt for i in train[:50]]


def test_gold_answers_score_full_and_wrong_ones_do_not(task):
    for item in task.eval_items(5):
        gold = task.score(item, f"<answer>{item.answer}</answer>")
        assert gold.metrics["correct"] == 1.0 and gold.metrics["format"] == 1.0 and gold.reward == 1.0
        wrong = task.score(item, "<answer>x</answer>")
        assert wrong.metrics["correct"] == 0.0 and wrong.metrics["score"] < 0.1 and wrong.reward < 0.2
        missing = task.score(item, item.answer)  # right answer, but not in the tags the prompt asks for
        assert missing.metrics["format"] == 0.0 and missing.metrics["correct"] == 0.0


def test_items_cross_processes_and_score_the_same(task):
    item = task.eval_items(1)[0]
    wire = msgspec.msgpack.decode(msgspec.msgpack.encode(item), type=TaskItem)
    assert wire == item
    fresh = make_task(task.name)  # another process: a new task object, nothing cached
    assert fresh.entry(wire) == task.entry(item)
    assert fresh.score(wire, f"<answer>{item.answer}</answer>").metrics["correct"] == 1.0


def test_countdown_uses_its_own_verifier_not_string_match():
    task = make_task("gym:countdown")
    item = task.eval_items(1)[0]
    entry = task.entry(item)
    # Another spelling of the gold expression: string match would reject it, the verifier accepts it.
    alt = f"({item.answer}) * 1" if 1 in entry["metadata"]["numbers"] else f"({item.answer})"
    assert alt != item.answer
    assert task.score(item, f"<answer>{alt}</answer>").metrics["correct"] == 1.0
    # Right value, but not using the given numbers: the verifier's partial credit, not full marks.
    s = task.score(item, f"<answer>{entry['metadata']['target']}</answer>")
    assert s.metrics["correct"] == 0.0 and 0.0 < s.metrics["score"] < 1.0


@pytest.mark.parametrize("fmt,text,want", [
    ("tags", "thinking... <answer> 12 </answer>", "12"),
    ("tags", "<answer>1</answer> then <answer>2</answer>", "2"),
    ("tags", "12", None),
    ("last_number", "7 + 5 = 12.", "12"),
    ("last_number", "no digits", None),
    ("raw", "  42 \n", "42"),
    ("raw", "   ", None),
])
def test_answer_extraction(fmt, text, want):
    assert extract(text, fmt) == want


def test_last_number_format_for_small_models():
    task = make_task("gym:chain_sum", answer_format="last_number", system_prompt="Answer with a number.")
    item = task.eval_items(1)[0]
    assert task.system_prompt == "Answer with a number."
    assert task.score(item, f"The answer is {item.answer}.").metrics["correct"] == 1.0
    assert task.score(item, f"The answer is {int(item.answer) + 1}.").metrics["correct"] == 0.0


def test_registry_names_and_errors():
    a = make_task("gym:chain_sum")
    b = make_task("gym", dataset="chain_sum")
    assert [i.prompt for i in a.eval_items(5)] == [i.prompt for i in b.eval_items(5)]
    c = make_task("gym:chain_sum", config={"min_digits": 3, "max_digits": 3})
    assert all(len(n) == 3 for i in c.eval_items(5) for n in re.findall(r"\d+", i.prompt))
    with pytest.raises(ValueError, match="no dataset"):
        make_task("gym:no_such_dataset")
    with pytest.raises(ValueError, match="answer_format"):
        make_task("gym:chain_sum", answer_format="xml")
    with pytest.raises(ValueError, match="seed"):
        make_task("gym:chain_sum", config={"seed": 3})


CHATML = ("{% for m in messages %}<|im_start|>{{ m['role'] }}\n{{ m['content'] }}<|im_end|>\n{% endfor %}"
          "{% if add_generation_prompt %}<|im_start|>assistant\n{% endif %}")


def test_prompts_get_the_models_chat_template(tmp_path):
    """What the trainer hands to nodes: the system prompt and question inside the model's chat template
    (the tiny model's own template drops system messages, so it is given a ChatML one here; the SmolLM2
    test checks the real one)."""
    from model_builders.default_model import build_default_model
    from swarm_common.chat import encode_prompt
    from trainer.policy import load_tokenizer

    tok = load_tokenizer(build_default_model(tmp_path / "m"))
    tok.chat_template = CHATML
    task = make_task("gym:gsm_symbolic")
    item = task.eval_items(1)[0]
    text = tok.decode(encode_prompt(tok, item.prompt, task.system_prompt))
    assert task.system_prompt and "<answer>" in task.system_prompt
    assert text == f"<|im_start|>system\n{task.system_prompt}<|im_end|>\n<|im_start|>user\n{item.prompt}<|im_end|>\n" \
        "<|im_start|>assistant\n"


def test_greedy_evaluation_runs_on_a_gym_task(tmp_path):
    """The trainer's own evaluation scores model output with the task's verifier (tiny default model)."""
    from model_builders.default_model import build_default_model
    from trainer.learner import evaluate
    from trainer.policy import load_model, load_tokenizer

    path = build_default_model(tmp_path / "m")
    model, tok = load_model(path), load_tokenizer(path)
    task = make_task("gym:chain_sum", answer_format="last_number", system_prompt=None)
    items = task.eval_items(8)
    ev = evaluate(model, tok, task, items, max_tokens=4)
    assert set(ev) == {"accuracy", "reward_mean"}
    assert 0.0 <= ev["accuracy"] <= 1.0 and 0.0 <= ev["reward_mean"] <= 1.0
