"""Polling helpers for every test module: wait on states and counters, never on bare sleeps.

An absence ("nothing was claimed", "nothing moved") is proved by waiting until whatever
could have made it happen had its chance: a supervisor's counter grew by a few turns
(``counter_grows`` for a supervisor in this process, ``supervisor_turns`` for one in
another process, read from its registry row). Timeouts are seconds."""

from __future__ import annotations

import time
from typing import Any, Callable

import psutil
import pytest

from cyclone_mp.store import connect


def wait_for(predicate: Callable[[], Any], timeout: float, what: str = "condition", interval: float = 0.02) -> Any:
    """Poll ``predicate`` every ``interval`` seconds until it returns a truthy value, and
    return that value; fail the test after ``timeout`` seconds."""
    deadline = time.monotonic() + timeout
    while True:
        value = predicate()
        if value:
            return value
        if time.monotonic() > deadline:
            pytest.fail(f"timed out after {timeout}s waiting for {what}")
        time.sleep(interval)


def counter_grows(read: Callable[[], int], n: int, timeout: float = 15.0, what: str = "a counter") -> None:
    """Wait until the counter ``read()`` returns (e.g. ``lambda: sup.stats["claim_statements"]``
    of a supervisor in this process) has grown by ``n`` from its value now."""
    start = read()
    wait_for(lambda: read() >= start + n, timeout, f"{n} more {what}")


def supervisor_turns(dsn: str, key: str, n: int = 2, *, timeout: float = 15.0,
                     supervisor_id: str | None = None) -> None:
    """Wait until a supervisor (any registered one, or ``supervisor_id``) has counted ``n``
    more ``key`` after this call: ``claim_statements`` (claims), ``sweeps`` (recovery
    sweeps), ``late_completions_dropped``... Read from its registry row
    (``cyclone_workers.info.stats``, rewritten every ``registry_interval``). The baseline is
    the second row written after the call (the first may carry counters read before it),
    so the ``n`` turns all began after the call: what they would have done had its chance."""
    query = "SELECT id, heartbeat_at, info FROM cyclone_workers"
    with connect(dsn) as conn:
        t0 = conn.execute("SELECT clock_timestamp() AS t").fetchone()["t"]
        first: dict[str, Any] = {}  # supervisor id -> heartbeat_at of its first row written after t0
        base: dict[str, int] = {}  # supervisor id -> its counter in the row written after that one

        def grown() -> bool:
            for row in conn.execute(query).fetchall():
                if (supervisor_id is not None and row["id"] != supervisor_id) or row["heartbeat_at"] <= t0:
                    continue
                value = int(((row["info"] or {}).get("stats") or {}).get(key, 0))
                if row["id"] not in first:
                    first[row["id"]] = row["heartbeat_at"]
                elif row["id"] not in base:
                    if row["heartbeat_at"] > first[row["id"]]:
                        base[row["id"]] = value
                elif value >= base[row["id"]] + n:
                    return True
            return False

        wait_for(grown, timeout, f"{n} more {key} of {supervisor_id or 'a supervisor'}")


def registry_infos(dsn: str) -> list[dict[str, Any]]:
    """The ``info`` of every supervisor's registry row (``cyclone_workers``): what its
    process control last said (``draining``, ``children`` with their ``run_id``...)."""
    with connect(dsn) as conn:
        return [row["info"] or {} for row in conn.execute("SELECT info FROM cyclone_workers").fetchall()]


def supervisors_idle(dsn: str) -> bool:
    """True when every registered supervisor's last registry row shows no child running a
    step (process control has settled every attempt it had)."""
    infos = registry_infos(dsn)
    busy = [kid for info in infos for kid in info.get("children") or () if kid.get("run_id") is not None]
    return bool(infos) and not busy


def not_zombie(pid: int) -> bool:
    """``pid`` runs (exists and is not a zombie)."""
    try:
        return psutil.Process(pid).status() != psutil.STATUS_ZOMBIE
    except psutil.Error:
        return False


def wait_exited(pids, timeout: float) -> list[int]:
    """Wait up to ``timeout`` seconds until none of ``pids`` runs (a zombie counts as
    exited, whoever must reap it); return those still running."""
    deadline = time.monotonic() + timeout
    while True:
        alive = [p for p in pids if not_zombie(p)]
        if not alive or time.monotonic() >= deadline:
            return alive
        time.sleep(0.02)
