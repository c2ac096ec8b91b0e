"""The code tool's sandbox (bubblewrap + rlimits) stops what a model, or an attacker choosing its code, may try.

Each case runs real code in a real sandbox: a fork bomb, a network connection, a write outside the scratch
directory, a memory hog, a CPU loop, a flood of output, a sleeper; programs that try to leave something
for the next program in the same resident sandbox (files, processes, System V IPC) or to reach, stop or
kill its runner; and the replay budget refuses the rest of a submission once it is spent. `make test`
installs bubblewrap (apt), as it does chromium."""

from __future__ import annotations

import os
import socket
import subprocess
import time

import pytest

from rewards import sandbox
from rewards.sandbox import Budget, BudgetSpent, Limits, available, budget, run_python

if available():
    if os.environ.get("CI"):
        raise RuntimeError(f"CI: {available()}; `make test` installs bubblewrap")
    pytest.skip(available(), allow_module_level=True)

FAST = Limits(cpu_s=1, wall_s=3.0)


def _stray_processes() -> int:
    """Live processes of sandbox users other than the resident sandboxes' own (bwrap, its init, the runner
    and the process it forked for the next program): what programs left running (a killed one may stay a
    zombie until its reaper gets to it)."""
    time.sleep(0.5)
    rows = subprocess.run(["ps", "-eo", "uid=,stat="], capture_output=True, text=True).stdout.split("\n")
    live = sum(1 for r in rows if r.strip() and int(r.split()[0]) >= 200_000 and not r.split()[1].startswith("Z"))
    return live - 4 * len(sandbox._idle)


def test_ordinary_code_runs_and_is_deterministic():
    code = "import random, sys; print(sum(range(10)), hash('abc') % 1000, sys.version_info[:2] >= (3, 8))"
    a, b = run_python(code, FAST), run_python(code, FAST)
    assert a.status == "ok" and a.stdout == b.stdout and a.stdout.startswith("45 ")


def test_a_fork_bomb_is_stopped():
    t0 = time.monotonic()
    r = run_python("import os\nwhile True:\n    try:\n        os.fork()\n    except OSError:\n        pass\n", FAST)
    assert r.status == "timeout" and time.monotonic() - t0 < FAST.wall_s + 2
    assert _stray_processes() == 0  # nothing outlives the run


def test_the_fork_bomb_meets_the_process_limit():
    code = ("import os\nn = 0\nfor _ in range(200):\n    try:\n        pid = os.fork()\n    except OSError:\n"
            "        print('limit', n); break\n    if pid == 0:\n        import time; time.sleep(2); os._exit(0)\n"
            "    n += 1\n")
    r = run_python(code, Limits(cpu_s=2, wall_s=5.0, processes=16))
    assert r.status == "ok" and r.stdout.startswith("limit ") and int(r.stdout.split()[1]) < 16


def test_no_network():
    with socket.socket() as srv:  # a listener on this machine's loopback: the sandbox cannot reach it
        srv.bind(("127.0.0.1", 0))
        srv.listen()
        port = srv.getsockname()[1]
        r = run_python(f"import socket; socket.create_connection(('127.0.0.1', {port}), timeout=2); print('in')", FAST)
    assert r.status == "error" and "in" not in r.stdout and "Connection" in r.stderr_tail
    r = run_python("import socket; socket.create_connection(('1.1.1.1', 80), timeout=2)", FAST)
    assert r.status == "error" and "unreachable" in r.stderr_tail


def test_no_write_outside_the_scratch(tmp_path):
    target = tmp_path / "escape.txt"
    for path in (target, "/usr/escape.txt", "/etc/escape.txt"):
        r = run_python(f"open({str(path)!r}, 'w').write('x')", FAST)
        assert r.status == "error", path
    assert not target.exists() and not os.path.exists("/usr/escape.txt")
    ok = run_python("open('/tmp/x', 'w').write('hello'); print(open('/tmp/x').read())", FAST)
    assert ok.status == "ok" and ok.stdout.strip() == "hello"
    full = run_python("\ni = 0\nwhile True:\n    open(f'/tmp/f{i}', 'w').write('x' * 10000)\n    i += 1\n", FAST)
    assert full.status == "error" and "No space left" in full.stderr_tail


def test_a_memory_hog_is_stopped():
    for code in ("x = bytearray(2 << 30)", "x = [0] * (10 ** 9)", "x = []\nwhile True: x.append(' ' * 10**6)"):
        r = run_python(code, FAST)
        assert r.status == "memory", (code, r)


def test_cpu_output_and_wall_clock_limits():
    assert run_python("while True: pass", FAST).status == "timeout"
    assert run_python("import time; time.sleep(60)", FAST).status == "timeout"
    assert run_python("while True: print('y' * 1000)", FAST).status == "output_limit"
    secrets = run_python("import os; print(sorted(os.listdir('/')), os.path.exists('/work'), os.getuid())", FAST)
    assert secrets.status == "ok" and "False" in secrets.stdout and "work" not in secrets.stdout


def test_the_budget_refuses_the_rest_of_a_submission():
    token = budget.set(Budget(1.5))
    try:
        t0 = time.monotonic()
        results = []
        with pytest.raises(BudgetSpent):
            for _ in range(10):
                results.append(run_python("while True: pass", FAST).status)
        assert results and time.monotonic() - t0 < 4.0  # at most one run past the budget, never ten
    finally:
        budget.reset(token)
    assert run_python("print(1)", FAST).status == "ok"  # no budget outside a replay


def test_a_program_leaves_nothing_for_the_next():
    count = "import os; print(sum(p.isdigit() for p in os.listdir('/proc')), os.listdir('.'), os.listdir('/dev/shm'))"
    before = run_python(count, FAST)
    assert before.status == "ok" and before.stdout.endswith(" [] []\n"), before
    left = run_python("import os, time\nopen('x', 'w').write('x'); open('/dev/shm/y', 'w').write('y')\n"
                      "if os.fork() == 0:\n    os.setsid(); time.sleep(1.5); open('/tmp/late', 'w').write('z')\n"
                      "    os._exit(0)\nprint('left')", FAST)
    assert left.status == "ok" and left.stdout == "left\n"
    assert run_python(count, FAST).stdout == before.stdout  # no file, no process: the same as before
    time.sleep(2)
    assert run_python(count, FAST).stdout == before.stdout  # the background process never wrote
    assert _stray_processes() == 0


def test_system_v_ipc_retires_the_sandbox():
    shm = ("import ctypes; libc = ctypes.CDLL(None); print(libc.shmget(0, 1 << 20, 0o1600) >= 0); "
           "print(len(open('/proc/sysvipc/shm').read().splitlines()) - 1)")
    first = run_python(shm, FAST)
    assert first.status == "ok" and first.stdout == "True\n1\n", first
    assert run_python(shm, FAST).stdout == "True\n1\n"  # the next program meets none of it


def test_the_runner_cannot_be_read_traced_stopped_or_killed():
    peek = ("import os\nfor path in (f'/proc/{os.getppid()}/mem', f'/proc/{os.getppid()}/fd/0'):\n"
            "    try:\n        open(path, 'rb')\n        print('open', path)\n    except PermissionError:\n"
            "        print('denied')\n")
    r = run_python(peek, FAST)
    assert r.status == "ok" and r.stdout == "denied\ndenied\n", r
    t0 = time.monotonic()
    assert run_python("import os, signal; os.kill(os.getppid(), signal.SIGKILL)", FAST).status == "killed"
    assert run_python("import os, signal; os.kill(os.getppid(), signal.SIGSTOP)", FAST).status == "timeout"
    assert time.monotonic() - t0 < 2 * FAST.wall_s + 4
    assert run_python("print(2)", FAST).stdout == "2\n"  # a fresh sandbox takes over
    assert _stray_processes() == 0


def test_a_program_that_leaves_much_to_empty_costs_the_next_no_wait():
    """Emptying 60,000 files takes the runner far longer than CLEAN_WAIT_S after it answered; the next
    program does not wait for it but takes a fresh sandbox (a new runner), and finds an empty scratch."""
    r = run_python("for i in range(60000):\n    open(f'f{i}', 'w').close()\nprint('made')", Limits(cpu_s=8, wall_s=30.0))
    assert r.status == "ok" and r.stdout == "made\n", r
    left = next(b for b in sandbox._idle if b.key == (FAST.scratch_bytes, FAST.processes))
    nxt = run_python("import os; print(len(os.listdir('.')))", FAST)
    assert nxt.status == "ok" and nxt.stdout == "0\n"
    assert left.p.poll() is not None and left not in sandbox._idle  # given up, not waited for
