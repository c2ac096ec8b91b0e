"""Learner benchmark: a GRPO step's time, tokens/s and peak memory per rank, one process (the plain
Learner, today's trainer) against the sharded learner (FSDP2) on 1 and N ranks; MFU on a GPU.

    python bench/trainer.py [--quick] [--models tiny,smollm2] [--ranks 1,2] [--json FILE]
    python bench/trainer.py --models qwen1.5b        (a GPU: ~1.5B Qwen2-shaped, random weights, offline)
    torchrun --nproc-per-node N bench/trainer.py --worker --model M --mode fsdp --out DIR   (one run, as
        bench/gpu_trainer.sh does), then  python bench/trainer.py --report DIR

Each configuration runs in fresh processes (rank processes started as torchrun starts them) on the same
synthetic batch: whole GRPO groups of random tokens, every group with signal. One warm-up step, then
--steps measured steps; the median is reported, and its ratio to the plain learner's in the same run.
Peak memory: the device's max allocated (GPU), or the process's peak RSS (CPU: torch, Python and all).

MFU = model FLOPs per step / step time / (ranks x the device's dense bf16 peak). FLOPs are counted for
the work the step does, with the trainer's shared-prompt layout (trainer/policy.py): 3 x (forward) for
forward and backward, where forward = 2 x decoder-layer params x tokens through the layers (each prompt
once, each completion's tokens but its last) + 2 x d x vocab per logit row (one per prompt, then the
completion rows) + 4 x layers x (heads x head_dim) x the causal context of every query token (QK^T and
AV). Peaks: H100/H200 SXM 989 TFLOP/s (NVIDIA's dense bf16 figure), A100 312; others need --peak-tflops.
"""

from __future__ import annotations

import argparse
import json
import os
import random
import resource
import statistics
import subprocess
import sys
import tempfile
import time
import types
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))

# model: (groups, samples per group, prompt tokens, completion tokens, samples per micro-batch)
BATCHES = {
    "tiny": (8, 8, 10, 6, 256),  # the default run's shape (16 x 8 there); completions of max_tokens 6
    "smollm2": (4, 8, 40, 16, 256),  # configs/smollm2-arith.toml: 4 prompts x 8, max_tokens 16
    "qwen1.5b": (8, 8, 256, 768, 16),  # 64 samples x (256 + 768): a realistic GRPO batch for 1.5B
    "qwen-mini": (4, 4, 32, 32, 8),  # the 1.5B recipe scaled down: CPU fallback of bench/gpu_trainer.sh
}
QWEN = {
    "qwen1.5b": dict(hidden_size=1536, intermediate_size=8960, num_hidden_layers=28, num_attention_heads=12,
                     num_key_value_heads=2, vocab_size=151936),  # Qwen2.5-1.5B's shape: 1.54 B parameters
    "qwen-mini": dict(hidden_size=128, intermediate_size=512, num_hidden_layers=2, num_attention_heads=4,
                      num_key_value_heads=2, vocab_size=4096),
}
PEAKS = {"H200": 989e12, "H100": 989e12, "A100": 312e12}  # dense bf16, FLOP/s


def build_model(name: str, device, model_dir: str):
    """tiny and smollm2 from their directory, the Qwen2 shapes built in memory with random weights."""
    import torch

    from trainer.policy import load_model

    if name in ("tiny", "smollm2"):
        return load_model(model_dir).to(device)
    from transformers import Qwen2Config, Qwen2ForCausalLM

    cfg = Qwen2Config(**QWEN[name], max_position_embeddings=4096, rope_theta=1e6, tie_word_embeddings=True,
                      pad_token_id=0, bos_token_id=None, eos_token_id=1)
    torch.manual_seed(0)
    with torch.device(device):  # random init on the device: seconds, not minutes, for 1.5 B
        return Qwen2ForCausalLM(cfg).to(torch.float32)


def make_batch(name: str, vocab: int, seed: int = 0) -> list:
    groups, g, lp, lc, _ = BATCHES[name]
    rng = random.Random(seed)
    out = []
    for _ in range(groups):
        samples = [types.SimpleNamespace(token_ids=[rng.randrange(3, vocab) for _ in range(lc)],
                                         logprobs=[-10.0] * lc) for _ in range(g)]
        prompt = [rng.randrange(3, vocab) for _ in range(lp)]
        out.append(types.SimpleNamespace(prompt_ids=prompt, samples=samples,
                                         rewards=[float(i % 2) for i in range(g)]))
    return out


def step_flops(cfg, batch: list, layer_params: int) -> float:
    d, layers = cfg.hidden_size, cfg.num_hidden_layers
    d_attn = cfg.num_attention_heads * (getattr(cfg, "head_dim", None) or d // cfg.num_attention_heads)
    fwd = 0.0
    for g in batch:
        lp = len(g.prompt_ids)
        comp = [len(s.token_ids) for s in g.samples]
        rows = sum(n - 1 for n in comp)  # completion tokens fed to the model (the last one is only a target)
        fwd += 2 * layer_params * (lp + rows) + 2 * d * cfg.vocab_size * (1 + rows)
        ctx = lp * (lp + 1) / 2 + sum(n - 1 for n in comp) * lp + sum((n - 1) * n / 2 for n in comp)
        fwd += 4 * layers * d_attn * ctx
    return 3 * fwd


def peak_memory_mib(device) -> float:
    import torch

    if device.type == "cuda":
        return torch.cuda.max_memory_allocated(device) / 2**20
    return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024  # KiB on Linux


def worker(args) -> None:
    """One configuration: this process is the plain learner, or one rank of the sharded one."""
    import torch
    import torch.distributed as dist

    from trainer.grpo import LossConfig

    torch.set_num_threads(args.threads)
    name, mode = args.model, args.mode
    _, _, _, _, micro = BATCHES[name]
    micro = args.micro_batch or micro
    loss = LossConfig()
    env = None
    if mode == "fsdp":
        from trainer.dist_learner import DistLearner, open_driver
        from trainer.distributed import init_distributed

        env = init_distributed(args.timeout)
        device, rank, world = env.device, env.rank, env.world
    else:
        device = torch.device("cuda" if torch.cuda.is_available() else "cpu")
        rank, world = 0, 1
    model = build_model(name, device, args.model_dir)
    cfg = model.config
    n_params = sum(p.numel() for p in model.parameters())  # a tied embedding counts once
    layer_params = sum(p.numel() for p in model.model.layers.parameters())
    batch = make_batch(name, cfg.vocab_size)
    if env is not None:
        learner = DistLearner(model, 0, env, 1e-6, 0.0, 1.0, loss, micro_batch=micro)
        dist.barrier(group=env.channel)
        if rank != 0:
            learner.follow()
        else:
            learner.driver = open_driver(env)
    else:
        from trainer.learner import Learner

        tok = types.SimpleNamespace(pad_token_id=0)
        learner = Learner(model, tok, 1e-6, 0.0, 1.0, loss, micro_batch=micro)
    times = []
    if rank == 0:
        for i in range(args.steps + 1):
            t0 = time.perf_counter()
            learner.step(batch)
            if device.type == "cuda":
                torch.cuda.synchronize(device)
            if i:  # the first step warms up (allocator, kernels, lazy init)
                times.append(time.perf_counter() - t0)
        if env is not None:
            learner.close()
    mem = peak_memory_mib(device)
    mems = [mem]
    if env is not None:
        mems = [None] * world
        dist.all_gather_object(mems, mem, group=env.channel)
        dist.destroy_process_group()
    if rank != 0:
        return
    tokens = sum(len(g.prompt_ids) + sum(len(s.token_ids) for s in g.samples) for g in batch)
    dev_name = torch.cuda.get_device_name(device) if device.type == "cuda" else "cpu"
    peak = next((v for k, v in PEAKS.items() if k in dev_name), None)
    peak = args.peak_tflops * 1e12 if args.peak_tflops else peak
    step_s = statistics.median(times)
    flops = step_flops(cfg, batch, layer_params)
    row = {"model": name, "mode": mode, "ranks": world, "threads": args.threads, "micro_batch": micro,
           "device": dev_name, "params": n_params,
           "layer_params": layer_params, "tokens_per_step": tokens, "step_s": step_s, "step_times": times,
           "tokens_per_s": tokens / step_s, "peak_mem_mib": mems, "flops_per_step": flops,
           "achieved_tflops": flops / step_s / 1e12, "peak_tflops_per_device": peak / 1e12 if peak else None,
           "mfu": flops / step_s / (peak * world) if peak else None}
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    (out / f"{name}-{mode}{world}.json").write_text(json.dumps(row, indent=1))
    print(f"{name} {mode} x{world}: {step_s:.3f} s/step, peak {max(mems):.0f} MiB", flush=True)


def spawn(args, model: str, mode: str, ranks: int, out: Path) -> bool:
    """Run one configuration in fresh processes (as torchrun would start the ranks); False if it failed."""
    cores = os.cpu_count() or 1
    threads = args.threads or max(1, cores // ranks)
    cmd = [sys.executable, str(Path(__file__).resolve()), "--worker", "--model", model, "--mode", mode,
           "--out", str(out), "--steps", str(args.steps), "--threads", str(threads),
           "--timeout", str(args.timeout)]
    if model in ("tiny", "smollm2"):
        cmd += ["--model-dir", args.smollm2_dir if model == "smollm2" else str(out / "tiny-model")]
    if args.micro_batch:
        cmd += ["--micro-batch", str(args.micro_batch)]
    port = free_port()
    env = {**os.environ, "OMP_NUM_THREADS": str(threads), "PYTHONUNBUFFERED": "1",
           "TOKENIZERS_PARALLELISM": "false"}
    procs = []
    for r in range(ranks if mode == "fsdp" else 1):
        e = dict(env)
        if mode == "fsdp":
            e.update(RANK=str(r), WORLD_SIZE=str(ranks), LOCAL_RANK=str(r), MASTER_ADDR="127.0.0.1",
                     MASTER_PORT=str(port), SWARM_DIST_DEVICE=os.environ.get("SWARM_DIST_DEVICE", "cpu"))
        procs.append(subprocess.Popen(cmd, env=e, cwd=ROOT))
    codes = [p.wait() for p in procs]
    if any(codes):
        print(f"{model} {mode} x{ranks} failed: exit codes {codes}", file=sys.stderr)
    return not any(codes)


def free_port() -> int:
    import socket

    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def report(out: Path, json_path: str | None) -> list[dict]:
    rows = [json.loads(f.read_text()) for f in sorted(out.glob("*.json"))]
    base = {r["model"]: r["step_s"] for r in rows if r["mode"] == "plain"}
    rows.sort(key=lambda r: (r["model"], r["mode"] != "plain", r["ranks"]))
    head = (f"{'model':<10} {'learner':<8} {'ranks':>5} {'thr':>3} {'mb':>4} {'s/step':>8} {'vs plain':>8} "
            f"{'tokens':>7} {'tok/s':>9} {'peak MiB/rank':>22} {'TFLOP/s':>8} {'MFU':>6}")
    print(head)
    print("-" * len(head))
    for r in rows:
        ratio = f"{base[r['model']] / r['step_s']:.2f}x" if r["model"] in base else "-"
        mem = "/".join(f"{m:.0f}" for m in r["peak_mem_mib"])
        mfu = f"{100 * r['mfu']:.1f}%" if r["mfu"] is not None else "n/a"
        print(f"{r['model']:<10} {r['mode']:<8} {r['ranks']:>5} {r['threads']:>3} {r['micro_batch']:>4} "
              f"{r['step_s']:>8.3f} {ratio:>8} {r['tokens_per_step']:>7} {r['tokens_per_s']:>9.0f} {mem:>22} "
              f"{r['achieved_tflops']:>8.3g} {mfu:>6}")
    devices = sorted({r["device"] for r in rows})
    peaks = sorted({r["peak_tflops_per_device"] for r in rows if r["peak_tflops_per_device"]})
    print(f"device: {', '.join(devices)}; MFU against a dense bf16 peak of {peaks or 'n/a'} TFLOP/s "
          "per device; "
          "'vs plain': the plain learner's step time over this one's (above 1: faster)")
    if json_path:
        Path(json_path).write_text(json.dumps({"rows": rows}, indent=1))
    return rows


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--quick", action="store_true", help="the tiny model only, 2 measured steps")
    p.add_argument("--models", default="tiny,smollm2",
                   help="comma-separated: tiny, smollm2, qwen1.5b, qwen-mini")
    p.add_argument("--ranks", default="1,2",
                   help="sharded learner rank counts to run (the plain one always runs)")
    p.add_argument("--steps", type=int, default=3, help="measured steps (after one warm-up step)")
    p.add_argument("--threads", type=int, default=0, help="torch threads per rank (default: cores / ranks)")
    p.add_argument("--micro-batch", type=int, default=0, help="samples per micro-batch (default: per model)")
    p.add_argument("--smollm2-dir", default="runs/models/smollm2",
                   help="converted by `swarm model smollm2 DIR`")
    p.add_argument("--peak-tflops", type=float, default=0.0, help="the device's dense bf16 peak, for MFU")
    p.add_argument("--timeout", type=float, default=600.0, help="collective timeout, seconds")
    p.add_argument("--json", help="write the figures to this file")
    p.add_argument("--worker", action="store_true", help=argparse.SUPPRESS)
    p.add_argument("--model", help=argparse.SUPPRESS)
    p.add_argument("--mode", choices=["plain", "fsdp"], help=argparse.SUPPRESS)
    p.add_argument("--out", help="with --worker: where the run's figures go")
    p.add_argument("--model-dir", help="with --worker: the tiny or SmolLM2 model's directory")
    p.add_argument("--report", metavar="DIR", help="print the table of the runs in DIR (and --json)")
    args = p.parse_args()
    if args.worker:
        args.threads = args.threads or int(os.environ.get("OMP_NUM_THREADS", "0")) or (os.cpu_count() or 1)
        worker(args)
        return 0
    if args.report:
        return 0 if report(Path(args.report), args.json) else 1
    models = ["tiny"] if args.quick else args.models.split(",")
    if args.quick:
        args.steps = 2
    if "smollm2" in models and not (Path(args.smollm2_dir) / "config.json").exists():
        from model_builders.smollm2 import convert_smollm2

        print(f"converting SmolLM2 into {args.smollm2_dir} (once)", flush=True)
        convert_smollm2(args.smollm2_dir)
    out = Path(tempfile.mkdtemp(prefix="bench-trainer-"))
    if "tiny" in models:
        from model_builders.default_model import build_default_model

        build_default_model(out / "tiny-model", seed=0)
    ok = True
    for m in models:
        ok &= spawn(args, m, "plain", 1, out)
        for n in (int(x) for x in args.ranks.split(",")):
            ok &= spawn(args, m, "fsdp", n, out)
    report(out, args.json)
    return 0 if ok else 1


if __name__ == "__main__":
    sys.exit(main())
