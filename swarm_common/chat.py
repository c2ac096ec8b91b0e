"""Prompts and observations as token ids: the model's own chat template, shared by the trainer and the nodes.

An episode's tokens are never re-tokenized from text: the prompt's ids, then each turn's sampled ids as the
engine produced them, then the ids of the environment's answer, and so on. Chat templates are not
append-only (a template may render earlier turns differently once later ones exist), so the ids of an
environment's answer are not "template of everything minus template of the past": they are the ids the
template gives the answer after a fixed stand-in conversation, cut right after the stand-in's assistant
stop token (`observation_ids`). Node and trainer compute them with the same function, so the trainer can
require them to match exactly.
"""

from __future__ import annotations

from functools import lru_cache

# The stand-in conversation an environment's answer is rendered after: what precedes it never changes.
_STAND_IN = ({"role": "user", "content": "x"}, {"role": "assistant", "content": "y"})


def _ids(out) -> list[int]:
    if isinstance(out, dict) or hasattr(out, "keys"):
        out = out["input_ids"]
    return list(out)


def encode_messages(tokenizer, messages: list[dict], tools: list[dict] | None = None,
                    add_generation_prompt: bool = True) -> list[int]:
    """Token ids of a conversation with the model's chat template (and the generation prompt)."""
    if not tokenizer.chat_template:
        return tokenizer("".join(m["content"] for m in messages))["input_ids"]
    return _ids(tokenizer.apply_chat_template(messages, tools=tools, add_generation_prompt=add_generation_prompt,
                                              tokenize=True))


def encode_prompt(tokenizer, text: str, system: str | None = None) -> list[int]:
    """Token ids of a user prompt with the model's chat template and the generation prompt applied."""
    messages = ([{"role": "system", "content": system}] if system else []) + [{"role": "user", "content": text}]
    return encode_messages(tokenizer, messages)


class TemplateError(ValueError):
    """The chat template cannot render environment answers after a turn (no turn-ending stop token)."""


@lru_cache(maxsize=8)
def _stand_in(tokenizer) -> tuple[list[int], int]:
    base = encode_messages(tokenizer, list(_STAND_IN), add_generation_prompt=False)
    stop = stop_token_id(tokenizer)
    if stop not in base:
        raise TemplateError("the chat template does not end an assistant turn with the stop token "
                            f"({tokenizer.convert_ids_to_tokens(stop)!r}): multi-turn episodes need one")
    cut = len(base) - base[::-1].index(stop)
    return base, cut


def stop_token_id(tokenizer) -> int:
    """The token that ends an assistant turn (the engine stops sampling there)."""
    return tokenizer.eos_token_id


def observation_ids(tokenizer, reply: list[dict]) -> list[int]:
    """The ids the environment's `reply` messages add after an assistant turn's stop token, up to and
    including the generation prompt of the next assistant turn."""
    key = tuple(tuple(sorted((k, str(v)) for k, v in m.items())) for m in reply)
    return list(_observation_ids(tokenizer, key))


@lru_cache(maxsize=4096)  # answers repeat (a game's "higher"): rendering a template is most of a replay's cost
def _observation_ids(tokenizer, key: tuple) -> tuple[int, ...]:
    reply = [dict(m) for m in key]
    base, cut = _stand_in(tokenizer)
    full = encode_messages(tokenizer, [*_STAND_IN, *reply], add_generation_prompt=True)
    if full[:cut] != base[:cut]:
        raise TemplateError("the chat template renders the conversation before an environment answer "
                            "differently once the answer is there")
    return tuple(full[cut:])
