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


def test_components_own_their_sections_and_old_keys_still_work(tmp_path, caplog):
    cfg = load_config(None, ["loss.kl_beta=0.1", "guard.pair_z=5.0", "audit.rate=0.2"])
    assert (cfg.loss.kl_beta, cfg.guard.pair_z, cfg.audit.rate) == (0.1, 5.0, 0.2)
    f = tmp_path / "old.toml"
    f.write_text('[train]\nkl_beta = 0.3\n[security]\naudit_rate = 0.4\npair_release_z = 1.5\naudit = false\n'
                 'trusted = ["AB"]\n')
    with caplog.at_level("WARNING"):
        old = load_config(f)
    assert (old.loss.kl_beta, old.audit.rate, old.guard.pair_release_z, old.audit.enabled) == (0.3, 0.4, 1.5, False)
    assert old.guard.trusted == frozenset({"ab"})  # keys are compared lower-case
    assert "security.audit_rate is now audit.rate" in caplog.text
    with pytest.raises(ValueError, match="unknown"):
        load_config(None, ["guard.no_such_key=1"])
    # What is written back reads back the same, under the new keys.
    again = tmp_path / "again.toml"
    again.write_text(dump_config(old))
    assert "[security]" not in again.read_text() and load_config(again) == old


def test_the_relay_tree_owns_its_section_and_old_server_keys_still_work(tmp_path, caplog):
    """[server.tree] is broadcast.config.OriginConfig: one name per knob from the file to the origin."""
    from broadcast.config import OriginConfig

    cfg = load_config(None, ["server.tree.fanout=3", "server.tree.piece_bytes=0"])
    assert isinstance(cfg.server.tree, OriginConfig) and (cfg.server.tree.fanout, cfg.server.tree.piece_bytes) == (3, 0)
    f = tmp_path / "old.toml"
    f.write_text('[server]\nfanout = 2\npiece_bytes = 65536\nmax_peers = 50\nallow_private = "never"\nfull_every = 1\n')
    with caplog.at_level("WARNING"):
        old = load_config(f)
    t = old.server.tree
    assert (t.fanout, t.piece_bytes, t.max_peers, t.allow_private, t.full_every) == (2, 65536, 50, "never", 1)
    assert "server.piece_bytes is now server.tree.piece_bytes" in caplog.text
    with pytest.raises(ValueError):
        load_config(None, ["server.tree.fanout=0"])  # the room's own checks
    again = tmp_path / "again.toml"
    again.write_text(dump_config(old))
    assert "[server.tree]" in again.read_text() and load_config(again) == old
