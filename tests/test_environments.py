"""Environments, tools, episode tokens and the trainer's replay of an episode (no engine: fast).

The replay tests forge episodes the way a node could and check each is refused with its code; the honest
episode of every environment passes. One shows why the check is on token ids and not on text."""

from __future__ import annotations

import pytest

from model_builders.default_model import build_tokenizer
from rewards.calculator import CalculatorEnv, calc
from rewards.environment import Episode, Rubric, ToolEnv
from rewards.guess import GuessEnv
from rewards.registry import make_task
from rewards.token_episode import TokenEpisode, demonstration_ids, node_item, prompt_ids
from rewards.tools import ToolCall, format_call, parse_calls, tool
from swarm_common import protocol as P
from swarm_common.chat import observation_ids
from trainer.episode_check import EPISODE_FRAUD, NOT_FRAUD, replay_episode
from trainer.guard import FRAUD

TOK = build_tokenizer()
MAX_TOKENS, MAX_EPISODE = 160, 400  # the python tool's programs are long for a byte-level model


def test_a_tool_schema_comes_from_the_signature():
    def lookup(word: str, limit: int = 3, exact: bool = False) -> str:
        """Find a word in the dictionary.

        Args:
            word: what to look for
            limit: how many entries
        """
        return word

    s = tool(lookup).schema["function"]
    assert s["name"] == "lookup" and s["description"] == "Find a word in the dictionary."
    assert s["parameters"]["required"] == ["word"]
    assert s["parameters"]["properties"]["limit"] == {"type": "integer", "description": "how many entries"}
    assert s["parameters"]["properties"]["exact"] == {"type": "boolean"}
    with pytest.raises(TypeError):
        tool(lambda x: x)  # no type hint: no schema


def test_tool_calls_parse_in_both_formats_and_never_run_code():
    tools = {"calc": tool(calc)}
    assert parse_calls("pythonic", "ok [calc('1+2')] then", tools) == [ToolCall("calc", {"expr": "1+2"})]
    assert parse_calls("pythonic", "[calc(expr='(1+2)*3')]", tools) == [ToolCall("calc", {"expr": "(1+2)*3"})]
    assert parse_calls("pythonic", "[calc(__import__('os').system('x'))]", tools) == []  # not a literal
    assert parse_calls("pythonic", "no call [here]", tools) == []
    hermes = format_call("hermes", ToolCall("calc", {"expr": "2*3"}))
    assert parse_calls("hermes", f"sure {hermes}", tools) == [ToolCall("calc", {"expr": "2*3"})]
    assert parse_calls("hermes", "<tool_call>{not json}</tool_call>", tools) == []


def test_tool_errors_are_answers_and_counted():
    env = CalculatorEnv()
    ep = Episode(env, env.eval_items(1)[0])
    reply = ep.act("[calc('import os')] [nope(1)]")
    assert reply[0]["content"].startswith("error:") and ep.tool_calls == 1 and ep.tool_errors == 1
    reply = ep.act("[nope('1')]")  # max_turns 2: the episode is over whatever the turn says
    assert reply is None and ep.done


@pytest.mark.parametrize("name", ["calculator", "guess", "python"])
def test_held_out_items_never_appear_in_training(name):
    env = make_task(name)
    held = {(it.prompt, it.answer) for it in env.eval_items(50)}
    stream = env.train_items(seed=0)
    assert len(held) == 50 and not held & {(x.prompt, x.answer) for x in (next(stream) for _ in range(2000))}


def test_the_demonstrations_are_right():
    calc_env, guess = CalculatorEnv(), GuessEnv()
    for it in calc_env.eval_items(20):
        ep = Episode(calc_env, it)
        for m in calc_env.demonstration(it):
            if m["role"] == "assistant":
                ep.act(m["content"])
        assert ep.score().metrics["correct"] == 1.0 and ep.turns == 2 and ep.tool_calls == 1
    # The game's warm-up plays by the rules (every guess inside the open range) but not well.
    solved = 0
    for it in guess.eval_items(40):
        ep = Episode(guess, it)
        for m in guess.demonstration(it):
            if m["role"] == "assistant":
                ep.act(m["content"])
        assert ep.score().metrics["valid"] == 1.0
        solved += ep.score().metrics["correct"]
    assert 0.2 < solved / 40 < 0.95


def test_the_tiny_template_renders_turns_and_answers():
    assert TOK.decode(observation_ids(TOK, [{"role": "tool", "content": "42"}])) == "<|im_start|>42<|im_end|>"
    assert TOK.decode(observation_ids(TOK, [{"role": "user", "content": "higher"}])) == "higher="
    env = CalculatorEnv()
    it = env.eval_items(1)[0]
    ids, mask = demonstration_ids(env, TOK, it, MAX_EPISODE)
    assert TOK.decode(prompt_ids(env, TOK, it)) == it.prompt + "="
    text = TOK.decode(ids)
    assert text == f"[calc('{it.prompt}')]<|endoftext|><|im_start|>{it.answer}<|im_end|>{it.answer}<|endoftext|>"
    assert sum(mask) == len(f"[calc('{it.prompt}')]") + 1 + len(it.answer) + 1


def test_nodes_get_no_answer():
    env = make_task("python")
    it = env.eval_items(1)[0]
    got = node_item(env, it)
    assert got.meta == {} and it.answer not in str(got.meta)
    assert node_item(GuessEnv(), GuessEnv().eval_items(1)[0]).meta.keys() == {"lo", "hi", "secret"}


def test_the_python_tool_keeps_outputs_of_programs_that_exit_not_of_those_stopped(monkeypatch):
    import rewards.python_tool as pt
    from rewards.sandbox import Result

    env, runs = make_task("python"), []

    def fake(code, limits):
        runs.append(code)
        return Result("timeout", "", "", 3.0) if "while" in code else Result("ok", "42\n", "", 0.05)

    monkeypatch.setattr(pt, "run_python", fake)
    for code in ("print(42)", "print(42)", "while True: pass", "while True: pass"):
        env.run_tool(ToolCall("python", {"code": code}))
    assert env.run_tool(ToolCall("python", {"code": "print(42)"})) == ("42", True)
    assert runs == ["print(42)", "while True: pass", "while True: pass"]  # a stopped run is never kept


# ---- the replay ------------------------------------------------------------------------------------


def honest(env, item, turns: list[str]) -> P.Episode:
    """An episode whose turns are these texts, as an honest node would send it."""
    te = TokenEpisode(env, item, TOK, MAX_TOKENS, MAX_EPISODE)
    for text in turns:
        ids = TOK(text, add_special_tokens=False)["input_ids"] + [TOK.eos_token_id]
        te.add_turn(ids, [-0.5] * len(ids))
        if te.done:
            break
    return P.Episode(te.ids, te.mask, te.logprobs, te.finish)


def check(env, item, e: P.Episode) -> str | None:
    return replay_episode(env, item, TOK, e, MAX_TOKENS, MAX_EPISODE, len(TOK)).reason


def spans(e: P.Episode) -> list[tuple[int, int, bool]]:
    out, i = [], 0
    while i < len(e.mask):
        j = i
        while j < len(e.mask) and e.mask[j] == e.mask[i]:
            j += 1
        out.append((i, j, e.mask[i]))
        i = j
    return out


def rebuilt(e: P.Episode, ids: list[int], mask: list[bool], finish: str | None = None) -> P.Episode:
    """A tampered episode, with a plausible log-prob for every token it labels sampled."""
    return P.Episode(ids, mask, [-0.5] * sum(mask), finish or e.finish_reason)


@pytest.fixture(scope="module")
def calc_case():
    env = CalculatorEnv()
    it = env.eval_items(1)[0]
    return env, it, honest(env, it, [f"[calc('{it.prompt}')]", it.answer])


def test_honest_episodes_of_every_environment_pass():
    for env in (CalculatorEnv(), GuessEnv(), make_task("python")):
        for it in env.eval_items(4):
            demo = [m["content"] for m in env.demonstration(it) if m["role"] == "assistant"]
            e = honest(env, it, demo)
            r = replay_episode(env, it, TOK, e, MAX_TOKENS, MAX_EPISODE, len(TOK))
            assert r.reason is None and r.turns == len(demo), (env.name, r)


def test_a_forged_observation_is_refused(calc_case):
    env, it, e = calc_case
    start, end, _ = spans(e)[1]
    ids = list(e.token_ids)
    ids[start + 1] = TOK.convert_tokens_to_ids("9") if ids[start + 1] != TOK.convert_tokens_to_ids("9") else ids[start + 2]
    assert check(env, it, rebuilt(e, ids, e.mask)) == "observation_mismatch"


def test_an_edited_tool_result_is_refused():
    """The model called the tool with a wrong expression; the node edits the result to the right answer."""
    env = CalculatorEnv()
    it = env.eval_items(1)[0]
    e = honest(env, it, ["[calc('1+1')]", it.answer])
    (a0, a1, _), (o0, o1, _), (b0, b1, _) = spans(e)
    forged = observation_ids(TOK, [{"role": "tool", "name": "calc", "content": it.answer}])
    ids = e.token_ids[:o0] + forged + e.token_ids[b0:]
    mask = e.mask[:o0] + [False] * len(forged) + e.mask[b0:]
    assert check(env, it, rebuilt(e, ids, mask)) == "observation_mismatch"


def test_a_skipped_tool_call_is_refused(calc_case):
    env, it, e = calc_case
    (a0, a1, _), (o0, o1, _), (b0, b1, _) = spans(e)
    ids, mask = e.token_ids[:o0] + e.token_ids[b0:], e.mask[:o0] + e.mask[b0:]
    assert check(env, it, rebuilt(e, ids, mask)) == "missing_observation"


def test_an_invented_tool_call_is_refused():
    """The model answered at once (no call); the node adds a tool result and a second turn."""
    env = CalculatorEnv()
    it = env.eval_items(1)[0]
    e = honest(env, it, ["12345"])
    obs = observation_ids(TOK, [{"role": "tool", "name": "calc", "content": it.answer}])
    turn = TOK(it.answer, add_special_tokens=False)["input_ids"] + [TOK.eos_token_id]
    ids, mask = e.token_ids + obs + turn, e.mask + [False] * len(obs) + [True] * len(turn)
    assert check(env, it, rebuilt(e, ids, mask)) == "unexpected_observation"


def test_mislabelled_masks_are_refused_both_ways(calc_case):
    env, it, e = calc_case
    (a0, a1, _), (o0, o1, _), (b0, b1, _) = spans(e)
    # The final answer labelled as the environment's (it would escape the audit).
    assert check(env, it, rebuilt(e, e.token_ids, e.mask[:b0] + [False] * (b1 - b0))) == "observation_mismatch"
    # The tool result labelled as sampled.
    assert check(env, it, rebuilt(e, e.token_ids, e.mask[:o0] + [True] * (o1 - o0) + e.mask[o1:])) == "bad_mask"


def test_an_episode_cut_short_but_claimed_complete_is_refused(calc_case):
    env, it, e = calc_case
    (a0, a1, _), (o0, o1, _), _ = spans(e)
    assert check(env, it, rebuilt(e, e.token_ids[:a1], e.mask[:a1], "stop")) == "cut_short"
    assert check(env, it, rebuilt(e, e.token_ids[:o1], e.mask[:o1], "stop")) == "cut_short"
    assert check(env, it, rebuilt(e, e.token_ids[:a1 - 1], e.mask[:a1 - 1], "length")) == "cut_short"


def test_environment_tokens_that_decode_right_but_tokenize_otherwise_are_refused(calc_case):
    """<|im_start|> spelled out byte by byte: the same text, other ids. A check on decoded text (what
    trusting trainers compare, if anything) passes it; the check on ids does not."""
    env, it, e = calc_case
    (a0, a1, _), (o0, o1, _), _ = spans(e)
    start = e.token_ids[o0]
    spelled = TOK("<|im_start|>", add_special_tokens=False, split_special_tokens=True)["input_ids"]
    assert spelled != [start] and TOK.decode(spelled) == TOK.decode([start])
    ids = e.token_ids[:o0] + spelled + e.token_ids[o0 + 1 :]
    mask = e.mask[:o0] + [False] * len(spelled) + e.mask[o0 + 1 :]
    assert TOK.decode(ids) == TOK.decode(e.token_ids)  # a text comparison would accept it
    assert check(env, it, rebuilt(e, ids, mask)) == "observation_mismatch"


def test_a_wrong_finish_or_shape_is_refused(calc_case):
    env, it, e = calc_case
    assert check(env, it, rebuilt(e, e.token_ids, e.mask, "length")) == "bad_finish"
    assert check(env, it, P.Episode(e.token_ids, e.mask, e.logprobs[:-1], e.finish_reason)) == "bad_episode"
    assert check(env, it, P.Episode([len(TOK) + 5] + e.token_ids[1:], e.mask, e.logprobs, "stop")) == "bad_episode"


def test_rewards_come_from_the_replay_and_the_codes_are_fraud(calc_case):
    env, it, e = calc_case
    r = replay_episode(env, it, TOK, e, MAX_TOKENS, MAX_EPISODE, len(TOK))
    assert r.reward == 1.0 and r.correct == 1.0 and r.tool_calls == 1
    wrong = honest(env, it, [f"[calc('{it.prompt}')]", "7"])
    assert replay_episode(env, it, TOK, wrong, MAX_TOKENS, MAX_EPISODE, len(TOK)).correct == 0.0
    assert EPISODE_FRAUD <= FRAUD and not NOT_FRAUD & FRAUD


def test_a_ported_environment_needs_only_the_verifiers_methods():
    """An environment written as for verifiers (tools as functions, a rubric of plain functions) runs here."""
    def reverse(text: str) -> str:
        """Reverse a string."""
        return text[::-1]

    def used_tool(state) -> float:
        return float(state["tool_calls"] > 0)

    class ReverseEnv(ToolEnv):
        def __init__(self):
            super().__init__("reverse", [reverse], Rubric([("used", used_tool, 1.0)]), 3, {}, "hermes")

    env = ReverseEnv()
    item = make_task("calculator").eval_items(1)[0]
    call = format_call("hermes", ToolCall("reverse", {"text": "abc"}))
    ep = Episode(env, item)
    assert ep.act(call) == [{"role": "tool", "name": "reverse", "content": "cba"}]
    assert ep.act("done") is None and ep.score().reward == 1.0
