"""The computation audit: re-score a node's samples with the exact weights it claims to have used.

For an audited group the trainer runs a prefill of prompt + completion with the claimed version's
published weights and compares, token by token, the node's log-probs with its own (same temperature,
same precision). A node that tampered with tokens, made up log-probs, ran another model or claimed a
version it did not use lands outside the tolerance. The same pass checks that every sampled token was
plausible under the claimed sampling parameters: not vanishingly unlikely, and inside the top-p set.

The tolerance is calibrated from honest nodes: every audit that passes records its largest deviation,
and the run reports their distribution (`calibration`).
"""

from __future__ import annotations

import copy
import random
import threading
from dataclasses import dataclass, field

import msgspec
import torch

from swarm_common import protocol as P
from trainer.policy import completion_logits, pack_groups


class AuditConfig(msgspec.Struct, forbid_unknown_fields=True, kw_only=True, frozen=True):
    """The run config's [audit] section."""

    enabled: bool = True
    rate: float = 0.1  # share of groups audited from established nodes
    new_node_groups: int = 8  # every group of a node's first N is audited (and all of a suspect's)
    tol: float = 0.01  # largest accepted |node log-prob - recomputed log-prob|, in nats
    # Implausible: the sampled token and every token no more likely than it hold less than this mass. An
    # honest sampler picks such a token with probability below min_tail_mass (a p-value per token), so
    # the false-alarm rate is known whatever the vocabulary; a raw log-prob floor is not (a 49k-token
    # vocabulary at T=1 samples e^-18-rare tokens now and then: an honest node was banned for it).
    min_tail_mass: float = 1e-9
    top_p_slack: float = 1e-3


@dataclass
class AuditResult:
    reason: str | None  # None when the group passed
    max_diff: float
    worst_logprob: float
    worst_tail: float = 1.0  # smallest tail mass (see min_tail_mass) among the sampled tokens


@dataclass
class Calibration:
    diffs: list[float] = field(default_factory=list)

    def summary(self) -> dict[str, float]:
        if not self.diffs:
            return {"audits": 0}
        d = sorted(self.diffs)
        q = lambda p: d[min(len(d) - 1, int(p * len(d)))]  # noqa: E731
        return {"audits": len(d), "median": q(0.5), "p99": q(0.99), "max": d[-1]}


class Auditor:
    def __init__(self, model, pad_id: int, temperature: float, top_p: float, cfg: AuditConfig, seed: int = 0):
        self.model = copy.deepcopy(model).eval().requires_grad_(False)
        self.pad_id, self.temperature, self.top_p, self.cfg = pad_id, temperature, top_p, cfg
        self.versions: dict[int, dict[str, torch.Tensor]] = {}
        self.loaded: int | None = None
        self.rng = random.Random(seed)
        self.calibration = Calibration()
        self.lock = threading.Lock()  # one user at a time of the shared model (audits, trainer/reference.py)

    def remember(self, version: int, state: dict[str, torch.Tensor], keep_from: int) -> None:
        """Keep version `version`'s weights (a state dict no one changes) and forget those older than
        `keep_from`."""
        with self.lock:
            self.versions[version] = state
            for v in [v for v in self.versions if v < keep_from]:
                del self.versions[v]

    def load(self, version: int):
        """The model with version `version`'s weights, or None when they are not kept (hold `lock`)."""
        state = self.versions.get(version)
        if state is None:
            return None
        if self.loaded != version:
            self.model.load_state_dict(state)
            self.loaded = version
        return self.model

    def should_audit(self, groups_from_node: int, suspect: bool) -> bool:
        if suspect or groups_from_node < self.cfg.new_node_groups:
            return True
        return self.rng.random() < self.cfg.rate

    @torch.no_grad()
    def audit(self, prompt_ids: list[int], samples: list[P.Sample], version: int,
              masks: list[list[bool]] | None = None) -> AuditResult:
        """`masks`: for episodes, which tokens were sampled; only those are compared (the environment's
        tokens have no sampling log-prob, and the replay has checked them exactly)."""
        with self.lock:
            model = self.load(version)
            if model is None:
                return AuditResult("unknown_version", 0.0, 0.0)
            b = pack_groups([prompt_ids], [[s.token_ids for s in samples]], [[s.logprobs for s in samples]],
                            self.pad_id, masks=[masks])
            logits = completion_logits(model, b)
        logprobs = torch.log_softmax(logits / self.temperature, dim=-1)
        mask = b.loss_mask.bool()
        targets = b.completion_ids
        ours = logprobs.gather(-1, targets.unsqueeze(-1)).squeeze(-1)
        diff = ((ours - b.old_logp).abs() * mask).max().item()
        worst = ours.masked_fill(~mask, 0.0).min().item()
        if diff > self.cfg.tol:
            return AuditResult("logprob_mismatch", diff, worst)
        probs = logprobs.exp()
        p_tok = probs.gather(-1, targets.unsqueeze(-1))
        tail = (probs * (probs <= p_tok)).sum(-1)  # the sampled token's mass and all less likely tokens'
        worst_tail = tail.masked_fill(~mask, 1.0).min().item()
        if worst_tail < self.cfg.min_tail_mass:
            return AuditResult("implausible_token", diff, worst, worst_tail)
        if self.top_p < 1.0:
            # The nucleus: tokens whose more-likely competitors hold less than top_p of the mass.
            mass_above = (probs * (probs > p_tok)).sum(-1)
            outside = (mass_above > self.top_p + self.cfg.top_p_slack) & mask
            if outside.any():
                return AuditResult("outside_top_p", diff, worst, worst_tail)
        self.calibration.diffs.append(diff)
        return AuditResult(None, diff, worst, worst_tail)
