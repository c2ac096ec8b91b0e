"""GRPO: group-relative advantages and the clipped, importance-corrected policy loss.

Read top to bottom: `group_advantages` turns each prompt's G rewards into advantages, `grpo_loss` is the
whole objective for one batch of sequences. Everything here is plain tensor math, tested by hand.
"""

from __future__ import annotations

import math

import msgspec
import torch


class LossConfig(msgspec.Struct, forbid_unknown_fields=True, kw_only=True, frozen=True):
    """The run config's [loss] section."""

    eps_low: float = 0.2  # PPO clip: ratio >= 1 - eps_low ...
    eps_high: float = 0.28  # ... and <= 1 + eps_high (asymmetric, as in DAPO)
    delta: float = 4.0  # INTELLECT-2: for negative advantages the ratio's term is bounded by delta
    seq_is_cap: float = 4.0  # truncation cap on the sequence-level importance weight
    kl_beta: float = 0.0  # weight of the k3 KL estimate to the reference policy (0 = no reference)


def group_advantages(rewards: torch.Tensor, scale_by_std: bool = False, eps: float = 1e-6) -> torch.Tensor:
    """rewards: [groups, G]. Advantage = reward - group mean, optionally divided by the group's std."""
    adv = rewards - rewards.mean(dim=1, keepdim=True)
    if scale_by_std:
        adv = adv / (rewards.std(dim=1, keepdim=True, unbiased=False) + eps)
    return adv


def has_signal(rewards: list[float], eps: float = 1e-8) -> bool:
    """Does a group carry any gradient? Not when every sample scored the group's mean."""
    mean = sum(rewards) / len(rewards)
    return any(abs(r - mean) > eps for r in rewards)


def grpo_loss(
    logp: torch.Tensor,  # [B, T] log-probs of the sampled tokens under the policy being trained
    old_logp: torch.Tensor,  # [B, T] the node's own sampling log-probs for the same tokens
    advantages: torch.Tensor,  # [B] one advantage per sequence
    mask: torch.Tensor,  # [B, T] 1 for completion tokens, 0 for padding
    cfg: LossConfig,
    ref_logp: torch.Tensor | None = None,  # [B, T] reference policy, only when cfg.kl_beta > 0
) -> tuple[torch.Tensor, dict[str, float]]:
    """Token-level-normalised GRPO loss and its diagnostics.

    Per token: ratio r = pi_theta / pi_node. Positive advantages get PPO's clipped objective
    min(r A, clip(r, 1-eps_low, 1+eps_high) A). Negative advantages get the same, then INTELLECT-2's
    second bound max(., delta A), so a huge ratio on a bad sample cannot blow up the update.
    Per sequence: the importance weight w = prod_t r_t (detached) is truncated at seq_is_cap by scaling
    the sequence's terms with min(1, cap / w). The sum over all completion tokens is divided by their
    count (every token weighs the same, whatever its sequence's length).
    """
    mask = mask.to(logp.dtype)
    log_ratio = (logp - old_logp) * mask
    ratio = torch.exp(log_ratio)
    adv = advantages.to(logp.dtype).unsqueeze(1)

    unclipped = ratio * adv
    clipped = torch.clamp(ratio, 1.0 - cfg.eps_low, 1.0 + cfg.eps_high) * adv
    objective = torch.minimum(unclipped, clipped)
    objective = torch.where(adv < 0, torch.maximum(objective, cfg.delta * adv), objective)

    # Sequence-level truncation: sequences whose total ratio exceeds the cap are scaled down to it.
    seq_log_w = log_ratio.detach().sum(dim=1, keepdim=True)
    trunc = torch.clamp(math.log(cfg.seq_is_cap) - seq_log_w, max=0.0).exp()

    per_token = -objective * trunc
    if cfg.kl_beta > 0:
        if ref_logp is None:
            raise ValueError("kl_beta > 0 needs reference log-probs")
        d = ref_logp - logp
        per_token = per_token + cfg.kl_beta * (torch.exp(d) - d - 1.0)  # k3 estimator, >= 0

    n_tokens = mask.sum().clamp(min=1.0)
    loss = (per_token * mask).sum() / n_tokens

    with torch.no_grad():
        clipped_frac = ((unclipped != objective).to(logp.dtype) * mask).sum() / n_tokens
        stats = {
            "loss": float(loss),
            "clip_frac": float(clipped_frac),
            "ratio_mean": float((ratio * mask).sum() / n_tokens),
            "seq_truncated": float((trunc < 1.0).to(logp.dtype).mean()),
            "tokens": float(n_tokens),
        }
    return loss, stats


def token_logprobs(logits: torch.Tensor, targets: torch.Tensor) -> torch.Tensor:
    """log softmax(logits)[targets], computed without materialising a second [B, T, V] tensor."""
    return torch.gather(logits.log_softmax(dim=-1), -1, targets.unsqueeze(-1)).squeeze(-1)
