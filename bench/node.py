"""Node benchmark: live weight reload against an engine restart, and node throughput against raw vLLM.

    python bench/node.py [--model DIR] [--json FILE]

In one run, with the same model, prompts and sampling parameters:
  1. restart: building a fresh vLLM engine for the model (in this process, vLLM already imported: the
     cheapest restart there is) against `Engine.reload` of a published version, the node's live path;
  2. throughput: raw `LLM.generate()` tokens/s in this process, against tokens/s that a real node
     process (`swarm node`) delivers to a work server here, counted from the rollouts it submits.
The work server below stands in for the trainer: it hands out the same prompts forever and takes the
submissions; only the node is measured.
"""

from __future__ import annotations

import argparse
import asyncio
import gc
import json
import os
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))

N_PROMPTS, N_SAMPLES, MAX_TOKENS = 32, 8, 32


def prompts_for(tok) -> list[list[int]]:
    from swarm.chat import encode_prompt

    return [encode_prompt(tok, f"{a}+{b}+{(a * b) % 10}") for a in range(8) for b in range(4)][:N_PROMPTS]


def raw_vllm(model_dir: Path, version_dir: Path) -> dict:
    os.environ.setdefault("VLLM_ENABLE_V1_MULTIPROCESSING", "0")
    from vllm import SamplingParams, TokensPrompt

    from inference_nodes.engine import Engine

    eng = Engine(model_dir)
    prompts = prompts_for(eng.tokenizer)
    params = SamplingParams(n=N_SAMPLES, max_tokens=MAX_TOKENS, temperature=1.0, top_p=1.0, logprobs=0)
    inputs = [TokensPrompt(prompt_token_ids=p) for p in prompts]
    eng.llm.generate(inputs, params, use_tqdm=False)  # warm up this shape
    rates = []
    for _ in range(5):
        t0 = time.perf_counter()
        outs = eng.llm.generate(inputs, params, use_tqdm=False)
        secs = time.perf_counter() - t0
        rates.append(sum(len(c.token_ids) for o in outs for c in o.outputs) / secs)
    reloads = [eng.reload(version_dir) for _ in range(7)]
    del eng
    gc.collect()
    restarts = []
    for _ in range(2):
        t0 = time.perf_counter()
        e2 = Engine(model_dir)
        e2.greedy([prompts[0]], 1)
        restarts.append(time.perf_counter() - t0)
        del e2
        gc.collect()
    return {"raw_tok_s": statistics.median(rates), "reload_s": statistics.median(reloads),
            "restart_s": statistics.median(restarts)}


async def through_node(model_dir: Path, seconds: float, tmp: Path) -> dict:
    """Serve work to a real `swarm node` process and count the tokens it returns."""
    import msgspec
    import zmq
    import zmq.asyncio
    from aiohttp import web

    from swarm import protocol as P
    from swarm.default_model import build_tokenizer
    from swarm.weights import sha256_file

    tok = build_tokenizer()
    prompts = prompts_for(tok)
    vdir = tmp / "serve" / "v000000"
    vdir.mkdir(parents=True)
    for f in model_dir.iterdir():
        if f.is_file():
            (vdir / f.name).write_bytes(f.read_bytes())
    files = [P.FileHash(f.name, f.stat().st_size, sha256_file(f)) for f in sorted(vdir.iterdir())]
    (vdir / "manifest.json").write_bytes(msgspec.json.encode(P.VersionManifest(0, files, time.time())))
    app = web.Application()
    app.router.add_static("/weights/", tmp / "serve")
    runner = web.AppRunner(app)
    await runner.setup()
    site = web.TCPSite(runner, "127.0.0.1", 0)
    await site.start()
    http_port = site._server.sockets[0].getsockname()[1]
    info = P.WeightsInfo(0, f"http://127.0.0.1:{http_port}/weights/v000000/manifest.json")
    sampling = P.SamplingSpec(n=N_SAMPLES, max_tokens=MAX_TOKENS, temperature=1.0, top_p=1.0)

    ctx = zmq.asyncio.Context()
    sock = ctx.socket(zmq.ROUTER)
    port = sock.bind_to_random_port("tcp://127.0.0.1")
    env = {**os.environ, "PYTHONUNBUFFERED": "1"}
    node = subprocess.Popen([sys.executable, "-m", "swarm.cli", "node", "--trainer", f"127.0.0.1:{port}",
                             "--data-dir", str(tmp / "node"), "--max-prompts", str(N_PROMPTS)],
                            cwd=ROOT, env=env, stdout=open(tmp / "node.log", "w"), stderr=subprocess.STDOUT)
    counted, t_start, batches, aid = 0, None, 0, 0
    try:
        while True:
            ident, data = await sock.recv_multipart()
            msg = P.decode(data)
            reply = None
            if isinstance(msg, P.Register):
                reply = P.Registered(node_id=msg.node_id, weights=info, sampling=sampling, heartbeat_s=5.0, max_lag=2)
            elif isinstance(msg, P.WorkRequest):
                assigns = []
                for p in prompts:
                    aid += 1
                    assigns.append(P.Assignment(f"a{aid}", p))
                reply = P.WorkAssignment(weights=info, min_version=0, assignments=assigns, sampling=sampling)
            elif isinstance(msg, P.RolloutSubmission):
                batches += 1
                ntok = sum(len(s.token_ids) for r in msg.rollouts for s in r.samples)
                if batches == 2:  # the first batch pays for the new shape: start the clock after it
                    t_start = time.perf_counter()
                elif batches > 2:
                    counted += ntok
                reply = P.SubmissionResult(accepted=[r.assignment_id for r in msg.rollouts], refused={})
                if t_start and time.perf_counter() - t_start >= seconds:
                    break
            if reply is not None:
                await sock.send_multipart([ident, P.encode(reply)])
    finally:
        node.terminate()
        node.wait(30)
        sock.close(0)
        ctx.term()
        await runner.cleanup()
    elapsed = time.perf_counter() - t_start
    return {"node_tok_s": counted / elapsed, "node_batches": batches - 2}


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--model", help="HF model directory (default: the embedded default model)")
    ap.add_argument("--seconds", type=float, default=30.0, help="how long to measure the node")
    ap.add_argument("--json", help="write the figures to this file")
    args = ap.parse_args()

    import torch

    torch.set_num_threads(1)
    tmp = Path(tempfile.mkdtemp(prefix="bench-node-"))
    if args.model:
        model_dir = Path(args.model)
    else:
        from swarm.default_model import build_default_model

        model_dir = build_default_model(tmp / "model")
    # A "new version": the same architecture with other weights, written as the trainer publishes it.
    from swarm.default_model import build_default_model

    version_dir = build_default_model(tmp / "v1", seed=1) if not args.model else model_dir

    raw = raw_vllm(model_dir, version_dir)
    node = asyncio.run(through_node(model_dir, args.seconds, tmp))
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
