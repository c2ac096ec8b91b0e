"""The sandbox's resident runner: it lives inside one bubblewrap sandbox and runs each program in a fork of itself.

Run by Debian's python3 (`-S -s -B -c` this file's text) inside the sandbox that rewards/sandbox.py starts;
it imports the standard library only. A fresh sandbox per program costs a bubblewrap start, its namespaces
and a Python start (~15 ms here); a fork of this process costs about one. What one program could leave for
the next is taken away after every run, so a program's output still depends on its text alone (the
environment's contract, and what lets the trainer's replay agree with an honest node):
- processes: this runner is a child subreaper, so everything a program started is its descendant; after
  each run it kills every process of the sandbox but bubblewrap's init and itself (kill(-1)) and reaps them;
- files: the scratch (/tmp, the working directory) and /dev/shm are emptied; the program's stdout and
  stderr go to files outside the scratch, as a fresh interpreter's would go to its pipes;
- this runner: it is not dumpable, so a program (same user) can neither ptrace it nor read its memory or
  its descriptors through /proc; a program can still signal it, which ends the sandbox (the host starts a
  new one; the run that did it is reported killed or timed out);
- anything else the runner cannot empty (System V IPC objects, new entries in /dev) marks the sandbox dirty:
  the host replaces it after this run.

Protocol on stdin/stdout, one run at a time: a request is one JSON line (code and limits); the reply is one
JSON line (exit code, timed out, byte counts) followed by the stdout and the stderr tail; then, once the
runner has cleaned up and forked the process for the next program (both while the host reads the
reply), one word: "clean" (send the next) or "dirty" (it has left: start another sandbox). The first
"clean" says it started.
"""

import builtins
import ctypes
import json
import os
import resource
import select
import shutil
import signal
import sys
import time
import traceback

SCRATCH = "/tmp"
OUT = "/run/sb/out"
ERR = "/run/sb/err"
ERR_TAIL = 4096
PR_SET_DUMPABLE, PR_SET_CHILD_SUBREAPER = 4, 36
WARM_UP = "x = [str(i) + '' for i in range(300)]\nd = {k: len(k) for k in x}\ny = sum(d.values()) % 7 + abs(-1)"


def _exit_code(e: SystemExit) -> int:
    """What `python -c` exits with for this SystemExit (and what it prints)."""
    if e.code is None:
        return 0
    if isinstance(e.code, int):
        return e.code & 0xFF
    print(e.code, file=sys.stderr)
    return 1


def child(requests: int, report: int) -> None:
    """Become the next program, ahead of its request: own output files, the scratch as working directory;
    then read the request from `requests`, take its rlimits, run it, and write its exit code to `report`
    (the runner answers on that, not on this process's exit, whose teardown costs a few hundred us)."""
    rc = 1
    try:
        null = os.open("/dev/null", os.O_RDONLY)
        out = os.open(OUT, os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o600)
        err = os.open(ERR, os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o600)
        for fd, target in ((null, 0), (out, 1), (err, 2)):
            os.dup2(fd, target)
        os.dup2(requests, 3)
        os.dup2(report, 4)
        os.closerange(5, 1 << 16)  # the runner's pipes to the host were 0 and 1, now replaced
        os.chdir(SCRATCH)
        # Touch what every program touches before the request comes: a fork shares its parent's pages
        # until either writes them, and the copies (a page fault each, dear in a virtual machine) were most
        # of a short program's time. Nothing here is visible to the program.
        exec(compile(WARM_UP, "<warm-up>", "exec"), {"__builtins__": builtins})
        json.loads('{"code": "", "cpu_s": 1}')
        data = b""
        while chunk := os.read(3, 1 << 16):
            data += chunk
        os.close(3)
        if not data:  # the runner ended before giving us a program
            os._exit(0)
        req = json.loads(data)
        cpu = req["cpu_s"]
        for lim, value in ((resource.RLIMIT_CPU, (cpu, cpu + 1)),
                           (resource.RLIMIT_AS, (req["memory_bytes"],) * 2),
                           (resource.RLIMIT_FSIZE, (req["output_bytes"],) * 2),
                           (resource.RLIMIT_NOFILE, (64, 64)), (resource.RLIMIT_CORE, (0, 0))):
            resource.setrlimit(lim, value)
        sys.argv = ["-c"]
        code = compile(req["code"], "<string>", "exec")
        exec(code, {"__name__": "__main__", "__doc__": None, "__builtins__": builtins})
        rc = 0
    except SystemExit as e:
        rc = _exit_code(e)
    except MemoryError:
        os.write(2, b"MemoryError\n")
    except BaseException:
        try:
            traceback.print_exc()
        except BaseException:
            os.write(2, b"Error\n")
    try:
        sys.stdout.flush()
        sys.stderr.flush()
    except BaseException:
        rc = rc or 120  # as python: output that could not be written is a failed exit
    try:
        os.write(4, b"%d" % rc)
    except OSError:
        pass
    os._exit(rc)


def prefork() -> tuple[int, int, int]:
    """The next program's process, forked and set up while nobody waits: (its pid, the pipe to hand it
    its request, the pipe its exit code comes back on)."""
    req_r, req_w = os.pipe()
    rep_r, rep_w = os.pipe()
    pid = os.fork()
    if pid == 0:
        os.close(req_w)
        os.close(rep_r)
        child(req_r, rep_w)
    os.close(req_r)
    os.close(rep_w)
    return pid, req_w, rep_r


def _read(path: str, tail: int, limit: int) -> bytes:
    """At most `limit` bytes of a file the program wrote (its last `tail` bytes when tail > 0); nothing if
    it never made one."""
    try:
        with open(path, "rb") as f:
            if tail:
                f.seek(max(0, os.fstat(f.fileno()).st_size - tail))
            return f.read(limit)
    except OSError:
        return b""


def _wipe(path: str) -> bool:
    ok = True
    for entry in os.scandir(path):
        try:
            if entry.is_dir(follow_symlinks=False):
                os.chmod(entry.path, 0o700)
                shutil.rmtree(entry.path)
            else:
                os.unlink(entry.path)
        except OSError:
            ok = False
    return ok


def _reap_all() -> None:
    """Kill every other process of the sandbox (bubblewrap's init excepted) and reap the lot."""
    try:
        os.kill(-1, signal.SIGKILL)
    except ProcessLookupError:
        pass
    while True:
        try:
            os.waitpid(-1, 0)
        except ChildProcessError:
            return


def _sysv_left() -> bool:
    for kind in ("shm", "sem", "msg"):
        try:
            with open(f"/proc/sysvipc/{kind}") as f:
                if len(f.read().splitlines()) > 1:
                    return True
        except OSError:
            return True
    return False


def run(req: dict, line: bytes, ready: tuple[int, int, int]) -> tuple[dict, bytes, bytes]:
    pid, requests, report = ready
    deadline = time.monotonic() + req["wall_s"]
    pidfd = os.pidfd_open(pid)
    os.write(requests, line)  # a request line is far below a pipe's capacity
    os.close(requests)
    rc, timed_out = None, False
    # The program's own report of its exit code, else its end (a signal: a limit, a crash), else the clock.
    # The host closing our stdin (it exited) ends the run too.
    waiting = [report, pidfd, 0]
    while rc is None:
        ready_fds = select.select(waiting, [], [], max(0.0, deadline - time.monotonic()))[0]
        if not ready_fds or 0 in ready_fds:
            timed_out = True
            os.kill(pid, signal.SIGKILL)
        if report in ready_fds:
            said = os.read(report, 16)
            waiting.remove(report)
            if said.isdigit():
                rc = int(said)
                continue
        if timed_out or pidfd in ready_fds:
            rc = os.waitstatus_to_exitcode(os.waitpid(pid, 0)[1])
    os.close(pidfd)
    os.close(report)
    try:  # before reading: nothing the program left running writes its output any more (reaped later)
        os.kill(-1, signal.SIGKILL)
    except ProcessLookupError:
        pass
    out, err = _read(OUT, 0, req["output_bytes"] + 1), _read(ERR, ERR_TAIL, ERR_TAIL)
    head = {"rc": rc, "timed_out": timed_out, "out": len(out), "err": len(err)}
    return head, out, err


def clean(dev: set) -> bool:
    """Reap the program and all it left; empty what it wrote; False if something is left that this runner
    cannot empty."""
    _reap_all()
    emptied = _wipe(SCRATCH) & _wipe("/dev/shm") & _wipe("/run/sb")
    return emptied and not _sysv_left() and set(os.listdir("/dev")) == dev


def _send(data: bytes) -> None:
    while data:
        data = data[os.write(1, data):]


def _read_line(buf: bytearray) -> bytes | None:
    while b"\n" not in buf:
        chunk = os.read(0, 1 << 16)
        if not chunk:
            return None
        buf += chunk
    line, _, rest = bytes(buf).partition(b"\n")
    buf[:] = rest
    return line


def main() -> None:
    libc = ctypes.CDLL(None)
    libc.prctl(PR_SET_DUMPABLE, 0, 0, 0, 0)
    libc.prctl(PR_SET_CHILD_SUBREAPER, 1, 0, 0, 0)
    os.makedirs("/run/sb", exist_ok=True)
    dev = set(os.listdir("/dev"))
    buf = bytearray()
    ready = prefork()
    _send(b"clean\n")
    while (line := _read_line(buf)) is not None:
        head, out, err = run(json.loads(line), line, ready)
        _send(json.dumps(head).encode() + b"\n" + out + err)
        # The clean-up and the next program's fork happen while the host reads the answer; the host reads
        # this word before it sends another program.
        if not clean(dev):
            _send(b"dirty\n")
            return
        ready = prefork()
        _send(b"clean\n")


if __name__ == "__main__":
    main()
