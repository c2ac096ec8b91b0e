"""Episodes in the learner and the audit: only sampled tokens are trained and checked; the environment's
tokens are read (attended to) but never trained on, whatever log-probs a node puts beside them. And the
supervised warm-up and the greedy evaluation of an environment run on the tiny model."""

from __future__ import annotations

import pytest
import torch

from model_builders.default_model import build_default_model
from rewards.calculator import CalculatorEnv
from swarm_common import protocol as P
from trainer.audit import AuditConfig, Auditor
from trainer.episode_eval import evaluate_episodes
from trainer.grpo import LossConfig
from trainer.intake import Group
from trainer.learner import Learner, sampled_tokens
from trainer.policy import completion_logprobs, frozen_state, load_model, load_tokenizer, pack_groups
from trainer.sft import sft_warmup


@pytest.fixture(scope="module")
def tiny(tmp_path_factory):
    torch.manual_seed(0)
    path = build_default_model(tmp_path_factory.mktemp("tiny"), seed=0)
    return load_model(path), load_tokenizer(path)


PROMPT = [5, 60, 61, 62]
EPISODE = [40, 41, 0, 1, 50, 51, 2, 42, 0]  # turn, stop | environment's answer | turn, stop
MASK = [True, True, True, False, False, False, False, True, True]


def _true_logprobs(model, completions):
    with torch.no_grad():
        return completion_logprobs(model, pack_groups([PROMPT], [completions], None, 0)).tolist()


def test_the_loss_mask_is_the_sampled_tokens(tiny):
    model, _ = tiny
    b = pack_groups([PROMPT], [[EPISODE, EPISODE[:3]]], None, 0, masks=[[MASK, MASK[:3]]])
    assert b.completion_mask[0].tolist() == [1.0] * len(EPISODE)  # every real token is attended to
    assert b.loss_mask[0].tolist() == [float(m) for m in MASK]
    assert b.loss_mask[1].tolist()[:3] == [1.0] * 3 and b.loss_mask[1].sum() == 3


def test_environment_tokens_are_never_trained(tiny):
    """Two batches that differ only in the log-probs beside environment tokens give the same update."""
    model, tok = tiny
    lp = _true_logprobs(model, [EPISODE, EPISODE])
    updates = []
    for env_lp in (0.0, -30.0):
        m = load_model_copy(model)
        samples = [P.Sample(EPISODE, [x if s else env_lp for x, s in zip(lp[i], MASK, strict=True)], "stop")
                   for i in range(2)]
        g = Group("a", "n", None, PROMPT, samples, [1.0, 0.0], [1.0, 0.0], 0, [MASK, MASK])
        before = [p.detach().clone() for p in m.parameters()]
        st = Learner(m, tok, 1e-2, 0.0, 1.0, LossConfig()).step([g])
        assert st["tokens"] == 2 * sum(MASK) == sampled_tokens(g)
        updates.append([(p.detach() - b).clone() for p, b in zip(m.parameters(), before, strict=True)])
    assert max((a - b).abs().max().item() for a, b in zip(*updates, strict=True)) < 1e-7
    assert max(a.abs().max().item() for a in updates[0]) > 0


def load_model_copy(model):
    import copy

    return copy.deepcopy(model)


def test_the_audit_checks_sampled_tokens_only(tiny):
    model, _ = tiny
    a = Auditor(model, 0, 1.0, 1.0, AuditConfig())
    a.remember(0, frozen_state(model), keep_from=0)
    lp = _true_logprobs(model, [EPISODE])[0]
    # The environment's tokens carry no sampling log-prob (0 in the learner's layout) and may be "rare".
    honest = [P.Sample(EPISODE, [x if s else 0.0 for x, s in zip(lp, MASK, strict=True)], "stop")]
    assert a.audit(PROMPT, honest, 0, [MASK]).reason is None
    assert a.audit(PROMPT, honest, 0).reason == "logprob_mismatch"  # without the mask they would count
    forged = [P.Sample(EPISODE, [x - 0.5 if s else 0.0 for x, s in zip(lp, MASK, strict=True)], "stop")]
    assert a.audit(PROMPT, forged, 0, [MASK]).reason == "logprob_mismatch"


def test_warm_up_and_greedy_evaluation_of_an_environment(tiny):
    """A few warm-up steps on worked episodes, then greedy episodes: the loop runs end to end and counts."""
    model, tok = tiny
    env = CalculatorEnv()
    items = env.eval_items(8)
    before = evaluate_episodes(model, tok, env, items, 48, 192)
    sft_warmup(model, tok, env, steps=3, batch_size=8, progress=False)
    after = evaluate_episodes(model, tok, env, items, 48, 192)
    for ev in (before, after):
        assert 1.0 <= ev["turns"] <= env.max_turns and 0.0 <= ev["accuracy"] <= 1.0
