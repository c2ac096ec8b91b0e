"""Run configuration: typed sections with defaults, loaded from one TOML file, overridden from the CLI.
The loss, the guard and the audit own their sections' structs (trainer/grpo.py, guard.py, audit.py).

`load_config(path, overrides)` reads the file (optional), applies `section.key=value` overrides (values
parsed as TOML, so `train.lr=3e-4` is a float and `task.params={digits=1}` a table) and validates the
result against the structs below: unknown keys and wrong types are errors, not silent defaults.
"""

from __future__ import annotations

import logging
import tomllib
from pathlib import Path
from typing import Any, Literal

import msgspec

from broadcast.config import OriginConfig
from trainer.audit import AuditConfig
from trainer.grpo import LossConfig
from trainer.guard import GuardConfig

log = logging.getLogger(__name__)


class ModelConfig(msgspec.Struct, forbid_unknown_fields=True, kw_only=True):
    path: str = ""  # a local HF model directory; empty = the embedded default, built offline
    # Supervised warm-up steps on the task's format before RL (trainer/sft.py). -1: 150 for the embedded
    # default, none for a model of your own (`path`); 0: none.
    sft_steps: int = -1
    sft_lr: float = 3e-3
    sft_batch: int = 64
    # > 0: the warm-up stops at the first of its checks (every 10 steps: greedy accuracy on items of the
    # training split, never the held-out ones) that reaches this; `sft_steps` is then its most. At a fixed 150
    # steps the demo's start ranged 0.07-0.52 held-out over model seeds 0-7, and another machine's float path
    # is another such draw (docs/benchmarks.md, "The warm-up's spread").
    sft_until: float = 0.0
    seed: int = 0
    max_shard_bytes: int = 2 * 2**20  # shard size of published versions (HF layout with an index)
    # dtype of published versions; the trainer keeps fp32 master weights either way, and the audit
    # recomputes with exactly the published weights. bfloat16 halves the bytes every node fetches (and
    # makes deltas 20x smaller), but an update smaller than bf16's resolution does not reach the nodes:
    # on SmolLM2 at lr 1e-5, 3 seeds each (docs/benchmarks.md), fp32 reached the target on 3 of 3, bf16 on
    # 2 of 3 (seed 1 stalled at 0.27 after 12 steps), though bf16 steps were 1.5x faster.
    publish_dtype: Literal["float32", "bfloat16"] = "float32"

    def __post_init__(self) -> None:
        if not 0.0 <= self.sft_until <= 1.0:
            raise ValueError(f"model.sft_until is an accuracy in [0, 1], not {self.sft_until}")


class TaskConfig(msgspec.Struct, forbid_unknown_fields=True, kw_only=True):
    name: str = "arithmetic"
    # Sums of three one-digit numbers: the tiny model can learn them, and the item space (1000 problems)
    # leaves ~150 held out for evaluation that training never sees.
    params: dict[str, Any] = msgspec.field(
        default_factory=lambda: {"digits": 1, "terms": 3, "ops": "+", "eval_share": 0.15}
    )
    eval_size: int = 120
    seed: int = 0
    # Environments (multi-turn tasks: calculator, guess, python; rewards/registry.py). train.max_tokens is
    # then per turn; an episode's tokens after the prompt (sampled and the environment's) are at most:
    max_episode_tokens: int = 192
    # Sandbox seconds (wall) the trainer may spend replaying the tool calls (the python tool) of a submission,
    # per group in it: past them the rest is refused (replay_budget) and the node is audited in full from
    # then on, so a replay bomb costs its sender its work, not the run its time. An honest group of 8
    # episodes with two short programs each takes ~1 s here.
    replay_sandbox_s: float = 10.0
    # May nodes that are not in guard.trusted run this task's episodes? Only an environment the trainer can
    # replay (Environment.replayable) may be open to strangers; the trainer refuses to start otherwise.
    open_to_strangers: bool = True


class TrainConfig(msgspec.Struct, forbid_unknown_fields=True, kw_only=True):
    max_steps: int = 400
    max_minutes: float = 0.0  # stop after this many minutes of RL (0 = no limit)
    group_size: int = 8  # G completions per prompt
    prompts_per_step: int = 16  # groups per optimizer step
    lr: float = 2e-4
    weight_decay: float = 0.0
    grad_clip: float = 1.0
    scale_adv_by_std: bool = False
    max_lag: int = 2  # rollouts from up to this many versions back are accepted
    inflight_groups: int = 24  # pacing: groups buffered or assigned at once, beyond which nodes wait
    # Freshness of new work: it goes only to nodes at most this many versions behind the newest policy the
    # learner has made (which may still be on its way to them). 1: generation overlaps the learner's step,
    # rollouts are trained ~2 versions stale. 0: nodes wait for the version just made, rollouts are ~1 stale
    # and teach more per step (measured on SmolLM2: configs/smollm2-arith.toml), at the price of node time
    # spent waiting.
    work_lag: int = 1
    # Dynamic sampling (DAPO): accepted groups whose samples all scored the same (all right, or all wrong)
    # have zero advantage; they are dropped on arrival (the ledger says so) rather than filling a batch
    # slot, and nodes generate more in their place. Off: such groups take batch slots and are skipped in
    # the step. Off by default: measured only with bf16 versions, it saved steps on SmolLM2 but not always
    # time (seed 0: 180 s to the target against 203 s; seed 1: 205 s against 177 s).
    dynamic_sampling: bool = False
    max_tokens: int = 6
    temperature: float = 1.0
    top_p: float = 1.0
    eval_every: int = 10  # steps between held-out evaluations (0 = only at the start and the end)
    snapshot_every: int = 0  # steps between kept copies of the policy in RUN/snapshots/ (0 = none)
    checkpoint_every: int = 25  # steps between checkpoints (model, optimizer, cursor, RNG); 0 = only at the end
    keep_versions: int = 3
    torch_threads: int = 1
    # A sharded learner's (swarm train --nproc N) longest wait on a collective before a lost rank stops the
    # run with a clear error (resume from the last checkpoint).
    dist_timeout_s: float = 300.0
    seed: int = 0


class ServerConfig(msgspec.Struct, forbid_unknown_fields=True, kw_only=True):
    host: str = "127.0.0.1"  # the address every listener binds (0.0.0.0: all interfaces)
    # The address nodes reach this machine at, when it is not the one they dialled (a NAT, a floating IP,
    # a DNS name). Empty: each node is told the tracker is at the host it reached the node port at.
    public_host: str = ""
    port: int = 5555  # zmq ROUTER for nodes
    http_port: int = 5556  # /api and /metrics
    web_port: int = 8265  # the live web view (0: any free port, -1: none); its /api is on http_port too
    web_host: str = "127.0.0.1"  # set 0.0.0.0 to show the page to other machines
    tracker_port: int = 5557  # the relay tree's origin and tracker (weights leave the trainer only here)
    # The relay tree's own knobs ([server.tree]: fanout, piece_bytes, max_peers, full_every, ...), owned by
    # broadcast/config.py. Its heartbeat (tree.heartbeat_s) is the tree's; heartbeat_s below is the nodes'.
    tree: OriginConfig = msgspec.field(default_factory=OriginConfig)
    heartbeat_s: float = 2.0  # how often nodes tell the trainer they are alive
    assignment_timeout_s: float = 120.0  # work not answered by then is re-assigned
    gone_after_s: float = 0.0  # a node silent this long is gone and its work re-assigned (0 = 10 x heartbeat_s)
    max_message_bytes: int = 8 * 2**20


class RunConfig(msgspec.Struct, forbid_unknown_fields=True, kw_only=True):
    run_dir: str = "runs/demo"
    model: ModelConfig = msgspec.field(default_factory=ModelConfig)
    task: TaskConfig = msgspec.field(default_factory=TaskConfig)
    train: TrainConfig = msgspec.field(default_factory=TrainConfig)
    loss: LossConfig = msgspec.field(default_factory=LossConfig)
    server: ServerConfig = msgspec.field(default_factory=ServerConfig)
    guard: GuardConfig = msgspec.field(default_factory=GuardConfig)
    audit: AuditConfig = msgspec.field(default_factory=AuditConfig)


# Keys that moved when the loss, the guard, the audit and the relay tree came to own their sections: still read, with a
# warning, so older config files and scripts keep working.
MOVED_KEYS = {
    **{f"train.{k}": f"loss.{k}" for k in ("eps_low", "eps_high", "delta", "seq_is_cap", "kl_beta")},
    **{f"security.{k}": f"guard.{k}" for k in (
        "allowlist", "trusted", "strikes_to_ban", "msg_rate", "msg_burst", "max_held", "duplicate_share",
        "pair_z", "pair_min", "pair_release_z", "probation_groups")},
    "security.audit": "audit.enabled", "security.audit_rate": "audit.rate",
    "security.audit_new_node_groups": "audit.new_node_groups", "security.audit_tol": "audit.tol",
    "security.min_tail_mass": "audit.min_tail_mass",
    # The relay tree owns its knobs (broadcast/config.py): [server.tree].
    **{f"server.{k}": f"server.tree.{k}" for k in ("fanout", "piece_bytes", "max_peers", "allow_private", "full_every")},
}


def parse_override(text: str) -> tuple[list[str], Any]:
    if "=" not in text:
        raise ValueError(f"override {text!r} is not of the form section.key=value")
    key, raw = text.split("=", 1)
    try:
        value = tomllib.loads(f"v = {raw}")["v"]
    except tomllib.TOMLDecodeError:
        value = raw  # a bare word: take it as a string
    return key.strip().split("."), value


def _set(data: dict[str, Any], keys: list[str], value: Any) -> None:
    node = data
    for k in keys[:-1]:
        node = node.setdefault(k, {})
    node[keys[-1]] = value


def _move_old_keys(data: dict[str, Any]) -> None:
    for old, new in MOVED_KEYS.items():
        section, key = old.split(".")
        if isinstance(data.get(section), dict) and key in data[section]:
            log.warning("config key %s is now %s; please rename it", old, new)
            _set(data, new.split("."), data[section].pop(key))
    if data.get("security") == {}:
        del data["security"]


def load_config(path: str | Path | None = None, overrides: list[str] | None = None) -> RunConfig:
    data: dict[str, Any] = {}
    if path:
        data = tomllib.loads(Path(path).read_text())
    for text in overrides or []:
        keys, value = parse_override(text)
        _set(data, keys, value)
    _move_old_keys(data)
    try:
        return msgspec.convert(data, RunConfig)
    except msgspec.ValidationError as e:
        raise ValueError(f"config: {e}") from None


def dump_config(cfg: RunConfig) -> str:
    return msgspec.toml.encode(cfg).decode()
