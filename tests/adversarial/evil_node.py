"""A malicious inference node: speaks the real protocol over zmq with its own key, and cheats.

`Sampler` makes plausible samples with HF transformers from the trainer's published version directories
(RUN/versions/vNNNNNN): token ids from sampling, and each token's log-prob from a prefill of the same
weights, exactly what the trainer's audit recomputes. An attack starts from those and tampers.
`EvilNode` is a blocking zmq DEALER client: register, ask for work, submit, or send raw frames.
"""

from __future__ import annotations

import copy
import threading
import time
from pathlib import Path

import torch
import zmq

from swarm_common import protocol as P
from swarm_common.keys import KeyPair
from trainer.policy import load_model, load_tokenizer, pack

_LOAD_LOCK = threading.Lock()


class Sampler:
    """Samples G completions per prompt with a published version's weights (or a perturbed copy)."""

    def __init__(self, run_dir: str | Path, temperature: float = 1.0, max_tokens: int = 6, seed: int = 0):
        self.run_dir = Path(run_dir)
        self.temperature, self.max_tokens = temperature, max_tokens
        self._models: dict[tuple[int, float], object] = {}
        self.gen = torch.Generator().manual_seed(seed)
        self.tok = None
        self._lock = threading.Lock()  # attackers on several threads share one sampler

    def version_dir(self, version: int) -> Path:
        return self.run_dir / "versions" / f"v{version:06d}"

    def versions(self) -> list[int]:
        return sorted(int(p.name[1:]) for p in (self.run_dir / "versions").glob("v*") if p.name[1:].isdigit())

    def model(self, version: int, noise: float = 0.0):
        """The version's model; with `noise`, a copy whose every weight is perturbed by that relative amount."""
        key = (version, noise)
        if key not in self._models and noise:  # a copy of the loaded version: no second load from disk
            m = copy.deepcopy(self.model(version))
            g = torch.Generator().manual_seed(1234)
            with torch.no_grad():
                for p in m.parameters():
                    p.add_(torch.randn(p.shape, generator=g) * noise * p.abs().mean())
            self._models[key] = m
        elif key not in self._models:
            # from_pretrained patches process-wide state while it builds a model: one load at a time.
            with _LOAD_LOCK:
                self._models[key] = load_model(self.version_dir(version)).eval()
                if self.tok is None:
                    self.tok = load_tokenizer(self.version_dir(version))
        return self._models[key]

    @torch.no_grad()
    def sample(self, version: int, prompt_ids: list[int], n: int, noise: float = 0.0) -> list[P.Sample]:
        """n samples of the prompt: token ids, per-token log-probs under the same weights, finish reasons."""
        with self._lock:
            return self._sample(version, prompt_ids, n, noise)

    def _sample(self, version: int, prompt_ids: list[int], n: int, noise: float) -> list[P.Sample]:
        m = self.model(version, noise)
        eos = self.tok.eos_token_id
        ids = torch.tensor([prompt_ids] * n)
        torch.manual_seed(int(torch.randint(0, 2**31, (1,), generator=self.gen)))
        out = m.generate(input_ids=ids, attention_mask=torch.ones_like(ids), do_sample=True,
                         temperature=self.temperature, top_p=1.0, top_k=0, max_new_tokens=self.max_tokens,
                         eos_token_id=eos, pad_token_id=self.tok.pad_token_id)
        comps, reasons = [], []
        for row in out[:, len(prompt_ids):].tolist():
            if eos in row:
                comps.append(row[: row.index(eos) + 1])
                reasons.append("stop")
            else:
                comps.append(row[: self.max_tokens])
                reasons.append("length")
        return [P.Sample(c, lp, r) for c, lp, r in zip(comps, self.logprobs(m, prompt_ids, comps), reasons, strict=True)]

    @torch.no_grad()
    def logprobs(self, model, prompt_ids: list[int], comps: list[list[int]]) -> list[list[float]]:
        b = pack([prompt_ids] * len(comps), comps, None, self.tok.pad_token_id)
        logits = model(input_ids=b.input_ids, attention_mask=b.attention_mask).logits[:, :-1].float()
        lp = torch.log_softmax(logits / self.temperature, dim=-1).gather(-1, b.targets.unsqueeze(-1)).squeeze(-1)
        start = len(prompt_ids) - 1
        return [lp[i, start : start + len(c)].tolist() for i, c in enumerate(comps)]


class EvilNode:
    """A blocking client with a fresh key: everything it sends is signed by that key unless it says otherwise."""

    def __init__(self, port: int, name: str = "evil", timeout_s: float = 10.0):
        self.key = KeyPair.generate()
        self.node_id = self.key.public_hex
        self.name = name
        self.ctx = zmq.Context()
        self.sock = self.ctx.socket(zmq.DEALER)
        self.sock.setsockopt(zmq.LINGER, 0)
        self.sock.setsockopt(zmq.RCVTIMEO, int(timeout_s * 1000))
        self.sock.connect(f"tcp://127.0.0.1:{port}")
        self.registered: P.Registered | None = None
        self.version = 0  # the newest version the trainer announced

    def close(self) -> None:
        self.sock.close(0)
        self.ctx.term()

    def send(self, msg: P.Message) -> list[bytes]:
        frames = P.sign(msg, self.key)
        self.sock.send_multipart(frames)
        return frames

    def send_frames(self, frames: list[bytes]) -> None:
        self.sock.send_multipart(frames)

    def recv(self, timeout_s: float | None = None) -> P.Message | None:
        """The next reply that is not a version notice (those update `version`); None on timeout, also
        when notices keep coming (a fast trainer announces several versions a second)."""
        end = time.monotonic() + (timeout_s if timeout_s is not None else self.sock.getsockopt(zmq.RCVTIMEO) / 1000)
        while time.monotonic() < end:
            try:
                msg = P.decode(self.sock.recv())
            except zmq.Again:
                return None
            if isinstance(msg, P.VersionNotice):
                self.version = max(self.version, msg.weights.version)
                continue
            return msg
        return None

    def register(self) -> P.Registered:
        self.send(P.Register(node_id=self.node_id, name=self.name, time_ms=int(time.time() * 1000)))
        reply = self.recv()
        assert isinstance(reply, P.Registered), reply
        self.registered = reply
        self.version = max(self.version, reply.weights.version)
        return reply

    def ask(self, max_prompts: int) -> P.WorkAssignment | None:
        """One work request at the newest version announced, as a node asks: the assignment when it holds
        work; None (after the wait the trainer asked for) when it does not, or no answer came."""
        self.send(P.WorkRequest(node_id=self.node_id, version_loaded=self.version, max_prompts=max_prompts))
        work = self.recv()
        if not isinstance(work, P.WorkAssignment):
            return None
        self.version = max(self.version, work.weights.version)
        if not work.assignments:
            time.sleep(work.retry_after_s or 0.2)
            return None
        return work

    def work(self, max_prompts: int, version_loaded: int | None = None, tries: int = 200) -> P.WorkAssignment:
        """Ask until the trainer hands out at least one assignment."""
        for _ in range(tries):
            v = self.version if version_loaded is None else version_loaded
            self.send(P.WorkRequest(node_id=self.node_id, version_loaded=v, max_prompts=max_prompts))
            reply = self.recv()
            assert isinstance(reply, P.WorkAssignment), reply
            self.version = max(self.version, reply.weights.version)
            if reply.assignments:
                return reply
            time.sleep(reply.retry_after_s or 0.2)
        raise TimeoutError("the trainer handed out no work")

    def submit(self, version: int, rollouts: list[P.Rollout]) -> P.Message | None:
        self.send(P.RolloutSubmission(node_id=self.node_id, version=version, rollouts=rollouts, gen_seconds=0.1))
        return self.recv()
