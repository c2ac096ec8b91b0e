"""The ranks of a sharded trainer: the process group, set up from torchrun's environment, and the channel
by which rank 0 tells the other ranks what to do next.

Every collective has a deadline (`timeout_s`): a rank that died or hangs makes the others fail with
`RankLost` within it, never wait forever. gloo on CPU, NCCL on GPUs (with a gloo group beside it for the
channel's small CPU messages).
"""

from __future__ import annotations

import ipaddress
import os
import socket
import threading
import time
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from dataclasses import dataclass
from datetime import timedelta
from typing import Any

import msgspec
import torch
import torch.distributed as dist


class RankLost(RuntimeError):
    """A collective failed: a rank died, hung past the timeout, or raised. The run stops; it resumes from
    its last checkpoint (nothing accepted is lost: the ledger keeps every group not trained in it)."""


@dataclass(frozen=True)
class DistEnv:
    rank: int
    world: int
    local_rank: int
    device: torch.device
    timeout_s: float
    channel: Any  # the process group that carries rank 0's commands (gloo: CPU tensors)


def in_torchrun() -> bool:
    """Launched by torchrun (or by hand with its variables): the trainer runs sharded."""
    return "TORCHELASTIC_RUN_ID" in os.environ or "WORLD_SIZE" in os.environ


def _env_int(name: str) -> int:
    value = os.environ.get(name)
    if value is None:
        raise RuntimeError(f"{name} is not set: start the sharded trainer with torchrun "
                           "(or `swarm train --nproc N`)")
    return int(value)


def _is_loopback(host: str) -> bool:
    try:
        return ipaddress.ip_address(socket.gethostbyname(host)).is_loopback
    except (OSError, ValueError):
        return False


_listeners: list[socket.socket] = []
_stores: list = []  # the rendezvous store we made (not under torchrun), for the leave-taking in shutdown()


def _own_store(rank: int, world: int, timeout: timedelta):
    """The rendezvous store without torchrun's agent: rank 0 listens on MASTER_ADDR itself (c10d's own
    server would listen on every interface)."""
    host, port = os.environ.get("MASTER_ADDR", "127.0.0.1"), _env_int("MASTER_PORT")
    if rank != 0:
        _stores.append(dist.TCPStore(host, port, world, False, timeout))
        return _stores[-1]
    sock = socket.create_server((host, port))
    store = dist.TCPStore(host, port, world, True, timeout, master_listen_fd=sock.fileno())
    _listeners.append(sock)  # open as long as the process: the store serves on it
    _stores.append(store)
    return store


def init_distributed(timeout_s: float = 300.0) -> DistEnv:
    """Join the process group described by torchrun's environment (RANK, WORLD_SIZE, LOCAL_RANK,
    MASTER_ADDR/PORT). One GPU per local rank where there are GPUs, else CPU."""
    rank, world, local = _env_int("RANK"), _env_int("WORLD_SIZE"), int(os.environ.get("LOCAL_RANK", "0"))
    timeout = timedelta(seconds=timeout_s)
    if _is_loopback(os.environ.get("MASTER_ADDR", "127.0.0.1")):
        os.environ.setdefault("GLOO_SOCKET_IFNAME", "lo")  # one machine: gloo's sockets on loopback
    cuda = torch.cuda.is_available() and os.environ.get("SWARM_DIST_DEVICE", "") != "cpu"
    if cuda:
        if local >= torch.cuda.device_count():
            raise RuntimeError(f"local rank {local} has no GPU: this machine has "
                               f"{torch.cuda.device_count()}; "
                               "start at most that many ranks per machine")
        device = torch.device("cuda", local)
        torch.cuda.set_device(device)
    else:
        device = torch.device("cpu")
    kw: dict[str, Any] = {"backend": "nccl" if cuda else "gloo", "timeout": timeout}
    if cuda:
        kw["device_id"] = device
    if "TORCHELASTIC_RUN_ID" not in os.environ:  # torchrun's agent hosts the store; by hand, rank 0 does
        kw.update(store=_own_store(rank, world, timeout), rank=rank, world_size=world)
    dist.init_process_group(**kw)
    channel = dist.new_group(backend="gloo", timeout=timeout) if cuda else dist.group.WORLD
    return DistEnv(rank, world, local, device, timeout_s, channel)


def shutdown() -> None:
    """Leave the process group. Without torchrun's agent, rank 0 hosts the store, so it waits (5 s at most)
    until the others have left before it exits: a rank whose store vanished while it was tearing down
    aborted once in a full test run ("terminate called without an active exception")."""
    if not dist.is_initialized():
        return
    rank, world = dist.get_rank(), dist.get_world_size()
    dist.destroy_process_group()
    if not _stores:
        return
    try:
        if rank:
            _stores[-1].set(f"left/{rank}", "1")
        else:
            _stores[-1].wait([f"left/{r}" for r in range(1, world)], timedelta(seconds=5))
    except Exception:  # noqa: BLE001 - a rank already gone, or a store already closed: nothing to wait for
        pass


@contextmanager
def collective(what: str, timeout_s: float) -> Iterator[None]:
    """Name what failed when a collective does: the backend's own error says little."""
    try:
        yield
    except RankLost:
        raise
    except RuntimeError as e:
        raise RankLost(f"{what}: a collective failed (a rank died, hung past the {timeout_s:g} s timeout, or "
                       f"raised; see its log). The run stops; resume it from its last checkpoint. "
                       f"Backend: {str(e)[:300]}") from e


def send(obj: msgspec.Struct, group) -> None:
    """Rank 0: broadcast one typed message (msgpack) to every rank."""
    data = msgspec.msgpack.encode(obj)
    dist.broadcast(torch.tensor([len(data)], dtype=torch.int64), 0, group=group)
    dist.broadcast(torch.frombuffer(bytearray(data), dtype=torch.uint8), 0, group=group)


def receive(kind: Any, group) -> Any:
    """Ranks 1..N-1: the next message rank 0 broadcast, decoded and validated as `kind`."""
    n = torch.zeros(1, dtype=torch.int64)
    dist.broadcast(n, 0, group=group)
    buf = torch.empty(int(n.item()), dtype=torch.uint8)
    dist.broadcast(buf, 0, group=group)
    return msgspec.msgpack.decode(buf.numpy().tobytes(), type=kind)


def all_sum(values: list[float], group) -> list[float]:
    """Sum a few figures over the ranks (float64, on the CPU channel)."""
    t = torch.tensor(values, dtype=torch.float64)
    dist.all_reduce(t, group=group)
    return t.tolist()


class Driver:
    """Rank 0's end of the channel. One command at a time (the trainer steps on one worker thread and
    publishes from another), and a ping when idle, so that the other ranks' wait for the next command never
    runs into the timeout while rank 0 waits for rollouts: they time out only when rank 0 is gone."""

    def __init__(self, env: DistEnv, ping: msgspec.Struct):
        self.env, self._ping = env, ping
        self._lock = threading.Lock()
        self._last = time.monotonic()
        self._failure: BaseException | None = None
        self._closed = threading.Event()
        self._thread = threading.Thread(target=self._keepalive, name="rank0-keepalive", daemon=True)
        self._thread.start()

    def call(self, cmd: msgspec.Struct, what: str, work: Callable[[], Any] | None = None) -> Any:
        """Tell every rank `cmd`, then do rank 0's part of it (`work`) with them."""
        with self._lock:
            if self._failure is not None:
                raise RankLost(f"{what}: the ranks were lost earlier ({self._failure})") from self._failure
            if self._closed.is_set():
                raise RuntimeError("the sharded learner is closed")
            try:
                with collective(what, self.env.timeout_s):
                    send(cmd, self.env.channel)
                    result = work() if work is not None else None
            except RankLost as e:
                self._failure = e
                raise
            self._last = time.monotonic()
            return result

    def close(self, stop: msgspec.Struct) -> None:
        """Tell the other ranks to stop (if they are still there)."""
        with self._lock:
            if not self._closed.is_set() and self._failure is None:
                try:
                    send(stop, self.env.channel)
                except RuntimeError:
                    pass
            self._closed.set()
        self._thread.join()

    def _keepalive(self) -> None:
        period = self.env.timeout_s / 4
        while not self._closed.wait(period / 4):
            with self._lock:
                idle = time.monotonic() - self._last >= period
                if self._closed.is_set() or self._failure is not None or not idle:
                    continue
                try:
                    with collective("keep-alive ping", self.env.timeout_s):
                        send(self._ping, self.env.channel)
                    self._last = time.monotonic()
                except RankLost as e:
                    self._failure = e  # raised by the next call
