"""Node benchmark: live weight reload against an engine restart, and node throughput against raw vLLM.

    python bench/node.py [--model DIR] [--json FILE]

In one run, with the same model, prompts and sampling parameters:
  1. restart: building a fresh vLLM engine for the model (in this process, vLLM already imported: the
     cheapest restart there is) against `Engine.reload` of a published version, the node's live path;
  2. throughput: raw `LLM.generate()` tokens/s in this process, against tokens/s that a real node
     process (`swarm node`) delivers to a work server here, from its first work request to its last
     submission, in alternating windows so that both see the same machine (this one is noisy).
The work server below stands in for the trainer: it hands out the same prompts and takes the
submissions; only the node is measured.
"""

from __future__ import annotations

import argparse
import asyncio
import concurrent.futures
import gc
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

N_PROMPTS, N_SAMPLES, MAX_TOKENS = 32, 8, 32
ENGINE_THREAD = concurrent.futures.ThreadPoolExecutor(max_workers=1, thread_name_prefix="engine")


def prompts_for(tok) -> list[list[int]]:
    from swarm_common.chat import encode_prompt

    return [encode_prompt(tok, f"{a}+{b}+{(a * b) % 10}") for a in range(8) for b in range(4)][:N_PROMPTS]


class RawArm:
    """Raw vLLM in this process: the same engine settings, prompts and sampling as the node's."""

    def __init__(self, model_dir: Path):
        os.environ.setdefault("VLLM_ENABLE_V1_MULTIPROCESSING", "0")
        from vllm import SamplingParams, TokensPrompt

        from inference_nodes.engine import Engine

        self.engine = Engine(model_dir)
        self.prompts = prompts_for(self.engine.tokenizer)
        self.params = SamplingParams(n=N_SAMPLES, max_tokens=MAX_TOKENS, temperature=1.0, top_p=1.0, logprobs=0)
        self.inputs = [TokensPrompt(prompt_token_ids=p) for p in self.prompts]
        self.batch()  # warm up this shape

    def batch(self) -> tuple[int, float]:
        t0 = time.perf_counter()
        outs = self.engine.llm.generate(self.inputs, self.params, use_tqdm=False)
        return sum(len(c.token_ids) for o in outs for c in o.outputs), time.perf_counter() - t0


def reload_vs_restart(raw: RawArm, model_dir: Path, version_dir: Path) -> dict:
    from inference_nodes.engine import Engine

    reloads = [raw.engine.reload(version_dir) for _ in range(7)]
    # vLLM keeps one engine's distributed state per process: drop this engine before building others.
    del raw.engine
    gc.collect()
    restarts = []
    for _ in range(2):
        t0 = time.perf_counter()
        e2 = Engine(model_dir)
        e2.greedy([raw.prompts[0]], 1)
        restarts.append(time.perf_counter() - t0)
        del e2
        gc.collect()
    return {"reload_s": statistics.median(reloads), "restart_s": statistics.median(restarts)}


async def throughput(raw: RawArm, model_dir: Path, tmp: Path, rounds: int, batches: int) -> dict:
    """Alternate windows of a real `swarm node` process and of raw vLLM, so both see the same machine.

    The node gets its weights through a relay-tree origin and its work from the server below; during
    raw windows the server hands it no work, so the two never run at once."""
    import zmq
    import zmq.asyncio

    from broadcast.origin import Origin
    from swarm_common import protocol as P
    from swarm_common.keys import KeyPair

    key = KeyPair.generate()
    origin = Origin(tmp / "origin", key)
    await origin.start()
    served = tmp / "origin" / "v0"  # a copy: the origin writes its manifest beside the files
    shutil.copytree(model_dir, served)
    await origin.publish(served, 0, None)
    info = P.WeightsInfo(0, f"{origin.url}/v/0/manifest")
    sampling = P.SamplingSpec(n=N_SAMPLES, max_tokens=MAX_TOKENS, temperature=1.0, top_p=1.0)

    ctx = zmq.asyncio.Context()
    sock = ctx.socket(zmq.ROUTER)
    port = sock.bind_to_random_port("tcp://127.0.0.1")
    node = subprocess.Popen([sys.executable, "-m", "swarm.cli", "node", "--trainer", f"127.0.0.1:{port}",
                             "--data-dir", str(tmp / "node"), "--max-prompts", str(N_PROMPTS)],
                            cwd=ROOT, env={**os.environ, "PYTHONUNBUFFERED": "1"},
                            stdout=open(tmp / "node.log", "w"), stderr=subprocess.STDOUT)
    state = {"quota": 0, "outstanding": 0, "first": None, "last": None, "tokens": 0, "aid": 0}
    window_done = asyncio.Event()

    async def serve():
        while True:
            frames = await sock.recv_multipart()
            ident, msg = frames[0], P.decode_signed(frames[1:])
            reply = None
            if isinstance(msg, P.Register):
                reply = P.Registered(node_id=msg.node_id, weights=info, sampling=sampling, heartbeat_s=5.0,
                                     max_lag=2, tracker_url=origin.url, trainer_key=key.public_hex)
            elif isinstance(msg, P.WorkRequest):
                assigns = []
                if state["quota"] > 0:
                    state["quota"] -= 1
                    state["outstanding"] += 1
                    state["first"] = state["first"] or time.perf_counter()
                    for p in raw.prompts:
                        state["aid"] += 1
                        assigns.append(P.Assignment(f"a{state['aid']}", p))
                reply = P.WorkAssignment(weights=info, min_version=0, assignments=assigns, sampling=sampling,
                                         retry_after_s=0.0 if assigns else 0.05)
            elif isinstance(msg, P.RolloutSubmission):
                state["outstanding"] -= 1
                state["tokens"] += sum(len(s.token_ids) for r in msg.rollouts for s in r.samples)
                state["last"] = time.perf_counter()
                reply = P.SubmissionResult(accepted=[r.assignment_id for r in msg.rollouts], refused={})
                if state["quota"] == 0 and state["outstanding"] == 0:
                    window_done.set()
            if reply is not None:
                await sock.send_multipart([ident, P.encode(reply)])

    async def node_window(n: int) -> float:
        state.update(quota=n, first=None, last=None, tokens=0)
        window_done.clear()
        await asyncio.wait_for(window_done.wait(), 600)
        return state["tokens"] / (state["last"] - state["first"])

    server = asyncio.create_task(serve())
    node_rates, raw_rates = [], []
    try:
        await node_window(2)  # start-up and the first batch of this shape
        for _ in range(rounds):
            node_rates.append(await node_window(batches))
            # On the engine's own thread, as the node does (vLLM's CPU attention is bound to the OpenMP
            # team of the thread that built it); the node is idle meanwhile.
            runs = [await asyncio.get_running_loop().run_in_executor(ENGINE_THREAD, raw.batch)
                    for _ in range(batches)]
            raw_rates.append(sum(t for t, _ in runs) / sum(s for _, s in runs))
    finally:
        server.cancel()
        node.terminate()
        node.wait(30)
        sock.close(0)
        ctx.term()
        await origin.stop()
    return {"node_tok_s": statistics.median(node_rates), "raw_tok_s": statistics.median(raw_rates),
            "node_rounds": node_rates, "raw_rounds": raw_rates}


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--model", help="HF model directory (default: the embedded default model)")
    ap.add_argument("--rounds", type=int, default=4, help="alternating node / raw windows")
    ap.add_argument("--batches", type=int, default=3, help="batches of 32 prompts x 8 samples per window")
    ap.add_argument("--json", help="write the figures to this file")
    args = ap.parse_args()

    tmp = Path(tempfile.mkdtemp(prefix="bench-node-"))
    if args.model:
        model_dir = Path(args.model)
    else:
        from model_builders.default_model import build_default_model

        model_dir = build_default_model(tmp / "model")
    # A "new version": the same architecture with other weights, written as the trainer publishes it.
    from model_builders.default_model import build_default_model

    version_dir = build_default_model(tmp / "v1", seed=1) if not args.model else model_dir

    # Raw vLLM runs on one dedicated thread, like the node's engine: same threading, same conditions.
    arm = ENGINE_THREAD.submit(RawArm, model_dir).result()
    node = asyncio.run(throughput(arm, model_dir, tmp, args.rounds, args.batches))
    raw = ENGINE_THREAD.submit(reload_vs_restart, arm, model_dir, version_dir).result()
    raw["raw_tok_s"] = node["raw_tok_s"]
    res = {**raw, **node, "reload_speedup": raw["restart_s"] / raw["reload_s"],
           "node_vs_raw": node["node_tok_s"] / raw["raw_tok_s"], "model": str(model_dir)}
    print(f"\n{'measure':<34} {'value':>12}")
    print(f"{'engine restart (s)':<34} {raw['restart_s']:>12.3f}")
    print(f"{'live reload (s)':<34} {raw['reload_s']:>12.4f}")
    print(f"{'reload speed-up (restart/reload)':<34} {res['reload_speedup']:>12.1f}x   target >= 20x")
    print(f"{'raw vLLM generate (tok/s)':<34} {raw['raw_tok_s']:>12.0f}")
    print(f"{'through a node (tok/s)':<34} {node['node_tok_s']:>12.0f}")
    print(f"{'node / raw':<34} {res['node_vs_raw']:>12.3f}    target >= 0.9")
    if args.json:
        Path(args.json).write_text(json.dumps(res, indent=2))
    return 0


if __name__ == "__main__":
    sys.exit(main())
