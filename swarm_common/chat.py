"""Prompts as token ids: the model's own chat template, shared by the trainer and the nodes."""

from __future__ import annotations


def encode_prompt(tokenizer, text: str, system: str | None = None) -> list[int]:
    """Token ids of a user prompt with the model's chat template and the generation prompt applied."""
    messages = ([{"role": "system", "content": system}] if system else []) + [{"role": "user", "content": text}]
    if tokenizer.chat_template:
        ids = tokenizer.apply_chat_template(messages, add_generation_prompt=True, tokenize=True)
        if isinstance(ids, dict) or hasattr(ids, "keys"):
            ids = ids["input_ids"]
        return list(ids)
    return tokenizer(text)["input_ids"]
