"""The trainer's policy: load an HF causal LM, score completions, generate greedily, save versions."""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path

import torch

from swarm_common.chat import encode_prompt  # noqa: F401 - re-exported for the trainer's modules
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


@dataclass
class GroupedBatch:
    """Completions that share prompts, laid out so that each prompt is run once for all its samples.

    GRPO samples G completions of every prompt. Running prompt+completion as G separate sequences repeats
    the prompt's computation G times, forward and backward; here the prompt goes through the model once
    (left-padded, so every prompt ends at the same position) and its key/value cache is shared by its
    completions (right-padded). The log-probs are those of the plain layout, for a fraction of the work.
    """

    prompt_ids: torch.Tensor  # [P, Lp] left-padded
    prompt_mask: torch.Tensor  # [P, Lp]
    owner: torch.Tensor  # [N] the prompt row of each completion
    completion_ids: torch.Tensor  # [N, Lc] right-padded
    completion_mask: torch.Tensor  # [N, Lc] float, 1 for real tokens (what attention sees)
    old_logp: torch.Tensor  # [N, Lc] the sampler's log-probs, 0 at padding
    # [N, Lc] float, 1 for the tokens the model sampled: what the loss trains and the audit checks. An
    # episode's environment tokens are real (attended to) but not sampled; elsewhere it is completion_mask.
    loss_mask: torch.Tensor | None = None

    def __post_init__(self):
        if self.loss_mask is None:
            self.loss_mask = self.completion_mask


def pack_groups(
    prompts: list[list[int]], completions: list[list[list[int]]], old_logps: list[list[list[float]]] | None,
    pad_id: int, min_len: int = 0, masks: list[list[list[bool]] | None] | None = None,
) -> GroupedBatch:
    """prompts[i] with its completions[i][j] (and their sampling log-probs old_logps[i][j]), the
    completions padded to at least `min_len` tokens (a sharded learner needs every micro-batch to make
    the same passes through the model: two when a completion is longer than one token). `masks[i][j]`:
    which of an episode's tokens were sampled (None: all of them)."""
    Lp = max(len(p) for p in prompts)
    pids = torch.full((len(prompts), Lp), pad_id, dtype=torch.long)
    pmask = torch.zeros((len(prompts), Lp), dtype=torch.long)
    for i, p in enumerate(prompts):
        pids[i, Lp - len(p) :] = torch.tensor(p, dtype=torch.long)
        pmask[i, Lp - len(p) :] = 1
    flat = [(i, j, c) for i, cs in enumerate(completions) for j, c in enumerate(cs)]
    Lc = max([min_len] + [len(c) for *_, c in flat])
    cids = torch.full((len(flat), Lc), pad_id, dtype=torch.long)
    cmask = torch.zeros((len(flat), Lc))
    old = torch.zeros((len(flat), Lc))
    for k, (i, j, c) in enumerate(flat):
        cids[k, : len(c)] = torch.tensor(c, dtype=torch.long)
        cmask[k, : len(c)] = 1.0
        if old_logps is not None:
            old[k, : len(c)] = torch.tensor(old_logps[i][j], dtype=old.dtype)
    owner = torch.tensor([i for i, *_ in flat], dtype=torch.long)
    loss = None
    if masks is not None and any(m is not None for m in masks):
        loss = cmask.clone()
        for k, (i, j, c) in enumerate(flat):
            if masks[i] is not None:
                loss[k, : len(c)] = torch.tensor(masks[i][j], dtype=loss.dtype)
    return GroupedBatch(pids, pmask, owner, cids, cmask, old, loss)


def completion_logprobs(model, b: GroupedBatch, temperature: float = 1.0) -> torch.Tensor:
    """[N, Lc] log-probs of each completion token under `model` (grad flows when enabled)."""
    return token_logprobs(completion_logits(model, b) / temperature, b.completion_ids.to(_device(model)))


def _device(model) -> torch.device:
    return next(model.parameters()).device


def completion_logits(model, b: GroupedBatch) -> torch.Tensor:
    """[N, Lc, V] fp32 logits predicting each completion token, from one pass over the prompts, whose
    cache the completions share, and one pass over the completions."""
    dev = _device(model)
    pmask = b.prompt_mask.to(dev)
    owner = b.owner.to(dev)
    ppos = (pmask.cumsum(1) - 1).clamp(min=0)
    out = model(input_ids=b.prompt_ids.to(dev), attention_mask=pmask, position_ids=ppos, use_cache=True,
                logits_to_keep=1)
    first = out.logits[:, -1:][owner]  # [N, 1, V]: the last prompt position predicts the first token
    Lc = b.completion_ids.shape[1]
    if Lc > 1:
        cache = out.past_key_values
        cache.reorder_cache(owner)  # index_select: each completion gets its prompt's keys and values
        cids = b.completion_ids[:, :-1].to(dev)
        cpos = pmask.sum(1)[owner, None] + torch.arange(Lc - 1, device=dev)
        attn = torch.cat([pmask[owner], b.completion_mask[:, :-1].to(dev, torch.long)], dim=1)
        rest = model(input_ids=cids, attention_mask=attn, position_ids=cpos, past_key_values=cache,
                     use_cache=False).logits
        logits = torch.cat([first, rest], dim=1)
    else:
        logits = first
    return logits.float()


def tensor_identity(v: torch.Tensor) -> tuple:
    """Equal for two names of one tensor (tied weights), different for a view of part of it."""
    return (v.data_ptr(), tuple(v.shape), v.stride())


def frozen_state(model, dtype: torch.dtype | None = None) -> dict[str, torch.Tensor]:
    """A CPU copy of `model`'s weights that later optimizer steps leave alone, its floating-point tensors
    cast to `dtype` when given (what a version is published as). Tied weights (an LM head that is the
    embedding) stay one tensor, so a version saved from it is laid out as the model's own."""
    copies: dict[tuple, torch.Tensor] = {}
    out = {}
    for k, v in model.state_dict().items():
        key = tensor_identity(v)
        if key not in copies:
            cast = dtype if dtype is not None and v.is_floating_point() else v.dtype
            copies[key] = v.detach().to("cpu", dtype=cast, copy=True)
        out[k] = copies[key]
    return out


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
