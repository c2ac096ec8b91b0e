"""Versions published from a frozen copy of the weights, and snapshots that retention leaves alone."""

import pytest
import torch
from safetensors.torch import load_file

from model_builders.default_model import build_default_model
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


def test_a_version_is_laid_out_as_save_pretrained_lays_it_out(model_dir, tmp_path):
    """The publisher writes shards itself (for speed); transformers must see the same checkpoint."""
    import json

    model = load_model(model_dir)
    with torch.no_grad():
        for p in model.parameters():
            p.add_(torch.randn_like(p) * 1e-3)
    ref = tmp_path / "ref"
    model.save_pretrained(ref, safe_serialization=True, max_shard_size=200_000)
    path = Publisher(tmp_path / "run", model_dir, max_shard_bytes=200_000).publish(model, 1, frozen_state(model))
    ours, theirs = _tensors(path), _tensors(ref)
    assert ours.keys() == theirs.keys() and "lm_head.weight" not in ours
    assert all(torch.equal(ours[k], theirs[k]) for k in ours)
    index = json.loads((path / "model.safetensors.index.json").read_text())
    shards = sorted(p.name for p in path.glob("*.safetensors"))
    assert len(shards) > 1 and sorted(set(index["weight_map"].values())) == shards
    assert index["weight_map"].keys() == ours.keys()
    again = load_model(path)  # loads, re-tied, with every weight as published
    assert again.lm_head.weight is again.model.embed_tokens.weight
    assert all(torch.equal(a, b) for a, b in zip(model.state_dict().values(), again.state_dict().values(),
                                                   strict=True))


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


def test_a_bf16_version_is_what_nodes_load_and_the_audit_recomputes_with(model_dir, tmp_path):
    """Published in bf16 (model.publish_dtype): half the bytes, and the weights a node loads from the version are
    exactly the ones the trainer's audit keeps for it, so an honest node's log-probs still match."""
    from swarm_common import protocol as P
    from trainer.audit import AuditConfig, Auditor
    from trainer.policy import completion_logprobs, pack_groups

    model = load_model(model_dir)
    with torch.no_grad():  # weights with bits below bf16's precision, as training leaves them
        for p in model.parameters():
            p.add_(torch.randn_like(p) * 1e-3)
    state = frozen_state(model, torch.bfloat16)
    assert all(v.dtype == torch.bfloat16 for v in state.values())
    assert state["lm_head.weight"] is state["model.embed_tokens.weight"]
    path = Publisher(tmp_path, model_dir).publish(model, 1, state)
    on_disk = _tensors(path)
    assert all(v.dtype == torch.bfloat16 for v in on_disk.values())
    fp32_bytes = sum(p.numel() * 4 for p in model.state_dict().values() if p.is_floating_point())
    assert sum(f.stat().st_size for f in path.glob("*.safetensors")) < 0.6 * fp32_bytes

    node_model = load_model(path)  # what a node runs: the version, computed in fp32
    assert not torch.equal(node_model.model.layers[0].mlp.up_proj.weight, model.model.layers[0].mlp.up_proj.weight)
    prompt, comps = [5, 60, 61, 62], [[7, 8, 9], [10, 11, 12]]
    with torch.no_grad():
        node_lp = completion_logprobs(node_model, pack_groups([prompt], [comps], None, 0), 1.0)
        master_lp = completion_logprobs(model, pack_groups([prompt], [comps], None, 0), 1.0)
    samples = [P.Sample(c, node_lp[i, : len(c)].tolist(), "length") for i, c in enumerate(comps)]
    auditor = Auditor(model, 0, 1.0, 1.0, AuditConfig(min_tail_mass=0.0))
    auditor.remember(1, state, keep_from=0)
    res = auditor.audit(prompt, samples, 1)
    assert res.reason is None and res.max_diff < 1e-5
    assert (node_lp - master_lp).abs().max() > res.max_diff  # the rounding is real; the audit sees through it
