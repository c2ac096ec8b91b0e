import pytest

from trainer.config import dump_config, load_config


def test_defaults_file_and_overrides(tmp_path):
    f = tmp_path / "run.toml"
    f.write_text('run_dir = "r"\n[train]\nlr = 0.001\ngroup_size = 4\n[task.params]\ndigits = 1\n')
    cfg = load_config(f, ["train.lr=3e-4", "server.port=7000", "task.params={digits=3}"])
    assert cfg.run_dir == "r" and cfg.train.lr == 3e-4 and cfg.train.group_size == 4
    assert cfg.server.port == 7000 and cfg.task.params == {"digits": 3}
    again = tmp_path / "again.toml"
    again.write_text(dump_config(cfg))
    assert load_config(again) == cfg


def test_unknown_keys_and_bad_types_are_errors():
    with pytest.raises(ValueError, match="lrr"):
        load_config(None, ["train.lrr=1"])
    with pytest.raises(ValueError):
        load_config(None, ["train.group_size=lots"])
    with pytest.raises(ValueError):
        load_config(None, ["nonsense"])
