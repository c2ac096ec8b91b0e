"""The attacks, each driven by a fresh `EvilNode` against a running trainer; shared by the tests and
bench/adversarial.py.

Every attack returns an `Outcome`: how many attempts it made, how many the trainer refused or caught with
one of the expected reason codes, the codes it saw, and the keys it used (to look for them in batches).
"""

from __future__ import annotations

import os
import re
import threading
import time
import uuid
from collections import Counter
from collections.abc import Callable
from dataclasses import dataclass, field

import msgspec

from rewards.base import Task, TaskItem
from swarm_common import protocol as P
from tests.adversarial.evil_node import EvilNode, Sampler

_EXPR = re.compile(r"\d+(?:[+\-*]\d+)+")


@dataclass
class Ctx:
    port: int
    sampler: Sampler
    task: Task
    group_size: int
    max_lag: int
    strikes_to_ban: int
    max_message_bytes: int
    summary: Callable[[], dict]  # the trainer's /api/summary


@dataclass
class Outcome:
    attempts: int = 0
    detected: int = 0
    codes: Counter = field(default_factory=Counter)
    node_ids: list[str] = field(default_factory=list)
    banned: bool = False
    steps_kept: float | None = None  # trainer steps per minute during the attack / just before it

    def saw(self, code: str | None, expected: set[str]) -> None:
        self.attempts += 1
        self.codes[code or "accepted"] += 1
        self.detected += code in expected


def together(attack: Callable[[], Outcome], n: int = 2) -> Outcome:
    """`n` copies of one attack run at once (colluding keys): their outcomes summed, banned if all were."""
    results: list[Outcome] = []
    threads = [threading.Thread(target=lambda: results.append(attack())) for _ in range(n)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    out = Outcome()
    for r in results:
        out.attempts += r.attempts
        out.detected += r.detected
        out.codes.update(r.codes)
        out.node_ids += r.node_ids
    out.banned = all(r.banned for r in results)
    return out


def _code(reply: P.Message | None) -> str | None:
    """The reason a reply refuses with (one per submission: a fraud taints all of it), or None if accepted."""
    if reply is None:
        return "no_reply"
    if isinstance(reply, P.Error):
        return reply.code
    if isinstance(reply, P.SubmissionResult):
        reasons = [r for r in reply.refused.values() if r != "submission_refused"]
        return reasons[0] if reasons else ("submission_refused" if reply.refused else None)
    return type(reply).__name__


def item_from_prompt(tok, prompt_ids: list[int]) -> TaskItem:
    """What a cheater does to rank its samples: read the problem off the prompt and solve it."""
    text = tok.decode(prompt_ids, skip_special_tokens=True)
    expr = _EXPR.findall(text)[-1]
    return TaskItem(id="cheat", prompt=expr, answer=str(eval(expr, {"__builtins__": {}})))  # noqa: S307


def reward_of(task: Task, tok, item: TaskItem, s: P.Sample) -> float:
    ids = s.token_ids[:-1] if s.finish_reason == "stop" else s.token_ids
    return task.score(item, tok.decode(ids, skip_special_tokens=True)).reward


def honest_rollouts(ctx: Ctx, work: P.WorkAssignment, version: int, n: int | None = None,
                    noise: float = 0.0) -> list[P.Rollout]:
    n = n or ctx.group_size
    return [P.Rollout(a.assignment_id, ctx.sampler.sample(version, a.prompt_token_ids, n, noise))
            for a in work.assignments]


def _work(ctx: Ctx, ev: EvilNode, prompts: int, back: int = 0) -> P.WorkAssignment:
    """Work, with the newest published version's model loaded first (and the one `back` versions before it,
    for attacks that sample an older one): a load on a busy machine can outlast the lag window (steps come
    several a second here), and an attempt refused as stale tests nothing."""
    newest = ctx.sampler.versions()[-1]
    for v in {newest, max(0, newest - back)}:
        ctx.sampler.model(v)
    return ev.work(prompts)


def _fresh(ctx: Ctx, name: str, out: Outcome) -> EvilNode:
    ev = EvilNode(ctx.port, name)
    ev.register()
    out.node_ids.append(ev.node_id)
    return ev


def _repeat_fraud(ctx: Ctx, name: str, expected: set[str], tamper: Callable[[EvilNode, P.WorkAssignment], tuple[int, list[P.Rollout]]],
                  prompts: int = 2, answers_work: bool = True, back: int = 0) -> Outcome:
    """Cheat until banned: every attempt must be refused with an expected code; the last strike bans.
    `answers_work` False: the fraud answers none of the assignments it was given, so they stay held (a
    fresh key holds only guard.new_key_held) and every attempt uses the same ones."""
    out = Outcome()
    ev = _fresh(ctx, name, out)
    work = None
    redone = False
    try:
        while out.attempts < ctx.strikes_to_ban:
            work = _work(ctx, ev, prompts, back) if work is None or answers_work else work
            version, rollouts = tamper(ev, work)
            code = _code(ev.submit(version, rollouts))
            if code == "stale" and "stale" not in expected and not redone:
                # The trainer stepped past the lag window while this machine loaded and sampled (CI, busy):
                # a stale refusal is no strike and tests nothing, so the attempt is made once more. Only
                # once: every stale refusal is an expiry, and the second in a row pauses the key.
                redone, work = True, None
                continue
            out.saw(code, expected)
        ev.send(P.WorkRequest(node_id=ev.node_id, version_loaded=ev.version, max_prompts=1))
        out.banned = _code(ev.recv()) == "banned"
    finally:
        ev.close()
    return out


def forged_rewards(ctx: Ctx) -> Outcome:
    """A submission that carries its own rewards: the schema has no such field, so it is malformed."""
    out = Outcome()
    ev = _fresh(ctx, "forged-rewards", out)
    try:
        # A malformed submission answers nothing: the same assignments stay held, and a fresh key holds
        # only guard.new_key_held of them: all three forgeries are for the same assignments.
        work = _work(ctx, ev, 2)
        for _ in range(3):
            rollouts = honest_rollouts(ctx, work, work.weights.version)
            sub = msgspec.to_builtins(P.RolloutSubmission(node_id=ev.node_id, version=work.weights.version,
                                                          rollouts=rollouts, gen_seconds=0.1))
            sub["type"] = "submission"
            sub["rewards"] = [[1.0] * ctx.group_size for _ in rollouts]
            payload = msgspec.msgpack.encode(sub)
            ev.send_frames([payload, ev.key.sign(payload)])
            out.saw(_code(ev.recv()), {"malformed"})
    finally:
        ev.close()
    return out


def _tamper_token(ev, work, ctx: Ctx):
    v = work.weights.version
    rollouts = honest_rollouts(ctx, work, v)
    eos = ctx.sampler.tok.eos_token_id
    for r in rollouts:
        s = r.samples[0]
        j = 0
        s.token_ids[j] = next(t for t in range(ord("0"), ord("9") + 1) if t != s.token_ids[j] and t != eos)
    return v, rollouts


def tampered_tokens(ctx: Ctx) -> Outcome:
    return _repeat_fraud(ctx, "tampered-tokens", {"logprob_mismatch", "implausible_token"},
                         lambda ev, w: _tamper_token(ev, w, ctx))


def _fabricate(ev, work, ctx: Ctx):
    v = work.weights.version
    rollouts = honest_rollouts(ctx, work, v)
    for r in rollouts:
        for s in r.samples:
            s.logprobs = [-0.05] * len(s.token_ids)  # "confident" samples: a large importance ratio later
    return v, rollouts


def fabricated_logprobs(ctx: Ctx) -> Outcome:
    return _repeat_fraud(ctx, "fabricated-logprobs", {"logprob_mismatch"}, lambda ev, w: _fabricate(ev, w, ctx))


def different_model(ctx: Ctx) -> Outcome:
    """Samples and log-probs, self-consistent, from a perturbed copy of the claimed version."""
    return _repeat_fraud(ctx, "different-model", {"logprob_mismatch", "implausible_token"},
                         lambda ev, w: (w.weights.version, honest_rollouts(ctx, w, w.weights.version, noise=0.05)))


def false_version(ctx: Ctx) -> Outcome:
    """Generated with the oldest version inside the window, claimed as the newest (or as one not yet out)."""
    def tamper(ev, w):
        v = w.weights.version
        if tamper.k % 2 == 0:
            tamper.k += 1
            # Far ahead: v + 1 may be out by the time this arrives (steps take a tenth of a second here),
            # and one step's weights are within the audit's tolerance of v's.
            return v + 1000, honest_rollouts(ctx, w, v)
        tamper.k += 1
        return v, honest_rollouts(ctx, w, max(0, v - ctx.max_lag))
    tamper.k = 0
    return _repeat_fraud(ctx, "false-version", {"logprob_mismatch", "future_version"}, tamper, back=ctx.max_lag)


def stale_version(ctx: Ctx) -> Outcome:
    """A version older than the lag window: refused as stale (an honest slow node can be stale: no strike),
    and each such refusal counts as an expiry, so the second in a row pauses the key: no more work."""
    out = Outcome()
    ev = _fresh(ctx, "stale-version", out)
    try:
        for _ in range(2):  # guard.expiries_to_pause
            work = _work(ctx, ev, 2)
            old = work.weights.version - ctx.max_lag - 1
            assert old >= 0, "the trainer has not published enough versions yet"
            out.saw(_code(ev.submit(old, honest_rollouts(ctx, work, old))), {"stale"})
        ev.send(P.WorkRequest(node_id=ev.node_id, version_loaded=ev.version, max_prompts=2))
        reply = ev.recv()
        out.saw("paused" if isinstance(reply, P.WorkAssignment) and not reply.assignments else "work", {"paused"})
    finally:
        ev.close()
    return out


def replay(ctx: Ctx) -> Outcome:
    """An honest submission, accepted (into quarantine), then sent again byte for byte."""
    out = Outcome()
    ev = _fresh(ctx, "replay", out)
    try:
        for _ in range(ctx.strikes_to_ban):
            work = _work(ctx, ev, 2)
            frames = ev.send(P.RolloutSubmission(node_id=ev.node_id, version=work.weights.version,
                                                 rollouts=honest_rollouts(ctx, work, work.weights.version),
                                                 gen_seconds=0.1))
            first = ev.recv()
            assert _code(first) is None, first
            ev.send_frames(frames)
            out.saw(_code(ev.recv()), {"unassigned"})
        ev.send(P.WorkRequest(node_id=ev.node_id, version_loaded=ev.version, max_prompts=1))
        out.banned = _code(ev.recv()) == "banned"
    finally:
        ev.close()
    return out


def unassigned(ctx: Ctx) -> Outcome:
    """Answers to prompts it was never given (ids made up; prompts from its own real assignment)."""
    def tamper(ev, w):
        v = ev.version  # the newest it heard of: the same assignments are reused while versions move on
        rollouts = honest_rollouts(ctx, w, v)
        return v, [P.Rollout(uuid.uuid4().hex[:16], r.samples) for r in rollouts]
    return _repeat_fraud(ctx, "unassigned", {"unassigned"}, tamper, answers_work=False)


def fewer_samples(ctx: Ctx) -> Outcome:
    return _repeat_fraud(ctx, "fewer-samples", {"wrong_group_size"},
                         lambda ev, w: (w.weights.version, honest_rollouts(ctx, w, w.weights.version, ctx.group_size - 1)))


def more_samples(ctx: Ctx) -> Outcome:
    return _repeat_fraud(ctx, "more-samples", {"wrong_group_size"},
                         lambda ev, w: (w.weights.version, honest_rollouts(ctx, w, w.weights.version, ctx.group_size + 1)))


def best_of_k(ctx: Ctx, k: int = 4, timeout_s: float = 120.0) -> Outcome:
    """Samples k*G per prompt, returns the G with the highest (recomputed) reward: honest log-probs.
    Counted in groups: attempts are groups submitted, detected those the paired test caught."""
    out = Outcome()
    ev = _fresh(ctx, f"best-of-{k}", out)
    end = time.monotonic() + timeout_s
    groups = 0
    try:
        while time.monotonic() < end:
            ev.send(P.WorkRequest(node_id=ev.node_id, version_loaded=ev.version, max_prompts=P.DEFAULT_MAX_PROMPTS))
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
                pool = ctx.sampler.sample(v, a.prompt_token_ids, k * ctx.group_size)
                item = item_from_prompt(ctx.sampler.tok, a.prompt_token_ids)
                pool.sort(key=lambda s, item=item: -reward_of(ctx.task, ctx.sampler.tok, item, s))
                rollouts.append(P.Rollout(a.assignment_id, pool[: ctx.group_size]))
            out.saw(_code(ev.submit(v, rollouts)), set())
            groups += len(rollouts)
        # What counts, group by group: those the paired test caught in quarantine, and the ban.
        row = next((n for n in ctx.summary()["nodes"] if n["node_id"] == ev.node_id), {})
        out.codes = Counter(row.get("refused", {})) + Counter(accepted_into_quarantine=out.codes["accepted"])
        out.detected = row.get("refused", {}).get("cherry_picking", 0)
        out.attempts = groups
    finally:
        ev.close()
    return out


def malformed(ctx: Ctx) -> Outcome:
    """Signed payloads that are not messages: a wrong schema, bad types, a cut-off submission."""
    out = Outcome()
    ev = _fresh(ctx, "malformed", out)
    try:
        work = _work(ctx, ev, 1)
        good = P.encode(P.RolloutSubmission(node_id=ev.node_id, version=work.weights.version,
                                            rollouts=honest_rollouts(ctx, work, work.weights.version),
                                            gen_seconds=0.1))
        payloads = [
            msgspec.msgpack.encode({"type": "submission", "node_id": ev.node_id, "version": "latest"}),
            msgspec.msgpack.encode({"type": "no_such_message", "node_id": ev.node_id}),
            msgspec.msgpack.encode([1, 2, 3]),
            good[: len(good) // 2],  # truncated, then signed: the signature is fine, the message is not
        ]
        for payload in payloads:
            ev.send_frames([payload, ev.key.sign(payload)])
            out.saw(_code(ev.recv()), {"malformed"})
        ev.send_frames([good[:-7], ev.key.sign(good)])  # truncated after signing
        out.saw(_code(ev.recv()), {"malformed", "bad_signature"})
    finally:
        ev.close()
    return out


def random_bytes(ctx: Ctx) -> Outcome:
    out = Outcome()
    ev = EvilNode(ctx.port, "random")  # never registers: nothing about it is known
    try:
        for frames in ([os.urandom(100)], [os.urandom(300), os.urandom(64)], [os.urandom(10), os.urandom(10)],
                       [os.urandom(50), os.urandom(64), os.urandom(8)]):
            ev.send_frames(frames)
            out.saw(_code(ev.recv()), {"unsigned", "malformed"})
    finally:
        ev.close()
    return out


def oversized(ctx: Ctx) -> Outcome:
    """A message over server.max_message_bytes: zmq drops the connection before the trainer reads it."""
    out = Outcome()
    ev = _fresh(ctx, "oversized", out)
    try:
        ev.send_frames([os.urandom(ctx.max_message_bytes + 1024), os.urandom(64)])
        time.sleep(1.0)  # the DEALER reconnects on its own, as a new peer the trainer does not know
        ev.send(P.WorkRequest(node_id=ev.node_id, version_loaded=ev.version, max_prompts=1))
        out.saw(_code(ev.recv()), {"unknown_node"})
    finally:
        ev.close()
    return out


def flood(ctx: Ctx, n: int = 1500) -> Outcome:
    """Many signed messages as fast as it can: past the burst, each one is refused as rate_limited."""
    out = Outcome()
    ev = _fresh(ctx, "flood", out)
    try:
        for _ in range(n):
            ev.send(P.Heartbeat(node_id=ev.node_id, version_loaded=0))
        limited = 0
        while (reply := ev.recv(2.0)) is not None:  # a heartbeat within the rate gets no reply at all
            limited += _code(reply) == "rate_limited"
        out.attempts, out.detected = n, limited
        out.codes["rate_limited"] = limited
    finally:
        ev.close()
    return out


ATTACKS: dict[str, Callable[[Ctx], Outcome]] = {
    "forged_rewards": forged_rewards,
    "tampered_tokens": tampered_tokens,
    "fabricated_logprobs": fabricated_logprobs,
    "different_model": different_model,
    "false_version": false_version,
    "stale_version": stale_version,
    "replay": replay,
    "unassigned": unassigned,
    "fewer_samples": fewer_samples,
    "more_samples": more_samples,
    "best_of_4": best_of_k,
    "malformed": malformed,
    "random_bytes": random_bytes,
    "oversized": oversized,
    "flood": flood,
}
