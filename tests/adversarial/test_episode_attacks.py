"""The attack suite on multi-turn work: a trainer running the calculator environment, an honest vLLM node
running its episodes, and attackers that forge observations, tool calls, masks, endings and tokenizations,
or cherry-pick whole episodes. Each is refused with its code (and banned for fraud), nothing of it reaches
a trained batch, and the honest node is never refused (its episodes replay exactly)."""

from __future__ import annotations

import time
import urllib.request

import pytest
import torch

from rewards.registry import make_task
from swarm_common.keys import KeyPair
from tests.adversarial.attacks import Ctx, Outcome
from tests.adversarial.conftest import HONEST, MAX_MESSAGE_BYTES, Swarm, swarm_args
from tests.adversarial.episode_attacks import EPISODE_ATTACKS
from tests.adversarial.evil_node import Sampler
from tests.conftest import Procs, free_port, wait_json

# The calculator on the tiny model, briefly warmed up: its episodes call the tool and answer. Attackers
# sample whole episodes with HF, slower than a single answer: a lag window of 16 versions (the learner
# steps about twice a second here) keeps their honest-looking work from going stale.
EPISODE_LAG = 16
EPISODE_RUN = ["--set", 'task.name="calculator"', "--set", "task.params={digits=3, terms=2}",
               "--set", "task.max_episode_tokens=96", "--set", "train.max_tokens=24", "--set", "model.sft_steps=100",
               "--set", f"train.max_lag={EPISODE_LAG}"]
EXPECTED = {
    "forged_observation": {"observation_mismatch"},
    "edited_tool_result": {"observation_mismatch"},
    "skipped_tool_call": {"missing_observation"},
    "invented_tool_call": {"unexpected_observation"},
    "sampled_as_environment": {"observation_mismatch", "unexpected_observation"},
    "environment_as_sampled": {"bad_mask"},
    "cut_short": {"cut_short", "bad_finish"},
    "retokenized_observation": {"observation_mismatch"},
}


@pytest.fixture(scope="module")
def episode_swarm(tmp_path_factory) -> Swarm:
    root = tmp_path_factory.mktemp("adv-episodes")
    run_dir = root / "run"
    zport, hport, tport = free_port(), free_port(), free_port()
    procs = Procs(root)
    try:
        honest_key = KeyPair.load_or_create(root / "node" / "node.key").public_hex
        trainer = procs.start("trainer", *swarm_args(run_dir, zport, hport, tport, honest_key, EPISODE_RUN))
        url = f"http://127.0.0.1:{hport}/api/summary"
        wait_json(url, timeout=300, proc=trainer)
        procs.start("node", "node", "--trainer", f"127.0.0.1:{zport}", "--data-dir", str(root / "node"),
                    "--name", HONEST, "--max-prompts", "4")
        sw = Swarm(run_dir, zport, url, procs)
        wait_json(url, lambda s: s["step"] >= 3, timeout=300, proc=trainer)
        yield sw
        row = sw.honest_row()
        assert row["refused"] == {}, row  # every honest episode replayed exactly
        assert row["mean_turns"] > 0 and row["tool_calls_per_episode"] > 0
        metrics = urllib.request.urlopen(url.replace("/api/summary", "/metrics"), timeout=5).read().decode()
        assert f'swarm_episodes_total{{node="{HONEST}"}}' in metrics and "swarm_tool_calls_total" in metrics
    finally:
        procs.stop_all()
        for p in procs.procs:
            print(f"==== {p.log_path.name} (exit {p.returncode})\n{p.log_path.read_text()[-4000:]}")


@pytest.fixture(scope="module")
def ctx(episode_swarm) -> Ctx:
    torch.set_num_threads(1)
    sampler = Sampler(episode_swarm.run_dir)
    sampler.model(sampler.versions()[-1])  # transformers' first model load is slow: not inside an attack
    return Ctx(episode_swarm.zport, sampler, make_task("calculator", digits=3, terms=2),
               group_size=8, max_lag=EPISODE_LAG, strikes_to_ban=3, max_message_bytes=MAX_MESSAGE_BYTES,
               summary=episode_swarm.summary)


def _check_after(sw: Swarm, out: Outcome) -> None:
    sw.wait_carry_on()
    assert not set(out.node_ids) & sw.trained_node_ids()
    assert sw.honest_row()["refused"] == {}


@pytest.mark.parametrize("name", list(EXPECTED))
def test_episode_attack_is_refused(episode_swarm, ctx, name):
    out = EPISODE_ATTACKS[name](ctx)
    assert out.attempts == ctx.strikes_to_ban and out.detected == out.attempts, (name, dict(out.codes))
    assert out.banned, (name, dict(out.codes))
    _check_after(episode_swarm, out)


def test_colluding_best_of_k_over_whole_episodes_is_caught(episode_swarm, ctx):
    t0 = time.monotonic()
    out = EPISODE_ATTACKS["colluding_best_of_4_episodes"](ctx)
    assert out.attempts > 0 and out.detected > 0 and out.banned, (dict(out.codes), time.monotonic() - t0)
    _check_after(episode_swarm, out)
