"""What checking multi-turn episodes costs the trainer (bench/episodes.py's second and third parts): the replay
(trainer/episode_check.py) and the audit (a prefill with masks) per group, against the learner's step per
group; and honest groups made from an environment's worked episodes."""

from __future__ import annotations

import statistics
import time
from pathlib import Path

G = 8  # episodes a group


def costs(cfg, model_dir: Path, work, groups_of_episodes: list[tuple], rate: float, sampled: bool = True) -> dict:
    """Replay and audit per group, against the learner's step per group (16 groups a step). `sampled`: the
    episodes are the model's own, so the audit must pass them (worked episodes' made-up log-probs fail it;
    the audit's cost is the same prefill either way)."""
    import torch

    from rewards.sandbox import Budget
    from trainer.audit import AuditConfig, Auditor
    from trainer.episode_check import as_samples, replay_group
    from trainer.intake import Held, episode_group
    from trainer.learner import Learner
    from trainer.policy import frozen_state, load_model, load_tokenizer

    torch.set_num_threads(1)  # as the trainer runs (train.torch_threads); after vLLM started, --threads decides
    model, tok = load_model(model_dir), load_tokenizer(model_dir)
    auditor = Auditor(model, tok.pad_token_id, 1.0, 1.0, AuditConfig())
    auditor.remember(0, frozen_state(model), keep_from=0)
    replay_s, audit_s, groups = [], [], []
    for item, prompt, episodes in groups_of_episodes:
        if isinstance(getattr(work.env, "results", None), dict):  # the python tool's kept outputs: only the
            work.env.results.clear()  # group's own repeats may hit (the worked episodes' filled it)
        t0 = time.perf_counter()
        rs = replay_group(work.env, item, tok, episodes, cfg.train.max_tokens, cfg.task.max_episode_tokens, len(tok),
                          Budget(1e9))
        replay_s.append(time.perf_counter() - t0)
        assert all(r.reason is None for r in rs), [r.reason for r in rs]
        samples, masks = as_samples(episodes)
        t0 = time.perf_counter()
        verdict = auditor.audit(prompt, samples, 0, masks).reason
        assert verdict is None or not sampled, verdict
        audit_s.append(time.perf_counter() - t0)
        held = Held(item.id, "n", item, prompt, 0, 0.0)
        g = episode_group(held, episodes, rs, 0, "n")
        g.rewards = [r.reward + 1e-3 * k for k, r in enumerate(rs)]  # every group with signal: a full step
        groups.append(g)
    learner = Learner(model, tok, cfg.train.lr, 0.0, 1.0, cfg.loss)
    batch = (groups * (16 // len(groups) + 1))[:16]
    learner.step(batch)  # warm-up
    steps = []
    for _ in range(3):
        t0 = time.perf_counter()
        learner.step(batch)
        steps.append(time.perf_counter() - t0)
    per_group = statistics.median(steps) / len(batch)
    replay_g, audit_g = statistics.median(replay_s), statistics.median(audit_s)
    return {"replay_s_per_group": replay_g, "audit_s_per_group": audit_g, "step_s_per_group": per_group,
            "share": (replay_g + rate * audit_g) / per_group, "share_all_audited": (replay_g + audit_g) / per_group,
            "replay_share": replay_g / per_group}


def demo_groups(work, cfg, tok, n: int) -> list[tuple]:
    """Honest groups from the environment's worked episodes (the python tool: its programs run in the sandbox)."""
    from rewards.token_episode import TokenEpisode

    out = []
    for item, prompt in list(zip(work.items, work.prompts, strict=True))[:n]:
        turns = [m["content"] for m in work.env.demonstration(item) if m["role"] == "assistant"]
        eps = [TokenEpisode(work.env, item, tok, cfg.train.max_tokens, cfg.task.max_episode_tokens).play(turns, -0.5)
               for _ in range(G)]
        out.append((item, prompt, eps))
    return out
