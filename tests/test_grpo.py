"""GRPO math against values computed by hand."""

import math

import pytest
import torch

from trainer.grpo import LossConfig, group_advantages, grpo_loss, token_logprobs

CFG = LossConfig(eps_low=0.2, eps_high=0.3, delta=3.0, seq_is_cap=4.0)


def test_advantages_mean_and_std():
    r = torch.tensor([[1.0, 0.0, 0.0, 1.0], [0.5, 0.5, 0.5, 0.5]])
    assert group_advantages(r).tolist() == [[0.5, -0.5, -0.5, 0.5], [0.0, 0.0, 0.0, 0.0]]
    scaled = group_advantages(r, scale_by_std=True, eps=0.0)
    assert scaled[0].tolist() == pytest.approx([1.0, -1.0, -1.0, 1.0])  # population std 0.5


def _loss(logp, old, adv, mask, cfg=CFG):
    return grpo_loss(torch.tensor(logp), torch.tensor(old), torch.tensor(adv), torch.tensor(mask), cfg)


def test_on_policy_loss_is_minus_mean_advantage_per_token():
    # ratio 1 everywhere: loss = -sum(A_i * n_i) / sum(n_i) with token-level normalisation.
    logp = [[-1.0, -2.0, -0.5], [-1.0, -1.0, 0.0]]
    mask = [[1.0, 1.0, 1.0], [1.0, 1.0, 0.0]]
    loss, st = _loss(logp, logp, [1.0, -2.0], mask)
    assert loss.item() == pytest.approx(-(1.0 * 3 + -2.0 * 2) / 5)
    assert st["clip_frac"] == 0.0 and st["tokens"] == 5.0


def test_positive_advantage_clipped_above():
    # r = e^1 ~ 2.718 > 1 + 0.3: objective = 1.3 * A.
    loss, st = _loss([[0.0]], [[-1.0]], [2.0], [[1.0]])
    assert loss.item() == pytest.approx(-1.3 * 2.0)
    assert st["clip_frac"] == 1.0


def test_positive_advantage_below_low_clip_uses_ratio():
    # r = e^-1 ~ 0.368 < 0.8: min(r A, 0.8 A) = r A for A > 0.
    loss, _ = _loss([[-1.0]], [[0.0]], [1.0], [[1.0]])
    assert loss.item() == pytest.approx(-math.exp(-1.0))


def test_negative_advantage_two_sided_delta_bound():
    # r = e^2 ~ 7.39, A = -1: PPO gives min(-7.39, -1.3) = -7.39; INTELLECT-2 bounds it at delta*A = -3.
    loss, _ = _loss([[0.0]], [[-2.0]], [-1.0], [[1.0]], LossConfig(eps_low=0.2, eps_high=0.3, delta=3.0, seq_is_cap=100.0))
    assert loss.item() == pytest.approx(3.0)
    # r = e^0.5 ~ 1.65 < delta: plain PPO, min(-1.65, -1.3) = -1.65.
    loss, _ = _loss([[0.0]], [[-0.5]], [-1.0], [[1.0]], LossConfig(eps_low=0.2, eps_high=0.3, delta=3.0, seq_is_cap=100.0))
    assert loss.item() == pytest.approx(math.exp(0.5))


def test_negative_advantage_gradient_vanishes_beyond_delta():
    logp = torch.tensor([[0.0]], requires_grad=True)
    loss, _ = grpo_loss(logp, torch.tensor([[-2.0]]), torch.tensor([-1.0]), torch.ones(1, 1),
                        LossConfig(eps_low=0.2, eps_high=0.3, delta=3.0, seq_is_cap=100.0))
    loss.backward()
    assert logp.grad.item() == 0.0


def test_sequence_importance_cap_truncates():
    # Two tokens with log-ratio 1 each: w = e^2 ~ 7.39 > cap 4, so the sequence is scaled by 4 / e^2.
    # Each token: r = e (clipped at 1.3 for A = 1): objective 1.3.
    loss, st = _loss([[0.0, 0.0]], [[-1.0, -1.0]], [1.0], [[1.0, 1.0]])
    assert loss.item() == pytest.approx(-1.3 * 4.0 / math.exp(2.0))
    assert st["seq_truncated"] == 1.0
    # Below the cap nothing changes.
    loss, st = _loss([[0.0, 0.0]], [[-0.5, -0.5]], [1.0], [[1.0, 1.0]])
    assert loss.item() == pytest.approx(-1.3)
    assert st["seq_truncated"] == 0.0


def test_padding_does_not_count():
    loss_a, _ = _loss([[-1.0, 5.0]], [[-1.0, 0.0]], [1.0], [[1.0, 0.0]])
    loss_b, _ = _loss([[-1.0]], [[-1.0]], [1.0], [[1.0]])
    assert loss_a.item() == pytest.approx(loss_b.item())


def test_kl_term_k3():
    cfg = LossConfig(kl_beta=0.5, seq_is_cap=100.0)
    logp, ref = -1.0, -1.5
    d = ref - logp
    loss, _ = grpo_loss(torch.tensor([[logp]]), torch.tensor([[logp]]), torch.tensor([0.0]), torch.ones(1, 1),
                        cfg, ref_logp=torch.tensor([[ref]]))
    assert loss.item() == pytest.approx(0.5 * (math.exp(d) - d - 1))
    with pytest.raises(ValueError):
        grpo_loss(torch.zeros(1, 1), torch.zeros(1, 1), torch.zeros(1), torch.ones(1, 1), cfg)


def test_token_logprobs_matches_log_softmax():
    logits = torch.randn(2, 3, 5)
    targets = torch.randint(0, 5, (2, 3))
    want = torch.log_softmax(logits, -1).gather(-1, targets[..., None])[..., 0]
    assert torch.allclose(token_logprobs(logits, targets), want)
