"""The node's episode runner (inference_nodes/episodes.py) against a scripted engine: the episodes it builds
from a hand-out replay exactly on the trainer's side, with the engine asked for every running episode's
next turn in one call per round and each turn's budget as the rules give it. (The real vLLM engine runs it
in tests/adversarial/test_episode_attacks.py and the demo.)"""

from __future__ import annotations

from inference_nodes.engine import GenSample
from inference_nodes.episodes import EpisodeRunner
from model_builders.default_model import build_tokenizer
from rewards.registry import make_task
from rewards.sandbox import Budget
from rewards.token_episode import handout, prompt_ids
from swarm_common import protocol as P
from trainer.episode_check import replay_group

TOK = build_tokenizer()


class ScriptedEngine:
    """Answers every turn as a worked episode would; a call that asks too little budget gets cut."""

    def __init__(self, env, items):
        self.tokenizer, self.calls = TOK, []
        self.script = {tuple(prompt_ids(env, TOK, it)): [m["content"] for m in env.demonstration(it) if m["role"] == "assistant"]
                       for it in items}

    def turns(self, seqs, budgets, temperature, top_p, stop_id):
        self.calls.append(len(seqs))
        out = []
        for seq, budget in zip(seqs, budgets, strict=True):
            prompt = next(p for p in self.script if tuple(seq[: len(p)]) == p)
            turn_no = seq[len(prompt):].count(stop_id)
            ids = (TOK(self.script[prompt][turn_no], add_special_tokens=False)["input_ids"] + [stop_id])[:budget]
            out.append(GenSample(ids, [-0.25] * len(ids), "stop" if ids[-1] == stop_id else "length"))
        return out


def test_the_node_builds_episodes_the_trainer_replays():
    for name, max_tokens in (("calculator", 24), ("guess", 6)):
        env = make_task(name)
        items = env.eval_items(5)
        spec, item_of = handout(env, 96)
        engine = ScriptedEngine(env, items)
        work = P.WorkAssignment(P.WeightsInfo(0, ""), 0, [P.Assignment(f"a{i}", prompt_ids(env, TOK, it), item_of(it))
                                                       for i, it in enumerate(items)],
                                P.SamplingSpec(n=3, max_tokens=max_tokens, temperature=1.0, top_p=1.0), env=spec)
        rollouts, st = EpisodeRunner().run(engine, work)
        assert st.episodes == 15 and engine.calls[0] == 15  # all episodes of all assignments in one call
        assert len(engine.calls) == max(len([m for m in env.demonstration(it) if m["role"] == "assistant"])
                                        for it in items)
        for r, it in zip(rollouts, items, strict=True):
            assert not r.samples and len(r.episodes) == 3
            rs = replay_group(env, it, TOK, r.episodes, max_tokens, 96, len(TOK), Budget(10))
            assert all(x.reason is None for x in rs), [x.reason for x in rs]
        assert st.tool_calls == (15 if name == "calculator" else 0)
