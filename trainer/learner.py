"""The learner: one GRPO optimizer step on a batch of accepted groups, and greedy evaluation."""

from __future__ import annotations

import copy

import torch

from rewards.base import Task, TaskItem
from trainer.config import RunConfig
from trainer.grpo import LossConfig, group_advantages, grpo_loss, has_signal
from trainer.intake import Group
from trainer.policy import completion_logprobs, encode_prompt, greedy_complete, pack_groups


def make_adamw(model, lr: float, weight_decay: float) -> torch.optim.AdamW:
    """AdamW with torch's fused kernel (one pass over each tensor) where the parameters allow it: measured
    on SmolLM2-135M on 2 CPU cores, 0.05 s a step against 0.5-1 s for the default per-tensor loop. It is
    also what transformers' Trainer uses by default (adamw_torch_fused)."""
    try:
        return torch.optim.AdamW(model.parameters(), lr=lr, weight_decay=weight_decay, fused=True)
    except RuntimeError:  # a device or dtype the fused kernel does not support
        return torch.optim.AdamW(model.parameters(), lr=lr, weight_decay=weight_decay)


def make_learner(cfg: RunConfig, model, tok) -> Learner:
    t = cfg.train
    return Learner(model, tok, t.lr, t.weight_decay, t.grad_clip, cfg.loss, temperature=t.temperature,
                   scale_adv_by_std=t.scale_adv_by_std)


class Learner:
    def __init__(self, model, tokenizer, lr: float, weight_decay: float, grad_clip: float, loss: LossConfig,
                 temperature: float = 1.0, scale_adv_by_std: bool = False, micro_batch: int = 256):
        self.model, self.tok = model, tokenizer
        self.opt = make_adamw(model, lr, weight_decay)
        self.grad_clip, self.loss_cfg = grad_clip, loss
        self.temperature, self.scale_adv_by_std = temperature, scale_adv_by_std
        self.micro_batch = micro_batch
        self.ref = None
        if loss.kl_beta > 0:  # a frozen copy of the starting policy
            self.ref = copy.deepcopy(model).eval().requires_grad_(False)

    def step(self, groups: list[Group]) -> dict[str, float]:
        """One optimizer step. Groups whose advantages are all zero carry no signal and are skipped."""
        rewards = torch.tensor([g.rewards for g in groups], dtype=torch.float32)
        adv = group_advantages(rewards, self.scale_adv_by_std)
        keep = [i for i in range(len(groups)) if has_signal(groups[i].rewards)]
        stats = {"zero_adv_groups": float(len(groups) - len(keep)), "groups": float(len(groups))}
        if not keep:
            return stats
        self.model.train()
        self.opt.zero_grad(set_to_none=True)
        # The loss is normalised by every completion token of the batch, flat groups' included (they add
        # nothing to the sum): DAPO's token-level normalisation, as TRL's loss_type="dapo" computes it.
        # Measured: 4 steps of TRL 1.16's GRPOTrainer and 4 of ours on its exact samples, total update
        # cosine 0.9999999 (0.999 when dividing by the kept groups' tokens only).
        total_tokens = float(sum(len(s.token_ids) for g in groups for s in g.samples))
        kept_tokens = float(sum(len(s.token_ids) for i in keep for s in groups[i].samples))
        agg: dict[str, float] = {}
        # Micro-batches of whole groups (a group's samples share its prompt's forward pass).
        per_mb = max(1, self.micro_batch // max(len(groups[i].samples) for i in keep))
        for lo in range(0, len(keep), per_mb):
            idx = keep[lo : lo + per_mb]
            b = pack_groups([groups[i].prompt_ids for i in idx],
                            [[s.token_ids for s in groups[i].samples] for i in idx],
                            [[s.logprobs for s in groups[i].samples] for i in idx], self.tok.pad_token_id)
            advs = torch.tensor([float(adv[i, j]) for i in idx for j in range(len(groups[i].samples))])
            logp = completion_logprobs(self.model, b, self.temperature)
            ref = None
            if self.ref is not None:
                with torch.no_grad():
                    ref = completion_logprobs(self.ref, b, self.temperature)
            loss, st = grpo_loss(logp, b.old_logp, advs, b.completion_mask, self.loss_cfg, ref)
            # grpo_loss normalises by this micro-batch's tokens; rescale to the whole batch's count.
            (loss * (st["tokens"] / total_tokens)).backward()
            for k, v in st.items():  # diagnostics: means over the trained tokens
                agg[k] = agg.get(k, 0.0) + v * st["tokens"] / kept_tokens
        grad_norm = torch.nn.utils.clip_grad_norm_(self.model.parameters(), self.grad_clip)
        self.opt.step()
        self.model.eval()
        agg.pop("tokens", None)
        return {**stats, **agg, "grad_norm": float(grad_norm), "tokens": kept_tokens}


@torch.no_grad()
def evaluate(model, tokenizer, task: Task, items: list[TaskItem], max_tokens: int, batch: int = 128) -> dict[str, float]:
    """Greedy accuracy and mean reward on a fixed held-out set."""
    model.eval()
    correct = reward = 0.0
    for lo in range(0, len(items), batch):
        chunk = items[lo : lo + batch]
        ids = [encode_prompt(tokenizer, it.prompt, task.system_prompt) for it in chunk]
        outs = greedy_complete(model, tokenizer, ids, max_tokens)
        for it, out in zip(chunk, outs, strict=True):
            s = task.score(it, tokenizer.decode(out, skip_special_tokens=True))
            correct += s.metrics.get(task.correct_metric, 0.0)
            reward += s.reward
    n = max(len(items), 1)
    return {"accuracy": correct / n, "reward_mean": reward / n}
