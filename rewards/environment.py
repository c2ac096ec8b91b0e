"""Environments: tasks whose episodes have turns. Named as verifiers names them, so its environments port.

An episode starts from a task item's prompt; the model acts (an assistant message), the environment
answers (`env_response`: tool results, game feedback, a user's reply), until `is_completed` says so or
`max_turns` assistant turns are spent. A `Rubric` of plain reward functions scores the whole trajectory.

Deterministic by contract: `setup_state(item)` depends only on the item, and `env_response(messages,
state)` only on the item and the messages so far, so the next observation is a pure function of the
item and the model's actions. That is what lets the trainer replay an untrusted node's episode and
require the same observations, token for token (trainer/episode_check.py). An environment that cannot
promise it (an external service, a clock) sets `replayable = False` and is only handed to trusted nodes.
The environment sees the item's prompt and meta, never its answer (nodes run environments, and the
answer is for the rubric, which only the trainer runs).

The loop, the same on the node and in the trainer's replay (`Episode.act`), as verifiers runs it:

    messages = env.prompt(item); state = env.setup_state(item)
    repeat: model writes turn -> turns += 1 -> stop if is_completed(messages, state) or turns == max_turns
            -> reply, state = env_response(messages, state) -> messages += reply
"""

from __future__ import annotations

import functools
import inspect
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from typing import Any

from rewards.base import Rubric as AnswerRubric
from rewards.base import Score, Task, TaskItem
from rewards.tools import MAX_CALLS_PER_TURN, Tool, ToolCall, check_arguments, format_call, parse_calls, tool

Message = dict[str, Any]  # {"role": "system" | "user" | "assistant" | "tool", "content": str, ...}
State = dict[str, Any]
MAX_TOOL_RESULT = 512  # characters of a tool's result that reach the model


def assistant_texts(messages: Sequence[Message]) -> list[str]:
    return [m["content"] for m in messages if m["role"] == "assistant"]


_KWARGS = ("item", "answer", "completion", "messages", "state", "text")


@functools.lru_cache(maxsize=1024)
def _wanted(fn: Callable[..., float]) -> tuple[str, ...]:
    """The rubric's keyword arguments a reward function takes (read once: inspect is slow)."""
    return tuple(p for p in inspect.signature(fn).parameters if p in _KWARGS)


@dataclass(frozen=True)
class Rubric:
    """A weighted list of reward functions over a whole episode (verifiers' Rubric).

    Each function takes any of these keyword arguments and returns a score in [0, 1]: `item` (the
    TaskItem), `answer` (its reference answer), `messages` (the whole conversation), `completion`
    (the messages after the prompt), `state` (the environment's state at the end), `text` (the last
    assistant message)."""

    funcs: Sequence[tuple[str, Callable[..., float], float]]

    def score(self, item: TaskItem, messages: list[Message], state: State, prompt_len: int) -> Score:
        last = assistant_texts(messages)
        kw = {"item": item, "answer": item.answer, "messages": messages, "completion": messages[prompt_len:],
              "state": state, "text": last[-1] if last else ""}
        metrics: dict[str, float] = {}
        total = weight = 0.0
        for name, fn, w in self.funcs:
            s = float(fn(**{k: kw[k] for k in _wanted(fn)}))
            if not 0.0 <= s <= 1.0:
                raise ValueError(f"reward {name} returned {s}, outside [0, 1]")
            metrics[name] = s
            total += w * s
            weight += w
        return Score(reward=total / weight if weight else 0.0, metrics=metrics)


class Environment(Task):
    """A task with turns. Subclasses set `rubric` (an episode Rubric) and implement `is_completed` and
    `env_response`; the item stream and held-out split are the Task's (`train_items`, `eval_items`)."""

    max_turns: int = 4
    replayable: bool = True
    node_meta: tuple[str, ...] | None = None  # the item's meta keys nodes get (None: all of them)

    def __init__(self, name: str, rubric: Rubric, max_turns: int, params: dict, system_prompt: str | None = None,
                 correct_metric: str = "correct"):
        # The Task's single-turn rubric is not used: episodes are scored by `rubric` over the trajectory.
        super().__init__(name=name, rubric=AnswerRubric([]), system_prompt=system_prompt,
                         correct_metric=correct_metric, params=params)
        self.episode_rubric, self.max_turns = rubric, max_turns

    # ---- what a port from verifiers overrides ------------------------------------------------------

    def prompt(self, item: TaskItem) -> list[Message]:
        return ([{"role": "system", "content": self.system_prompt}] if self.system_prompt else []) + [
            {"role": "user", "content": item.prompt}]

    def setup_state(self, item: TaskItem) -> State:
        return {}

    def is_completed(self, messages: list[Message], state: State) -> bool:
        raise NotImplementedError

    def env_response(self, messages: list[Message], state: State) -> tuple[list[Message], State]:
        raise NotImplementedError

    def demonstration(self, item: TaskItem) -> list[Message]:
        """A worked episode for the supervised warm-up: the assistant turns and the environment's
        answers after the prompt. Environments without one get no warm-up."""
        raise NotImplementedError(f"{self.name} has no demonstration for the warm-up")

    def tool_schemas(self) -> list[dict] | None:
        """The tools' schemas, for chat templates that render them (None: no tools)."""
        return None

    # ---- scoring ----------------------------------------------------------------------------------

    def score_episode(self, item: TaskItem, messages: list[Message], state: State) -> Score:
        return self.episode_rubric.score(item, messages, state, len(self.prompt(item)))

    def score(self, item: TaskItem, completion: str) -> Score:
        """A single completion as a one-turn episode (what a single-turn caller of a Task gets)."""
        ep = Episode(self, item)
        ep.act(completion)
        return ep.score()


class ToolEnv(Environment):
    """Tools as plain functions; the model calls them in `tool_format` (rewards/tools.py); each call's
    result comes back as a `tool` message. The episode is over when a turn calls no tool.

    Counts kept in the state for the operator's views: `tool_calls` and `tool_errors` (a call that did not
    fit a tool, or whose tool raised: the model sees "error: ...")."""

    def __init__(self, name: str, tools: Sequence[Callable[..., Any]], rubric: Rubric, max_turns: int,
                 params: dict, tool_format: str = "hermes", system_prompt: str | None = None):
        super().__init__(name, rubric, max_turns, params, system_prompt)
        self.tools: dict[str, Tool] = {t.name: t for t in map(tool, tools)}
        self.tool_format = tool_format
        parse_calls(tool_format, "", self.tools)  # an unknown format fails here

    def setup_state(self, item: TaskItem) -> State:
        return {"tool_calls": 0, "tool_errors": 0}

    def calls(self, text: str) -> list[ToolCall]:
        return parse_calls(self.tool_format, text, self.tools)

    def is_completed(self, messages: list[Message], state: State) -> bool:
        return not self.calls(messages[-1]["content"])

    def env_response(self, messages: list[Message], state: State) -> tuple[list[Message], State]:
        out = []
        for i, call in enumerate(self.calls(messages[-1]["content"])):
            result, ok = self.run_tool(call) if i < MAX_CALLS_PER_TURN else ("error: too many calls in one turn", False)
            state["tool_calls"] += 1
            state["tool_errors"] += not ok
            out.append({"role": "tool", "name": call.name, "content": result[:MAX_TOOL_RESULT]})
        return out, state

    def run_tool(self, call: ToolCall) -> tuple[str, bool]:
        """(the result as the model sees it, whether the call worked). Deterministic: an error is text."""
        t = self.tools.get(call.name)
        if t is None:
            return f"error: no tool named {call.name}", False
        why = check_arguments(t, call.arguments)
        if why:
            return f"error: {why}", False
        try:
            return str(t.fn(**call.arguments)), True
        except Exception as e:  # the model's bad input, not ours: it sees the exception's type and text
            return f"error: {type(e).__name__}: {e}"[:MAX_TOOL_RESULT], False

    def tool_schemas(self) -> list[dict]:
        return [t.schema for t in self.tools.values()]

    def write_call(self, name: str, positional: bool = False, **arguments) -> str:
        return format_call(self.tool_format, ToolCall(name, arguments), positional)


@dataclass
class Episode:
    """One episode in memory: the conversation, the environment's state and the turn count. The node runs
    it beside its engine; the trainer runs it again from the decoded actions to check what the node sent."""

    env: Environment
    item: TaskItem
    messages: list[Message] = field(init=False)
    state: State = field(init=False)
    turns: int = 0
    done: bool = False

    def __post_init__(self):
        self.messages = self.env.prompt(self.item)
        self.state = self.env.setup_state(self.item)

    def act(self, text: str) -> list[Message] | None:
        """The model's turn; the environment's answer, or None when the episode is over."""
        if self.done:
            raise RuntimeError("the episode is over")
        self.messages.append({"role": "assistant", "content": text})
        self.turns += 1
        if self.env.is_completed(self.messages, self.state) or self.turns >= self.env.max_turns:
            self.done = True
            return None
        reply, self.state = self.env.env_response(self.messages, self.state)
        self.messages.extend(reply)
        return reply

    def cut(self, text: str) -> None:
        """The model's last turn, cut off by the token budget: it counts and is scored, nothing answers it."""
        self.messages.append({"role": "assistant", "content": text})
        self.turns += 1
        self.done = True

    def score(self) -> Score:
        return self.env.score_episode(self.item, self.messages, self.state)

    @property
    def tool_calls(self) -> int:
        return int(self.state.get("tool_calls", 0))

    @property
    def tool_errors(self) -> int:
        return int(self.state.get("tool_errors", 0))
