"""The trainer's policy: load an HF causal LM, score completions, generate greedily, save versions."""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path

import torch

from swarm.chat import encode_prompt  # noqa: F401 - re-exported for the trainer's modules
from trainer.grpo import token_logprobs


@dataclass
class PackedBatch:
    """Prompt+completion sequences, right-padded, with masks aligned to the predicted tokens."""

    input_ids: torch.Tensor  # [B, L]
    attention_mask: torch.Tensor  # [B, L]
    targets: torch.Tensor  # [B, L-1] = input_ids[:, 1:]
    completion_mask: torch.Tensor  # [B, L-1] 1 where the target is a completion token
    old_logp: torch.Tensor  # [B, L-1] node log-probs at completion positions, 0 elsewhere


def pack(
    prompts: list[list[int]], completions: list[list[int]], old_logps: list[list[float]] | None, pad_id: int
) -> PackedBatch:
    lengths = [len(p) + len(c) for p, c in zip(prompts, completions, strict=True)]
    B, L = len(prompts), max(lengths)
    ids = torch.full((B, L), pad_id, dtype=torch.long)
    attn = torch.zeros((B, L), dtype=torch.long)
    cmask = torch.zeros((B, L - 1))
    old = torch.zeros((B, L - 1))
    for i, (p, c) in enumerate(zip(prompts, completions, strict=True)):
        n = len(p) + len(c)
        ids[i, :n] = torch.tensor(p + c, dtype=torch.long)
        attn[i, :n] = 1
        # Target position t predicts token t+1: completion token j sits at len(p)+j, predicted at len(p)+j-1.
        cmask[i, len(p) - 1 : n - 1] = 1.0
        if old_logps is not None:
            old[i, len(p) - 1 : n - 1] = torch.tensor(old_logps[i], dtype=old.dtype)
    return PackedBatch(ids, attn, ids[:, 1:], cmask, old)


def load_model(path: str | Path, dtype: torch.dtype = torch.float32, device: str = "cpu"):
    from transformers import AutoModelForCausalLM

    model = AutoModelForCausalLM.from_pretrained(str(path), dtype=dtype)
    return model.to(device)


def load_tokenizer(path: str | Path):
    from transformers import AutoTokenizer

    return AutoTokenizer.from_pretrained(str(path))


def sequence_logprobs(model, batch: PackedBatch) -> torch.Tensor:
    """[B, L-1] log-probs of each next token under `model` (grad flows when enabled)."""
    dev = next(model.parameters()).device
    out = model(input_ids=batch.input_ids.to(dev), attention_mask=batch.attention_mask.to(dev))
    logits = out.logits[:, :-1].float()
    return token_logprobs(logits, batch.targets.to(dev))


@torch.no_grad()
def greedy_complete(model, tokenizer, prompt_ids: list[list[int]], max_new_tokens: int) -> list[list[int]]:
    """Greedy completions (token ids, without the EOS), batched with left padding."""
    dev = next(model.parameters()).device
    pad = tokenizer.pad_token_id
    L = max(len(p) for p in prompt_ids)
    ids = torch.full((len(prompt_ids), L), pad, dtype=torch.long)
    attn = torch.zeros_like(ids)
    for i, p in enumerate(prompt_ids):
        ids[i, L - len(p) :] = torch.tensor(p)
        attn[i, L - len(p) :] = 1
    out = model.generate(
        input_ids=ids.to(dev),
        attention_mask=attn.to(dev),
        max_new_tokens=max_new_tokens,
        do_sample=False,
        eos_token_id=tokenizer.eos_token_id,
        pad_token_id=pad,
    )
    result = []
    for row in out[:, L:].tolist():
        if tokenizer.eos_token_id in row:
            row = row[: row.index(tokenizer.eos_token_id)]
        result.append(row)
    return result
