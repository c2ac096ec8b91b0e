"""Code chosen by a model runs here: Debian's bubblewrap plus resource limits, never Python-level filters.

Each run is a fresh `bwrap` with every namespace unshared (no network: the new network namespace has no
interface but loopback), run as an unprivileged user id of its own (so the per-user process limit stops a
fork bomb, which root would not be held to), `/usr` bound read-only, a size-capped tmpfs as the only
writable directory (the scratch, also the working directory), a fresh /proc and /dev, an empty
environment but PYTHONHASHSEED=0, and `--die-with-parent` so nothing outlives it. Before exec the child
gets rlimits: CPU seconds, address space, processes, file size (which also caps what it can write to its
stdout, a file here) and open files. The parent enforces a wall clock and kills the whole sandbox.

The result is deterministic where the code is: output only from a clean exit (anything that hit a limit
is reported by status alone, with no partial output that timing could change), so the trainer's replay
gives the node's answer. `Budget` caps what one submission may spend in sandboxes (a replay bomb costs
its sender a refusal, not the run its time).

Measured here (tests/test_sandbox.py): a fork bomb, a network connection, a write outside the scratch and
a memory hog are all stopped.
"""

from __future__ import annotations

import contextvars
import itertools
import os
import resource
import shutil
import signal
import subprocess
import tempfile
import threading
import time
from dataclasses import dataclass

import msgspec

_UID_BASE = 200_000  # sandbox user ids: one per concurrent run of this process, outside any real user's
_slots = itertools.count()
_slot_lock = threading.Lock()


class Limits(msgspec.Struct, frozen=True, forbid_unknown_fields=True):
    cpu_s: int = 2  # CPU seconds (RLIMIT_CPU)
    memory_bytes: int = 256 * 2**20  # address space (RLIMIT_AS)
    output_bytes: int = 16 * 2**10  # stdout and every file written (RLIMIT_FSIZE)
    wall_s: float = 5.0  # wall clock, enforced by the parent
    processes: int = 16  # processes of the sandbox's user (RLIMIT_NPROC): a fork bomb meets it
    scratch_bytes: int = 8 * 2**20  # size of the writable tmpfs


MAX_LIMITS = Limits(cpu_s=10, memory_bytes=2**30, output_bytes=2**20, wall_s=30.0, processes=64,
                    scratch_bytes=64 * 2**20)


def clamp(limits: Limits) -> Limits:
    """Limits no larger than MAX_LIMITS (a node takes the trainer's settings only up to these)."""
    return Limits(**{f: min(getattr(limits, f), getattr(MAX_LIMITS, f)) for f in Limits.__struct_fields__})


@dataclass
class Result:
    status: str  # ok, error (nonzero exit), timeout (CPU or wall clock), memory, output_limit
    stdout: str  # only for ok and error
    stderr_tail: str  # the last line of stderr (an exception's type and text), only for error
    wall_s: float


class SandboxUnavailable(RuntimeError):
    pass


class BudgetSpent(RuntimeError):
    """The submission being replayed has used up its sandbox time."""


# The budget of the submission being replayed on this thread (None: no cap, as on a node).
budget: contextvars.ContextVar[Budget | None] = contextvars.ContextVar("sandbox_budget", default=None)


def interpreter() -> str:
    """The Python the sandbox runs: Debian's (under /usr, which is all the sandbox sees)."""
    for p in ("/usr/bin/python3",):
        if os.path.exists(p):
            return p
    raise SandboxUnavailable("no /usr/bin/python3 for the sandbox (apt-get install -y python3)")


_version: str | None = None


def interpreter_version() -> str:
    """major.minor of the sandbox's Python (a run's outputs may differ between versions)."""
    global _version
    if _version is None:
        out = subprocess.run([interpreter(), "-I", "-S", "-c", "import sys; print('%d.%d' % sys.version_info[:2])"],
                             capture_output=True, text=True, timeout=30)
        _version = out.stdout.strip()
    return _version


def available() -> str | None:
    """Why the sandbox cannot run here, or None."""
    if shutil.which("bwrap") is None:
        return "bubblewrap is not installed (apt-get install -y bubblewrap)"
    try:
        interpreter()
    except SandboxUnavailable as e:
        return str(e)
    return None


def _preexec(limits: Limits, uid: int):
    def setup() -> None:
        os.setsid()
        for lim, value in ((resource.RLIMIT_CPU, limits.cpu_s), (resource.RLIMIT_AS, limits.memory_bytes),
                           (resource.RLIMIT_FSIZE, limits.output_bytes), (resource.RLIMIT_NPROC, limits.processes),
                           (resource.RLIMIT_NOFILE, 64), (resource.RLIMIT_CORE, 0)):
            resource.setrlimit(lim, (value, value + (lim == resource.RLIMIT_CPU)))
        if os.getuid() == 0:  # root is not held to RLIMIT_NPROC: become a user of the sandbox's own
            os.setgroups([])
            os.setgid(uid)
            os.setuid(uid)
    return setup


def _kill_tree(pid: int) -> None:
    """SIGKILL a sandbox: bwrap's descendants first (its child is the PID namespace's init, whose death ends
    every process in the namespace at once), then bwrap."""
    children: dict[int, list[int]] = {}
    for entry in os.scandir("/proc"):
        if entry.name.isdigit():
            try:
                with open(f"/proc/{entry.name}/stat", "rb") as f:
                    ppid = int(f.read().rsplit(b")", 1)[1].split()[1])
            except (OSError, ValueError, IndexError):
                continue
            children.setdefault(ppid, []).append(int(entry.name))
    todo, tree = [pid], []
    while todo:
        p = todo.pop()
        tree.append(p)
        todo.extend(children.get(p, []))
    for p in reversed(tree):
        try:
            os.kill(p, signal.SIGKILL)
        except ProcessLookupError:
            pass


def run_python(code: str, limits: Limits | None = None) -> Result:
    """Run `code` with Debian's Python in a fresh sandbox; its stdout, or why it stopped."""
    limits = limits or Limits()
    why = available()
    if why:
        raise SandboxUnavailable(why)
    cap = budget.get()
    if cap is not None and cap.spent:
        raise BudgetSpent("the submission's sandbox budget is spent")
    with _slot_lock:
        uid = _UID_BASE + (os.getpid() % 50_000) * 64 + next(_slots) % 64
    argv = ["bwrap", "--unshare-all", "--die-with-parent", "--new-session", "--cap-drop", "ALL",
            "--ro-bind", "/usr", "/usr", "--symlink", "usr/lib", "/lib", "--symlink", "usr/lib64", "/lib64",
            "--symlink", "usr/bin", "/bin", "--size", str(limits.scratch_bytes), "--tmpfs", "/tmp",
            "--proc", "/proc", "--dev", "/dev", "--chdir", "/tmp", "--clearenv",
            "--setenv", "PYTHONHASHSEED", "0", "--setenv", "PATH", "/usr/bin",
            interpreter(), "-S", "-s", "-B", "-c", code]
    t0 = time.monotonic()
    with tempfile.TemporaryFile() as out, tempfile.TemporaryFile() as err:
        try:
            p = subprocess.Popen(argv, stdin=subprocess.DEVNULL, stdout=out, stderr=err,
                                 preexec_fn=_preexec(limits, uid), close_fds=True)
        except OSError as e:
            raise SandboxUnavailable(f"could not start bwrap: {e}") from e
        timed_out = False
        try:
            p.wait(timeout=limits.wall_s)
        except subprocess.TimeoutExpired:
            timed_out = True
            _kill_tree(p.pid)
            p.wait()
        wall = time.monotonic() - t0
        if cap is not None:
            cap.spend(wall)
        rc = p.returncode
        out.seek(0)
        stdout = out.read(limits.output_bytes + 1)
        err.seek(0, os.SEEK_END)
        err.seek(max(0, err.tell() - 4096))
        stderr = err.read().decode(errors="replace")
    # The CPU limit ends a run by SIGXCPU or, at the hard limit, SIGKILL (bwrap reports 128 + signal).
    if timed_out or rc in (-signal.SIGXCPU, -signal.SIGKILL, 128 + signal.SIGXCPU, 128 + signal.SIGKILL):
        return Result("timeout", "", "", wall)
    # Python ignores SIGXFSZ: past the file-size limit its writes fail, and what reached stdout is cut.
    if rc in (-signal.SIGXFSZ, 128 + signal.SIGXFSZ) or len(stdout) >= limits.output_bytes:
        return Result("output_limit", "", "", wall)
    tail = (stderr.strip().splitlines() or [""])[-1][:200]
    if rc != 0 and tail.startswith("MemoryError"):
        return Result("memory", "", "", wall)
    if rc != 0:
        return Result("error", stdout.decode(errors="replace"), tail, wall)
    return Result("ok", stdout.decode(errors="replace"), "", wall)


class Budget:
    """Wall seconds one submission may spend in sandboxes; past it, every further run is refused."""

    def __init__(self, seconds: float):
        self.left = seconds

    def spend(self, seconds: float) -> None:
        self.left -= seconds

    @property
    def spent(self) -> bool:
        return self.left <= 0
