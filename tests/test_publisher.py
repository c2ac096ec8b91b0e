"""Versions published from a frozen copy of the weights, and snapshots that retention leaves alone."""

import pytest
import torch
from safetensors.torch import load_file

from swarm.default_model import build_default_model
from trainer.policy import frozen_state, load_model
from trainer.publisher import Publisher


@pytest.fixture(scope="module")
def model_dir(tmp_path_factory):
    return build_default_model(tmp_path_factory.mktemp("tiny"), seed=0)


def _tensors(path):
    out = {}
    for f in sorted(path.glob("*.safetensors")):
        out.update(load_file(f))
    return out


def test_a_frozen_copy_publishes_the_weights_of_its_moment(model_dir, tmp_path):
    model = load_model(model_dir)
    pub = Publisher(tmp_path, model_dir, keep=5)
    frozen = frozen_state(model)
    assert frozen["lm_head.weight"] is frozen["model.embed_tokens.weight"]  # still tied
    with torch.no_grad():  # an optimizer step after the copy must not reach the published version
        for p in model.parameters():
            p.add_(1.0)
    direct = _tensors(pub.publish(load_model(model_dir), 1))
    from_copy = _tensors(pub.publish(model, 2, frozen))
    assert "lm_head.weight" in frozen  # the caller's copy (the auditor's too) is left whole
    assert direct.keys() == from_copy.keys()  # the tied head is saved once, as the model saves it
    assert all(torch.equal(direct[k], from_copy[k]) for k in direct)


def test_snapshots_outlive_retention(model_dir, tmp_path):
    model = load_model(model_dir)
    pub = Publisher(tmp_path, model_dir, keep=2)
    pub.publish(model, 0)
    snap = pub.snapshot(0, "step-000000")
    for v in range(1, 4):
        pub.publish(model, v)
    assert pub.versions() == [2, 3] and not pub.path(0).exists()
    again = load_model(snap)
    assert all(torch.equal(a, b) for a, b in zip(model.state_dict().values(), again.state_dict().values(),
                                                   strict=True))
