"""The computation audit on the tiny model: honest samples pass, a forced rare token is implausible by its
tail mass, a wrong log-prob is a mismatch, and honest samples of the rarest tokens pass at the stated rate."""

import pytest
import torch

from model_builders.default_model import build_default_model
from swarm_common import protocol as P
from trainer.audit import AuditConfig, Auditor
from trainer.policy import completion_logprobs, frozen_state, load_model, pack_groups


@pytest.fixture(scope="module")
def model(tmp_path_factory):
    torch.manual_seed(0)
    return load_model(build_default_model(tmp_path_factory.mktemp("tiny"), seed=0))


def _auditor(model, temperature=1.0):
    a = Auditor(model, 0, temperature, 1.0, AuditConfig(min_tail_mass=1e-9))
    a.remember(0, frozen_state(model), keep_from=0)
    return a


def _samples(model, prompt, comps, temperature=1.0):
    with torch.no_grad():
        lp = completion_logprobs(model, pack_groups([prompt], [comps], None, 0), temperature)
    return [P.Sample(c, lp[i, : len(c)].tolist(), "length") for i, c in enumerate(comps)]


def test_honest_samples_pass(model):
    a = _auditor(model)
    prompt = [5, 60, 61, 62]
    gen = torch.Generator().manual_seed(1)
    comps = []
    for _ in range(4):  # sampled from the model itself, token by token
        ids = list(prompt)
        for _ in range(5):
            with torch.no_grad():
                p = torch.softmax(model(torch.tensor([ids])).logits[0, -1], -1)
            ids.append(int(torch.multinomial(p, 1, generator=gen)))
        comps.append(ids[len(prompt):])
    res = a.audit(prompt, _samples(model, prompt, comps), 0)
    assert res.reason is None and res.max_diff < 1e-4 and res.worst_tail >= 1e-9


def test_rare_token_with_its_true_logprob_is_implausible(model):
    # At T=0.02 the random tiny model is peaked enough that its rarest tokens are vanishingly rare.
    a, prompt = _auditor(model, 0.02), [5, 60, 61, 62]
    with torch.no_grad():
        probs = torch.softmax(model(torch.tensor([prompt])).logits[0, -1].double() / 0.02, -1)
    order = probs.argsort()
    rare, fair = int(order[0]), int(order[-2])  # the rarest token; the second likeliest
    tail_rare = float(probs[probs <= probs[rare]].sum())
    tail_fair = float(probs[probs <= probs[fair]].sum())
    assert tail_rare < 1e-9 < tail_fair
    res = a.audit(prompt, _samples(model, prompt, [[rare, 40]], 0.02), 0)  # its log-probs are the true ones
    assert res.reason == "implausible_token" and res.max_diff < 1e-3
    assert res.worst_tail == pytest.approx(tail_rare, rel=1e-2)
    res = a.audit(prompt, _samples(model, prompt, [[fair]], 0.02), 0)
    assert res.reason is None and res.worst_tail == pytest.approx(tail_fair, rel=1e-3)


def test_tampered_logprob_is_a_mismatch_and_unknown_version_is_named(model):
    a = _auditor(model)
    prompt = [5, 60]
    samples = _samples(model, prompt, [[40, 41]])
    samples[0].logprobs[1] += 0.05
    assert a.audit(prompt, samples, 0).reason == "logprob_mismatch"
    assert a.audit(prompt, samples, 7).reason == "unknown_version"
