"""An episode kept as token ids: the rules by which sampled turns and the environment's answers join.

The node drives a `TokenEpisode` with its engine's output; the trainer drives another with the node's
claimed turns and checks each environment answer against its own. Both follow these rules, written once:

- The tokens after the prompt alternate: a turn the model sampled (mask True), then the environment's
  answer (mask False), and so on. A turn ends at the model's stop token (included, and sampled), or when
  it runs out of tokens.
- A turn's text, for the environment, is its ids without the stop token, decoded skipping special tokens.
- The environment's answer is `observation_ids` of its reply messages (swarm_common/chat.py): the ids
  after a turn's stop token up to the next turn's generation prompt. Never a re-tokenization.
- A turn may sample at most `min(max_tokens, max_episode_tokens - tokens so far)` tokens. A turn that
  hits that without its stop token ends the episode ("length"); so does an answer that would leave no
  room for another token ("length", without the answer). The environment ending it (`is_completed`, or
  `max_turns` turns) is "stop".
"""

from __future__ import annotations

from dataclasses import dataclass, field

from rewards.base import Score, TaskItem
from rewards.environment import Environment, Episode
from swarm_common import protocol as P
from swarm_common.chat import encode_messages, encode_prompt, observation_ids, stop_token_id


@dataclass
class TokenEpisode:
    env: Environment
    item: TaskItem
    tokenizer: object
    max_tokens: int  # per turn
    max_episode_tokens: int  # after the prompt, sampled and environment's together
    ids: list[int] = field(default_factory=list)
    mask: list[bool] = field(default_factory=list)
    logprobs: list[float] = field(default_factory=list)
    finish: str | None = None  # "stop" or "length" once the episode is over
    last_answer: list[int] = field(default_factory=list)  # the environment's ids after the newest turn

    def __post_init__(self):
        self.episode = Episode(self.env, self.item)
        self.stop_id = stop_token_id(self.tokenizer)

    @property
    def done(self) -> bool:
        return self.finish is not None

    def turn_budget(self) -> int:
        """The most tokens the next turn may sample."""
        return min(self.max_tokens, self.max_episode_tokens - len(self.ids))

    def add_turn(self, turn: list[int], logprobs: list[float]) -> list[int]:
        """The model's next turn, as sampled (ending with the stop token unless it ran out of tokens); returns
        the environment's answer ids appended after it (empty when the episode is over)."""
        if self.done:
            raise RuntimeError("the episode is over")
        budget = self.turn_budget()
        if not turn or len(turn) > budget or len(logprobs) != len(turn):
            raise ValueError("a turn of 1..turn_budget() tokens with one log-prob each")
        stopped = turn[-1] == self.stop_id
        if self.stop_id in turn[:-1]:
            raise ValueError("a turn has its stop token only at its end")
        self.ids += turn
        self.mask += [True] * len(turn)
        self.logprobs += logprobs
        self.last_answer = []
        if not stopped:
            if len(turn) != budget:  # it had tokens left: not a length stop
                raise ValueError("a turn without its stop token must use every token it may")
            self.episode.cut(self.tokenizer.decode(turn, skip_special_tokens=True))
            self.finish = "length"
            return []
        text = self.tokenizer.decode(turn[:-1], skip_special_tokens=True)
        reply = self.episode.act(text)
        if reply is None:
            self.finish = "stop"
            return []
        answer = observation_ids(self.tokenizer, reply)
        if len(self.ids) + len(answer) >= self.max_episode_tokens:
            self.finish = "length"  # no room for the answer and another turn
            return []
        self.ids += answer
        self.mask += [False] * len(answer)
        self.last_answer = answer
        return answer

    def play(self, texts: list[str], logprob: float) -> P.Episode:
        """The episode whose turns are these texts, each ended by the stop token and each token given
        `logprob` (worked episodes, for benchmarks and tests); it stops where the environment ends it."""
        for text in texts:
            ids = self.tokenizer(text, add_special_tokens=False)["input_ids"] + [self.stop_id]
            self.add_turn(ids, [logprob] * len(ids))
            if self.done:
                break
        return P.Episode(self.ids, self.mask, self.logprobs, self.finish)

    def score(self) -> Score:
        return self.episode.score()

    @property
    def turns(self) -> int:
        return self.episode.turns


def prompt_ids(task, tokenizer, item: TaskItem) -> list[int]:
    """An item's prompt as token ids: an environment's prompt messages (with its tools, for templates that
    render them), or a single-turn task's user prompt under its system prompt."""
    if isinstance(task, Environment):
        return encode_messages(tokenizer, task.prompt(item), tools=task.tool_schemas())
    return encode_prompt(tokenizer, item.prompt, task.system_prompt)


def node_item(env: Environment, item: TaskItem) -> P.EpisodeItem:
    """What a node gets of an item to run its episodes: the prompt and the meta the environment uses."""
    keep = env.node_meta
    return P.EpisodeItem(item.id, item.prompt, {k: v for k, v in item.meta.items() if keep is None or k in keep})


def env_spec(env: Environment, max_episode_tokens: int) -> P.EnvSpec:
    return P.EnvSpec(env.name, dict(env.params), max_episode_tokens)


def handout(task, max_episode_tokens: int):
    """For work hand-outs: (the EnvSpec nodes build the environment from, item -> what a node gets of it);
    (None, None) for a single-turn task."""
    if not isinstance(task, Environment):
        return None, None
    return env_spec(task, max_episode_tokens), lambda item: node_item(task, item)


def demonstration_ids(env: Environment, tokenizer, item: TaskItem, max_episode_tokens: int) -> tuple[list[int], list[bool]]:
    """A worked episode (`env.demonstration`) as the tokens after the prompt and the mask of the model's
    own: the assistant turns tokenized as text plus the stop token, the environment's answers as the
    environment itself gives them in an episode. What the supervised warm-up trains on."""
    te = TokenEpisode(env, item, tokenizer, max_episode_tokens, max_episode_tokens)
    for m in env.demonstration(item):
        if m["role"] != "assistant" or te.done:
            continue
        turn = tokenizer(m["content"], add_special_tokens=False)["input_ids"][: te.turn_budget() - 1] + [te.stop_id]
        te.add_turn(turn, [0.0] * len(turn))
    return te.ids, te.mask
