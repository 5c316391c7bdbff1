"""Module-level step handlers used by the tests (children import them by module path)."""

from __future__ import annotations

import ctypes
import dataclasses
import os
import re
import subprocess
import sys
import time
from pathlib import Path

import cyclone_mp as cy


def _no_backoff(attempt: int) -> float:
    return 0.0


@cy.step("ok")
def ok(ctx: cy.Context, inp: dict) -> dict:
    return {"echo": inp, "attempt": ctx.attempt, "run_id": ctx.run_id}


@dataclasses.dataclass
class Point:
    x: int
    y: int


@cy.step("typed_input", max_attempts=1)
def typed_input(ctx: cy.Context, inp: Point) -> dict:
    """The input annotation is a dataclass (a string annotation here): it is converted."""
    return {"type": type(inp).__name__, "sum": inp.x + inp.y}


@cy.step("raises", max_attempts=3, backoff=_no_backoff)
def raises(ctx: cy.Context, inp: dict) -> dict:
    raise ValueError(f"bad value on attempt {ctx.attempt}")


@cy.step("flaky", max_attempts=5, backoff=_no_backoff)
def flaky(ctx: cy.Context, inp: dict) -> dict:
    if ctx.attempt < inp.get("succeed_on", 2):
        raise RuntimeError("not yet")
    return {"attempt": ctx.attempt}


@cy.step("flaky_default_backoff", max_attempts=5)
def flaky_default_backoff(ctx: cy.Context, inp: dict) -> dict:
    if ctx.attempt < 2:
        raise RuntimeError("first attempt fails")
    return {"attempt": ctx.attempt}


@cy.step("permanent", max_attempts=5, backoff=_no_backoff)
def permanent(ctx: cy.Context, inp: dict) -> dict:
    raise cy.Permanent(KeyError("missing thing"))


@cy.step("exits", max_attempts=2, backoff=_no_backoff)
def exits(ctx: cy.Context, inp: dict) -> dict:
    os._exit(inp.get("code", 3))


@cy.step("segfault", max_attempts=1)
def segfault(ctx: cy.Context, inp: dict) -> dict:
    ctypes.string_at(0)
    return {}


@cy.step("cooperative", timeout=0.5, max_attempts=2, backoff=_no_backoff)
def cooperative(ctx: cy.Context, inp: dict) -> dict:
    """Waits on the cancellation handle; returns when woken."""
    woke = ctx.cancellation.wait(inp.get("sleep", 30))
    if woke:
        ctx.check_cancellation()
    return {"woke": woke}


@cy.step("late_after_cancel", max_attempts=1)
def late_after_cancel(ctx: cy.Context, inp: dict) -> dict:
    """Woken by its cancel, it still returns ``after`` seconds later (past a short kill_grace)."""
    ctx.cancellation.wait(30)
    time.sleep(inp["after"])
    return {"late": True}


@cy.step("ignores_cancel", timeout=0.5, max_attempts=2, backoff=_no_backoff)
def ignores_cancel(ctx: cy.Context, inp: dict) -> dict:
    """Sleeps in small slices whatever ctx says, then returns (too late)."""
    end = time.monotonic() + inp.get("sleep", 1.5)
    while time.monotonic() < end:
        time.sleep(0.05)
    Path(inp["marker"]).write_text(str(ctx.attempt)) if inp.get("marker") else None
    return {"late": True}


@cy.step("regex_wedge", timeout=1, max_attempts=1)
def regex_wedge(ctx: cy.Context, inp: dict) -> dict:
    re.match(r"(a+)+$", "a" * 60 + "b")  # catastrophic backtracking in C
    return {}


@cy.step("deque_wedge", timeout=1, max_attempts=1)
def deque_wedge(ctx: cy.Context, inp: dict) -> dict:
    import collections
    import itertools

    collections.deque(itertools.repeat(None, 10**12), maxlen=0)  # a C loop holding the GIL
    return {}


@cy.step("gil_holder")
def gil_holder(ctx: cy.Context, inp: dict) -> dict:
    """Holds the GIL for ``seconds`` of wall time (no thread of the child runs): libc's
    nanosleep called through ``ctypes.PyDLL``, which keeps the GIL during the call. A C
    loop sized by a calibration held it for as long as the CPU allowed: under load the
    calibration ran slow and the hold came out short."""
    import ctypes

    class Timespec(ctypes.Structure):
        _fields_ = [("tv_sec", ctypes.c_long), ("tv_nsec", ctypes.c_long)]

    nanosleep = ctypes.PyDLL(None).nanosleep  # PyDLL: the GIL is not released
    seconds = float(inp["seconds"])
    want, left = Timespec(int(seconds), int(seconds % 1 * 1e9)), Timespec()
    started = time.perf_counter()
    while nanosleep(ctypes.byref(want), ctypes.byref(left)) != 0:  # a signal cut it short: the rest
        want = Timespec(left.tv_sec, left.tv_nsec)
    return {"held": round(time.perf_counter() - started, 3)}


@cy.step("interrupts_its_program", max_attempts=1)
def interrupts_its_program(ctx: cy.Context, inp: dict) -> dict:
    """Starts ``sleep 30``, reads the signals it ignores, sends it SIGINT, and says how it
    ended (a program a step starts must be interruptible, as it would be from a shell)."""
    import signal

    proc = subprocess.Popen(["sleep", "30"])
    with open(f"/proc/{proc.pid}/status") as fh:
        ignored = int(next(line for line in fh if line.startswith("SigIgn:")).split()[1], 16)
    proc.send_signal(signal.SIGINT)
    try:
        code = proc.wait(5)
    except subprocess.TimeoutExpired:
        proc.kill()
        proc.wait()
        code = None
    return {"sigint_ignored": bool(ignored & (1 << (signal.SIGINT - 1))), "returncode": code}


@cy.step("sleeper", max_attempts=3)
def sleeper(ctx: cy.Context, inp: dict) -> dict:
    """Sleeps ``seconds`` (ignoring ctx); appends a line to ``log`` when it starts and ends."""
    log = inp.get("log")
    if log:
        with open(log, "a") as fh:
            fh.write(f"start {os.getpid()} {ctx.attempt}\n")
    time.sleep(inp.get("seconds", 1.0))
    if log:
        with open(log, "a") as fh:
            fh.write(f"end {os.getpid()} {ctx.attempt}\n")
    return {"slept": inp.get("seconds", 1.0)}


@cy.step("spawner", max_attempts=3)
def spawner(ctx: cy.Context, inp: dict) -> dict:
    """Starts grandchildren (one in its group, one setsid'd), records pids, then blocks."""
    a = subprocess.Popen(["sleep", "300"])
    b = subprocess.Popen(["sleep", "300"], start_new_session=True)
    Path(inp["pids"]).write_text(f"{os.getpid()} {a.pid} {b.pid}\n")
    if inp.get("block", True):
        time.sleep(300)
    return {"pids": [a.pid, b.pid]}


@cy.step("progress", max_attempts=1)
def progress(ctx: cy.Context, inp: dict) -> dict:
    for i in range(inp.get("n", 5)):
        ctx.set_progress(i + 1, inp.get("n", 5), f"item {i + 1}")
        time.sleep(inp.get("pause", 0.1))
    return {"done": True}


@cy.step("protocol_breaker", max_attempts=1)
def protocol_breaker(ctx: cy.Context, inp: dict) -> dict:
    """Writes a bogus frame header straight onto the control socket (fd in argv[1])."""
    import sys

    os.write(int(sys.argv[1]), b"\xff" * 8 + b"garbage")
    time.sleep(30)
    return {}


@cy.step("sched_policy", max_attempts=1)
def sched_policy(ctx: cy.Context, inp: dict) -> dict:
    """The child's scheduling policy, and a grandchild's (it inherits it)."""
    out = subprocess.run([sys.executable, "-c", "import os; print(os.sched_getscheduler(0))"],
                         capture_output=True, text=True, check=True).stdout
    return {"child": os.sched_getscheduler(0), "grandchild": int(out)}


@cy.step("daemonizes", max_attempts=1)
def daemonizes(ctx: cy.Context, inp: dict) -> dict:
    """Leaves a process whose parent exits at once (reparented to the subreaper)."""
    out = subprocess.run(["sh", "-c", "sleep 300 >/dev/null 2>&1 & echo $!"], capture_output=True, text=True, check=True)
    return {"pid": int(out.stdout.strip())}


_kept: list[subprocess.Popen] = []  # never waited for


@cy.step("leaves_zombie", max_attempts=1)
def leaves_zombie(ctx: cy.Context, inp: dict) -> dict:
    """Leaves a process it never waits for: once the supervisor kills it, a zombie of the child."""
    proc = subprocess.Popen(["sleep", "300"])
    _kept.append(proc)
    return {"pid": proc.pid}


@cy.step("logged", max_attempts=3)
def logged(ctx: cy.Context, inp: dict) -> dict:
    """Sleeps ``seconds``, then appends ``<run id> <pid> <attempt>`` to ``log`` (one line
    per execution that ran to its end, O_APPEND: lines of several children never mix)."""
    time.sleep(inp.get("seconds", 0.05))
    fd = os.open(inp["log"], os.O_WRONLY | os.O_CREAT | os.O_APPEND, 0o644)
    try:
        os.write(fd, f"{ctx.run_id} {os.getpid()} {ctx.attempt}\n".encode())
    finally:
        os.close(fd)
    return {"n": inp.get("n")}
