"""Benchmark: delta versions against full versions, on real optimizer steps of real models.

For each model (SmolLM2-135M-Instruct, converted by `swarm model smollm2 DIR`, and the tiny default model)
and each published dtype (float32, bfloat16), --steps consecutive optimizer steps as the race takes them:
AdamW (torch's fused kernel, as trainer/learner.py), lr 1e-5, no weight decay, gradients clipped at 1, on
fp32 master weights. The loss is a real one but not GRPO's (no vLLM rollouts here): next-token cross-entropy
on batches of 4 arithmetic problems with their answers. Adam's step size is set by the lr, not by the loss,
and that is what decides how many published elements change. Each version is written by the trainer's own
Publisher (2-MiB shards, as a run writes them), encoded against the version before (broadcast/delta.py),
decoded into a scratch directory, and compared byte for byte with what was written: every version.

Then the first --bcast + 1 versions go through a real tree: an origin and --relays relay processes, every
uplink paced to --mbit (20 Mbit/s, a home uplink), the first version whole, the others as deltas. T is from
the publish call (encode, hash and sign included) to the last relay holding the rebuilt, verified version;
every relay's files are then compared with the source's by sha256.

  python bench/delta.py --smollm2 DIR [--steps 20] [--bcast 3] [--json FILE]
"""

from __future__ import annotations

import argparse
import asyncio
import json
import logging
import random
import shutil
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO))


# ---------------------------------------------------------------------------------------------------------
# versions from real optimizer steps
# ---------------------------------------------------------------------------------------------------------
def _files(d: Path) -> list[str]:
    from broadcast.delta import list_files

    return list_files(d)


def _sha(p: Path) -> str:
    from broadcast.delta import file_sha256

    return file_sha256(p)


def _same(src: Path, copies: list[Path]) -> bool:
    want = {f: _sha(src / f) for f in _files(src)}
    return all(_sha(c / f) == h for c in copies for f, h in want.items())


def make_versions(model_dir: Path, work: Path, steps: int, keep_first: int, seed: int) -> dict:
    """Take `steps` optimizer steps; publish every version in both dtypes; encode, decode and check each."""
    import torch

    from broadcast import delta
    from trainer.learner import make_adamw
    from trainer.policy import frozen_state, load_model, load_tokenizer
    from trainer.publisher import Publisher

    torch.manual_seed(seed)
    model, tok = load_model(model_dir), load_tokenizer(model_dir)
    if tok.pad_token_id is None:
        tok.pad_token = tok.eos_token
    opt = make_adamw(model, 1e-5, 0.0)
    rnd = random.Random(seed)
    dtypes = {"float32": torch.float32, "bfloat16": torch.bfloat16}
    pubs = {n: Publisher(work / n, model_dir, keep=2) for n in dtypes}
    rows: dict[str, list[dict]] = {n: [] for n in dtypes}
    kept: dict[str, list[Path]] = {n: [] for n in dtypes}
    step_s = []
    for v in range(steps + 1):
        if v:
            t0 = time.perf_counter()
            texts = []
            for _ in range(4):
                a, b, c = (rnd.randint(0, 9) for _ in range(3))
                texts.append(f"What is {a}+{b}+{c}? {a + b + c}")
            enc = tok(texts, return_tensors="pt", padding=True)
            labels = enc["input_ids"].masked_fill(enc["attention_mask"] == 0, -100)
            model.train()
            opt.zero_grad(set_to_none=True)
            model(**enc, labels=labels).loss.backward()
            torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)
            opt.step()
            step_s.append(time.perf_counter() - t0)
        for name, dt in dtypes.items():
            pub = pubs[name]
            cur = pub.publish(model, v, frozen_state(model, dt))
            if v < keep_first:
                kept[name].append(pub.snapshot(v, f"v{v}"))  # hard links: retention cannot touch them
            if not v:
                continue
            prev = pub.path(v - 1)
            out, scratch = work / name / "delta", work / name / "rebuilt"
            shutil.rmtree(out, ignore_errors=True)
            shutil.rmtree(scratch, ignore_errors=True)
            t0 = time.perf_counter()
            target, size = delta.encode(prev, v - 1, cur, out)
            t1 = time.perf_counter()
            delta.apply(prev, out / delta.PAYLOAD, target, v - 1, scratch)
            t2 = time.perf_counter()
            exact = all((scratch / t.path).read_bytes() == (cur / t.path).read_bytes() for t in target)
            full = sum(t.size for t in target)
            rows[name].append({"version": v, "full_bytes": full, "delta_bytes": size, "ratio": size / full,
                               "encode_s": t1 - t0, "decode_s": t2 - t1, "bit_exact": exact})
            print(f"  step {v:>3} {name:<8} delta {size / 1e6:8.2f} MB = {100 * size / full:6.2f}% of "
                  f"{full / 1e6:7.1f} MB  encode {t1 - t0:5.2f}s decode {t2 - t1:5.2f}s  "
                  f"{'bit-exact' if exact else 'MISMATCH'}", flush=True)
    return {"rows": rows, "kept": kept, "step_s": statistics.median(step_s) if step_s else None}


# ---------------------------------------------------------------------------------------------------------
# the tree: relays as processes, several peers to a process
# ---------------------------------------------------------------------------------------------------------
async def _relay_worker(args: argparse.Namespace) -> None:
    from broadcast.peer import Peer, PeerConfig

    logging.basicConfig(level=logging.WARNING)
    peers = []
    for i in args.indices:
        async def done(version: int, path: Path, i=i) -> None:
            print(f"DONE {i} {version} {time.time():.6f} {path}", flush=True)

        p = Peer(args.tracker, Path(args.dir) / f"r{i}", bytes.fromhex(args.key),
                 PeerConfig(upload_rate=args.rate, name=f"r{i}", stall_timeout=120), on_version=done)
        await p.start()
        peers.append(p)
    print("READY", flush=True)
    await asyncio.get_running_loop().run_in_executor(None, sys.stdin.readline)
    for p in peers:
        await p.stop()


async def broadcast(versions: list[Path], n: int, rate: float, tmp: Path, procs_n: int = 2) -> list[dict]:
    from broadcast.config import OriginConfig
    from broadcast.origin import Origin
    from swarm_common.keys import KeyPair

    kp = KeyPair.generate()
    origin = Origin(tmp / "origin", kp, OriginConfig(fanout=2, upload_rate=rate, piece_bytes=1 << 20,
                                                   heartbeat_s=1.0, full_every=10**9), keep=3)
    await origin.start()
    procs, lines = [], []

    async def read(p, sink):
        async for line in p.stdout:
            sink.append(line.decode().strip())

    out = []
    try:
        for w in range(procs_n):
            idx = [str(i) for i in range(w, n, procs_n)]
            p = await asyncio.create_subprocess_exec(
                sys.executable, __file__, "--relay-worker", "--tracker", origin.url, "--key", kp.public_hex,
                "--dir", str(tmp), "--rate", str(rate), "--indices", *idx,
                stdin=subprocess.PIPE, stdout=subprocess.PIPE)
            sink: list[str] = []
            asyncio.create_task(read(p, sink))
            procs.append(p)
            lines.append(sink)
        end = time.monotonic() + 60
        while sum("READY" in s for s in lines) < procs_n or len(origin.tracker.peers) < n:
            if time.monotonic() > end:
                raise RuntimeError("relays did not start")
            await asyncio.sleep(0.1)
        for v, d in enumerate(versions):
            t0 = time.time()
            m = await origin.publish(d, v, v - 1 if v else None)
            t_pub = time.time() - t0
            end = time.monotonic() + 3 * m.total_size / rate + 120
            while True:
                done = [s.split() for sink in lines for s in sink if s.startswith("DONE ") and s.split()[2] == str(v)]
                if len(done) == n:
                    break
                if time.monotonic() > end:
                    raise RuntimeError(f"v{v}: {len(done)}/{n} relays done in time")
                await asyncio.sleep(0.05)
            T = max(float(x[3]) for x in done) - t0
            exact = await asyncio.to_thread(_same, d, [Path(x[4]) for x in done])  # off the origin's loop
            out.append({"version": v, "kind": "delta" if m.base is not None else "full", "bytes": m.total_size,
                        "publish_s": t_pub, "T_s": T, "relays_bit_exact": exact})
            print(f"  v{v} {out[-1]['kind']:<5} {m.total_size / 1e6:8.2f} MB through {n} relays in {T:7.2f}s "
                  f"(publish {t_pub:.2f}s)  {'bit-exact' if exact else 'MISMATCH'}", flush=True)
    finally:
        for p in procs:
            if p.returncode is None:
                p.stdin.write(b"stop\n")
                await p.stdin.drain()
        for p in procs:
            try:
                await asyncio.wait_for(p.wait(), 20)
            except TimeoutError:
                p.kill()
                await p.wait()
        await origin.stop()
    return out


# ---------------------------------------------------------------------------------------------------------
def summarize(model: str, gen: dict, bc: dict[str, list[dict]]) -> list[dict]:
    out = []
    for dt, rows in gen["rows"].items():
        b = bc.get(dt, [])
        full_T = next((r["T_s"] for r in b if r["kind"] == "full"), None)
        delta_T = [r["T_s"] for r in b if r["kind"] == "delta"]
        out.append({
            "model": model, "dtype": dt, "steps": len(rows), "full_MB": rows[0]["full_bytes"] / 1e6,
            "delta_mean_pct": 100 * statistics.mean(r["ratio"] for r in rows),
            "delta_max_pct": 100 * max(r["ratio"] for r in rows),
            "encode_s": statistics.mean(r["encode_s"] for r in rows),
            "decode_s": statistics.mean(r["decode_s"] for r in rows),
            "enc_plus_dec_max_s": max(r["encode_s"] + r["decode_s"] for r in rows),
            "bit_exact": all(r["bit_exact"] for r in rows) and all(r["relays_bit_exact"] for r in b),
            "T_full_s": full_T, "T_delta_s": statistics.mean(delta_T) if delta_T else None,
        })
        s = out[-1]
        s["T_speedup"] = s["T_full_s"] / s["T_delta_s"] if full_T and delta_T else None
    return out


def _f(x, spec: str) -> str:
    return format(x, spec) if isinstance(x, (int, float)) else "—"


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--smollm2", type=Path, help="SmolLM2 directory from `swarm model smollm2 DIR` (else skipped)")
    ap.add_argument("--no-tiny", action="store_true", help="skip the tiny default model")
    ap.add_argument("--steps", type=int, default=20)
    ap.add_argument("--bcast", type=int, default=3, help="deltas sent through the tree after the full version")
    ap.add_argument("--bcast-dtypes", nargs="*", default=["float32", "bfloat16"])
    ap.add_argument("--relays", type=int, default=4)
    ap.add_argument("--mbit", type=float, default=20.0, help="every uplink's rate, Mbit/s")
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--json", type=Path)
    ap.add_argument("--relay-worker", action="store_true", help=argparse.SUPPRESS)
    ap.add_argument("--tracker", help=argparse.SUPPRESS)
    ap.add_argument("--key", help=argparse.SUPPRESS)
    ap.add_argument("--dir", help=argparse.SUPPRESS)
    ap.add_argument("--rate", type=float, help=argparse.SUPPRESS)
    ap.add_argument("--indices", nargs="+", type=int, help=argparse.SUPPRESS)
    args = ap.parse_args()
    if args.relay_worker:
        asyncio.run(_relay_worker(args))
        return
    import torch

    torch.set_num_threads(2)
    logging.basicConfig(level=logging.WARNING)
    rate = args.mbit * 1e6 / 8
    summary, detail = [], {}
    with tempfile.TemporaryDirectory(prefix="deltabench-") as td:
        tmp = Path(td)
        models = []
        if not args.no_tiny:
            from model_builders.default_model import build_default_model

            models.append(("tiny", build_default_model(tmp / "tiny-base")))
        if args.smollm2:
            models.append(("smollm2", args.smollm2))
        for name, path in models:
            print(f"{name}: {args.steps} AdamW steps (lr 1e-5), every version encoded, decoded and checked")
            gen = make_versions(path, tmp / name, args.steps, args.bcast + 1, args.seed)
            bc = {}
            for dt in args.bcast_dtypes:
                print(f"{name} {dt}: v0 whole then {args.bcast} deltas through {args.relays} relays at "
                      f"{args.mbit:g} Mbit/s per uplink")
                bc[dt] = asyncio.run(broadcast(gen["kept"][dt], args.relays, rate, tmp / f"bc-{name}-{dt}"))
            detail[name] = {"versions": gen["rows"], "broadcast": bc, "step_s": gen["step_s"]}
            summary += summarize(name, gen, bc)
            shutil.rmtree(tmp / name, ignore_errors=True)
    print()
    print(f"{'model':<8} {'dtype':<9} {'steps':>5} {'full MB':>8} {'delta %':>8} {'max %':>7} {'enc s':>6} "
          f"{'dec s':>6} {'T full s':>9} {'T delta s':>9} {'speedup':>8} {'exact':>6}")
    for s in summary:
        print(f"{s['model']:<8} {s['dtype']:<9} {s['steps']:>5} {s['full_MB']:>8.1f} {s['delta_mean_pct']:>8.2f} "
              f"{s['delta_max_pct']:>7.2f} {s['encode_s']:>6.2f} {s['decode_s']:>6.2f} {_f(s['T_full_s'], '>9.2f')} "
              f"{_f(s['T_delta_s'], '>9.2f')} {_f(s['T_speedup'], '>7.1f')}x {str(s['bit_exact']):>6}")
    goal = [s for s in summary if s["model"] == "smollm2" and s["dtype"] == "bfloat16"]
    for s in goal:
        print(f"goal, SmolLM2 bf16: mean delta {s['delta_mean_pct']:.2f}% of full (<= 5%: "
              f"{'met' if s['delta_mean_pct'] <= 5 else 'NOT met'}); encode+decode at most "
              f"{s['enc_plus_dec_max_s']:.2f}s (< 1 s: {'met' if s['enc_plus_dec_max_s'] < 1 else 'NOT met'})")
    if args.json:
        args.json.write_text(json.dumps({"summary": summary, "detail": detail, "mbit": args.mbit,
                                         "relays": args.relays}, indent=2))
        print(f"wrote {args.json}")


if __name__ == "__main__":
    main()
