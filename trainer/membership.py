"""Keys in and out of the node service: who may register, what a node is told when it does (or when it only
says Hello), and forgetting keys that went silent.

Registration is budgeted per source address and prefix and may cost a proof of work or an invite
(trainer/admission.py); a registration must be newer than the key's last one. A key that is not
established and has been silent past `guard.forget_after_s`, holding no work and nothing in quarantine,
is forgotten: a flood of throwaway keys costs the run nothing once they go quiet, and an honest node that
comes back simply registers again.
"""

from __future__ import annotations

import logging
import time
from collections.abc import Callable, Container

from swarm_common import protocol as P
from trainer.admission import Admission
from trainer.config import RunConfig
from trainer.guard import Guard
from trainer.newcomers import Newcomers
from trainer.node_registry import NodeRegistry
from trainer.probation import Probation
from trainer.stats import RunStats
from trainer.work import WorkHandout
from trainer.work_share import WorkShare

log = logging.getLogger(__name__)


class Membership:
    def __init__(self, cfg: RunConfig, guard: Guard, registry: NodeRegistry, stats: RunStats, work: WorkHandout,
                 share: WorkShare, probation: Probation, newcomers: Newcomers, tracker_url: str, trainer_key: str,
                 sampling: P.SamplingSpec, weights_info: Callable[[], P.WeightsInfo]):
        self.cfg, self.guard, self.registry, self.stats = cfg, guard, registry, stats
        self.work, self.share, self.probation, self.newcomers = work, share, probation, newcomers
        self.tracker_url, self.trainer_key, self.sampling = tracker_url, trainer_key, sampling
        self.weights_info = weights_info
        self.admission = Admission(cfg.run_dir, cfg.guard, cfg.task.open_to_strangers)
        self.idents: dict[str, bytes] = {}  # node id -> zmq routing identity

    def register(self, ident: bytes, msg: P.Register, source: str) -> P.Message:
        if msg.protocol != P.PROTOCOL_VERSION:
            return P.Error(code="protocol", message=f"trainer speaks protocol {P.PROTOCOL_VERSION}")
        established = self.guard.is_established(msg.node_id)
        if not established and not self.admission.register_allowed(source):
            self.stats.refuse(None, "register_rate")
            return P.Error(code="rate_limited", message=f"too many registrations from {source}; slow down")
        refusal = self.admission.check(msg, established)
        if refusal is not None:
            self.stats.refuse(None, refusal.code)
            return refusal
        if not self.guard.fresh_register(msg.node_id, msg.time_ms):
            return P.Error(code="stale_register", message="registration older than the last one, or clock off")
        rec = self.registry.register(msg.node_id, msg.name, msg.status_url)
        self.idents[msg.node_id] = ident
        self.probation.begin(msg.node_id)
        rec.standing = ("trusted" if msg.node_id in self.guard.cfg.trusted else "established" if established
                        else "probation" if self.probation.holds(msg.node_id) else "open")
        log.info("node %s registered (%s)", msg.name, msg.node_id[:12])
        return P.Registered(node_id=msg.node_id, weights=self.weights_info(), sampling=self.sampling,
                            heartbeat_s=self.cfg.server.heartbeat_s, max_lag=self.cfg.train.max_lag,
                            tracker_url=self.tracker_url_for(msg.trainer_host), trainer_key=self.trainer_key)

    def hello(self, msg: P.Hello, source: str) -> P.Message:
        """Where things are, and where the sender's key stands (`swarm doctor`); registers nothing."""
        if not self.admission.register_allowed(source):
            return P.Error(code="rate_limited", message=f"too many requests from {source}; slow down")
        established = self.guard.is_established(msg.node_id)
        standing = "established" if established else "probation" if self.probation.holds(msg.node_id) else "new"
        return P.Welcome(protocol=P.PROTOCOL_VERSION, trainer_key=self.trainer_key,
                         tracker_url=self.tracker_url_for(msg.trainer_host), http_port=self.cfg.server.http_port,
                         version=self.work.version, seen_as=source, standing=standing,
                         unpaired=not established and not self.newcomers.can_pair(),
                         shared_prompts=self.guard.pairs.n[msg.node_id])

    def tracker_url_for(self, trainer_host: str) -> str:
        """Where a node reaches the tracker: the operator's public address, else the host the node reached
        this trainer at (`trainer_host`: the tracker listens beside the node port), else the bound address."""
        host = self.cfg.server.public_host or trainer_host
        if not host:
            return self.tracker_url
        return f"http://{f'[{host}]' if ':' in host else host}:{self.cfg.server.tracker_port}"

    def forget_silent(self, waiting: Container[str]) -> None:
        """Forget keys that are not established, silent past guard.forget_after_s, holding no work, nothing
        in quarantine and no request `waiting`."""
        cutoff = time.monotonic() - self.cfg.guard.forget_after_s
        busy = {h.node_id for h in self.work.held.values()} | {g.node_id for g in self.probation.quarantine}
        silent = [n for n, r in self.registry.nodes.items() if r.last_seen < cutoff and n not in busy
                  and n not in waiting and not self.guard.is_established(n)]
        for node_id in silent:
            self.idents.pop(node_id, None)
            self.share.forget(node_id)
            self.guard.forget(node_id)
            self.probation.forget(node_id)
            self.stats.forget(self.registry.forget(node_id))
        if silent:
            log.info("forgot %d keys silent for %.0fs (they register again if they come back)", len(silent),
                     self.cfg.guard.forget_after_s)
