"""Module-level step handlers for tests/acceptance/test_scenarios_*.py (SC-01..SC-11).

Children import handlers by module path, so everything here is defined at module level.
Handlers report what they did by appending JSON lines to a file named in their input
(``_append``); the tests read them back with :func:`read_records`. Small appends with
``O_APPEND`` are atomic, so several processes may share one file.
"""

from __future__ import annotations

import collections
import ctypes
import dataclasses
import itertools
import json
import multiprocessing
import os
import signal
import subprocess
import sys
import threading
import time
from pathlib import Path
from typing import Any

import psutil

import cyclone_mp as cy


def _no_backoff(attempt: int) -> float:
    return 0.0


def _hour_backoff(attempt: int) -> float:
    return 3600.0


def _append(path: str, record: dict[str, Any]) -> None:
    record = {"pid": os.getpid(), "t": time.time(), **record}
    with open(path, "a") as fh:
        fh.write(json.dumps(record) + "\n")


def read_records(path: str | Path) -> list[dict[str, Any]]:
    """Every complete JSON line of ``path`` (a torn last line is ignored); [] if missing."""
    try:
        text = Path(path).read_text()
    except FileNotFoundError:
        return []
    out = []
    for line in text.split("\n")[:-1]:
        if line.strip():
            out.append(json.loads(line))
    return out


def _write_json_atomic(path: str, value: Any) -> None:
    tmp = f"{path}.tmp.{os.getpid()}"
    with open(tmp, "w") as fh:
        json.dump(value, fh)
    os.replace(tmp, path)


def _alive(pid: int) -> bool:
    """True for a live, non-zombie process."""
    try:
        return psutil.Process(pid).status() != psutil.STATUS_ZOMBIE
    except psutil.Error:
        return False


# -- every scenario: a normal step ---------------------------------------------------------------


@cy.step("sc_ok", max_attempts=3, backoff=_no_backoff)
def sc_ok(ctx: cy.Context, inp: dict) -> dict:
    time.sleep(inp.get("sleep", 0.0))
    return {"ok": True, "pid": os.getpid(), "i": inp.get("i")}


# -- SC-01 hard kill after an ignored cancel -------------------------------------------------------


@cy.step("sc01_ignores_cancel", timeout=1, max_attempts=1, backoff=_hour_backoff)
def sc01_ignores_cancel(ctx: cy.Context, inp: dict) -> dict:
    """Sees the cancel (records it) and keeps sleeping in 0.1 s slices."""
    _append(inp["log"], {"event": "start", "attempt": ctx.attempt})
    seen = False
    end = time.monotonic() + inp.get("seconds", 3.0)
    while time.monotonic() < end:
        if ctx.cancelled and not seen:
            seen = True
            _append(inp["log"], {"event": "cancel_seen", "reason": ctx.cancel_reason})
        time.sleep(0.1)
    _append(inp["log"], {"event": "returned"})
    return {"returned": True, "would_be_output": "must never be stored"}


@cy.step("sc01_never_looks", timeout=1, max_attempts=1, backoff=_hour_backoff)
def sc01_never_looks(ctx: cy.Context, inp: dict) -> dict:
    """Never looks at ctx: one long sleep, then returns."""
    _append(inp["log"], {"event": "start", "attempt": ctx.attempt})
    time.sleep(inp.get("seconds", 3.0))
    _append(inp["log"], {"event": "returned"})
    return {"returned": True, "would_be_output": "must never be stored"}


# -- SC-02 wedged in native code -----------------------------------------------------------------


@cy.step("sc02_deque_wedge", timeout=1, max_attempts=1)
def sc02_deque_wedge(ctx: cy.Context, inp: dict) -> dict:
    """A C loop that never returns to the interpreter and holds the GIL."""
    _append(inp["log"], {"event": "start", "kind": "deque"})
    collections.deque(itertools.repeat(None, 10**12), maxlen=0)
    return {"returned": True}


@cy.step("sc02_pause_wedge", timeout=1, max_attempts=1)
def sc02_pause_wedge(ctx: cy.Context, inp: dict) -> dict:
    """libc ``pause()`` with SIGTERM ignored, called through PyDLL so the GIL stays held."""
    signal.signal(signal.SIGTERM, signal.SIG_IGN)
    _append(inp["log"], {"event": "start", "kind": "pause"})
    ctypes.PyDLL(None).pause()
    return {"returned": True}


# -- SC-03 grandchildren die with the attempt ------------------------------------------------------

_ESCAPE = (
    "import os, sys, time\n"
    "pid = os.fork()\n"
    "if pid:\n"
    "    sys.stdout.write(f'{pid}\\n'); sys.stdout.flush(); os._exit(0)\n"
    "os.setsid()\n"
    "fd = os.open(os.devnull, os.O_RDWR); os.dup2(fd, 1)\n"
    "time.sleep(300)\n"
)


@cy.step("sc03_spawner", timeout=1, max_attempts=2, backoff=_no_backoff)
def sc03_spawner(ctx: cy.Context, inp: dict) -> dict:
    """Starts grandchildren of every kind, writes their pids, then blocks.

    On attempt n > 1 it first records which pids of attempt n-1 are still alive (the
    scenario wants them all gone *before* the retry starts).
    """
    out_dir = inp["dir"]
    record: dict[str, Any] = {"attempt": ctx.attempt, "pid": os.getpid(), "t": time.time()}
    prev = Path(out_dir) / f"pids-{ctx.attempt - 1}.json"
    if prev.exists():
        listed = json.loads(prev.read_text())["all"]
        record["prev_alive"] = [p for p in listed if _alive(p)]
    # 1. a double-forked, setsid'd escapee: its parent exits at once, so it is reparented
    #    (to this child, a child subreaper: it stays a descendant of this child).
    esc = subprocess.Popen([sys.executable, "-c", _ESCAPE], stdout=subprocess.PIPE)
    assert esc.stdout is not None
    escapee = int(esc.stdout.readline())
    esc.wait()
    try:
        escapee_ppid = psutil.Process(escapee).ppid()
    except psutil.Error:
        escapee_ppid = None
    # 2. the scenario's shell with a background job
    sh = subprocess.Popen(["sh", "-c", "sleep 300 & sleep 300"])
    # 3. a Python multiprocessing child
    mp = multiprocessing.Process(target=time.sleep, args=(300,))
    mp.start()
    # 4. a grandchild that left the process group with setsid()
    sid = subprocess.Popen(["sleep", "300"], start_new_session=True)
    deadline = time.monotonic() + 0.3
    while time.monotonic() < deadline and len(psutil.Process(sh.pid).children()) < 1:
        time.sleep(0.005)
    descendants = [p.pid for p in psutil.Process().children(recursive=True)]
    record.update({
        "sh": sh.pid, "sh_children": [p.pid for p in psutil.Process(sh.pid).children(recursive=True)],
        "mp": mp.pid, "setsid": sid.pid, "escapee": escapee, "escapee_ppid": escapee_ppid,
        "all": sorted(set(descendants) | {escapee}),
    })
    _write_json_atomic(str(Path(out_dir) / f"pids-{ctx.attempt}.json"), record)
    time.sleep(300)
    return {"returned": True}


# -- SC-04 / SC-05: supervisor killed mid-step -------------------------------------------------------


@cy.step("sc04_writer", max_attempts=3)
def sc04_writer(ctx: cy.Context, inp: dict) -> dict:
    """Appends a line every 100 ms for ``seconds`` (5 s), then a ``done`` line."""
    n = int(inp.get("seconds", 5.0) / 0.1)
    for i in range(n):
        _append(inp["log"], {"event": "tick", "i": i, "attempt": ctx.attempt})
        time.sleep(0.1)
    _append(inp["log"], {"event": "done", "attempt": ctx.attempt})
    return {"lines": n}


# -- SC-06 heartbeats under CPU saturation ------------------------------------------------------------


@cy.step("sc06_busy", max_attempts=1)
def sc06_busy(ctx: cy.Context, inp: dict) -> dict:
    """Busy-loops (pure CPU, no sleeping) for ``seconds``."""
    _append(inp["log"], {"event": "start", "run": ctx.run_id})
    end = time.monotonic() + inp["seconds"]
    n = 0
    while time.monotonic() < end:
        n += 1
    _append(inp["log"], {"event": "done", "run": ctx.run_id})
    return {"loops": n}


# -- SC-07 / SC-08 shutdown --------------------------------------------------------------------------


def _sleep_noting_cancel(ctx: cy.Context, log: str, seconds: float) -> None:
    """Sleep ``seconds`` in 0.1 s slices, ignoring a cancel but recording the first one seen
    (a slice ends when the cancel comes, so its record says when it came)."""
    end = time.monotonic() + seconds
    seen = False
    while time.monotonic() < end:
        if ctx.cancelled and not seen:
            seen = True
            _append(log, {"event": "cancel_seen", "reason": ctx.cancel_reason})
        if seen:
            time.sleep(0.1)
        else:  # woken by the cancel itself: its time is when it arrived, not up to a slice later
            ctx.cancellation.wait(max(0.0, min(0.1, end - time.monotonic())))


@cy.step("sc07_five_seconds", max_attempts=3)
def sc07_five_seconds(ctx: cy.Context, inp: dict) -> dict:
    """Takes ``seconds`` (5 s) in 0.1 s slices; records a cancel if one ever arrives."""
    _append(inp["log"], {"event": "start", "attempt": ctx.attempt})
    _sleep_noting_cancel(ctx, inp["log"], inp.get("seconds", 5.0))
    _append(inp["log"], {"event": "done", "attempt": ctx.attempt})
    return {"done": True}


@cy.step("sc08_long_then_short", max_attempts=3)
def sc08_long_then_short(ctx: cy.Context, inp: dict) -> dict:
    """The first execution sleeps ``first`` (20 s) ignoring the cancel; later ones ``later`` s."""
    first = not any(r["event"] == "start" for r in read_records(inp["log"]))
    _append(inp["log"], {"event": "start", "attempt": ctx.attempt, "first": first})
    _sleep_noting_cancel(ctx, inp["log"], inp.get("first", 20.0) if first else inp.get("later", 0.3))
    _append(inp["log"], {"event": "done", "attempt": ctx.attempt})
    return {"first": first}


# -- SC-09 poison steps --------------------------------------------------------------------------------


@cy.step("sc09_kills_itself", max_attempts=10, max_reclaims=3, backoff=_no_backoff)
def sc09_kills_itself(ctx: cy.Context, inp: dict) -> dict:
    """A child crash: SIGKILL its own process."""
    _append(inp["log"], {"event": "run", "attempt": ctx.attempt})
    os.kill(os.getpid(), signal.SIGKILL)
    time.sleep(30)
    return {}


@cy.step("sc09_kills_supervisor", max_attempts=10, max_reclaims=3, backoff=_no_backoff)
def sc09_kills_supervisor(ctx: cy.Context, inp: dict) -> dict:
    """Think cgroup OOM: SIGKILL the supervisor (this child's parent)."""
    _append(inp["log"], {"event": "run", "attempt": ctx.attempt, "supervisor": os.getppid()})
    os.kill(os.getppid(), signal.SIGKILL)
    time.sleep(30)  # PDEATHSIG ends us
    return {}


# -- SC-10 what the child sends back ----------------------------------------------------------------------


class UnpicklableError(Exception):
    """Pickles, but fails to unpickle: ``__init__`` needs two arguments and passes one to the base."""

    def __init__(self, code: int, detail: str) -> None:
        super().__init__(f"refused with code {code}")
        self.code = code
        self.detail = detail


class LockHolder:
    """A plain object holding a ``threading.Lock``."""

    def __init__(self) -> None:
        self.lock = threading.Lock()
        self.value = 1


@dataclasses.dataclass
class LockedResult:
    """A dataclass holding a ``threading.Lock`` (dataclass outputs are converted, SPEC 2)."""

    value: int
    lock: Any


@cy.step("sc10_unpicklable_exception", max_attempts=2, backoff=_no_backoff)
def sc10_unpicklable_exception(ctx: cy.Context, inp: dict) -> dict:
    raise UnpicklableError(42, "the detail")


@cy.step("sc10_returns_lock_holder", max_attempts=2, backoff=_no_backoff)
def sc10_returns_lock_holder(ctx: cy.Context, inp: dict) -> Any:
    return LockHolder()


@cy.step("sc10_returns_locked_dataclass", max_attempts=2, backoff=_no_backoff)
def sc10_returns_locked_dataclass(ctx: cy.Context, inp: dict) -> Any:
    return LockedResult(value=1, lock=threading.Lock())


@cy.step("sc10_returns_lambda", max_attempts=2, backoff=_no_backoff)
def sc10_returns_lambda(ctx: cy.Context, inp: dict) -> Any:
    return lambda: 1


# -- SC-11 memory does not creep ----------------------------------------------------------------------------

LEAK: list[bytes] = []
_STEPS_IN_THIS_CHILD = 0
_FRESH_RSS: int | None = None
_PAGE = os.sysconf("SC_PAGE_SIZE")


def _rss() -> int:
    with open("/proc/self/statm") as fh:
        return int(fh.read().split()[1]) * _PAGE


@cy.step("sc11_churn", max_attempts=1)
def sc11_churn(ctx: cy.Context, inp: dict) -> dict:
    """Allocates (and touches) 100 MB, frees it, and leaks 1 MB into a module-level list."""
    global _STEPS_IN_THIS_CHILD, _FRESH_RSS
    rss_start = _rss()
    if _FRESH_RSS is None:
        _FRESH_RSS = rss_start
    _STEPS_IN_THIS_CHILD += 1
    big = b"x" * (inp.get("alloc_mb", 100) << 20)
    peak = _rss()
    del big
    LEAK.append(b"y" * (inp.get("leak_mb", 1) << 20))
    return {"pid": os.getpid(), "n": _STEPS_IN_THIS_CHILD, "fresh_rss": _FRESH_RSS,
            "rss_start": rss_start, "rss_peak": peak, "rss_end": _rss()}


# SC-10, the same kind of fault: values that are valid Python/JSON but that PostgreSQL
# cannot store (NUL, lone surrogates), and an output too deep to serialise.


@cy.step("sc10_output_with_nul", max_attempts=2, backoff=_no_backoff)
def sc10_output_with_nul(ctx: cy.Context, inp: dict) -> Any:
    return {"text": "a\x00b"}  # valid JSON ("\u0000"), rejected by jsonb


@cy.step("sc10_output_with_surrogate", max_attempts=2, backoff=_no_backoff)
def sc10_output_with_surrogate(ctx: cy.Context, inp: dict) -> Any:
    return {"text": "bad \udcff surrogate"}  # e.g. os.fsdecode() of a non-UTF-8 file name


@cy.step("sc10_message_with_nul", max_attempts=2, backoff=_no_backoff)
def sc10_message_with_nul(ctx: cy.Context, inp: dict) -> Any:
    raise ValueError("bad\x00byte in message")


@cy.step("sc10_message_with_surrogate", max_attempts=2, backoff=_no_backoff)
def sc10_message_with_surrogate(ctx: cy.Context, inp: dict) -> Any:
    raise ValueError("bad \ud800 surrogate in message")


@cy.step("sc10_deeply_nested_output", max_attempts=2, backoff=_no_backoff)
def sc10_deeply_nested_output(ctx: cy.Context, inp: dict) -> Any:
    out: list = []
    for _ in range(100_000):
        out = [out]
    return out


@cy.step("sc10_progress_with_nul", max_attempts=2, backoff=_no_backoff)
def sc10_progress_with_nul(ctx: cy.Context, inp: dict) -> Any:
    """Progress is sent back too (and stored with the next heartbeat)."""
    ctx.set_progress(1, 2, "half\x00way")
    time.sleep(inp.get("sleep", 1.5))
    return {"done": True}
