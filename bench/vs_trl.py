"""Time to accuracy: the swarm (trainer + one vLLM node, two processes) against TRL's GRPOTrainer.

Both arms start from the same model directory, train on the same task with the same reward (the task's
rubric), group size G, prompts per step, learning rate, completion length, clipping, loss normalisation and
step budget, with every core of the machine.

- swarm: `swarm train` + one `swarm node` subprocess on 127.0.0.1, as `swarm demo --nodes 1` runs them.
- TRL: GRPOTrainer as its documentation sets it up for one machine (HF generate, no vLLM), in this process.

Evaluation is off both clocks and the same for both: each arm keeps a copy of its policy every
--eval-every steps (the swarm hard-links the version it published, `train.snapshot_every`; TRL saves in a
callback while its clock is paused), and after both runs this process scores every copy with one function
(trainer.learner.evaluate: held-out greedy accuracy on the same items).

Each arm's RL clock starts when it can first generate: TRL when training begins (model loaded), the swarm
when its node has started vLLM with the weights and gets work (`first_work_s`). What came before is
start-up, reported separately, and counted in the "from launch" column. Reported: RL time to reach the
target held-out accuracy (default: start + 0.25), accuracy after a fixed budget (default: the shorter arm's
run time), and the curves. `--seeds 0,1,2` races once per seed (data order and sampling) and reports
medians: with a few prompts per step, which prompts come first decides much of a single run.

    python bench/vs_trl.py [--model tiny|smollm2] [--minutes 3] [--steps 60] [--json FILE]

Wrap it in `flock /tmp/swarm-vllm.lock` on shared machines: the node starts a vLLM engine.
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import subprocess
import sys
import time
import urllib.request
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))

from bench.race_figures import acc_at, fmt_seconds, summarize, time_to  # noqa: E402
from swarm.demo import free_port, node_threads, stop_processes  # noqa: E402
from trainer.config import RunConfig, dump_config, load_config  # noqa: E402


def bench_config(args, seed: int) -> RunConfig:
    """The shared settings of both arms for one seed (sampling, data order, init of anything random)."""
    sets = [f'run_dir="{args.out}/seed-{seed}/swarm"', f"train.seed={seed}", f"task.seed={seed}",
            f"train.max_steps={args.steps}", f"train.max_minutes={args.minutes}",
            f"train.group_size={args.group_size}", f"train.prompts_per_step={args.prompts_per_step}",
            f"train.lr={args.lr}", "train.eval_every=0", f"train.snapshot_every={args.eval_every}",
            "train.checkpoint_every=0", f"train.torch_threads={args.threads}", f"task.eval_size={args.eval_size}",
            f"train.inflight_groups={args.prompts_per_step}"]  # one batch ahead: fresh rollouts
    if args.model == "smollm2":
        sets += [f'model.path="{args.smollm2_dir}"', 'task.name="gym:single_digit"',
                 'task.params={answer_format="last_number", system_prompt="", eval_share=0.3}',
                 "train.max_tokens=16", "model.max_shard_bytes=67108864"]
    return load_config(args.config, sets + list(args.set or []))


def base_model(cfg: RunConfig, out: Path) -> Path:
    """The starting model both arms and every seed share (the tiny default gets its SFT warm-up once, here)."""
    import msgspec

    from trainer.model_prep import prepare_base_model

    if not cfg.model.path:  # cached (by recipe) outside the swarm arm's run dir, which is wiped per run
        cfg = msgspec.structs.replace(cfg, run_dir=str(out / "base"))
    return prepare_base_model(cfg, progress=False).resolve()


# ---------------------------------------------------------------------------------------------- swarm


def run_swarm(cfg: RunConfig, model_dir: Path, out: Path, trusted: bool = True) -> dict:
    import msgspec

    cfg = msgspec.structs.replace(cfg, model=msgspec.structs.replace(cfg.model, path=str(model_dir)))
    cfg.server.port, cfg.server.http_port, cfg.server.tracker_port = free_port(), free_port(), free_port()
    run_dir = Path(cfg.run_dir)
    if run_dir.exists():
        shutil.rmtree(run_dir)
    run_dir.mkdir(parents=True)
    if trusted:  # the node is the operator's own, as TRL's generation is: no probation before it may train
        from swarm_common.keys import KeyPair

        node_key = KeyPair.load_or_create(run_dir / "node" / "node.key")
        cfg.guard.trusted = frozenset({node_key.public_hex})
    cfg_path = run_dir / "bench.toml"
    cfg_path.write_text(dump_config(cfg))
    env = {**os.environ, "OMP_NUM_THREADS": "1", "PYTHONUNBUFFERED": "1", "TOKENIZERS_PARALLELISM": "false"}
    node_env = {**env, "OMP_NUM_THREADS": str(node_threads(cfg, nodes=1))}  # as `swarm demo` gives it
    py = [sys.executable, "-m", "swarm.cli"]
    launch = time.monotonic()
    logs = [open(run_dir / "trainer.log", "w"), open(run_dir / "node.log", "w")]
    procs = [subprocess.Popen([*py, "train", str(cfg_path)], stdout=logs[0], stderr=subprocess.STDOUT, env=env,
                              cwd=ROOT),
             subprocess.Popen([*py, "node", "--trainer", f"tcp://127.0.0.1:{cfg.server.port}", "--data-dir",
                               str(run_dir / "node"), "--name", "node0", "--seed", str(cfg.train.seed)],
                              stdout=logs[1], stderr=subprocess.STDOUT, env=node_env, cwd=ROOT)]
    url = f"http://127.0.0.1:{cfg.server.http_port}/api/summary"
    startup = None
    try:
        while procs[0].poll() is None:
            time.sleep(1.0)
            if procs[1].poll() is not None:
                raise RuntimeError(f"the node exited ({procs[1].returncode}); see {run_dir}/node.log")
            if startup is None:
                try:
                    with urllib.request.urlopen(url, timeout=2) as r:
                        s = json.loads(r.read())
                    # The RL clock started elapsed_s ago: everything before it is start-up.
                    startup = time.monotonic() - launch - s["elapsed_s"]
                    print(f"  swarm: trainer up after {startup:.0f}s", flush=True)
                except (OSError, ValueError):
                    pass
    finally:
        stop_processes(procs)
        for f in logs:
            f.close()
    if procs[0].returncode != 0 or not (run_dir / "summary.json").exists():
        raise RuntimeError(f"the swarm trainer failed ({procs[0].returncode}); see {run_dir}/trainer.log")
    s = json.loads((run_dir / "summary.json").read_text())
    if s.get("first_work_s") is None or not s["steps"]:
        raise RuntimeError(f"the swarm trained no step; see {run_dir}/trainer.log")
    t0 = s["first_work_s"]  # the RL clock of this arm starts when the node could generate
    snaps = [(x["step"], max(0.0, x["time"] - t0), x["path"]) for x in s["snapshots"]]
    return {"snapshots": snaps, "startup_s": startup + t0, "steps": s["step"],
            "rl_seconds": s["steps"][-1]["time"] - t0, "sampled_correct": [r["correct_mean"] for r in s["steps"]]}


# ---------------------------------------------------------------------------------------------- TRL


def run_trl(cfg: RunConfig, model_dir: Path, out: Path, threads: int) -> dict:
    import torch
    from datasets import Dataset
    from transformers import PrinterCallback, TrainerCallback
    from trl import GRPOConfig, GRPOTrainer

    from rewards.registry import make_task
    from trainer.policy import load_tokenizer

    torch.set_num_threads(threads)
    t = cfg.train
    t_launch = time.monotonic()
    task = make_task(cfg.task.name, **cfg.task.params)
    n_items = t.max_steps * t.prompts_per_step
    # The swarm's item stream, in order; the same chat messages encode_prompt builds.
    by_idx = dict(zip(range(n_items), task.train_items(seed=cfg.task.seed), strict=False))
    sys_msg = [{"role": "system", "content": task.system_prompt}] if task.system_prompt else []
    train = [{"prompt": sys_msg + [{"role": "user", "content": it.prompt}], "item": i} for i, it in by_idx.items()]
    sampled: list[float] = []

    def reward(prompts, completions, item, **_) -> list[float]:
        out = []
        for comp, idx in zip(completions, item, strict=True):
            text = comp[0]["content"] if isinstance(comp, list) else comp
            s = task.score(by_idx[idx], text)
            sampled.append(s.metrics.get(task.correct_metric, 0.0))
            out.append(s.reward)
        return out

    tok = load_tokenizer(model_dir)
    if tok.pad_token is None:
        tok.pad_token = tok.eos_token
    args = GRPOConfig(
        output_dir=str(out / "trl"), learning_rate=t.lr, weight_decay=t.weight_decay, max_grad_norm=t.grad_clip,
        lr_scheduler_type="constant", warmup_steps=0, adam_beta1=0.9, adam_beta2=0.999, adam_epsilon=1e-8,
        # One optimizer step on prompts_per_step prompts x G completions, generated by the policy of that step.
        per_device_train_batch_size=t.prompts_per_step * t.group_size, gradient_accumulation_steps=1,
        num_generations=t.group_size, max_completion_length=t.max_tokens, max_steps=t.max_steps,
        temperature=t.temperature, top_p=t.top_p, beta=cfg.loss.kl_beta, epsilon=cfg.loss.eps_low, epsilon_high=cfg.loss.eps_high,
        scale_rewards="group" if t.scale_adv_by_std else "none", loss_type="dapo", num_iterations=1,
        use_vllm=False, use_cpu=True, bf16=False, fp16=False, seed=t.seed, logging_steps=1,
        save_strategy="no", report_to="none", disable_tqdm=True, dataloader_num_workers=0,
        # The swarm's prompts in the swarm's order: step k of both arms trains on the same prompts, so a
        # seed's race is paired. Early GRPO steps hinge on which prompts they draw: our learner fed TRL's
        # shuffled order of the same 64 items reached 0.48 at step 6 on seed 2, and 0.11 fed them in order.
        shuffle_dataset=False,
    )
    snaps: list[tuple[int, float, str]] = []
    clock = {"start": 0.0, "paused": 0.0}

    def rl_time() -> float:
        return time.monotonic() - clock["start"] - clock["paused"]

    def snapshot(model, step: int) -> None:
        t0, now = time.monotonic(), rl_time()
        path = out / "trl" / "snapshots" / f"step-{step:06d}"
        model.save_pretrained(path, safe_serialization=True)
        tok.save_pretrained(path)
        snaps.append((step, round(now, 3), str(path)))
        clock["paused"] += time.monotonic() - t0  # keeping the copy is not on TRL's clock
        print(f"  trl: step {step} t={now:.1f}s", flush=True)

    class Watch(TrainerCallback):
        def on_train_begin(self, a, state, control, model=None, **kw):
            clock["start"] = time.monotonic()
            clock["startup"] = clock["start"] - t_launch
            snapshot(model, 0)

        def on_step_end(self, a, state, control, model=None, **kw):
            if state.global_step % t.snapshot_every == 0:
                snapshot(model, state.global_step)
            if t.max_minutes > 0 and rl_time() >= t.max_minutes * 60:
                control.should_training_stop = True

    trainer = GRPOTrainer(model=str(model_dir), reward_funcs=reward, args=args,
                          train_dataset=Dataset.from_list(train), processing_class=tok, callbacks=[Watch()])
    trainer.remove_callback(PrinterCallback)  # a dict of metrics per step drowns the table
    trainer.train()
    step = trainer.state.global_step
    rl_seconds = rl_time()
    if snaps[-1][0] != step:
        snapshot(trainer.model, step)
    return {"snapshots": snaps, "startup_s": clock.get("startup"), "steps": step, "rl_seconds": rl_seconds,
            "sampled_correct": sampled}


def score_snapshots(cfg: RunConfig, snaps: list, arm: str) -> list[tuple[int, float, float]]:
    """Held-out greedy accuracy of every kept policy, by the same function for both arms."""
    from rewards.registry import make_task
    from trainer.learner import evaluate
    from trainer.policy import load_model, load_tokenizer

    task = make_task(cfg.task.name, **cfg.task.params)
    items = task.eval_items(cfg.task.eval_size)
    curve = []
    for step, t, path in snaps:
        acc = evaluate(load_model(path), load_tokenizer(path), task, items, cfg.train.max_tokens)["accuracy"]
        curve.append((step, t, acc))
        print(f"  {arm}: step {step} at {t:.1f}s: held-out accuracy {acc:.3f}", flush=True)
    return curve


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--model", choices=["tiny", "smollm2"], default="tiny")
    p.add_argument("--smollm2-dir", default="runs/models/smollm2", help="from `swarm model smollm2 DIR`")
    p.add_argument("--config", help="a swarm TOML to start from (the flags below override it)")
    p.add_argument("--set", action="append", help="extra swarm config overrides, KEY=VALUE")
    p.add_argument("--steps", type=int, default=60, help="optimizer-step budget of each arm")
    p.add_argument("--minutes", type=float, default=3.0, help="RL wall-clock budget of each arm")
    p.add_argument("--group-size", type=int, default=8)
    p.add_argument("--prompts-per-step", type=int, default=16)
    p.add_argument("--lr", type=float, default=2e-4)
    p.add_argument("--eval-every", type=int, default=5)
    p.add_argument("--eval-size", type=int, default=120)
    p.add_argument("--target", type=float, help="target held-out accuracy (default: start + --target-gain)")
    p.add_argument("--target-gain", type=float, default=0.25)
    p.add_argument("--budget", type=float, help="RL seconds for the fixed-budget column (default: shorter run)")
    p.add_argument("--threads", type=int, default=os.cpu_count() or 1,
                   help="torch threads of TRL and of the swarm's trainer (the node has its own engine thread)")
    p.add_argument("--arms", default="swarm,trl")
    p.add_argument("--seeds", default="0", help="comma-separated seeds (train.seed and task.seed), each a race: "
                   "with few prompts per step one run is mostly luck")
    p.add_argument("--untrusted", action="store_true",
                   help="the swarm's node is a stranger: probation (audited, quarantined groups) before it trains")
    p.add_argument("--out", default="runs/bench-vs-trl")
    p.add_argument("--json", metavar="FILE")
    p.add_argument("--keep-files", action="store_true",
                   help="keep every arm's weights (versions, snapshots, checkpoints) after scoring them")
    args = p.parse_args()
    if args.model == "smollm2" and args.group_size == 8 and args.prompts_per_step == 16:
        args.prompts_per_step, args.lr = 4, 1e-5  # what configs/smollm2-arith.toml uses
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    seeds = [int(x) for x in args.seeds.split(",")]
    if "trl" in args.arms.split(","):
        try:  # before the first arm, not ten minutes into the run
            import datasets  # noqa: F401
            import trl  # noqa: F401
        except ImportError as e:
            sys.exit(f"TRL's arm needs the bench extra ({e}): pip install -e '.[bench]' (or make vs-trl)")
    cfg = bench_config(args, seeds[0])
    model_dir = base_model(cfg, out)
    t = cfg.train
    print(f"model {model_dir} | task {cfg.task.name} {cfg.task.params} | G={t.group_size} "
          f"prompts/step={t.prompts_per_step} lr={t.lr} max_tokens={t.max_tokens} | budget {t.max_steps} steps "
          f"or {t.max_minutes:g} min per arm | seeds {seeds}", flush=True)
    import torch

    torch.set_num_threads(args.threads)  # TRL's arm and the scoring of every kept policy run here
    results: dict[int, dict[str, dict]] = {}
    arms_run = args.arms.split(",")
    try:
        for seed in seeds:
            cfg_s = bench_config(args, seed)
            results[seed] = {}
            for arm in arms_run:
                print(f"seed {seed}, arm {arm}:", flush=True)
                t0 = time.monotonic()
                if arm == "swarm":
                    r = run_swarm(cfg_s, model_dir, out / f"seed-{seed}", trusted=not args.untrusted)
                else:
                    r = run_trl(cfg_s, model_dir, out / f"seed-{seed}", args.threads)
                r["wall_s"] = round(time.monotonic() - t0, 1)
                results[seed][arm] = r
            print(f"seed {seed}: scoring the kept policies (off both clocks):", flush=True)
            for arm, r in results[seed].items():
                r["curve"] = score_snapshots(cfg, r["snapshots"], f"seed {seed} {arm}")
            if not args.keep_files:  # SmolLM2: ~0.5 GB a copy, ~13 GB a seed
                for bulky in ("swarm/versions", "swarm/snapshots", "swarm/node", "swarm/checkpoints", "trl"):
                    shutil.rmtree(out / f"seed-{seed}" / bulky, ignore_errors=True)
    except KeyboardInterrupt:  # Ctrl-C between or during seeds: report the ones already run and scored
        seeds = [s for s, arms in results.items() if len(arms) == len(arms_run) and all("curve" in r for r in arms.values())]
        if not seeds:
            raise
        results = {s: results[s] for s in seeds}
        print(f"\ninterrupted: reporting the {len(seeds)} seed(s) that finished", flush=True)
    start = results[seeds[0]][next(iter(results[seeds[0]]))]["curve"][0][2]
    target = args.target if args.target is not None else min(1.0, start + args.target_gain)
    budget = args.budget or min(r["rl_seconds"] for arms in results.values() for r in arms.values())
    print(f"\nstart accuracy {start:.3f}; target {target:.3f}; fixed budget {budget:.0f} s of RL time\n")
    head = (f"{'seed':>4} {'arm':<6} {'start-up s':>10} {'steps':>6} {'RL s':>7} {'s/step':>7} {'time to target s':>17} "
            f"{'from launch s':>14} {'acc @ budget':>13} {'final acc':>10} {'best acc':>9} "
            f"{'sampled acc first->last 5 steps':>32}")
    print(head)
    rows: dict[int, dict[str, dict]] = {}
    for seed, arms in results.items():
        rows[seed] = {}
        for arm, r in arms.items():
            c, sc = r["curve"], r["sampled_correct"]
            k = max(1, len(sc) // max(r["steps"], 1) * 5)  # ~5 steps' worth of samples
            first = sum(sc[:k]) / max(len(sc[:k]), 1)
            last = sum(sc[-k:]) / max(len(sc[-k:]), 1)
            tt = time_to(c, target)
            launch_tt = None if tt is None else tt + (r["startup_s"] or 0.0)
            w = rows[seed][arm] = {
                "startup_s": r["startup_s"], "steps": r["steps"], "rl_seconds": r["rl_seconds"],
                "s_per_step": r["rl_seconds"] / max(r["steps"], 1), "time_to_target_s": tt,
                "launch_to_target_s": launch_tt, "acc_at_budget": acc_at(c, budget), "final_acc": c[-1][2],
                "best_acc": max(a for *_, a in c), "sampled_first": first, "sampled_last": last, "curve": c,
                "wall_s": r["wall_s"]}
            print(f"{seed:>4} {arm:<6} {w['startup_s'] or 0:>10.0f} {w['steps']:>6} {w['rl_seconds']:>7.0f} "
                  f"{w['s_per_step']:>7.2f} {'not reached' if tt is None else f'{tt:.0f}':>17} "
                  f"{'-' if launch_tt is None else f'{launch_tt:.0f}':>14} {w['acc_at_budget']:>13.3f} "
                  f"{w['final_acc']:>10.3f} {w['best_acc']:>9.3f} {f'{first:.3f} -> {last:.3f}':>32}")
    summary = summarize(rows, seeds)
    print(f"\nover {len(seeds)} seed(s): median time to {target:.3f} (a run that never reached it counts as "
          f"never), mean accuracy at {budget:.0f} s")
    for arm, a in summary["arms"].items():
        print(f"  {arm:<6} reached {a['reached']}/{len(seeds)}  median RL s to target {fmt_seconds(a['median_tt'])}  "
              f"from launch {fmt_seconds(a['median_launch_tt'])}  acc @ budget {a['mean_acc_at_budget']:.3f}  "
              f"s/step {a['mean_s_per_step']:.2f}")
    ratio = summary.get("speedup")
    if ratio is not None:
        print(f"\nswarm reaches {target:.3f} {ratio:.2f}x sooner than TRL (median RL time; "
              f"{summary['speedup_from_launch']:.2f}x counting start-up)")
    elif summary.get("trl_never_reached"):
        print(f"\nswarm reaches {target:.3f}; TRL's median run does not within its budget")
    print("\ncurves (step, RL seconds, held-out greedy accuracy)")
    for seed, arms in rows.items():
        for arm, w in arms.items():
            print(f"  seed {seed} {arm}: " + "  ".join(f"{s}/{t:.0f}s/{a:.2f}" for s, t, a in w["curve"]))
    if args.json:
        Path(args.json).write_text(json.dumps({
            "config": dump_config(cfg), "seeds": seeds, "target": target, "budget_s": budget,
            "node_trusted": not args.untrusted, **summary, "runs": {str(k): v for k, v in rows.items()}}, indent=2))
    return 0


if __name__ == "__main__":
    sys.exit(main())
