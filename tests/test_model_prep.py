"""The run's starting policy (trainer/model_prep.py): the embedded default built and warmed up, a model of
your own used as it is, or warmed up on the task's format into the run's directory when asked."""

from __future__ import annotations

import pytest
from safetensors.torch import load_file

from rewards.registry import make_task
from trainer.config import load_config
from trainer.model_prep import CHECK_ITEMS, check_items, prepare_base_model
from trainer.policy import load_model, load_tokenizer
from trainer.sft import sft_warmup

TWO_TERMS = ["task.name=arithmetic", "task.params={digits = 1, terms = 2, ops = \"+\"}"]


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


def test_the_warm_up_stops_at_the_first_check_that_reaches_its_target(tmp_path):
    """model.sft_until: checked every `check_every` steps, the warm-up stops at the first check at or above
    the target (here the third), and runs its whole length where none is."""
    cfg = load_config(None, [f"run_dir={tmp_path}", "model.sft_steps=0", *TWO_TERMS])
    path = prepare_base_model(cfg, progress=False)
    task = make_task(cfg.task.name, **cfg.task.params)
    seen = iter([0.1, 0.39, 0.4, 0.9])
    model, tok = load_model(path), load_tokenizer(path)
    assert sft_warmup(model, tok, task, 20, batch_size=4, progress=False, check=lambda m: next(seen), until=0.4,
                      check_every=2) == 6
    assert next(seen) == 0.9  # no check after the one that reached it
    assert sft_warmup(model, tok, task, 4, batch_size=4, progress=False, check=lambda m: 0.0, until=0.4,
                      check_every=2) == 4


def test_the_warm_up_check_reads_training_items_only():
    """Where to stop is never chosen by the held-out items the run is judged on."""
    task = make_task("arithmetic", digits=1, terms=3, ops="+", eval_share=0.15)
    held_out = {it.prompt for it in task.eval_items(200)}  # more than the ~150 held out: all of them
    items = check_items(task)
    assert len(items) == CHECK_ITEMS
    assert not {it.prompt for it in items} & held_out


def test_the_warm_up_target_is_an_accuracy():
    with pytest.raises(ValueError, match="sft_until"):
        load_config(None, ["model.sft_until=1.5"])
