"""The learner's shared-prompt layout gives the plain layout's log-probs and gradients, and a step learns."""

import random
import types

import pytest
import torch

from model_builders.default_model import build_default_model
from trainer.grpo import LossConfig
from trainer.learner import Learner
from trainer.policy import (
    completion_logprobs,
    load_model,
    load_tokenizer,
    pack,
    pack_groups,
    sequence_logprobs,
)


@pytest.fixture(scope="module")
def model_dir(tmp_path_factory):
    return build_default_model(tmp_path_factory.mktemp("tiny"), seed=0)


def _groups(rng: random.Random, n: int, g: int, vocab: int):
    prompts = [[rng.randrange(3, vocab) for _ in range(rng.randint(2, 9))] for _ in range(n)]
    comps = [[[rng.randrange(3, vocab) for _ in range(rng.randint(1, 7))] for _ in range(g)] for _ in range(n)]
    return prompts, comps


def _plain(model, prompts, comps):
    """Each completion as its own prompt+completion sequence: the reference layout."""
    flat_p = [p for p, cs in zip(prompts, comps, strict=True) for _ in cs]
    flat_c = [c for cs in comps for c in cs]
    full = sequence_logprobs(model, pack(flat_p, flat_c, None, 0))
    out = torch.zeros((len(flat_c), max(len(c) for c in flat_c)))
    rows = []
    for k, (p, c) in enumerate(zip(flat_p, flat_c, strict=True)):
        rows.append(torch.cat([full[k, len(p) - 1 : len(p) - 1 + len(c)], out[k, len(c) :]]))
    return torch.stack(rows)


def test_shared_prompt_logprobs_and_gradients_match_the_plain_layout(model_dir):
    torch.manual_seed(0)
    model = load_model(model_dir).train()
    prompts, comps = _groups(random.Random(1), n=3, g=4, vocab=model.config.vocab_size)
    b = pack_groups(prompts, comps, None, 0)
    mask = b.completion_mask
    ours, ref = completion_logprobs(model, b) * mask, _plain(model, prompts, comps) * mask
    assert b.owner.tolist() == [0] * 4 + [1] * 4 + [2] * 4
    assert (ours - ref).abs().max().item() < 1e-4
    params = [p for p in model.parameters() if p.requires_grad]
    g_ours = torch.autograd.grad(ours.sum(), params)
    g_ref = torch.autograd.grad(ref.sum(), params)
    num = sum(((a - r) ** 2).sum() for a, r in zip(g_ours, g_ref, strict=True)) ** 0.5
    den = sum((r**2).sum() for r in g_ref) ** 0.5
    assert den > 0 and (num / den).item() < 1e-4


def test_single_token_completions(model_dir):
    model = load_model(model_dir)
    prompts, comps = [[5, 6, 7], [8]], [[[9], [10]], [[11]]]
    with torch.no_grad():
        ours = completion_logprobs(model, pack_groups(prompts, comps, None, 0))
        ref = _plain(model, prompts, comps)
    assert ours.shape == (3, 1) and (ours - ref).abs().max().item() < 1e-5


def test_a_step_raises_the_likelihood_of_rewarded_samples(model_dir):
    torch.manual_seed(0)
    model, tok = load_model(model_dir), load_tokenizer(model_dir)
    learner = Learner(model, tok, lr=1e-2, weight_decay=0.0, grad_clip=1.0, loss=LossConfig(), micro_batch=8)
    prompts, comps = _groups(random.Random(2), n=3, g=4, vocab=model.config.vocab_size)
    with torch.no_grad():
        before = completion_logprobs(model, pack_groups(prompts, comps, None, 0))
    groups = []
    for p, cs, i in zip(prompts, comps, range(3), strict=True):
        samples = [types.SimpleNamespace(token_ids=c, logprobs=before[4 * i + j, : len(c)].tolist())
                   for j, c in enumerate(cs)]
        groups.append(types.SimpleNamespace(prompt_ids=p, samples=samples, rewards=[1.0, 0.0, 0.0, 0.0]))
    groups.append(types.SimpleNamespace(prompt_ids=[4], samples=groups[0].samples, rewards=[0.5] * 4))
    st = learner.step(groups)  # micro_batch 8 = two groups per micro-batch: the batch spans three
    assert st["zero_adv_groups"] == 1.0 and st["tokens"] == sum(len(c) for cs in comps for c in cs)
    with torch.no_grad():
        after = completion_logprobs(model, pack_groups(prompts, comps, None, 0))
    mask = pack_groups(prompts, comps, None, 0).completion_mask
    gain = ((after - before) * mask).sum(1)
    for i in range(3):
        assert gain[4 * i] > 0 and gain[4 * i] > gain[4 * i + 1 : 4 * i + 4].max()


def test_flat_groups_count_in_the_token_normaliser(model_dir):
    """DAPO's token-level normalisation over the whole batch, as TRL's loss_type="dapo": adding a flat
    group (zero advantage, skipped in the forward pass) scales the gradient by kept / all tokens."""
    torch.manual_seed(0)
    tok = load_tokenizer(model_dir)
    prompts, comps = _groups(random.Random(3), n=2, g=4, vocab=64)

    def grads(with_flat: bool) -> list[torch.Tensor]:
        model = load_model(model_dir)
        learner = Learner(model, tok, lr=0.0, weight_decay=0.0, grad_clip=1e9, loss=LossConfig())
        with torch.no_grad():
            lp = completion_logprobs(model, pack_groups(prompts, comps, None, 0))
        groups = [types.SimpleNamespace(prompt_ids=p, rewards=[1.0, 0.0, 0.0, 0.0], samples=[
            types.SimpleNamespace(token_ids=c, logprobs=lp[4 * i + j, : len(c)].tolist()) for j, c in enumerate(cs)])
            for i, (p, cs) in enumerate(zip(prompts, comps, strict=True))]
        if with_flat:
            flat = [types.SimpleNamespace(token_ids=[7] * 5, logprobs=[-1.0] * 5) for _ in range(4)]
            groups.append(types.SimpleNamespace(prompt_ids=[4, 5], samples=flat, rewards=[0.5] * 4))
        learner.step(groups)
        return [p.grad.clone() for p in model.parameters() if p.grad is not None]

    kept = sum(len(c) for cs in comps for c in cs)
    alone, diluted = grads(False), grads(True)
    ratio = sum(float((d * a).sum()) for d, a in zip(diluted, alone, strict=True)) / sum(
        float((a * a).sum()) for a in alone)
    assert abs(ratio - kept / (kept + 20)) < 1e-4
