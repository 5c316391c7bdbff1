"""What the failure scenarios' tests share (``tests/acceptance/test_scenarios_*.py``,
SC-01..SC-11 of the shared scenarios/README.md): the README's "check after every
scenario", when a pid counts as gone, and the JSON lines the handlers write.

:func:`check_after`: the surviving supervisor is alive and completes a new step, no step
is ``running`` without a live lease held by a live supervisor, every pid the handlers
recorded is gone (reaped by its supervisor; an orphan whose supervisor died may wait as
a zombie for init, which on this VM reaps only every second or two), and no live
supervisor has a zombie child.
"""

from __future__ import annotations

import os
import time
from pathlib import Path
from typing import Any, Callable

import psutil
import pytest

from cyclone_mp.store import connect

import scenario_handlers as sh
from waiting import wait_for as wait_until


def present(pid: int) -> bool:
    """True while ``pid`` is in the process table (alive or an unreaped zombie)."""
    try:
        psutil.Process(pid)
        return True
    except psutil.NoSuchProcess:
        return False


def dead(pid: int) -> bool:
    """True once ``pid`` no longer runs: reaped, or a zombie."""
    try:
        return psutil.Process(pid).status() == psutil.STATUS_ZOMBIE
    except psutil.NoSuchProcess:
        return True


def ours(pid: int) -> bool:
    """True when ``pid`` is a descendant of the test process (so one of ours must reap it)."""
    me = os.getpid()
    try:
        return any(p.pid == me for p in psutil.Process(pid).parents())
    except psutil.Error:
        return False


def left_behind(pid: int) -> bool:
    """Still running, or a zombie that one of our processes (a supervisor) failed to reap.

    A zombie whose parent is outside the test's process tree is an orphan waiting for
    init: on this machine pid 1 (the VM's process API) reaps orphans only every second
    or two, so such a zombie is dead and not ours to reap.
    """
    return present(pid) and (not dead(pid) or ours(pid))


def wait_gone(pids, timeout: float) -> list[int]:
    """Wait until no pid is :func:`left_behind`; return those that still are."""
    deadline = time.monotonic() + timeout
    while True:
        left = [p for p in pids if left_behind(p)]
        if not left or time.monotonic() > deadline:
            return left
        time.sleep(0.01)


def gone_at(pids, timeout: float, test: Callable[[int], bool] = lambda p: not left_behind(p)) -> dict[int, float]:
    """Poll every 10 ms; return ``{pid: time.time() it was first seen dead}`` (missing if never).

    By default "dead" means not :func:`left_behind`: a supervisor's child counts once it
    is reaped, an orphan once it is a zombie.
    """
    seen: dict[int, float] = {}
    deadline = time.monotonic() + timeout
    while len(seen) < len(set(pids)) and time.monotonic() < deadline:
        now = time.time()
        for pid in pids:
            if pid not in seen and test(pid):
                seen[pid] = now
        time.sleep(0.01)
    return seen


def describe(pids) -> list[tuple[int, str, str]]:
    out = []
    for pid in pids:
        try:
            p = psutil.Process(pid)
            out.append((pid, p.status(), " ".join(p.cmdline())[:80]))
        except psutil.Error:
            out.append((pid, "gone", ""))
    return out


def zombies_under(pid: int) -> list[int]:
    """Zombie descendants of ``pid`` (a supervisor must reap what it killed)."""
    try:
        kids = psutil.Process(pid).children(recursive=True)
    except psutil.Error:
        return []
    out = []
    for k in kids:
        try:
            if k.status() == psutil.STATUS_ZOMBIE:
                out.append(k.pid)
        except psutil.Error:
            pass
    return out


def stranded_steps(env, live_owners: set[str]) -> list[dict[str, Any]]:
    """Steps ``running`` without a live lease, or leased to a supervisor that is not alive."""
    with connect(env.dsn) as conn:
        rows = conn.execute(
            "SELECT run_id::text AS run_id, node, lease_owner, lease_expiry, lease_expiry > now() AS live "
            "FROM cyclone_steps WHERE state = 'running'"
        ).fetchall()
    return [r for r in rows if not r["live"] or r["lease_owner"] not in live_owners]


def check_after(env, handle, *, pids=()) -> None:
    """The README's check after every scenario (see the module docstring)."""
    assert handle.alive(), "the supervisor did not survive the scenario"
    run = env.run_until_complete(env.enqueue(sh.sc_ok, {"i": "after"}), timeout=30)
    assert run.state == "completed" and run.step.output["ok"] is True, "the supervisor takes no new step"
    live_owners = {w.supervisor_id for w in env.workers if w.alive()}
    assert handle.supervisor_id in live_owners
    assert not stranded_steps(env, live_owners), "a step is left running without a live lease"
    left = wait_gone(list(pids), timeout=5.0)
    assert not left, f"processes the handlers started are still there: {describe(left)}"
    for w in env.workers:
        if w.alive():
            try:
                wait_until(lambda: not zombies_under(w.pid), timeout=3.0, what="no zombie")
            except TimeoutError:
                pytest.fail(f"zombies under supervisor {w.pid}: {describe(zombies_under(w.pid))}")


def records(path: Path, event: str | None = None) -> list[dict[str, Any]]:
    return [r for r in sh.read_records(path) if event is None or r.get("event") == event]


def wait_records(path: Path, event: str, n: int = 1, timeout: float = 15.0) -> list[dict[str, Any]]:
    return wait_until(lambda: (lambda rs: rs if len(rs) >= n else None)(records(path, event)),
                      timeout, what=f"{n} {event!r} record(s) in {path.name}")


def registry_row(env, supervisor_id: str) -> dict[str, Any] | None:
    with connect(env.dsn) as conn:
        return conn.execute("SELECT * FROM cyclone_workers WHERE id = %s", (supervisor_id,)).fetchone()
