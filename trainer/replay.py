"""Replay a run's recorded batches from its starting policy: the result must equal the run's final model.

The ledger holds every accepted group in full and, per step, which groups were trained on in which
order. Re-running those GRPO steps from the starting weights with the same settings must give the
same parameters as the trainer's last checkpoint, crashes and resumes included: a check that nothing
was trained on twice, skipped, or changed on the way.
"""

from __future__ import annotations

import torch

from trainer.config import RunConfig
from trainer.learner import make_learner
from trainer.ledger import Ledger
from trainer.model_prep import prepare_base_model
from trainer.policy import load_model, load_tokenizer


def replay(cfg: RunConfig, progress: bool = False):
    torch.set_num_threads(cfg.train.torch_threads)
    base = prepare_base_model(cfg, progress=progress)
    model, tok = load_model(base), load_tokenizer(base)
    model.eval()
    learner = make_learner(cfg, model, tok)
    led = Ledger(cfg.run_dir, write=False)
    groups = {g.assignment_id: g for g in led.read_accepted()}
    for line in led.read_batches():
        learner.step([groups[aid] for _, aid, _, _ in line.groups])
    return model


def max_param_diff(a, b) -> float:
    sa, sb = a.state_dict(), b.state_dict()
    return max((sa[k].float() - sb[k].float()).abs().max().item() for k in sa)
