"""Run configuration: typed sections with defaults, loaded from one TOML file, overridden from the CLI.

`load_config(path, overrides)` reads the file (optional), applies `section.key=value` overrides (values
parsed as TOML, so `train.lr=3e-4` is a float and `task.params={digits=1}` a table) and validates the
result against the structs below: unknown keys and wrong types are errors, not silent defaults.
"""

from __future__ import annotations

import tomllib
from pathlib import Path
from typing import Any, Literal

import msgspec


class ModelConfig(msgspec.Struct, forbid_unknown_fields=True, kw_only=True):
    path: str = ""  # a local HF model directory; empty = the embedded default, built offline
    sft_steps: int = 150  # warm-up steps for the embedded default (0 = start RL from the raw init)
    sft_lr: float = 3e-3
    sft_batch: int = 64
    seed: int = 0
    max_shard_bytes: int = 2 * 2**20  # shard size of published versions (HF layout with an index)
    # dtype of published versions; the trainer keeps fp32 master weights either way, and the audit
    # recomputes with exactly the published weights. bfloat16 halves the bytes every node fetches, but an
    # update smaller than bf16's resolution does not reach the nodes: measured on SmolLM2 at lr 1e-5
    # (bench/vs_trl.py, seed 1), held-out accuracy 0.11 at step 4 with bf16 versions against 0.41 in fp32
    # (seed 0: no difference, both slow).
    publish_dtype: Literal["float32", "bfloat16"] = "float32"


class TaskConfig(msgspec.Struct, forbid_unknown_fields=True, kw_only=True):
    name: str = "arithmetic"
    # Sums of three one-digit numbers: the tiny model can learn them, and the item space (1000 problems)
    # leaves ~150 held out for evaluation that training never sees.
    params: dict[str, Any] = msgspec.field(
        default_factory=lambda: {"digits": 1, "terms": 3, "ops": "+", "eval_share": 0.15}
    )
    eval_size: int = 120
    seed: int = 0


class TrainConfig(msgspec.Struct, forbid_unknown_fields=True, kw_only=True):
    max_steps: int = 400
    max_minutes: float = 0.0  # stop after this many minutes of RL (0 = no limit)
    group_size: int = 8  # G completions per prompt
    prompts_per_step: int = 16  # groups per optimizer step
    lr: float = 2e-4
    weight_decay: float = 0.0
    grad_clip: float = 1.0
    scale_adv_by_std: bool = False
    eps_low: float = 0.2
    eps_high: float = 0.28
    delta: float = 4.0
    seq_is_cap: float = 4.0
    kl_beta: float = 0.0
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
    seed: int = 0


class ServerConfig(msgspec.Struct, forbid_unknown_fields=True, kw_only=True):
    host: str = "127.0.0.1"
    port: int = 5555  # zmq ROUTER for nodes
    http_port: int = 5556  # /api and /metrics
    web_port: int = 8265  # the live web view (0: any free port, -1: none); its /api is on http_port too
    web_host: str = "127.0.0.1"  # set 0.0.0.0 to show the page to other machines
    tracker_port: int = 5557  # the relay tree's origin and tracker (weights leave the trainer only here)
    fanout: int = 4  # children per relay in each tree of the broadcast
    piece_bytes: int = 1 << 20  # broadcast piece size: a relay forwards each piece once verified
    # Every full_every-th version goes out whole, the others as deltas against the version before
    # (broadcast/delta.py); a node without the base fetches the chain or the version whole. 1: all whole.
    # Measured on SmolLM2 (bench/delta.py): a bf16 delta is ~2% of the version, an fp32 one ~40%.
    full_every: int = 10
    heartbeat_s: float = 2.0
    assignment_timeout_s: float = 120.0  # work not answered by then is re-assigned
    gone_after_s: float = 0.0  # a node silent this long is gone and its work re-assigned (0 = 10 x heartbeat_s)
    max_message_bytes: int = 8 * 2**20


class SecurityConfig(msgspec.Struct, forbid_unknown_fields=True, kw_only=True):
    allowlist: list[str] = []  # hex node keys allowed to join; empty = open to anyone
    # Hex keys of nodes the operator runs itself: no probation (their groups train at once), audited as
    # any new key is (their first audit_new_node_groups groups, then audit_rate), banned as anyone on fraud.
    trusted: list[str] = []
    strikes_to_ban: int = 3
    msg_rate: float = 50.0  # messages per second per node key
    msg_burst: int = 200
    max_held: int = 128  # assignments one node may hold at once
    audit: bool = True
    audit_rate: float = 0.1  # share of an established node's groups re-scored by the trainer
    audit_new_node_groups: int = 8  # every group of a node's first N is audited
    audit_tol: float = 0.01  # |node log-prob - trainer log-prob| above this (nats) is fraud
    # A sampled token is implausible when all the tokens at most as likely hold less than this much
    # probability: honest sampling lands there with exactly this chance per token (a p-value).
    min_tail_mass: float = 1e-9
    duplicate_share: float = 0.05  # prompts also given to a second node, for the cherry-picking test
    pair_z: float = 4.0
    pair_min: int = 12
    # Probation ends in release only once the excess is small (z at most this at pair_min shared prompts,
    # times sqrt(n / pair_min) at n): between it and pair_z the node stays on probation and more decide.
    pair_release_z: float = 1.0
    # A new key's groups wait in quarantine, its prompts all shared with another node, until pair_min shared
    # prompts clear it of cherry-picking (or, when it is alone, until it delivered this many audited groups).
    probation_groups: int = 16


class RunConfig(msgspec.Struct, forbid_unknown_fields=True, kw_only=True):
    run_dir: str = "runs/demo"
    model: ModelConfig = msgspec.field(default_factory=ModelConfig)
    task: TaskConfig = msgspec.field(default_factory=TaskConfig)
    train: TrainConfig = msgspec.field(default_factory=TrainConfig)
    server: ServerConfig = msgspec.field(default_factory=ServerConfig)
    security: SecurityConfig = msgspec.field(default_factory=SecurityConfig)


def parse_override(text: str) -> tuple[list[str], Any]:
    if "=" not in text:
        raise ValueError(f"override {text!r} is not of the form section.key=value")
    key, raw = text.split("=", 1)
    try:
        value = tomllib.loads(f"v = {raw}")["v"]
    except tomllib.TOMLDecodeError:
        value = raw  # a bare word: take it as a string
    return key.strip().split("."), value


def load_config(path: str | Path | None = None, overrides: list[str] | None = None) -> RunConfig:
    data: dict[str, Any] = {}
    if path:
        data = tomllib.loads(Path(path).read_text())
    for text in overrides or []:
        keys, value = parse_override(text)
        node = data
        for k in keys[:-1]:
            node = node.setdefault(k, {})
        node[keys[-1]] = value
    try:
        return msgspec.convert(data, RunConfig)
    except msgspec.ValidationError as e:
        raise ValueError(f"config: {e}") from None


def dump_config(cfg: RunConfig) -> str:
    return msgspec.toml.encode(cfg).decode()
