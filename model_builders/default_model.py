"""The embedded default model: a tiny Qwen2 with a byte-level tokenizer, built offline and deterministically.

Everything comes from code: the tokenizer's vocabulary is the 256 byte symbols plus three specials (no
merges), and the weights are a seeded random init. The result is an ordinary Hugging Face directory
(config.json, model.safetensors, tokenizer files) that transformers and vLLM both load. Its vocabulary
has exactly as many ids as the tokenizer, so vLLM can never sample an id that decodes to nothing.
"""

from __future__ import annotations

from pathlib import Path

from swarm_common.hf_config import hoist_rope_theta

EOS = "<|endoftext|>"
SPECIALS = [EOS, "<|im_start|>", "<|im_end|>"]
# The tiny model sees a prompt as "question=" and answers after the "="; its turn ends with the stop token
# (EOS). In an episode a tool's result follows as <|im_start|>result<|im_end|>, and a user's reply (game
# feedback) as "reply=", each followed at once by the model's next turn. System messages are not shown.
CHAT_TEMPLATE = (
    "{%- for m in messages -%}"
    "{%- if m['role'] == 'user' -%}{{ m['content'] }}="
    "{%- elif m['role'] == 'assistant' -%}{{ m['content'] }}<|endoftext|>"
    "{%- elif m['role'] == 'tool' -%}<|im_start|>{{ m['content'] }}<|im_end|>"
    "{%- endif -%}"
    "{%- endfor -%}"
)

TINY_CONFIG = dict(
    hidden_size=128,
    intermediate_size=512,
    num_hidden_layers=4,
    num_attention_heads=4,  # head_dim 32: vLLM's CPU attention needs 32, 64, 80, ...
    num_key_value_heads=2,
    max_position_embeddings=256,
    rope_theta=10000.0,
    rms_norm_eps=1e-6,
    tie_word_embeddings=True,
)


def build_tokenizer():
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers
    from transformers import PreTrainedTokenizerFast

    alphabet = pre_tokenizers.ByteLevel.alphabet()
    vocab = {tok: i for i, tok in enumerate(SPECIALS)}
    for ch in sorted(alphabet):
        vocab[ch] = len(vocab)
    tok = Tokenizer(models.BPE(vocab=vocab, merges=[]))
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=False)
    tok.decoder = decoders.ByteLevel()
    tok.add_special_tokens(SPECIALS)
    fast = PreTrainedTokenizerFast(
        tokenizer_object=tok, eos_token=EOS, pad_token=EOS, bos_token=None, unk_token=None
    )
    fast.chat_template = CHAT_TEMPLATE
    return fast


def build_default_model(out_dir: str | Path, seed: int = 0, **overrides) -> Path:
    """Write the untrained tiny model to `out_dir` and return it."""
    import torch
    from transformers import Qwen2Config, Qwen2ForCausalLM

    out = Path(out_dir)
    out.mkdir(parents=True, exist_ok=True)
    tok = build_tokenizer()
    cfg = Qwen2Config(
        vocab_size=len(tok),
        bos_token_id=None,
        eos_token_id=tok.eos_token_id,
        pad_token_id=tok.pad_token_id,
        **{**TINY_CONFIG, **overrides},
    )
    torch.manual_seed(seed)
    model = Qwen2ForCausalLM(cfg).to(torch.float32)
    model.generation_config.eos_token_id = tok.eos_token_id
    model.generation_config.pad_token_id = tok.pad_token_id
    model.save_pretrained(out, safe_serialization=True)
    tok.save_pretrained(out)
    hoist_rope_theta(out, TINY_CONFIG["rope_theta"])
    return out
