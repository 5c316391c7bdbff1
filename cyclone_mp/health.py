"""A supervisor's health: its maintenance tasks (which keep failing, how old the fleet's
last successful recovery sweep is: SPEC 9, a maintenance task that keeps failing is a
visible health problem, never only a log line), and what ``/healthz`` and ``/readyz``
answer (:data:`LIVE_AFTER`, :class:`DatabaseProbe`).

Maintenance (:mod:`cyclone_mp.sweep`) reports each attempt of a task here. A task that
fails :data:`FAILING_AFTER` attempts in a row is *failing*: the supervisor logs once what
does not work and what that stops, ``cyclone-mp workers`` and the dashboard show it (from
the registry row's ``info["maintenance"]``), and the metrics count every failure
(``cyclone_maintenance_failures_total{task}``) and export the sweep's age
(``cyclone_last_sweep_age_seconds``). One success ends it, and is logged once too.

Written by the maintenance thread only; other threads (the metrics server, the registry
snapshot) read plain values.
"""

from __future__ import annotations

import dataclasses
import logging
import threading
import time
from typing import Any, Callable

from .connections import connect

log = logging.getLogger("cyclone_mp.supervisor")

#: Failed attempts in a row after which a task is reported as failing.
FAILING_AFTER = 3

#: What each task's failure stops, for the one line logged when it starts failing.
CONSEQUENCES = {
    "sweep": "steps of crashed or frozen supervisors are not reclaimed, steps past their timeout are "
             "not settled, max_reclaims is not applied and workflow timers do not fire",
    "schedules": "this supervisor's schedules enqueue no runs",
    "history": "finished runs are not archived and retention drops no history",
    "registry": "this supervisor is missing from `cyclone-mp workers` and its prefetch share is not updated",
    "queue_depths": "the queue depth metrics are not updated",
    "vacuum_watch": "the hot tables are not vacuumed after a long transaction ends",
}


@dataclasses.dataclass
class TaskHealth:
    """One task's record: failed attempts in a row, the last error (one line), and when
    (local monotonic seconds) the current run of failures began."""

    failures: int = 0
    error: str = ""
    since: float | None = None
    total_failures: int = 0


class MaintenanceHealth:
    """Failures of the maintenance tasks, and the age of the fleet's last successful sweep.

    Args:
        clock: local monotonic clock in seconds.
        on_failure: called with the task's name at every failed attempt (the metrics'
            counter); must not raise.
    """

    def __init__(self, clock: Callable[[], float] = time.monotonic,
                 on_failure: Callable[[str], None] | None = None) -> None:
        self.clock = clock
        self.on_failure = on_failure
        self.tasks: dict[str, TaskHealth] = {}
        self._sweep_ok_at: float | None = None  # local time at which the fleet's last sweep succeeded

    def failed(self, task: str, error: BaseException | str) -> None:
        """An attempt of ``task`` failed with ``error``; logs once when it becomes failing."""
        health = self.tasks.setdefault(task, TaskHealth())
        health.failures += 1
        health.total_failures += 1
        health.error = str(error).strip().splitlines()[0][:300] if str(error).strip() else type(error).__name__
        if health.since is None:
            health.since = self.clock()
        if self.on_failure is not None:
            self.on_failure(task)
        if health.failures == FAILING_AFTER:
            log.error("maintenance task %r has failed %d times in a row (last: %s): until it works again, %s",
                      task, health.failures, health.error, CONSEQUENCES.get(task, "it does nothing"))

    def succeeded(self, task: str) -> None:
        """An attempt of ``task`` worked; logs once when it had been failing."""
        health = self.tasks.get(task)
        if task == "sweep":
            self._sweep_ok_at = self.clock()
        if health is None or health.failures == 0:
            return
        if health.failures >= FAILING_AFTER:
            log.warning("maintenance task %r works again after %d failed attempts over %.0fs",
                        task, health.failures, self.clock() - (health.since or self.clock()))
        health.failures, health.since = 0, None

    def sweep_seen(self, since_success: float | None) -> None:
        """The database says a sweep pass last succeeded ``since_success`` seconds ago, on
        any supervisor (None: never); kept when it is newer than what this one knew."""
        if since_success is None:
            return
        at = self.clock() - max(0.0, since_success)
        if self._sweep_ok_at is None or at > self._sweep_ok_at:
            self._sweep_ok_at = at

    def last_sweep_age(self) -> float | None:
        """Seconds since the fleet's last successful sweep, as this supervisor knows it
        (None: none seen since it started and none recorded)."""
        return None if self._sweep_ok_at is None else max(0.0, self.clock() - self._sweep_ok_at)

    def failures(self, task: str) -> int:
        """Failed attempts of ``task`` in a row now (0: its last attempt worked, or none yet)."""
        health = self.tasks.get(task)
        return 0 if health is None else health.failures

    def failing(self) -> dict[str, TaskHealth]:
        """The tasks failing now (:data:`FAILING_AFTER` failed attempts in a row or more)."""
        return {task: h for task, h in self.tasks.items() if h.failures >= FAILING_AFTER}

    def snapshot(self) -> dict[str, Any]:
        """Plain data for the registry row (``info["maintenance"]``): ``failing`` maps each
        failing task to ``{"failures": int, "error": str, "for": seconds}``;
        ``last_sweep_age``: seconds, or None."""
        now = self.clock()
        age = self.last_sweep_age()
        return {
            "failing": {task: {"failures": h.failures, "error": h.error,
                               "for": round(now - (h.since if h.since is not None else now), 1)}
                        for task, h in self.failing().items()},
            "last_sweep_age": None if age is None else round(age, 1),
        }


#: Seconds after which a process-control loop that has not turned is not live (its loop
#: wakes at least every second).
LIVE_AFTER = 10.0
PROBE_INTERVAL = 0.5  #: seconds between two looks at the database by :class:`DatabaseProbe`
PROBE_TIMEOUT = 1.0  #: seconds one look may take (connecting included)


class DatabaseProbe:
    """Whether the database answers, for ``/readyz``: a connection of its own runs
    ``SELECT 1`` every :data:`PROBE_INTERVAL` seconds on a thread of its own (reconnecting
    after a failure), so a probe request never waits on the database and a flood of them
    costs nothing. A look older than two intervals counts as a failure (the thread is
    stuck). Only made when the supervisor serves its metrics port.

    Args:
        connect: opens a connection (:func:`cyclone_mp.connections.connect`, bounded).
        clock: local monotonic clock in seconds.
    """

    def __init__(self, connect: Callable[[], Any], clock: Callable[[], float] = time.monotonic) -> None:
        self._connect = connect
        self.clock = clock
        self._conn: Any = None
        self._ok: tuple[bool, str, float] = (False, "not looked at yet", clock())
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._run, name="cyclone-readiness", daemon=True)

    @classmethod
    def started(cls, dsn: str, *, pgbouncer: bool, owner: str) -> "DatabaseProbe":
        """A probe of ``dsn`` (through PgBouncer when ``pgbouncer``), started."""
        probe = cls(lambda: connect(dsn, timeout=PROBE_TIMEOUT, dead_after=PROBE_TIMEOUT, pgbouncer=pgbouncer,
                                    prepare=False, application_name=f"cyclone_mp readiness {owner}"))
        probe.start()
        return probe

    def start(self) -> None:
        self._thread.start()

    def close(self) -> None:
        self._stop.set()
        self._thread.join(PROBE_TIMEOUT + 1.0)
        self._drop()

    def state(self) -> tuple[bool, str]:
        """``(True, "database reachable")``, or False and why."""
        ok, reason, at = self._ok
        if self.clock() - at > 2 * PROBE_INTERVAL + PROBE_TIMEOUT:
            return False, f"the database has not answered for {self.clock() - at:.1f}s"
        return ok, reason

    def _run(self) -> None:
        while not self._stop.is_set():
            self._look()
            self._stop.wait(PROBE_INTERVAL)

    def _look(self) -> None:
        try:
            if self._conn is None or self._conn.closed or self._conn.broken:
                self._drop()
                self._conn = self._connect()
            self._conn.execute("SELECT 1")
        except Exception as exc:  # noqa: BLE001 - any failure means "not ready"
            self._drop()
            detail = str(exc).strip().splitlines()[0] if str(exc).strip() else type(exc).__name__
            self._ok = (False, f"database unreachable: {detail}", self.clock())
            return
        self._ok = (True, "database reachable", self.clock())

    def _drop(self) -> None:
        conn, self._conn = self._conn, None
        if conn is not None:
            try:
                conn.close()
            except Exception:  # noqa: BLE001
                pass


def liveness(control: Any, stopped: bool) -> tuple[bool, str]:
    """``/healthz``: ``(True, "ok")`` while the process-control loop (``control``, with its
    ``turned_at``, local monotonic seconds) turns: it wakes at least every second; else
    False and for how long it has not."""
    if control is None:
        return (False, "stopped") if stopped else (True, "starting")
    stalled = time.monotonic() - control.turned_at
    if stalled > LIVE_AFTER:
        return False, f"process control has not turned for {stalled:.0f}s"
    return True, "ok"


def readiness(running: bool, draining: bool, probe: DatabaseProbe | None) -> tuple[bool, str]:
    """``/readyz``: ``(True, "ready")`` once the children run (``running``), while the
    database answers (``probe``, when there is one) and until a drain begins; else False
    and why."""
    if not running:
        return False, "starting: children not started yet"
    if draining:
        return False, "draining"
    if probe is not None:
        ok, reason = probe.state()
        if not ok:
            return False, reason
    return True, "ready"
