"""Flags shared by the front door's commands: the run's flags (a shorthand for `--set KEY=VALUE`), and
the flags every peer of the weight tree reads the same way (`swarm node` and `swarm relay`)."""

from __future__ import annotations

import argparse
import os

from broadcast.config import PeerConfig
from swarm_common.protocol import DEFAULT_MAX_PROMPTS

PEER = PeerConfig()  # the defaults every peer flag shows

# flag attribute -> config key: `--port 6000` is `--set server.port=6000`.
RUN_FLAG_KEYS = (("run_dir", "run_dir"), ("model", "model.path"), ("port", "server.port"),
                 ("http_port", "server.http_port"), ("host", "server.host"), ("max_steps", "train.max_steps"),
                 ("web_port", "server.web_port"))


def add_run_flags(p: argparse.ArgumentParser) -> None:
    p.add_argument("--set", action="append", metavar="KEY=VALUE",
                   help="override a config value, e.g. --set train.lr=3e-4 --set task.params={digits=1}")
    p.add_argument("--run-dir", help="where versions, logs and the summary go (config: run_dir)")
    p.add_argument("--model", help="a local Hugging Face model directory (default: the embedded tiny model)")
    p.add_argument("--host", help="address to serve on (default 127.0.0.1)")
    p.add_argument("--port", type=int, help="zmq port nodes connect to (default 5555)")
    p.add_argument("--http-port", type=int, help="HTTP port for weights, /api and /metrics (default 5556)")
    p.add_argument("--web-port", type=int, help="port of the live web view on server.web_host "
                   "(default 8265; 0: any free port, -1: none)")
    p.add_argument("--max-steps", type=int, help="optimizer steps to run")
    p.add_argument("--trust", action="append", metavar="KEY", help="a node key (64 hex chars, as `swarm node` "
                   "prints it) of a node you run yourself: no probation, and new nodes can be paired with it "
                   "(config: guard.trusted; repeat for several)")
    p.add_argument("--reference", action="store_true", default=None,
                   help="the trainer samples each prompt of a node on probation itself, with the same weights, as "
                   "the reference of the cherry-picking test: strangers are checked and released with no node of "
                   "your own (config: guard.reference; its cost: guard.reference_budget)")


def run_overrides(args: argparse.Namespace) -> list[str]:
    """The `--set` overrides the run flags stand for, after the explicit `--set`s (so flags win)."""
    overrides = list(getattr(args, "set", None) or [])
    for flag, key in RUN_FLAG_KEYS:
        value = getattr(args, flag, None)
        if value is not None:
            overrides.append(f'{key}="{value}"' if isinstance(value, str) else f"{key}={value}")
    if getattr(args, "trust", None):
        overrides.append("guard.trusted=[" + ",".join(f'"{k.strip()}"' for k in args.trust) + "]")
    if getattr(args, "reference", None):
        overrides.append("guard.reference=true")
    return overrides


def add_peer_flags(p: argparse.ArgumentParser, *, data_dir: str | None, key_help: str,
                   relay_host: str | None) -> None:
    """What a node and a relay both read: where they keep their files, the trainer's key they pin, and
    how their relay serves others."""
    p.add_argument("--data-dir", default=data_dir, required=data_dir is None,
                   help="where this peer keeps its key and downloaded versions")
    p.add_argument("--name", default="", help="a label for this peer in the trainer's views")
    p.add_argument("--trainer-key", help=key_help)
    p.add_argument("--trusted-key", dest="trainer_key", default=argparse.SUPPRESS, help=argparse.SUPPRESS)  # the old name, still read
    p.add_argument("--no-relay", action="store_true", help="download versions but serve no other peer")
    p.add_argument("--relay-host", default=relay_host,
                   help="address this peer's relay listens on" + (
                       " (default: 127.0.0.1 when the trainer is on this machine's loopback, else all "
                       "interfaces, 0.0.0.0)" if relay_host is None else f" (default {relay_host}; 0.0.0.0: all "
                       "interfaces, needed for peers on other machines to reach it)"))
    p.add_argument("--relay-port", type=int, default=0,
                   help="port of this peer's relay (0: any free; fix one to open or forward it in a firewall)")
    p.add_argument("--advertise", metavar="http://HOST:PORT", default=None,
                   help="the address other peers reach this relay at, when it is not the one the tracker sees "
                   "this machine connect from with the relay's port: behind NAT with a forwarded port, a "
                   "floating IP, a proxy. Without it the tracker reports the address it sees (as STUN does), "
                   "connects back to check it, and makes this peer a download-only leaf if that fails")
    p.add_argument("--first-byte-timeout", type=float, default=PEER.first_byte_timeout,
                   help="seconds a parent may leave a piece request unanswered before an ancestor is asked in "
                   "parallel (longer where answers are routinely slower)")


def peer_config(args: argparse.Namespace) -> PeerConfig:
    """The peer's config from its flags: each flag is the field of the same name (--no-relay: relay)."""
    known = {f: getattr(args, f) for f in PeerConfig.__struct_fields__ if hasattr(args, f)}
    return PeerConfig(**known, relay=not args.no_relay)


def add_node_flags(p: argparse.ArgumentParser) -> None:
    p.add_argument("--trainer", required=True, help="the trainer's node port, HOST:PORT or tcp://HOST:PORT")
    add_peer_flags(p, data_dir=os.path.expanduser("~/.cache/rollout-swarm/node"), relay_host=None,
                   key_help="pin the trainer's public key (64 hex chars or a .pub file); without it the key "
                   "seen on first contact is pinned and its fingerprint printed")
    p.add_argument("--max-prompts", type=int, default=DEFAULT_MAX_PROMPTS, help="prompts to ask for per work request")
    p.add_argument("--status-host", default=None, help="address the node's status page listens on (default: "
                   "127.0.0.1 when the trainer is on this machine's loopback, else all interfaces)")
    p.add_argument("--status-port", type=int, default=0, help="port of the node's status page (0: any free)")
    p.add_argument("--probe-prompt", default="3+5+8",
                   help="prompt completed greedily after each weight load, shown on the status page")
    p.add_argument("--seed", type=int, default=0, help="sampling seed of the engine")
    p.add_argument("--invite", default="", help="an invite token from the run's operator, for runs that admit "
                   "new nodes by invite only (guard.invites)")


def add_relay_flags(p: argparse.ArgumentParser) -> None:
    p.add_argument("--tracker", required=True, help="the trainer's origin/tracker URL, e.g. http://HOST:5557")
    add_peer_flags(p, data_dir=None, relay_host="127.0.0.1",
                   key_help="the trainer's public key (64 hex chars or a .pub file): "
                   "only versions it signed are fetched and forwarded (required)")
    # The relay's older names for --relay-host / --relay-port.
    p.add_argument("--host", dest="relay_host", default=argparse.SUPPRESS, help=argparse.SUPPRESS)
    p.add_argument("--port", dest="relay_port", type=int, default=argparse.SUPPRESS, help=argparse.SUPPRESS)
    p.add_argument("--keep", type=int, default=PEER.keep, help="versions to keep on disk")
    p.add_argument("--upload-rate", type=float, default=PEER.upload_rate, help="upload cap in bytes/s (0: none)")
    p.add_argument("--stall-timeout", type=float, default=PEER.stall_timeout,
                   help="seconds without progress before a source is reported and bypassed")
    p.add_argument("--progress", action="store_true", help="show progress bars")
    p.add_argument("--exit-after", type=int, default=None, help="exit once this version is held")


def add_tree_flags(p: argparse.ArgumentParser) -> None:
    p.add_argument("--tracker", required=True, help="the trainer's origin/tracker URL")
    p.add_argument("--watch", type=float, default=0, help="refresh every N seconds")


def add_doctor_flags(p: argparse.ArgumentParser) -> None:
    p.add_argument("--trainer", required=True, help="the trainer's node port, HOST:PORT or tcp://HOST:PORT")
    p.add_argument("--trainer-key", help="the trainer's public key to expect (64 hex chars or a .pub file)")
    p.add_argument("--relay-host", default="0.0.0.0", help="address to listen on for the reachability test")
    p.add_argument("--relay-port", type=int, default=0,
                   help="the port `swarm node --relay-port` will use (0: any free port, tested the same way)")
    p.add_argument("--data-dir", default=os.path.expanduser("~/.cache/rollout-swarm/node"),
                   help="the node's data dir (as `swarm node --data-dir`): with its key there, the trainer says "
                   "whether this node's work waits on probation; the key is read, never made")
