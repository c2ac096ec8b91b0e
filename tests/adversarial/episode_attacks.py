"""Attacks on multi-turn work: a node that forges what the environment said, or how its episode went.

Each attacker is a fresh key over the real protocol. It samples honest episodes of the environment the
trainer names with a published version's weights (HF, `EpisodeSampler`), tampers with them, and then, to
be as strong as it can, recomputes every sampled token's log-prob on the tampered sequence by a prefill
of the same weights: the computation audit alone sees nothing wrong with such an episode. What catches
each attack is the trainer's replay of the environment (trainer/episode_check.py), or for cherry-picking
whole episodes the paired reward test on probation.
"""

from __future__ import annotations

import threading
import time
from collections import Counter
from collections.abc import Callable

import torch

from rewards.base import TaskItem
from rewards.calculator import calc
from rewards.registry import make_task
from rewards.token_episode import TokenEpisode
from swarm_common import protocol as P
from swarm_common.chat import observation_ids
from tests.adversarial.attacks import Ctx, Outcome, _code, _fresh, together

SAMPLE_LOCK = threading.Lock()


class EpisodeSampler:
    """Episodes of the environment a hand-out names, sampled turn by turn with HF from a published version."""

    def __init__(self, ctx: Ctx):
        self.ctx = ctx

    def episodes(self, work: P.WorkAssignment, a: P.Assignment, n: int, version: int,
                 alive: Callable[[], None] = lambda: None) -> list[TokenEpisode]:
        """`alive` is called every turn: the attacker heartbeats, or a slow sample would make it look gone."""
        s = self.ctx.sampler
        with SAMPLE_LOCK, torch.no_grad():
            alive()
            model = s.model(version)
            tok, env = s.tok, make_task(work.env.name, **work.env.params)
            item = TaskItem(id=a.item.id, prompt=a.item.prompt, answer="", meta=dict(a.item.meta))
            eps = [TokenEpisode(env, item, tok, work.sampling.max_tokens, work.env.max_episode_tokens) for _ in range(n)]
            while active := [te for te in eps if not te.done]:  # one batched generate per turn, left-padded
                alive()
                seqs = [a.prompt_token_ids + te.ids for te in active]
                L = max(map(len, seqs))
                ids = torch.tensor([[tok.pad_token_id] * (L - len(q)) + q for q in seqs])
                attn = torch.tensor([[0] * (L - len(q)) + [1] * len(q) for q in seqs])
                out = model.generate(input_ids=ids, attention_mask=attn, do_sample=True, temperature=1.0, top_p=1.0,
                                     top_k=0, max_new_tokens=max(te.turn_budget() for te in active),
                                     eos_token_id=active[0].stop_id, pad_token_id=tok.pad_token_id)
                for te, row in zip(active, out[:, L:].tolist(), strict=True):
                    turn = row[: te.turn_budget()]
                    if te.stop_id in turn:
                        turn = turn[: turn.index(te.stop_id) + 1]
                    te.add_turn(turn, [0.0] * len(turn))
        return eps

    def submit_form(self, version: int, prompt: list[int], ids: list[int], mask: list[bool],
                    finish: str) -> P.Episode:
        """An episode as sent, its sampled tokens' log-probs recomputed on exactly these tokens."""
        s = self.ctx.sampler
        with SAMPLE_LOCK:
            full = s.logprobs(s.model(version), prompt, [ids])[0]
        return P.Episode(ids, mask, [lp for lp, m in zip(full, mask, strict=True) if m], finish)


def _heartbeat(ev, version: int) -> None:
    ev.send(P.Heartbeat(node_id=ev.node_id, version_loaded=version))


def spans(mask: list[bool]) -> list[tuple[int, int, bool]]:
    out, i = [], 0
    while i < len(mask):
        j = i
        while j < len(mask) and mask[j] == mask[i]:
            j += 1
        out.append((i, j, mask[i]))
        i = j
    return out


Tamper = Callable[[TokenEpisode, P.Assignment, object], tuple[list[int], list[bool], str] | None]


def _episode_fraud(ctx: Ctx, name: str, expected: set[str], tamper: Tamper, prompts: int = 2) -> Outcome:
    """Cheat until banned: each attempt tampers with one episode per group (the first it applies to: some
    lies need a tool call in the episode), the rest honest."""
    out = Outcome()
    ev = _fresh(ctx, name, out)
    sampler = EpisodeSampler(ctx)
    try:
        for _ in range(ctx.strikes_to_ban):
            work = ev.work(prompts)
            v = work.weights.version
            rollouts = []
            for a in work.assignments:
                for _ in range(5):  # a group with no episode the lie fits is sampled again
                    eps = sampler.episodes(work, a, ctx.group_size, v, lambda v=v: _heartbeat(ev, v))
                    forged = [tamper(te, a, ctx.sampler.tok) for te in eps]
                    if any(forged):
                        break
                k = next(i for i, f in enumerate(forged) if f)
                sent = []
                _heartbeat(ev, v)
                for i, te in enumerate(eps):
                    ids, mask, finish = forged[k] if i == k else (te.ids, te.mask, te.finish)
                    sent.append(sampler.submit_form(v, a.prompt_token_ids, ids, mask, finish))
                rollouts.append(P.Rollout(a.assignment_id, [], sent))
            out.saw(_code(ev.submit(v, rollouts)), expected)
        ev.send(P.WorkRequest(node_id=ev.node_id, version_loaded=ev.version, max_prompts=1))
        out.banned = _code(ev.recv()) == "banned"
    finally:
        ev.close()
    return out


def _first_answer(te: TokenEpisode) -> tuple[int, int] | None:
    env_spans = [(i, j) for i, j, m in spans(te.mask) if not m]
    return env_spans[0] if env_spans else None


def _swap_answer(te: TokenEpisode, tok, text: str):
    """The environment's first answer replaced by `text` (as the environment would render it); None for an
    episode without a tool call."""
    span = _first_answer(te)
    if span is None:
        return None
    i, j = span
    new = observation_ids(tok, [{"role": "tool", "name": "calc", "content": text}])
    return te.ids[:i] + new + te.ids[j:], te.mask[:i] + [False] * len(new) + te.mask[j:], te.finish


def forged_observation(ctx: Ctx) -> Outcome:
    def tamper(te, a, tok):
        return _swap_answer(te, tok, "1234567")
    return _episode_fraud(ctx, "forged-observation", {"observation_mismatch"}, tamper)


def edited_tool_result(ctx: Ctx) -> Outcome:
    """The tool's result edited to the right answer, and the final turn to match: a reward the model did
    not earn (the attacker reads the expression off the prompt and computes it)."""
    def tamper(te, a, tok):
        right = calc(a.item.prompt)
        if _first_answer(te) is None:
            return None
        ids, mask, finish = _swap_answer(te, tok, right)
        last = max(i for i, _, m in spans(mask) if m)
        answer = tok(right, add_special_tokens=False)["input_ids"] + [te.stop_id]
        return ids[:last] + answer, mask[:last] + [True] * len(answer), "stop"
    return _episode_fraud(ctx, "edited-tool-result", {"observation_mismatch"}, tamper)


def skipped_tool_call(ctx: Ctx) -> Outcome:
    def tamper(te, a, tok):
        span = _first_answer(te)
        if span is None:
            return None
        i, j = span
        return te.ids[:i] + te.ids[j:], te.mask[:i] + te.mask[j:], te.finish
    return _episode_fraud(ctx, "skipped-tool-call", {"missing_observation"}, tamper)


def invented_tool_call(ctx: Ctx) -> Outcome:
    """A first turn that calls nothing, then a tool result and a second turn: an exchange that never was."""
    def tamper(te, a, tok):
        first = tok("12345", add_special_tokens=False)["input_ids"] + [te.stop_id]
        obs = observation_ids(tok, [{"role": "tool", "name": "calc", "content": calc(a.item.prompt)}])
        final = tok(calc(a.item.prompt), add_special_tokens=False)["input_ids"] + [te.stop_id]
        return first + obs + final, [True] * len(first) + [False] * len(obs) + [True] * len(final), "stop"
    return _episode_fraud(ctx, "invented-tool-call", {"unexpected_observation"}, tamper)


def sampled_labelled_environment(ctx: Ctx) -> Outcome:
    """The final answer, forged to the right one, labelled as environment tokens: no log-prob to audit."""
    def tamper(te, a, tok):
        if _first_answer(te) is None:
            return None
        last = max(i for i, _, m in spans(te.mask) if m)
        answer = tok(calc(a.item.prompt), add_special_tokens=False)["input_ids"] + [te.stop_id]
        return te.ids[:last] + answer, te.mask[:last] + [False] * len(answer), "stop"
    return _episode_fraud(ctx, "sampled-as-environment", {"observation_mismatch", "unexpected_observation"},
                          tamper)


def environment_labelled_sampled(ctx: Ctx) -> Outcome:
    def tamper(te, a, tok):
        span = _first_answer(te)
        if span is None:
            return None
        i, j = span
        return te.ids, te.mask[:i] + [True] * (j - i) + te.mask[j:], te.finish
    return _episode_fraud(ctx, "environment-as-sampled", {"bad_mask"}, tamper)


def cut_short(ctx: Ctx) -> Outcome:
    """Only the first turn (a tool call), claimed complete: the rest, where the model went wrong, dropped."""
    def tamper(te, a, tok):
        if _first_answer(te) is None:
            return None
        first = spans(te.mask)[0][1]
        return te.ids[:first], te.mask[:first], "stop"
    return _episode_fraud(ctx, "cut-short", {"cut_short", "bad_finish"}, tamper)


def retokenized_observation(ctx: Ctx) -> Outcome:
    """Environment tokens that decode to the environment's exact text but are other ids (a special token
    spelled out byte by byte)."""
    def tamper(te, a, tok):
        span = _first_answer(te)
        if span is None:
            return None
        i, j = span
        spelled = []
        for t in te.ids[i:j]:  # every added (special) token spelled out in ordinary tokens
            text = tok.convert_ids_to_tokens(t)
            added = t in tok.added_tokens_decoder
            spelled += tok(text, add_special_tokens=False, split_special_tokens=True)["input_ids"] if added else [t]
        assert tok.decode(spelled) == tok.decode(te.ids[i:j]) and spelled != te.ids[i:j]
        if len(te.ids) - (j - i) + len(spelled) > te.max_episode_tokens:
            return None  # too long to send: the shape check would refuse it (bad_episode) before the replay
        return te.ids[:i] + spelled + te.ids[j:], te.mask[:i] + [False] * len(spelled) + te.mask[j:], te.finish
    return _episode_fraud(ctx, "retokenized-observation", {"observation_mismatch"}, tamper)


def best_of_k_episodes(ctx: Ctx, k: int = 4, timeout_s: float = 300.0) -> Outcome:
    """Runs k*G whole episodes per prompt and returns the G best (rewards the attacker computes itself, from
    the expression in the prompt). Every episode is honest, token for token; only the choice is not. Two
    prompts a round: HF samples k*G episodes a prompt, and on a busy machine four prompts' worth came after
    the lag window (refused 'late') before any pair was compared. It stops once banned."""
    out = Outcome()
    ev = _fresh(ctx, f"best-of-{k}-episodes", out)
    sampler = EpisodeSampler(ctx)
    end, groups = time.monotonic() + timeout_s, 0
    try:
        while time.monotonic() < end:
            ev.send(P.WorkRequest(node_id=ev.node_id, version_loaded=ev.version, max_prompts=2))
            work = ev.recv()
            if isinstance(work, P.Error) and work.code == "banned":
                out.banned = True
                break
            assert isinstance(work, P.WorkAssignment), work
            ev.version = max(ev.version, work.weights.version)
            if not work.assignments:
                time.sleep(0.3)
                continue
            v = work.weights.version
            rollouts = []
            for a in work.assignments:
                pool = sampler.episodes(work, a, k * ctx.group_size, v, lambda v=v: _heartbeat(ev, v))
                answer = calc(a.item.prompt)
                for te in pool:
                    te.item = TaskItem(te.item.id, te.item.prompt, answer, te.item.meta)
                    te.episode.item = te.item
                pool.sort(key=lambda te: -te.score().reward)
                rollouts.append(P.Rollout(a.assignment_id, [], [
                    sampler.submit_form(v, a.prompt_token_ids, te.ids, te.mask, te.finish)
                    for te in pool[: ctx.group_size]]))
            out.saw(_code(ev.submit(v, rollouts)), set())
            groups += len(rollouts)
        row = next((n for n in ctx.summary()["nodes"] if n["node_id"] == ev.node_id), {})
        out.codes = Counter(row.get("refused", {})) + Counter(accepted_into_quarantine=out.codes["accepted"])
        out.detected = row.get("refused", {}).get("cherry_picking", 0)
        out.attempts = groups
    finally:
        ev.close()
    return out


def colluding_best_of_k_episodes(ctx: Ctx, k: int = 4) -> Outcome:
    """Two best-of-k episode pickers together: never paired with each other, both caught on probation."""
    return together(lambda: best_of_k_episodes(ctx, k))


EPISODE_ATTACKS: dict[str, Callable[[Ctx], Outcome]] = {
    "forged_observation": forged_observation,
    "edited_tool_result": edited_tool_result,
    "skipped_tool_call": skipped_tool_call,
    "invented_tool_call": invented_tool_call,
    "sampled_as_environment": sampled_labelled_environment,
    "environment_as_sampled": environment_labelled_sampled,
    "cut_short": cut_short,
    "retokenized_observation": retokenized_observation,
    "colluding_best_of_4_episodes": colluding_best_of_k_episodes,
}
