"""Maintenance: the recovery sweep, due timers, schedules and the registry (SPEC 4).

:class:`Sweeper` is the recovery sweep as River's rescuer is (STYLE pattern 4): its
:meth:`~Sweeper.run_once` pages through at most 100 ``running`` rows whose lease expired
or whose ``started_at + timeout`` passed on the database clock, settles each under its run
and step locks (:meth:`cyclone_mp.store.Sweep.expire`, which asks
:func:`cyclone_mp.decisions.expiry`), fires due timers, and returns counts.

:class:`Maintenance` is the thin loop around it, on a thread and a connection of its own.
Each pass takes the sweep's turn (:meth:`cyclone_mp.store.Sweep.turn`, a one-statement row
lock that works through PgBouncer), so the database sees one pass per ``poll_interval``
however many supervisors run. The same loop refreshes the ``cyclone_workers`` registry
(which recovery never reads), fires schedules, and does the history work
(:mod:`cyclone_mp.history`); each is a call of its own, so one that fails never costs a
sweep. docs/operating.md explains the turns and the history work.
"""

from __future__ import annotations

import logging
import os
import random
import socket
import threading
import time
from typing import Any, Callable, Collection, TypeVar

from . import decisions, schedules
from .config import HISTORY_BUSY_INTERVAL, HISTORY_INTERVAL, SWEEP_LIMIT, VACUUM_BOUND, VACUUM_WATCH_INTERVAL, Config
from .store.server import vacuum_hot_tables
from .dbloop import DatabaseThread
from .errors import DatabaseBusy, DatabaseError, DatabaseUnavailable
from .health import MaintenanceHealth
from .history import History, Policy, VacuumWatch
from .messages import Fleet, LeaseKey, Outcome, Poll
from .mux import Mux
from .store import Store
from .telemetry import NO_OBSERVER, Observer

#: Seconds between looks for a child that started a step since the registry row was last
#: written: its row is then written at once, so ``cyclone-mp workers`` never shows a child
#: idle for a whole ``registry_interval`` after it took a (wedged) step.
REGISTRY_SOON = 0.25
FAILED: Any = object()  # what Maintenance.attempt returns for a failed call
T = TypeVar("T")

log = logging.getLogger("cyclone_mp.supervisor")


class Sweeper:
    """One pass of the recovery sweep over a store (see the module docstring).

    Args:
        owner: the sweeping supervisor's id (written into the entries it settles).
        backoff_for: ``step name -> (attempt -> seconds)`` for rows storing no backoff.
        held: returns the ``(step id, lease generation)`` leases ``owner`` still holds
            (:meth:`cyclone_mp.leases.LeaseKeeper.held`). A pass never reclaims them: after
            an outage longer than ``lease_ttl`` they are expired, yet their keeper is about
            to renew them and their outcome writer may hold their outcomes. Their DB
            deadlines still apply.
    """

    def __init__(self, owner: str, backoff_for: Callable[[str | None], Callable[[int], float]],
                 written: Callable[[str | None, str], None] | None = None,
                 discarded: Callable[[dict[str, Any]], None] | None = None,
                 held: Callable[[], Collection[LeaseKey]] = tuple) -> None:
        self.owner = owner
        self.backoff_for = backoff_for
        self.held = held
        self.written = written  # told of each attempt a pass ends: (step name, error kind stored)
        self.discarded = discarded  # told of each step a pass discards (on_step_discarded)

    def run_once(self, store: Store) -> dict[str, int]:
        """Settle at most :data:`~cyclone_mp.config.SWEEP_LIMIT` candidates and fire due timers.

        Returns counts by action: ``timeout``, ``reclaim``, ``reclaim_limit``, ``none``
        (renewed, finished or gone meanwhile) and ``timers`` (runs whose timers fired).

        Raises:
            DatabaseError: the database failed (counts so far are lost with it; the
                next pass finds the same candidates).
        """
        counts = {"timeout": 0, "reclaim": 0, "reclaim_limit": 0, "none": 0, "timers": 0}
        for row in store.sweep.candidates(SWEEP_LIMIT, owner=self.owner, held=self.held()):
            expired = store.sweep.expire(row["id"], self.backoff_for, {"swept_by": self.owner})
            counts[expired.action] += 1
            if expired.ended is not None and self.written is not None:
                self.written(*expired.ended)
            if expired.discarded and self.discarded is not None:
                self.discarded(expired.discarded)
        counts["timers"] = store.sweep.fire_due_timers(SWEEP_LIMIT)
        store.sweep.succeeded("sweep")
        return counts


class Maintenance(DatabaseThread):
    """The sweep and the registry on their own thread and connection (see the module docstring).

    Args:
        dsn: PostgreSQL connection string.
        config: the supervisor's :class:`~cyclone_mp.config.Config`.
        sweeper: the :class:`Sweeper`.
        mux: the supervisor's steps and schedules (``mux.schedule``).
        owner: the supervisor's id.
        snapshot: returns the registry's ``info`` (plain data) as process control last
            published it.
        tell_control: posts a message to process control.
        started: set once process control runs (its children started): the first
            registry row waits for it, so it lists them.
        history: the history work (archive, retention); default one from the
            config's ``archive_after`` and ``retain_*``.
        vacuum_watch: the :class:`~cyclone_mp.history.VacuumWatch` (default: one that
            vacuums over a connection of its own to ``dsn``).
        clock: local monotonic clock in seconds.
    """

    def __init__(self, dsn: str, config: Config, *, sweeper: Sweeper, mux: Mux, owner: str,
                 snapshot: Callable[[], dict[str, Any]], tell_control: Callable[[Any], None],
                 started: threading.Event | None = None,
                 observer: Observer = NO_OBSERVER, history: History | None = None,
                 vacuum_watch: VacuumWatch | None = None, clock: Callable[[], float] = time.monotonic) -> None:
        super().__init__("maintenance", dsn, config, owner=owner, bound=config.write_bound, generic_plans=False,
                         clock=clock)
        self.config = config
        self.sweeper = sweeper
        self.mux = mux
        self.owner = owner
        self.snapshot = snapshot
        self.tell_control = tell_control
        self.started = started
        self.observer = observer
        now = clock()
        self.next_sweep = now
        self.next_schedules = now
        self.next_registry = now
        self.busy_written: frozenset[Any] = frozenset()  # pids of the children busy in the last row written
        self.next_depths = now if observer.queue_depth_interval is not None else None
        self.history = history if history is not None else History(Policy.from_config(config), clock=clock)
        # a random first pass: supervisors started together do not all try at once
        self.next_history = now + random.uniform(0.0, HISTORY_INTERVAL) if self.history.policy.active else None
        self.sweeping = False  # the last pass settled a full page: go on with this turn
        self.history_more = False  # the last history pass left work behind: go on with this turn
        self.vacuum_watch = vacuum_watch if vacuum_watch is not None else VacuumWatch(
            lambda: vacuum_hot_tables(dsn, pgbouncer=config.pgbouncer, application_name=f"cyclone_mp vacuum {owner}",
                                      statement_timeout=VACUUM_BOUND))
        self.next_vacuum_watch = now + random.uniform(0.0, VACUUM_WATCH_INTERVAL)
        self.health = MaintenanceHealth(clock, on_failure=observer.maintenance_failed)
        self.paused_queues: list[str] = []  # of the queues served, those paused (as of the last registry refresh)

    @property
    def sweep_every(self) -> float:
        """Seconds between two sweep passes across every supervisor of the database: the
        poll interval's maximum (default 1 s), whatever the number of supervisors."""
        return self.config.poll_interval[1]

    def turn(self, now: float) -> float:
        self.inbox.take()  # nothing is posted here: the inbox only wakes the thread
        lo, hi = self.config.poll_interval
        if self.db_ok and now >= self.next_sweep:
            self.next_sweep = self.sweep_tick(now)
        if self.db_ok and now >= self.next_schedules:
            self.next_schedules = now + random.uniform(lo, hi)
            self.fire_schedules()
        if self.db_ok and now >= self.next_registry:
            if self.started is not None and not self.started.is_set():
                self.next_registry = now + 0.05  # process control has not started its children yet
            else:
                self.next_registry = now + self.config.registry_interval
                self.register()
        elif self.db_ok and self.newly_busy():
            self.register()
        if self.db_ok and self.next_depths is not None and now >= self.next_depths:
            self.next_depths = now + (self.observer.queue_depth_interval or 5.0)
            self.read_queue_depths()
        if self.db_ok and self.next_history is not None and now >= self.next_history:
            self.next_history = self.history_tick(now)
        if self.db_ok and now >= self.next_vacuum_watch:
            self.next_vacuum_watch = now + VACUUM_WATCH_INTERVAL
            self.watch_vacuum()
        return min(self.next_sweep, self.next_registry, self.next_schedules, self.next_vacuum_watch,
                   now + REGISTRY_SOON, *(t for t in (self.next_depths, self.next_history) if t is not None))

    def attempt(self, task: str, fn: Callable[[Store], T]) -> T:
        """One bounded call of a maintenance task (``config.write_bound``); returns its
        value, or :data:`FAILED` when the database failed it. Every failure is recorded
        in :attr:`health` (which logs once when the task keeps failing, and once when it
        works again) and logged here only when it is the first of a run: a task that
        fails every turn never floods the log."""
        try:
            value = self.call(self.config.write_bound, fn)
        except DatabaseError as exc:
            outage = self.down(exc)  # an outage is logged (once) by down()
            first = self.health.failures(task) == 0
            (log.warning if first and not outage else log.debug)("%s: %s", task, exc)
            self.health.failed(task, exc)
            return FAILED
        self.health.succeeded(task)
        return value

    def watch_vacuum(self) -> None:
        """One look at the xmin horizon (:meth:`cyclone_mp.history.VacuumWatch.run_once`);
        a VACUUM it starts is counted as ``vacuums``."""
        if self.attempt("vacuum_watch", self.vacuum_watch.run_once) not in (FAILED, False, None):
            self.count("vacuums")

    def history_tick(self, now: float) -> float:
        """Do a history pass when it is this supervisor's turn (the task ``history`` of
        :meth:`take_turn`, every :data:`~cyclone_mp.config.HISTORY_INTERVAL` seconds for all
        supervisors), and return when to look again: a pass that left work behind (its
        budget ran out) goes on after :data:`~cyclone_mp.config.HISTORY_BUSY_INTERVAL`
        without asking again."""
        if not self.history_more:
            later = self.take_turn("history", HISTORY_INTERVAL, now, failed_at=now + HISTORY_INTERVAL)
            if later is not None:
                return later
        counts = self.keep_history()
        self.history_more = bool(counts.get("more"))
        return self.clock() + (HISTORY_BUSY_INTERVAL if self.history_more else HISTORY_INTERVAL)

    def keep_history(self) -> dict[str, int]:
        """One history pass now (:meth:`cyclone_mp.history.History.run_once`), counted as
        ``archived``, ``history_deleted``, ``partitions_dropped`` and ``expired``."""
        counts = self.attempt("history", self.history.run_once)
        if counts is FAILED:  # the next pass tries again
            return {}
        self.count("archived", counts["archived"])
        self.count("history_deleted", counts["deleted"])
        self.count("partitions_dropped", counts["partitions_dropped"])
        self.count("expired", counts["expired"] + counts["dropped_runs"])
        self.count("slots_deleted", counts.get("slots_deleted", 0))
        return counts

    def sweep_tick(self, now: float) -> float:
        """Sweep when it is this supervisor's turn (:meth:`take_turn`), and return when to
        look again (local monotonic seconds): when the turn another took ends, or one
        interval after this one's pass, with a little jitter (the poll interval's
        minimum) so that supervisors do not all ask at the same instant. A pass that
        settled a full page (:data:`~cyclone_mp.config.SWEEP_LIMIT` candidates or due
        timers: a mass expiry) goes on at once, without asking again: recovery is not
        held to one page per interval (others join in once the interval is over)."""
        lo, _ = self.config.poll_interval
        if not self.sweeping:  # failed_at: when the database fails the ask, look again within a poll interval
            later = self.take_turn("sweep", self.sweep_every, now, failed_at=now + random.uniform(lo, self.sweep_every))
            if later is not None:
                return later
        counts = self.sweep()
        settled = sum(counts.get(k, 0) for k in ("timeout", "reclaim", "reclaim_limit", "none"))
        self.sweeping = settled >= SWEEP_LIMIT or counts.get("timers", 0) >= SWEEP_LIMIT
        return now if self.sweeping else now + self.sweep_every + random.uniform(0, lo)

    def take_turn(self, task: str, every: float, now: float, *, failed_at: float) -> float | None:
        """Ask for the turn of a maintenance task (``"sweep"`` or ``"history"``, one
        supervisor's every ``every`` seconds: :meth:`cyclone_mp.store.Sweep.turn`).
        None when it is ours (do it now); else when to look again (local monotonic
        seconds): when the turn another supervisor took ends, plus a little jitter (the
        poll interval's minimum; counted as ``sweep_turns_skipped`` or
        ``history_turns_skipped``), or ``failed_at`` when the database failed."""
        turn = self.attempt(task, lambda store: store.sweep.turn(self.owner, every, task))
        if turn is FAILED:
            return failed_at
        if task == "sweep":
            self.health.sweep_seen(turn.since_success)
        if turn.mine:
            return None
        self.count(f"{task}_turns_skipped")
        # (a turn just taken, seen from an older snapshot: ask again soon)
        return now + max(turn.wait, 0.001) + random.uniform(0, self.config.poll_interval[0])

    def read_queue_depths(self) -> None:
        """Read how many steps wait in each queue served, and since when, for the metrics:
        one bounded statement every ``observer.queue_depth_interval`` seconds, whatever the
        scrape rate (counted as ``queue_depth_reads``)."""
        rows = self.attempt("queue_depths", lambda store: store.registry.queue_depths(self.config.queues))
        if rows is FAILED:
            return
        self.count("queue_depth_reads")
        self.observer.queue_depths(rows)

    def sweep(self) -> dict[str, int]:
        """One sweep pass now (counted in this part's stats)."""
        counts = self.attempt("sweep", self.sweeper.run_once)
        if counts is FAILED:
            return {}
        if counts["reclaim"] or counts["timeout"] or counts["timers"]:
            self.tell_control(Poll())  # something may be claimable now: do not wait a poll
        self.count("sweeps")
        self.count("reclaimed", counts["reclaim"])
        self.count("swept_timeouts", counts["timeout"])
        self.count("reclaim_limits", counts["reclaim_limit"])
        return counts

    def fire_schedules(self) -> int:
        """Enqueue the due slots of the mux's schedules now (one transaction, bounded as a
        sweep is); returns how many runs it enqueued (counted as ``scheduled``)."""
        if not self.mux.schedules:
            return 0
        counts = self.attempt("schedules", lambda store: schedules.run_once(store, self.mux, self.config))
        if counts is FAILED:  # the next tick tries again
            return 0
        self.count("scheduled", counts["enqueued"])
        if counts["enqueued"]:
            self.tell_control(Poll())  # the runs may be ours to claim: do not wait a poll
        return counts["enqueued"]

    @staticmethod
    def _busy(info: dict[str, Any]) -> frozenset[Any]:
        return frozenset(kid.get("pid") for kid in info.get("children") or () if kid.get("run_id") is not None)

    def newly_busy(self) -> bool:
        """True when a child runs a step in process control's snapshot that was idle (or
        not there) in the last registry row written."""
        return not self._busy(self.snapshot()) <= self.busy_written

    def register(self) -> None:
        """Refresh this supervisor's registry row and tell process control how
        many supervisors are live (:class:`~cyclone_mp.messages.Fleet`)."""
        info = {**self.snapshot(), "maintenance": self.health.snapshot(), "paused_queues": self.paused_queues}
        self.busy_written = self._busy(info)
        live_within = max(5.0, 3 * self.config.registry_interval)  # a row missed twice still counts
        got = self.attempt("registry", lambda store: store.registry.register(
            id=self.owner, hostname=socket.gethostname(), pid=os.getpid(), info=info, live=live_within,
            queues=self.config.queues))
        if got is FAILED:
            return
        live, self.paused_queues = got
        self.observer.queues_paused(self.config.queues, self.paused_queues)
        self.tell_control(Fleet(live))  # its share of the fleet's prefetch (ProcessControl.prefetch_share)

    def finish(self) -> None:
        """Remove the registry row (best effort, bounded)."""
        if not self.db_ok:
            return
        try:
            self.call(0.5, lambda store: store.registry.unregister(self.owner))
        except DatabaseError:
            pass
