"""Wire protocol between the trainer and inference nodes.

Every message is a msgspec Struct in one tagged union, encoded as msgpack (ROUTER on the trainer,
DEALER on nodes). A node's message travels as two frames, [payload, signature]: the ed25519 signature
of the payload by the key whose public half is the message's `node_id`, so every message is
attributable to a key. Decoding checks the size bound first, then the schema and types (msgspec), then
ranges (`validate`). Anything that fails raises `ProtocolError`, which the receiver turns into an
`Error` reply and a log line; it never reaches the training code.
"""

from __future__ import annotations

import math
from typing import Any, Literal
from urllib.parse import urljoin

import msgspec

from swarm_common.keys import verify

PROTOCOL_VERSION = 1
MAX_MESSAGE_BYTES = 8 * 2**20  # a submission of 64 samples x 4096 tokens fits well inside
MAX_ID_LEN = 128
DEFAULT_MAX_PROMPTS = 16  # prompts a node asks for per work request unless told otherwise
MAX_TEXT_LEN = 64 * 1024

FinishReason = Literal["stop", "length"]


class ProtocolError(ValueError):
    """A message that is malformed, oversized or out of range."""

    def __init__(self, code: str, message: str):
        super().__init__(f"{code}: {message}")
        self.code = code
        self.message = message


# ---- node -> trainer -------------------------------------------------------------------------------


class Register(msgspec.Struct, tag="register", forbid_unknown_fields=True):
    node_id: str  # hex ed25519 public key of the node
    name: str  # a human-readable label chosen by the node's owner
    time_ms: int = 0  # the node's clock: a replayed (older) registration is refused
    protocol: int = PROTOCOL_VERSION
    max_prompts: int = DEFAULT_MAX_PROMPTS  # how many prompts the node wants per work request
    relay: bool = True
    status_url: str = ""  # where the node's own status page is, if it serves one
    trainer_host: str = ""  # the host this node reached the trainer at (the tracker is told to it there)
    pow_nonce: int = 0  # proof of work, when the trainer asks for one (swarm_common/proof_of_work.py)
    invite: str = ""  # an operator's invite token, when the trainer asks for one


class Hello(msgspec.Struct, tag="hello", forbid_unknown_fields=True):
    """Asks where things are, registering nothing (`swarm doctor` sends it with a throwaway key)."""

    node_id: str
    trainer_host: str = ""  # the host this sender reached the trainer at


class Heartbeat(msgspec.Struct, tag="heartbeat", forbid_unknown_fields=True):
    node_id: str
    version_loaded: int
    tokens_per_s: float = 0.0
    busy: bool = False


class WorkRequest(msgspec.Struct, tag="work_request", forbid_unknown_fields=True):
    node_id: str
    version_loaded: int
    max_prompts: int


class Sample(msgspec.Struct, forbid_unknown_fields=True, array_like=True):
    token_ids: list[int]
    logprobs: list[float]  # the node's log-prob of each sampled token, under its sampling distribution
    finish_reason: FinishReason


class Episode(msgspec.Struct, forbid_unknown_fields=True, array_like=True):
    """One multi-turn sample: every token after the prompt, as the engine and the environment made them.

    The node never re-tokenizes: each turn's sampled ids are the engine's, the environment's answers are
    the ids `swarm_common.chat.observation_ids` gives them. The trainer replays the episode and requires
    the same environment ids (trainer/episode_check.py)."""

    token_ids: list[int]  # each turn's sampled tokens, with the environment's tokens between turns
    mask: list[bool]  # per token: True sampled by the model, False written by the environment
    logprobs: list[float]  # the sampling log-prob of each sampled token, in order (one per True in mask)
    finish_reason: FinishReason  # stop: the environment ended it (done, or max_turns); length: out of tokens


class Rollout(msgspec.Struct, forbid_unknown_fields=True):
    assignment_id: str
    samples: list[Sample]  # single-turn work: G completions
    episodes: list[Episode] = []  # multi-turn work (the assignment names an environment): G episodes


class RolloutSubmission(msgspec.Struct, tag="submission", forbid_unknown_fields=True):
    node_id: str
    version: int  # the policy version the node generated with
    rollouts: list[Rollout]
    gen_seconds: float  # wall time the node spent generating them


# ---- trainer -> node -------------------------------------------------------------------------------


class SamplingSpec(msgspec.Struct, forbid_unknown_fields=True):
    n: int
    max_tokens: int
    temperature: float
    top_p: float


class EpisodeItem(msgspec.Struct, forbid_unknown_fields=True):
    """What an environment needs of a task item to run its episodes: never its answer."""

    id: str
    prompt: str
    meta: dict[str, str]


class EnvSpec(msgspec.Struct, forbid_unknown_fields=True):
    """The environment whose episodes a node runs: a name its registry knows (rewards/registry.py) and the
    parameters the trainer built it with, so both run the same one."""

    name: str
    params: dict[str, Any]
    max_episode_tokens: int  # tokens after the prompt, sampled and environment's together


class Assignment(msgspec.Struct, forbid_unknown_fields=True):
    assignment_id: str
    prompt_token_ids: list[int]
    item: EpisodeItem | None = None  # with multi-turn work: the item the episodes start from


class WeightsInfo(msgspec.Struct, forbid_unknown_fields=True):
    version: int
    # The signed manifest at the relay tree's origin, relative to the tracker URL the node is told (which
    # is per node: the trainer's bind address, 0.0.0.0 across machines, is nobody's to dial).
    manifest_url: str

    def manifest_at(self, tracker_url: str) -> str:
        """The manifest's absolute URL for a node that reaches the tracker at `tracker_url`."""
        return urljoin(tracker_url.rstrip("/") + "/", self.manifest_url.lstrip("/"))


class Registered(msgspec.Struct, tag="registered", forbid_unknown_fields=True):
    node_id: str
    weights: WeightsInfo  # the version the node must load before it generates
    sampling: SamplingSpec
    heartbeat_s: float
    max_lag: int
    tracker_url: str  # the relay tree's tracker: every version is fetched through the tree
    trainer_key: str  # hex ed25519 public key that signs every manifest


class Welcome(msgspec.Struct, tag="welcome", forbid_unknown_fields=True):
    protocol: int
    trainer_key: str  # hex ed25519 public key that signs every manifest
    tracker_url: str  # the relay tree's tracker, as a node reaching the trainer at trainer_host is told
    http_port: int  # the trainer's HTTP API (/api/summary, /metrics), on the host of the node port
    version: int  # the newest version announced
    seen_as: str  # the address the sender's message came from, as the trainer saw it
    # The sender's key as the trainer knows it: "established" (or trusted), "probation" (a registered key
    # not yet cleared by the paired test), or "new" (not registered).
    standing: str = "new"
    # A key on probation here waits for good: no reference of the trainer's and no established node live
    # to share prompts with (what `swarm doctor` warns about).
    unpaired: bool = False
    shared_prompts: int = 0  # the sender's shared prompts that count toward its probation verdict


class WorkAssignment(msgspec.Struct, tag="work", forbid_unknown_fields=True):
    weights: WeightsInfo  # the newest version; the node loads it when it can
    min_version: int  # generating with anything older than this will be refused as stale
    assignments: list[Assignment]
    sampling: SamplingSpec
    retry_after_s: float = 0.0  # when `assignments` is empty: ask again after this long
    env: EnvSpec | None = None  # multi-turn work: the environment; `sampling.max_tokens` is per turn


class SubmissionResult(msgspec.Struct, tag="result", forbid_unknown_fields=True):
    accepted: list[str]
    refused: dict[str, str]  # assignment id -> reason code


class VersionNotice(msgspec.Struct, tag="version", forbid_unknown_fields=True):
    weights: WeightsInfo


class NodeStatus(msgspec.Struct, forbid_unknown_fields=True):
    """A node's own status page (JSON)."""

    node_id: str
    name: str
    trainer: str
    version_loaded: int
    versions_loaded: int  # how many versions were loaded into the running engine
    restarts: int  # engine restarts (live reloads do not count)
    tokens_generated: int
    rollouts_submitted: int
    rollouts_accepted: int
    tokens_per_s: float
    probes: dict[str, list[int]]  # version -> greedy completion of the probe prompt after loading it
    reload_seconds: list[float]
    relay_url: str = ""  # where other peers fetch from this node's relay ("" : it serves no one)
    relay_reachable: bool | None = None  # the tracker's connect-back check (None: not checked)
    episodes: int = 0  # multi-turn work: episodes run, their turns, tool calls and failed tool calls
    turns: int = 0
    tool_calls: int = 0
    tool_errors: int = 0


class Error(msgspec.Struct, tag="error", forbid_unknown_fields=True):
    code: str
    message: str
    pow_bits: int = 0  # with code "pow_required": the proof of work Register must carry


Message = (
    Register
    | Hello
    | Heartbeat
    | WorkRequest
    | RolloutSubmission
    | Registered
    | WorkAssignment
    | SubmissionResult
    | VersionNotice
    | Welcome
    | Error
)

NODE_MESSAGES = (Register, Hello, Heartbeat, WorkRequest, RolloutSubmission)

_encoder = msgspec.msgpack.Encoder()
_decoder = msgspec.msgpack.Decoder(Message)


def encode(msg: Message) -> bytes:
    return _encoder.encode(msg)


def decode(data: bytes, max_bytes: int = MAX_MESSAGE_BYTES) -> Message:
    """Decode and validate one message; raise ProtocolError on anything wrong with it."""
    if len(data) > max_bytes:
        raise ProtocolError("oversized", f"message of {len(data)} bytes exceeds {max_bytes}")
    try:
        msg = _decoder.decode(data)
    except msgspec.DecodeError as e:  # ValidationError is a DecodeError
        raise ProtocolError("malformed", str(e)[:300]) from None
    validate(msg)
    return msg


def sign(msg: Message, key) -> list[bytes]:
    """The frames a node sends: the payload and its signature (`key` is a swarm_common.keys.KeyPair)."""
    payload = encode(msg)
    return [payload, key.sign(payload)]


def decode_signed(frames: list[bytes], max_bytes: int = MAX_MESSAGE_BYTES) -> Message:
    """Decode a node's [payload, signature] and check the signature against the message's node_id."""
    if len(frames) != 2 or len(frames[1]) != 64:
        raise ProtocolError("unsigned", "a node message is two frames: payload and ed25519 signature")
    msg = decode(frames[0], max_bytes)
    if not isinstance(msg, NODE_MESSAGES):
        raise ProtocolError("unexpected", f"{type(msg).__name__} is not a node-to-trainer message")
    if not verify(msg.node_id, frames[0], frames[1]):
        raise ProtocolError("bad_signature", "the signature does not match node_id's key")
    return msg


def is_host(s: str) -> bool:
    """A plain host name, IPv4 or bracket-less IPv6 address: nothing that could smuggle a path or a port."""
    return 0 < len(s) <= 253 and all(c.isalnum() or c in ".-:" for c in s) and s.isascii()


def _is_key(s: str) -> bool:
    return len(s) == 64 and all(c in "0123456789abcdef" for c in s)


def _check(cond: bool, what: str) -> None:
    if not cond:
        raise ProtocolError("invalid", what)


def _short_id(s: str, what: str) -> None:
    _check(0 < len(s) <= MAX_ID_LEN and s.isprintable(), f"{what} must be 1..{MAX_ID_LEN} printable chars")


def validate(msg: Message) -> None:
    """Range checks that types alone cannot express. Semantic checks (against the trainer's state)
    happen in the trainer's intake, not here."""
    if isinstance(msg, NODE_MESSAGES):
        _check(_is_key(msg.node_id), "node_id must be a 64-hex-char ed25519 public key")
    if isinstance(msg, Register):
        _short_id(msg.node_id, "node_id")
        _check(len(msg.name) <= MAX_ID_LEN, "name too long")
        _check(1 <= msg.max_prompts <= 1024, "max_prompts must be in 1..1024")
        _check(len(msg.status_url) <= 512, "status_url too long")
        _check(is_host(msg.trainer_host) or not msg.trainer_host, "trainer_host must be a host name or address")
        _check(0 <= msg.pow_nonce < 2**64, "pow_nonce must be in 0..2**64-1")
        _check(len(msg.invite) <= MAX_ID_LEN and msg.invite.isprintable(), "invite too long")
    elif isinstance(msg, Hello):
        _check(is_host(msg.trainer_host) or not msg.trainer_host, "trainer_host must be a host name or address")
    elif isinstance(msg, Heartbeat):
        _short_id(msg.node_id, "node_id")
        _check(msg.version_loaded >= -1, "version_loaded must be >= -1")
        _check(math.isfinite(msg.tokens_per_s) and msg.tokens_per_s >= 0, "tokens_per_s must be finite, >= 0")
    elif isinstance(msg, WorkRequest):
        _short_id(msg.node_id, "node_id")
        _check(1 <= msg.max_prompts <= 1024, "max_prompts must be in 1..1024")
    elif isinstance(msg, RolloutSubmission):
        _short_id(msg.node_id, "node_id")
        _check(msg.version >= 0, "version must be >= 0")
        _check(math.isfinite(msg.gen_seconds) and msg.gen_seconds >= 0, "gen_seconds must be finite, >= 0")
        _check(0 < len(msg.rollouts) <= 1024, "a submission holds 1..1024 rollouts")
        for r in msg.rollouts:
            _short_id(r.assignment_id, "assignment_id")
            _check(not (r.samples and r.episodes), "a rollout holds samples or episodes, not both")
            _check(0 < len(r.samples) + len(r.episodes) <= 1024, "a rollout holds 1..1024 samples")
            for s in r.samples:
                _check(len(s.token_ids) == len(s.logprobs), "token_ids and logprobs differ in length")
                _check(len(s.token_ids) > 0, "a sample has no tokens")
            for e in r.episodes:
                _check(len(e.token_ids) == len(e.mask), "token_ids and mask differ in length")
                _check(len(e.logprobs) == sum(e.mask), "one log-prob per sampled token")
                _check(len(e.token_ids) > 0 and e.mask[0], "an episode starts with a sampled token")
    elif isinstance(msg, Error):
        _check(len(msg.message) <= MAX_TEXT_LEN, "error message too long")
