"""Multi-turn episodes: a node's throughput against a plain vLLM loop, and what checking them costs the trainer.

    python bench/episodes.py [--envs calculator,guess] [--rounds 8] [--batches 1] [--json FILE]

For each environment, with its demo's starting policy (the embedded model after the warm-up on worked
episodes that `swarm demo --task ENV` gives it; built here into a temporary run directory):
  1. throughput: a real `swarm node` process answering a stand-in work server that hands out the
     environment's work (32 prompts x 8 episodes a batch), from its first request to its last submission,
     against a plain loop in this process doing the same episodes with the same vLLM engine settings
     (`LLM.generate` for every running episode's next turn with the same sampling and log-probs, decode,
     the environment, the answer's ids), in short windows side by side, the order swapped every round, so
     both see the same machine. Sampled tokens/s (median of the rounds' ratios; CPU seconds per token as
     a second view) and episodes/s, turns and tool calls per episode.
  2. costs, on the episodes the node sent: the trainer's replay (trainer/episode_check.py) and audit
     (a prefill with masks) per group, against the learner's step time per group (16 groups a step); the
     share at the default audit rate (the audit of every group of a new node is the second figure).
  3. the python tool (with --envs ...,python): replay cost per group of its worked episodes, whose programs
     run in the sandbox, against the same step; with --python-model, 1 and 2 on that policy's episodes.
"""

from __future__ import annotations

import argparse
import asyncio
import concurrent.futures
import json
import os
import shutil
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))

from bench.episode_costs import G, costs, demo_groups  # noqa: E402

N_PROMPTS = 32
ENGINE = concurrent.futures.ThreadPoolExecutor(max_workers=1, thread_name_prefix="engine")


def run_config(env: str, run_dir: Path):
    from trainer.config import load_config

    path = ROOT / "configs" / f"{env}.toml"
    over = [f'run_dir="{run_dir}"'] + ([] if path.exists() else [f'task.name="{env}"'])
    return load_config(path if path.exists() else None, over)


class Work:
    """The environment's hand-out, as the trainer makes it."""

    def __init__(self, cfg, tok):
        from rewards.registry import make_task
        from rewards.token_episode import handout, prompt_ids
        from swarm_common import protocol as P

        self.env = make_task(cfg.task.name, **cfg.task.params)
        self.spec, item_of = handout(self.env, cfg.task.max_episode_tokens)
        self.items = list(self.env.eval_items(N_PROMPTS))
        self.prompts = [prompt_ids(self.env, tok, it) for it in self.items]
        self.assignments = [P.Assignment(f"a{i}", p, item_of(it)) for i, (it, p) in
                            enumerate(zip(self.items, self.prompts, strict=True))]
        self.sampling = P.SamplingSpec(n=G, max_tokens=cfg.train.max_tokens, temperature=1.0, top_p=1.0)


def plain_batch(engine, work: Work) -> tuple[int, int, int, int]:
    """The same episodes with vLLM directly: (sampled tokens, episodes, turns, tool calls). The same sampling
    (the hand-out's temperature and top_p, each sampled token's log-prob taken out as the node does)."""
    from vllm import SamplingParams, TokensPrompt

    from rewards.environment import Episode
    from swarm_common.chat import observation_ids

    llm, tok, stop = engine.llm, engine.tokenizer, engine.tokenizer.eos_token_id
    cap, per_turn = work.spec.max_episode_tokens, work.sampling.max_tokens
    temp, top_p = work.sampling.temperature, work.sampling.top_p
    eps = [[p, [], Episode(work.env, it), []] for it, p in zip(work.items, work.prompts, strict=True) for _ in range(G)]
    sampled = 0
    active = eps
    while active:
        params = [SamplingParams(max_tokens=min(per_turn, cap - len(gen)), temperature=temp, top_p=top_p, logprobs=0,
                                 ignore_eos=True, stop_token_ids=[stop], detokenize=False) for _, gen, _, _ in active]
        outs = llm.generate([TokensPrompt(prompt_token_ids=p + gen) for p, gen, _, _ in active], params,
                            use_tqdm=False)
        still = []
        for (p, gen, ep, lps), out in zip(active, outs, strict=True):
            c = out.outputs[0]
            ids = list(c.token_ids)
            lps += [float(c.logprobs[i][t].logprob) for i, t in enumerate(ids)]
            sampled += len(ids)
            gen += ids
            if not ids or ids[-1] != stop:
                continue
            reply = ep.act(tok.decode(ids[:-1], skip_special_tokens=True))
            if reply is None:
                continue
            obs = observation_ids(tok, reply)
            if len(gen) + len(obs) < cap:
                gen += obs
                still.append((p, gen, ep, lps))
        active = still
    return sampled, len(eps), sum(e.turns for _, _, e, _ in eps), sum(e.tool_calls for _, _, e, _ in eps)


def cpu_seconds(pid: int) -> float:
    """A process's CPU time (user + system, all threads) so far."""
    fields = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()
    return (int(fields[11]) + int(fields[12])) / os.sysconf("SC_CLK_TCK")


async def throughput(engine, work: Work, model_dir: Path, tmp: Path, rounds: int, batches: int) -> dict:
    """Alternating windows: a `swarm node` process, then the plain loop (the node idle meanwhile)."""
    import zmq
    import zmq.asyncio

    from broadcast.origin import Origin
    from swarm_common import protocol as P
    from swarm_common.keys import KeyPair

    key = KeyPair.generate()
    origin = Origin(tmp / "origin", key)
    await origin.start()
    shutil.copytree(model_dir, tmp / "origin" / "v0")
    await origin.publish(tmp / "origin" / "v0", 0, None)
    info = P.WeightsInfo(0, f"{origin.url}/v/0/manifest")
    ctx = zmq.asyncio.Context()
    sock = ctx.socket(zmq.ROUTER)
    port = sock.bind_to_random_port("tcp://127.0.0.1")
    node = subprocess.Popen([sys.executable, "-m", "swarm.cli", "node", "--trainer", f"127.0.0.1:{port}",
                             "--data-dir", str(tmp / "node"), "--max-prompts", str(N_PROMPTS)], cwd=ROOT,
                            env={**os.environ, "PYTHONUNBUFFERED": "1"}, stdout=open(tmp / "node.log", "w"),
                            stderr=subprocess.STDOUT)
    st = {"quota": 0, "out": 0, "first": None, "last": None, "tokens": 0, "episodes": 0, "turns": 0, "calls": 0,
          "aid": 0, "sent": None, "gen": 0.0}
    done = asyncio.Event()
    window = asyncio.Event()  # set while there are batches left to hand out

    def hand_out() -> P.WorkAssignment:
        assigns = []
        if st["quota"] > 0:
            st["quota"] -= 1
            st["out"] += 1
            st["first"] = st["first"] or time.perf_counter()
            for a in work.assignments:
                st["aid"] += 1
                assigns.append(P.Assignment(f"{a.assignment_id}-{st['aid']}", a.prompt_token_ids, a.item))
            if st["quota"] == 0:
                window.clear()
        return P.WorkAssignment(weights=info, min_version=0, assignments=assigns, sampling=work.sampling,
                                retry_after_s=0.0, env=work.spec)

    held: set[asyncio.Task] = set()

    async def hold(ident: bytes) -> None:
        try:
            await asyncio.wait_for(window.wait(), 5.0)
        except TimeoutError:
            pass
        await sock.send_multipart([ident, P.encode(hand_out())])

    async def serve():
        while True:
            frames = await sock.recv_multipart()
            ident, msg = frames[0], P.decode_signed(frames[1:])
            reply = None
            if isinstance(msg, P.Register):
                reply = P.Registered(node_id=msg.node_id, weights=info, sampling=work.sampling, heartbeat_s=5.0,
                                     max_lag=2, tracker_url=origin.url, trainer_key=key.public_hex)
            elif isinstance(msg, P.WorkRequest):
                if st["quota"] == 0:  # held, as the trainer holds it: no polling while the plain loop runs
                    t = asyncio.create_task(hold(ident))
                    held.add(t)
                    t.add_done_callback(held.discard)
                    continue
                reply = hand_out()
            elif isinstance(msg, P.RolloutSubmission):
                st["out"] -= 1
                eps = [e for r in msg.rollouts for e in r.episodes]
                st["tokens"] += sum(len(e.logprobs) for e in eps)
                st["episodes"] += len(eps)
                st["gen"] += msg.gen_seconds
                st["last"], st["sent"] = time.perf_counter(), msg
                reply = P.SubmissionResult(accepted=[r.assignment_id for r in msg.rollouts], refused={})
                if st["quota"] == 0 and st["out"] == 0:
                    done.set()
            elif isinstance(msg, P.Heartbeat):
                continue
            if reply is not None:
                await sock.send_multipart([ident, P.encode(reply)])

    async def node_window(n: int) -> tuple[float, float, float]:
        st.update(quota=n, first=None, last=None, tokens=0, episodes=0, gen=0.0)
        done.clear()
        cpu0 = cpu_seconds(node.pid)
        window.set()
        await asyncio.wait_for(done.wait(), 900)
        cpu = cpu_seconds(node.pid) - cpu0
        secs = st["last"] - st["first"]
        print(f"  node:  {n} batches, {st['tokens']} sampled tokens in {secs:.2f} s from the first hand-out to the "
              f"last submission ({st['gen']:.2f} s in its episode runner), {cpu:.2f} CPU s", flush=True)
        return st["tokens"] / secs, st["episodes"] / secs, cpu / st["tokens"]

    async def plain_window(n: int) -> tuple[float, float, float]:
        t0, cpu0 = time.perf_counter(), time.process_time()
        runs = [await loop.run_in_executor(ENGINE, plain_batch, engine, work) for _ in range(n)]
        secs, cpu = time.perf_counter() - t0, time.process_time() - cpu0
        tokens = sum(r[0] for r in runs)
        print(f"  plain: {n} batches, {tokens} sampled tokens in {secs:.2f} s, {cpu:.2f} CPU s", flush=True)
        shape.extend(runs)
        return tokens / secs, sum(r[1] for r in runs) / secs, cpu / tokens

    server = asyncio.create_task(serve())
    node_rates, plain_rates, shape = [], [], []
    loop = asyncio.get_running_loop()
    try:
        await node_window(1)  # start-up and the first batches of these shapes
        await plain_window(1)
        shape.clear()
        # Other work on a shared machine comes in bursts of seconds: short windows side by side, the order
        # swapped every round so neither side always runs first, and the median of the rounds' ratios.
        for i in range(rounds):
            if i % 2:
                plain_rates.append(await plain_window(batches))
                node_rates.append(await node_window(batches))
            else:
                node_rates.append(await node_window(batches))
                plain_rates.append(await plain_window(batches))
    finally:
        server.cancel()
        for t in list(held):
            t.cancel()
        node.terminate()
        node.wait(30)
        sock.close(0)
        ctx.term()
        await origin.stop()
    n_eps = sum(r[1] for r in shape)
    ratios = [n[0] / p[0] for n, p in zip(node_rates, plain_rates, strict=True)]
    return {"node_vs_plain": statistics.median(ratios), "node_vs_plain_rounds": ratios,
            "node_vs_plain_cpu": statistics.median(p[2] / n[2] for n, p in zip(node_rates, plain_rates, strict=True)),
            "node_tok_s": statistics.median(r[0] for r in node_rates),
            "node_episodes_s": statistics.median(r[1] for r in node_rates),
            "plain_tok_s": statistics.median(r[0] for r in plain_rates),
            "plain_episodes_s": statistics.median(r[1] for r in plain_rates),
            "turns_per_episode": sum(r[2] for r in shape) / n_eps, "tool_calls_per_episode": sum(r[3] for r in shape) / n_eps,
            "node_rounds": node_rates, "plain_rounds": plain_rates, "submission": st["sent"]}


def one(env: str, tmp: Path, rounds: int, batches: int, rate: float) -> dict:
    """Everything for one environment, in this process (one vLLM engine per process)."""
    import torch

    from inference_nodes.engine import Engine, model_context
    from trainer.model_prep import prepare_base_model
    from trainer.policy import load_tokenizer

    torch.set_num_threads(int(os.environ.get("OMP_NUM_THREADS", "1")))  # before vLLM: it forbids changes after
    cfg = run_config(env, tmp / env)
    # The tiny model writes programs after ~500 warm-up steps (docs/benchmarks.md): a policy so warmed up
    # (--python-model, e.g. a demo's RUN/base-model) runs the python tool's work; without one only its costs
    # are measured, on worked episodes.
    worked = env == "python" and not os.environ.get("BENCH_PYTHON_MODEL")
    if env == "python":
        cfg.model.path, cfg.model.sft_steps = os.environ.get("BENCH_PYTHON_MODEL", ""), 0
    t0 = time.perf_counter()
    model_dir = prepare_base_model(cfg, progress=False)
    print(f"[{env}] starting policy in {time.perf_counter() - t0:.0f}s ({cfg.model.sft_steps} warm-up steps)", flush=True)
    tok = load_tokenizer(model_dir)
    work = Work(cfg, tok)
    res: dict = {"env": env}
    if worked:
        groups = demo_groups(work, cfg, tok, 8)
    else:
        shutil.rmtree(tmp / f"{env}-tp", ignore_errors=True)
        engine = ENGINE.submit(Engine, model_dir, max_model_len=model_context(model_dir)).result()
        tp = asyncio.run(throughput(engine, work, model_dir, tmp / f"{env}-tp", rounds, batches))
        sub = tp.pop("submission")
        by_id = {a.assignment_id: (it, a.prompt_token_ids) for a, it in zip(work.assignments, work.items, strict=True)}
        groups = [(*by_id[r.assignment_id.rsplit("-", 1)[0]], r.episodes) for r in sub.rollouts]
        res.update(tp)
    res.update(costs(cfg, model_dir, work, groups[:8], rate, sampled=not worked))
    return res


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--envs", default="calculator,guess,python")
    ap.add_argument("--rounds", type=int, default=8, help="rounds of a node window and a plain one")
    ap.add_argument("--batches", type=int, default=1, help="batches of 32 prompts x 8 episodes per window")
    ap.add_argument("--threads", type=int, default=1,
                    help="torch/OpenMP threads of both engines (and of the learner's step: the trainer uses 1). On a "
                    "machine others use too, two-thread teams stall whenever one of their threads is descheduled")
    ap.add_argument("--python-model", help="a policy warmed up on the python tool (a demo's RUN/base-model): its "
                    "node throughput is measured too")
    ap.add_argument("--json", help="write the figures to this file")
    ap.add_argument("--one", help=argparse.SUPPRESS)  # internal: one environment, in a fresh process
    ap.add_argument("--out", help=argparse.SUPPRESS)
    ap.add_argument("--dir", default=None, help="work directory (default: a fresh temporary one)")
    args = ap.parse_args()
    from trainer.audit import AuditConfig

    rate = AuditConfig().rate
    tmp = Path(args.dir or tempfile.mkdtemp(prefix="bench-episodes-"))
    if args.one:
        res = one(args.one, tmp, args.rounds, args.batches, rate)
        Path(args.out).write_text(json.dumps(res))
        return 0
    results = []
    os.environ["OMP_NUM_THREADS"] = str(args.threads)  # the node process and the plain loop's engine alike
    if args.python_model:
        os.environ["BENCH_PYTHON_MODEL"] = str(Path(args.python_model).resolve())
    for env in args.envs.split(","):
        out = tmp / f"{env}.json"
        subprocess.run([sys.executable, __file__, "--one", env, "--out", str(out), "--dir", str(tmp), "--rounds",
                        str(args.rounds), "--batches", str(args.batches)], check=True, cwd=ROOT)
        results.append(json.loads(out.read_text()))
    print(f"\n{'environment':<12}{'node tok/s':>11}{'plain tok/s':>12}{'node/plain':>11}{'by CPU':>7}{'episodes/s':>11}"
          f"{'turns':>7}{'calls':>7}{'replay ms':>10}{'audit ms':>9}{'step ms':>9}{'share':>8}{'all audited':>12}")
    for r in results:
        tp = (f"{r['node_tok_s']:>11.0f}{r['plain_tok_s']:>12.0f}{r['node_vs_plain']:>11.3f}"
              f"{r['node_vs_plain_cpu']:>7.3f}{r['node_episodes_s']:>11.1f}"
              f"{r['turns_per_episode']:>7.2f}{r['tool_calls_per_episode']:>7.2f}") if "node_tok_s" in r else \
            f"{'-':>11}{'-':>12}{'-':>11}{'-':>7}{'-':>11}{'-':>7}{'-':>7}"
        print(f"{r['env']:<12}{tp}{1000 * r['replay_s_per_group']:>10.1f}{1000 * r['audit_s_per_group']:>9.1f}"
              f"{1000 * r['step_s_per_group']:>9.1f}{r['share']:>8.1%}{r['share_all_audited']:>12.1%}")
    print("\nnode/plain: goal >= 0.9 (sampled tokens/s, median over rounds of a node window against the plain "
          "window beside it); by CPU: the plain loop's CPU seconds per sampled token / the node process's.\n"
          f"share: (replay + {rate:.0%} x audit) per group / the learner's step per group (16 groups a step, 1 thread as the trainer); goal <= 10%.")
    if args.json:
        Path(args.json).write_text(json.dumps(results, indent=2))
    return 0


if __name__ == "__main__":
    sys.exit(main())
