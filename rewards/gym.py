"""Tasks from `reasoning-gym` (an optional extra: `pip install '.[gym]'`), behind the same Task interface.

Any of its procedural datasets can be used (`task.name = "gym:chain_sum"`, or `"gym"` with
`params.dataset`), plus a few presets (`gym:single_digit` = one-digit a+b / a-b). The dataset's own
`score_answer` is the verifier; we only decide which part of the completion is the answer:

- `answer_format = "tags"`: reasoning-gym's convention, the last `<answer>...</answer>` (its own
  `extract_answer`), with its "direct" system prompt asking for exactly that;
- `"last_number"`: the last number in the completion (numeric datasets, small models);
- `"raw"`: the whole completion, stripped.

Items are regenerated from (dataset, seed, index) on every scoring, so an item that crossed processes or
a checkpoint as a plain TaskItem is scored against exactly the entry it was made from. The held-out
split is by a hash of the question text, as for the built-in tasks, so evaluation questions never appear
in training. reasoning_gym is imported lazily: the core install does not need it.
"""

from __future__ import annotations

import hashlib
import re
from collections import OrderedDict
from collections.abc import Iterator
from typing import Any

from rewards.base import Rubric, Task, TaskItem

# Named configurations of reasoning-gym datasets: name -> (dataset, config, default eval_share).
PRESETS: dict[str, tuple[str, dict[str, Any], float]] = {
    # "Calculate a + b." with one-digit operands: where a 135M model has a reward signal to learn from.
    # Only ~250 distinct questions: hold out 30% so evaluation has ~75 of them.
    "single_digit": ("basic_arithmetic", {"min_terms": 2, "max_terms": 2, "min_digits": 1, "max_digits": 1,
                                          "operators": ["+", "-"], "allow_parentheses": False,
                                          "allow_negation": False}, 0.3),
    "chain_sum": ("chain_sum", {"min_terms": 2, "max_terms": 3, "min_digits": 1, "max_digits": 1}, 0.1),
    "countdown": ("countdown", {"min_numbers": 3, "max_numbers": 4, "min_target": 10, "max_target": 100}, 0.1),
    "gsm_symbolic": ("gsm_symbolic", {}, 0.1),
}
FORMATS = ("tags", "last_number", "raw")
_NUMBER = re.compile(r"-?\d+(?:\.\d+)?")
_CHUNK = 1000  # items per reasoning-gym dataset object (gsm_symbolic precomputes per-item state)


def _reasoning_gym():
    try:
        import reasoning_gym
    except ImportError as e:
        raise ImportError("gym tasks need reasoning-gym: pip install 'rollout-swarm[gym]' "
                          "(or reasoning-gym==0.1.25)") from e
    return reasoning_gym


def _h(text: str) -> int:
    return int.from_bytes(hashlib.sha256(text.encode()).digest()[:8], "big")


def _is_eval(question: str, eval_share: float) -> bool:
    return _h(question) / 2**64 < eval_share


def extract(completion: str, answer_format: str) -> str | None:
    """The part of a completion that is handed to the dataset's scorer as the answer."""
    if answer_format == "tags":
        from reasoning_gym.utils import extract_answer

        return extract_answer(completion)
    if answer_format == "last_number":
        found = _NUMBER.findall(completion)
        return found[-1] if found else None
    text = completion.strip()
    return text or None


class GymTask(Task):
    def __init__(
        self,
        dataset: str = "chain_sum",
        config: dict[str, Any] | None = None,
        answer_format: str = "tags",
        system_prompt: str | None = "direct",
        eval_share: float | None = None,
        score_weight: float = 1.0,
        format_weight: float = 0.1,
        prompt_suffix: str = "",
    ):
        """`dataset`: a reasoning-gym dataset name or a PRESETS key; `config` overrides its settings.
        `system_prompt`: a key of reasoning_gym.utils.SYSTEM_PROMPTS, literal text, or None/"" (none: the
        chat template's own default, if it has one).
        `eval_share`: the share of the question space held out (default: the preset's, else 0.1)."""
        rg = _reasoning_gym()
        share = 0.1
        if dataset in PRESETS:
            name, preset, share = PRESETS[dataset]
            config = {**preset, **(config or {})}
        else:
            name, config = dataset, dict(config or {})
        eval_share = share if eval_share is None else eval_share
        if name not in rg.factory.DATASETS:
            raise ValueError(f"reasoning-gym has no dataset {name!r}")
        if answer_format not in FORMATS:
            raise ValueError(f"answer_format must be one of {FORMATS}, not {answer_format!r}")
        if not 0.0 < eval_share < 1.0:
            raise ValueError("eval_share must be in (0, 1)")
        for k in ("seed", "size"):
            if k in config:
                raise ValueError(f"gym config: {k!r} is set by the task (seeded splits), not in config")
        from reasoning_gym.utils import SYSTEM_PROMPTS

        if system_prompt in SYSTEM_PROMPTS:
            system_prompt = SYSTEM_PROMPTS[system_prompt]
        system_prompt = system_prompt or None  # TOML has no null: "" means none
        super().__init__(
            name=f"gym:{dataset}",
            rubric=Rubric([
                ("score", self._score, score_weight),  # the dataset's own verifier (may give partial credit)
                ("format", self._format, format_weight),  # an answer could be found in the completion
                ("correct", self._correct, 0.0),  # full marks from the verifier: the accuracy metric
            ]),
            system_prompt=system_prompt,
            correct_metric="correct",
            params={"dataset": dataset, "config": config, "answer_format": answer_format, "eval_share": eval_share},
        )
        self.dataset_name, self.config = name, config
        self.answer_format, self.eval_share, self.prompt_suffix = answer_format, eval_share, prompt_suffix
        self._datasets: OrderedDict[int, Any] = OrderedDict()
        self._create_dataset = rg.create_dataset
        self._dataset(0)  # fail now on a bad config, not at the first scoring

    # Global item i of a stream with base seed B is index i % C of the dataset seeded B + (i // C) * C:
    # reasoning-gym seeds item idx with Random(seed + idx), so every i maps to its own seed B + i.
    def _dataset(self, chunk_seed: int):
        ds = self._datasets.get(chunk_seed)
        if ds is None:
            ds = self._create_dataset(self.dataset_name, **self.config, seed=chunk_seed, size=_CHUNK)
            self._datasets[chunk_seed] = ds
            if len(self._datasets) > 8:
                self._datasets.popitem(last=False)
        else:
            self._datasets.move_to_end(chunk_seed)
        return ds

    def _base(self, split: str) -> int:
        # Splits live 2**32 seeds apart, so the train stream of any seed never replays the eval stream.
        return (_h(f"gym|{self.dataset_name}|{split}") % 2**20) * 2**32

    def _entry_at(self, base: int, i: int) -> tuple[dict, int, int]:
        chunk_seed = base + (i // _CHUNK) * _CHUNK
        ds = self._dataset(chunk_seed)
        return ds[i % _CHUNK], chunk_seed, i % _CHUNK

    def _item(self, entry: dict, chunk_seed: int, idx: int, item_id: str) -> TaskItem:
        prompt = entry["question"] + self.prompt_suffix
        return TaskItem(id=item_id, prompt=prompt, answer=str(entry["answer"]),
                        meta={"dataset": self.dataset_name, "seed": str(chunk_seed), "index": str(idx)})

    def entry(self, item: TaskItem) -> dict:
        """The reasoning-gym entry an item was made from (regenerated: deterministic in seed and index)."""
        if item.meta.get("dataset") != self.dataset_name:
            raise ValueError(f"item {item.id} is not from {self.dataset_name}")
        return self._dataset(int(item.meta["seed"]))[int(item.meta["index"])]

    def train_items(self, seed: int, start: int = 0) -> Iterator[TaskItem]:
        base = self._base(f"train-{seed}")
        i = n = 0
        while True:
            entry, chunk_seed, idx = self._entry_at(base, i)
            i += 1
            if _is_eval(entry["question"], self.eval_share):
                continue
            if n >= start:
                yield self._item(entry, chunk_seed, idx, f"train-{seed}-{n}")
            n += 1

    def eval_items(self, n: int) -> list[TaskItem]:
        base = self._base("eval")
        out: list[TaskItem] = []
        seen: set[str] = set()
        for i in range(1000 * n):
            if len(out) == n:
                break
            entry, chunk_seed, idx = self._entry_at(base, i)
            q = entry["question"]
            if q in seen or not _is_eval(q, self.eval_share):
                continue
            seen.add(q)
            out.append(self._item(entry, chunk_seed, idx, f"eval-{len(out)}"))
        return out

    def _raw_score(self, item: TaskItem, completion: str) -> float:
        answer = extract(completion, self.answer_format)
        entry = self.entry(item)
        try:
            s = float(self._dataset(int(item.meta["seed"])).score_answer(answer, entry))
        except Exception:  # a verifier choking on garbage is a wrong answer, not a crash of the trainer
            return 0.0
        return min(1.0, max(0.0, s))

    def _score(self, item: TaskItem, completion: str) -> float:
        return self._raw_score(item, completion)

    def _correct(self, item: TaskItem, completion: str) -> float:
        return 1.0 if self._raw_score(item, completion) >= 1.0 else 0.0

    def _format(self, item: TaskItem, completion: str) -> float:
        return 0.0 if extract(completion, self.answer_format) is None else 1.0
