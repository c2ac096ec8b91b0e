"""The run's starting policy (trainer/model_prep.py): the embedded default built and warmed up, a model of
your own used as it is, or warmed up on the task's format into the run's directory when asked."""

from __future__ import annotations

from safetensors.torch import load_file

from trainer.config import load_config
from trainer.model_prep import prepare_base_model


def weights(path):
    out = {}
    for f in sorted(path.glob("*.safetensors")):
        out.update(load_file(str(f)))
    return out


def test_a_model_of_your_own_is_used_as_it_is_or_warmed_up_into_the_run(tmp_path):
    task = ["task.name=arithmetic", "task.params={digits = 1, terms = 2, ops = \"+\"}", "model.sft_batch=4"]
    own = prepare_base_model(load_config(None, [f"run_dir={tmp_path / 'a'}", "model.sft_steps=0", *task]),
                             progress=False)
    assert own == tmp_path / "a" / "base-model"

    # A model of your own with no warm-up asked for: its own directory, untouched.
    as_is = load_config(None, [f"run_dir={tmp_path / 'b'}", f"model.path={own}", *task])
    assert as_is.model.sft_steps == -1
    assert prepare_base_model(as_is, progress=False) == own
    assert not (tmp_path / "b").exists()

    # Warm-up asked for: a warmed copy in the run's directory; the source is not written.
    before = weights(own)
    warm_cfg = load_config(None, [f"run_dir={tmp_path / 'c'}", f"model.path={own}", "model.sft_steps=2", *task])
    warm = prepare_base_model(warm_cfg, progress=False)
    assert warm == tmp_path / "c" / "base-model"
    after = weights(warm)
    assert after.keys() == before.keys()
    assert any(not (after[k] == before[k]).all() for k in before), "the warm-up changed nothing"
    assert all((weights(own)[k] == before[k]).all() for k in before)
    assert (warm / "tokenizer_config.json").exists()

    # The same settings again: the stamp says it is built (nothing is trained or written).
    stamp = (warm / "recipe.sha256").stat().st_mtime_ns
    mtimes = {f.name: f.stat().st_mtime_ns for f in warm.iterdir()}
    assert prepare_base_model(warm_cfg, progress=False) == warm
    assert {f.name: f.stat().st_mtime_ns for f in warm.iterdir()} == mtimes
    assert (warm / "recipe.sha256").stat().st_mtime_ns == stamp
