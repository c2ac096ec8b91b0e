"""Code chosen by a model runs here: Debian's bubblewrap plus resource limits, never Python-level filters.

A sandbox is a `bwrap` with every namespace unshared (no network: the new network namespace has no
interface but loopback), run as an unprivileged user id of its own (so the per-user process limit stops a
fork bomb, which root would not be held to), `/usr` bound read-only, a size-capped tmpfs as the only
writable directory (the scratch, also the working directory), a fresh /proc and /dev, and an empty
environment but PYTHONHASHSEED=0. It stays: inside, rewards/sandbox_zygote.py forks once per program,
gives the fork its rlimits (CPU seconds, address space, file size, which also caps its stdout, and open
files) and a wall clock, and after the run kills whatever the program left running and empties what it
wrote (after answering, while the host reads the answer), and forks the next program's process ahead of
it; what it cannot empty retires the sandbox. A fresh sandbox per program cost ~15 ms here (and a fork
of the whole calling process, ~100 ms in a trainer holding a model, before prlimit/setpriv replaced a
preexec_fn); a run in a resident one costs a fork. The host gives each run a deadline of its own too and
ends the sandbox of a program that stops or kills its runner.

The result is deterministic where the code is: output only from a clean exit (anything that hit a limit
is reported by status alone, with no partial output that timing could change), so the trainer's replay
gives the node's answer. `Budget` caps what one submission may spend in sandboxes (a replay bomb costs
its sender a refusal, not the run its time).

Measured here (tests/test_sandbox.py): a fork bomb, a network connection, a write outside the scratch, a
memory hog, and a program that tries to leave something for the next one are all stopped.
"""

from __future__ import annotations

import atexit
import contextvars
import itertools
import os
import select
import shutil
import signal
import subprocess
import threading
import time
from dataclasses import dataclass

import msgspec

CLEAN_WAIT_S = 0.05  # the longest a program waits for its sandbox's clean-up (normally ~1 ms) before a new one
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
    status: str  # ok, error (nonzero exit), timeout (CPU or wall clock), memory, output_limit, killed (the
    # program killed its sandbox's runner)
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
    for tool in ("prlimit", "setpriv"):
        if shutil.which(tool) is None:
            return f"{tool} is not installed (apt-get install -y util-linux)"
    try:
        interpreter()
    except SandboxUnavailable as e:
        return str(e)
    return None


def _limited(processes: int, uid: int) -> list[str]:
    """The argv prefix that starts a sandbox with its process and file limits and, under root, as a user of
    its own. util-linux's prlimit and setpriv do what a preexec_fn would, so Popen can vfork: a preexec_fn
    forces a fork() of the calling process, whose cost grows with its memory (~100 ms in a trainer holding
    a model)."""
    prefix = ["prlimit", f"--nproc={processes}", "--nofile=64", "--core=0", "--"]
    if os.getuid() == 0:  # root is not held to RLIMIT_NPROC: become a user of the sandbox's own
        prefix += ["setpriv", f"--reuid={uid}", f"--regid={uid}", "--clear-groups", "--"]
    return prefix


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


class _Resident:
    """One sandbox that stays: rewards/sandbox_zygote.py runs in it and forks once per program."""

    def __init__(self, key: tuple[int, int]):
        self.key, (scratch_bytes, processes) = key, key
        with _slot_lock:
            uid = _UID_BASE + (os.getpid() % 50_000) * 64 + next(_slots) % 64
        # The runner's own limits are the sandbox's (processes, files); each program gets the rest from it.
        # No --die-with-parent: it is tied to the thread that started the sandbox, and any thread may use
        # it; the runner exits when its stdin closes (this process gone) instead.
        argv = _limited(processes, uid) + [
            "bwrap", "--unshare-all", "--new-session", "--cap-drop", "ALL",
            "--ro-bind", "/usr", "/usr", "--symlink", "usr/lib", "/lib", "--symlink", "usr/lib64", "/lib64",
            "--symlink", "usr/bin", "/bin", "--size", str(scratch_bytes), "--tmpfs", "/tmp",
            "--size", str(3 * MAX_LIMITS.output_bytes), "--tmpfs", "/run",
            "--proc", "/proc", "--dev", "/dev", "--chdir", "/tmp", "--clearenv",
            "--setenv", "PYTHONHASHSEED", "0", "--setenv", "PATH", "/usr/bin",
            interpreter(), "-S", "-s", "-B", "-c", _runner_source()]
        try:
            self.p = subprocess.Popen(argv, stdin=subprocess.PIPE, stdout=subprocess.PIPE,
                                      stderr=subprocess.DEVNULL, start_new_session=True, close_fds=True)
        except OSError as e:
            raise SandboxUnavailable(f"could not start bwrap: {e}") from e
        self.buf = bytearray()
        self.ended = False  # its output closed: the sandbox is gone (its process may not be reaped yet)
        if not self.usable(30.0):
            self.close()
            raise SandboxUnavailable("the sandbox's runner did not start (bwrap or /usr/bin/python3 failed)")

    def _read_until(self, sep: bytes | int, deadline: float) -> bytes | None:
        """A line (sep: b"\\n") or `sep` bytes from the runner; None if it ended or the deadline passed."""
        fd = self.p.stdout.fileno()
        while (sep not in self.buf) if isinstance(sep, bytes) else len(self.buf) < sep:
            left = deadline - time.monotonic()
            if left <= 0 or not select.select([fd], [], [], left)[0]:
                return None
            chunk = os.read(fd, 1 << 16)
            if not chunk:
                self.ended = True
                return None
            self.buf += chunk
        n = self.buf.index(sep) + 1 if isinstance(sep, bytes) else sep
        out = bytes(self.buf[:n])
        del self.buf[:n]
        return out.rstrip(b"\n") if isinstance(sep, bytes) else out

    def usable(self, wait_s: float | None = None) -> bool:
        """The runner's word after it cleaned up from the last program and forked the next one's process:
        "clean", or it has left ("dirty": something it could not empty; or it died), or it is not done
        within `wait_s` (a program that left much to empty: the next program takes a new sandbox rather
        than wait, and the one who left it pays nobody's time)."""
        wait_s = CLEAN_WAIT_S if wait_s is None else wait_s
        return self._read_until(b"\n", time.monotonic() + wait_s) == b"clean" and self.p.poll() is None

    def run(self, code: str, limits: Limits) -> tuple[dict, bytes, bytes] | str:
        """The runner's report, stdout and stderr tail; or "killed" (the sandbox ended: the program killed
        its runner) or "timeout" (no answer in time: the runner was stopped)."""
        req = msgspec.json.encode({"code": code, "cpu_s": limits.cpu_s, "memory_bytes": limits.memory_bytes,
                                   "output_bytes": limits.output_bytes, "wall_s": limits.wall_s}) + b"\n"
        try:
            self.p.stdin.write(req)
            self.p.stdin.flush()
        except OSError:
            return "killed"
        deadline = time.monotonic() + limits.wall_s + 2.0  # the runner's own clock, plus its clean-up
        line = self._read_until(b"\n", deadline)
        if line is None:
            return "killed" if self.ended else "timeout"
        try:
            head = msgspec.json.decode(line, type=dict[str, int | bool])
            body = self._read_until(int(head["out"]) + int(head["err"]), deadline)
        except (msgspec.DecodeError, KeyError, ValueError):
            return "killed"
        if body is None:
            return "killed" if self.ended else "timeout"
        return head, body[: head["out"]], body[head["out"]:]

    def close(self) -> None:
        if self.p.poll() is None:
            _kill_tree(self.p.pid)
        self.p.wait()
        for f in (self.p.stdin, self.p.stdout):
            try:
                f.close()
            except OSError:
                pass


_source: str | None = None
_idle: list[_Resident] = []
_idle_pid = os.getpid()
MAX_IDLE = 4  # resident sandboxes kept between runs (one per thread that runs programs at once)


def _runner_source() -> str:
    global _source
    if _source is None:
        with open(os.path.join(os.path.dirname(__file__), "sandbox_zygote.py")) as f:
            _source = f.read()
    return _source


def _take(key: tuple[int, int]) -> _Resident:
    """An idle resident sandbox that says it is clean, or a new one."""
    global _idle_pid
    while True:
        with _slot_lock:
            if _idle_pid != os.getpid():  # a forked copy of this process: those sandboxes are the parent's
                _idle.clear()
                _idle_pid = os.getpid()
            box = next((b for b in _idle if b.key == key), None)
            if box is None:
                break
            _idle.remove(box)
        if box.usable():
            return box
        box.close()
    return _Resident(key)


def _give_back(box: _Resident) -> None:
    with _slot_lock:
        if len(_idle) < MAX_IDLE and _idle_pid == os.getpid():
            _idle.append(box)
            return
    box.close()


@atexit.register
def close_all() -> None:
    """End the resident sandboxes (they would end by themselves once this process's pipes close)."""
    with _slot_lock:
        boxes = _idle[:]
        _idle.clear()
    for box in boxes:
        box.close()


def run_python(code: str, limits: Limits | None = None) -> Result:
    """Run `code` with Debian's Python in a sandbox; its stdout, or why it stopped."""
    limits = limits or Limits()
    why = available()
    if why:
        raise SandboxUnavailable(why)
    cap = budget.get()
    if cap is not None and cap.spent:
        raise BudgetSpent("the submission's sandbox budget is spent")
    t0 = time.monotonic()
    box = _take((limits.scratch_bytes, limits.processes))
    reply = box.run(code, limits)
    wall = time.monotonic() - t0
    if cap is not None:
        cap.spend(wall)
    if isinstance(reply, str):  # the program ended or stopped its sandbox: never reused
        box.close()
        return Result(reply, "", "", wall)
    head, stdout, err = reply
    _give_back(box)  # whether it is clean again, its runner says before the next program (_take)
    rc, stderr = head["rc"], err.decode(errors="replace")
    # The CPU limit ends a run by SIGXCPU or, at the hard limit, SIGKILL.
    if head["timed_out"] or rc in (-signal.SIGXCPU, -signal.SIGKILL):
        return Result("timeout", "", "", wall)
    # Python ignores SIGXFSZ: past the file-size limit its writes fail, and what reached stdout is cut.
    if rc == -signal.SIGXFSZ or len(stdout) >= limits.output_bytes:
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
