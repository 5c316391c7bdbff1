"""History that stays small: finished runs leave the hot tables, retention deletes them,
and the hot tables are vacuumed as soon as a long transaction ends (:class:`VacuumWatch`).

A run finished more than ``archive_after`` seconds ago moves, with its steps and signals,
to ``cyclone_runs_archive`` and ``cyclone_steps_archive``, so the tables the claim, the
renewals and the completions touch hold the live work. The archive is partitioned by
(state, UTC day of ``finished_at``): a partition whose whole day is past its state's
``retain_*`` is dropped (no row deleted, no bloat); rows are deleted only in the partition
the cut-off falls in, and in the hot tables when a retention is shorter than
``archive_after``.

:class:`History` is maintenance work (STYLE pattern 4: :meth:`~History.run_once` returns
counts), bounded per pass (:data:`~cyclone_mp.config.HISTORY_BUDGET` seconds, batches of
:data:`~cyclone_mp.config.HISTORY_BATCH` rows, DDL lock waits capped) and one supervisor's
at a time (a transaction-level advisory lock), so no sweep waits for it. See
docs/operating.md ("History and retention").
"""

from __future__ import annotations

import dataclasses
import datetime as dt
import logging
import threading
import time
from typing import Any, Callable


from .store import operations
from .config import (
    HISTORY_BATCH, HISTORY_BUDGET, HISTORY_DDL_LOCK_TIMEOUT, HISTORY_WALK_RESTART, VACUUM_HELD_FOR, VACUUM_MIN_DEAD,
    Config,
)
from .connections import no_partition
from .errors import DatabaseBusy, DatabaseError
from .store.operations import FINISHED_STATES, day_end
from .store import Store, to_us

log = logging.getLogger("cyclone_mp.supervisor")

#: The cursor's start: before every finished step.
WALK_START = dt.datetime(1, 1, 1, tzinfo=dt.timezone.utc)


@dataclasses.dataclass(frozen=True)
class Policy:
    """When finished runs leave the hot tables and when they are deleted (seconds; None:
    never). ``retain`` maps each finished state to its retention."""

    archive_after: float | None
    retain: dict[str, float | None]

    @classmethod
    def from_config(cls, config: Config) -> "Policy":
        """The policy of a supervisor's :class:`~cyclone_mp.config.Config`."""
        return cls(config.archive_after, dict(config.retention))

    def move_after(self, state: str) -> float | None:
        """Seconds after which a run finished in ``state`` leaves the hot tables (archived,
        or deleted when its retention is that short), or None: it stays."""
        ages = [a for a in (self.archive_after, self.retain.get(state)) if a is not None]
        return min(ages) if ages else None

    def archives(self, state: str) -> bool:
        """True when runs finished in ``state`` are kept in the archive for a while."""
        keep = self.retain.get(state)
        return self.archive_after is not None and (keep is None or keep > self.archive_after)

    @property
    def active(self) -> bool:
        """True when runs of some finished state ever leave the hot tables."""
        return any(self.move_after(s) is not None for s in FINISHED_STATES)

    def params(self, after: dt.datetime, inclusive: bool, limit: int) -> dict[str, Any]:
        """The parameters of ``archive_runs`` and ``archive_days`` (sql/history.sql)."""
        moves = [self.move_after(s) for s in FINISHED_STATES]
        return {
            "states": list(FINISHED_STATES),
            "move_us": [to_us(m) for m in moves],
            "drop_us": [to_us(self.retain.get(s)) for s in FINISHED_STATES],
            "scan_us": to_us(min(m for m in moves if m is not None)),
            "after": after, "inclusive": inclusive, "limit": limit,
        }

    def droppable(self, partitions: set[tuple[str, dt.date]], now: dt.datetime) -> list[tuple[str, dt.date]]:
        """The archive partitions whose whole day is past their state's retention at ``now``."""
        out = []
        for state, day in sorted(partitions, key=lambda p: (p[1], p[0])):
            keep = self.retain.get(state)
            if keep is not None and day_end(day) <= now - dt.timedelta(seconds=keep):
                out.append((state, day))
        return out


def missing_partition(exc: DatabaseError) -> bool:
    """True when ``exc`` is an insert into the archive that found no partition for a row."""
    return no_partition(exc)


class History:
    """One supervisor's history work.

    Candidates are found through ``cyclone_steps_finished_idx`` (steps by
    ``finished_at``): ``cyclone_runs`` keeps no index on ``finished_at``, so that a run's
    completion stays a HOT update. A pass walks that index with a cursor, so the finished
    steps of runs still going (a workflow's first nodes) are looked at once per walk, not
    once per batch; a walk that reached the present goes on from there at the next pass,
    and starts again from the oldest finished step only every ``restart_every`` seconds
    (for the runs it passed over: one locked by an operator, one not old enough yet).
    Behind a long transaction every step archived since it began is still in that index:
    walking it from the start at every pass would scan all of them every few seconds,
    just when the database has the least to spare.

    Args:
        policy: when runs leave the hot tables and when they are deleted.
        batch: finished step rows one statement looks at, at most.
        budget: seconds of work per :meth:`run_once`, at most (checked between batches).
        ddl_lock_timeout: seconds a partition's CREATE or DROP may wait for its lock.
        restart_every: seconds between two walks from the oldest finished step.
        clock: local monotonic clock in seconds.
    """

    def __init__(self, policy: Policy, *, batch: int = HISTORY_BATCH, budget: float = HISTORY_BUDGET,
                 ddl_lock_timeout: float = HISTORY_DDL_LOCK_TIMEOUT, restart_every: float = HISTORY_WALK_RESTART,
                 clock: Callable[[], float] = time.monotonic) -> None:
        self.policy = policy
        self.batch = batch
        self.budget = budget
        self.ddl_lock_timeout = ddl_lock_timeout
        self.restart_every = restart_every
        self.clock = clock
        #: where the walk over finished steps goes on: (finished_at, look at that instant again)
        self.cursor: tuple[dt.datetime, bool] = (WALK_START, True)
        self.walk_started = clock()  # when the walk last started from WALK_START (local monotonic)
        self.caught_up = False  # the walk reached the present (it may start again from WALK_START)

    def run_once(self, store: Store) -> dict[str, int]:
        """One pass: make the archive partitions needed, move or delete the runs whose time
        has come (batches), then apply retention to the archive (partitions dropped,
        rows deleted in the partitions a cut-off falls in).

        Returns counts: ``archived`` and ``deleted`` (runs moved to the archive, and runs
        deleted from the hot tables), ``partitions_made``, ``partitions_dropped``,
        ``dropped_runs`` (runs those partitions held), ``expired`` (archived runs deleted
        row by row), ``batches`` (statements that moved or deleted), ``busy`` (1: another
        supervisor was doing history work, this pass stopped) and ``more`` (1: the budget
        ran out with work left; the next pass comes sooner), ``slots_deleted`` (slot rows
        of limited groups none of whose steps waits or runs any more).

        Raises:
            DatabaseError: the database failed (what was committed stays done; the next
                pass goes on from there).
        """
        counts = dict.fromkeys(("archived", "deleted", "partitions_made", "partitions_dropped", "dropped_runs",
                                "expired", "batches", "busy", "more", "slots_deleted"), 0)
        if not self.policy.active:
            return counts
        deadline = self.clock() + self.budget
        now, partitions = store.run(operations.read_archive_partitions())
        today = now.astimezone(dt.timezone.utc).date()
        ahead = {(s, d) for s in FINISHED_STATES if self.policy.archives(s)
                 for d in (today, today + dt.timedelta(days=1))}
        if not self._make(store, ahead - partitions, partitions, counts):
            return counts
        if not self._move(store, partitions, deadline, counts):
            return counts
        self._retain(store, partitions, now, deadline, counts)
        if self.clock() < deadline:  # the slot rows of limited groups that are over (a bounded share)
            counts["slots_deleted"] = store.run(operations.delete_idle_slots(batch=HISTORY_BATCH,
                                                                             budget=10 * HISTORY_BATCH))
        return counts

    # -- the parts -----------------------------------------------------------------------------

    def _make(self, store: Store, days: set[tuple[str, dt.date]], partitions: set[tuple[str, dt.date]],
              counts: dict[str, int]) -> bool:
        """Make the partitions of ``days``; False when the pass must stop (busy)."""
        if not days:
            return True
        try:
            made = store.run(operations.make_archive_partitions(sorted(days), lock_timeout=self.ddl_lock_timeout))
        except DatabaseBusy as exc:  # a reader of the archive held its lock: next pass
            log.info("history: archive partitions not made now (%s); trying again at the next pass", exc)
            counts["more"] = 1
            return False
        if made is None:
            counts["busy"] = 1
            return False
        counts["partitions_made"] += made
        partitions |= days
        return True

    def _move(self, store: Store, partitions: set[tuple[str, dt.date]], deadline: float,
              counts: dict[str, int]) -> bool:
        """Batches of archive_runs until the walk reaches the present or the budget runs
        out; False when the pass must stop."""
        if self.caught_up and self.clock() - self.walk_started >= self.restart_every:
            self.cursor, self.walk_started = (WALK_START, True), self.clock()
        while True:
            after, inclusive = self.cursor
            params = self.policy.params(after, inclusive, self.batch)
            try:
                row = store.run(operations.archive_batch(params))
            except DatabaseError as exc:
                if not missing_partition(exc):
                    raise
                needed = store.run(operations.archive_days(params)) - partitions
                if not self._make(store, needed, partitions, counts):
                    return False
                row = store.run(operations.archive_batch(params))
            if row is None:
                counts["busy"] = 1
                return False
            counts["archived"] += row["archived"]
            counts["deleted"] += row["deleted"]
            counts["batches"] += bool(row["archived"] or row["deleted"])
            self.caught_up = row["scanned"] < self.batch
            if self.caught_up:  # the walk reached the present: the next pass goes on from here
                if row["last"] is not None:
                    self.cursor = (row["last"], True)
                return True
            # go on after the last row looked at (again at that instant, unless every row
            # of the batch shared it: then past it, and the next walk picks up the rest)
            self.cursor = (row["last"], row["first"] != row["last"])
            if self.clock() >= deadline:
                counts["more"] = 1
                return True

    def _retain(self, store: Store, partitions: set[tuple[str, dt.date]], now: dt.datetime, deadline: float,
                counts: dict[str, int]) -> None:
        """Drop the partitions past their retention, then delete the archived rows past it
        in the partitions a cut-off falls in (batches), within the budget."""
        for state, day in self.policy.droppable(partitions, now):
            if self.clock() >= deadline:
                counts["more"] = 1
                return
            try:
                runs = store.run(operations.drop_archive_partition(state, day, lock_timeout=self.ddl_lock_timeout))
            except DatabaseBusy as exc:
                log.info("history: archive partition %s %s not dropped now (%s); trying again at the next pass",
                         state, day, exc)
                counts["more"] = 1
                return
            if runs is None:
                counts["busy"] = 1
                return
            partitions.discard((state, day))
            counts["partitions_dropped"] += 1
            counts["dropped_runs"] += runs
        for state in FINISHED_STATES:
            keep = self.policy.retain.get(state)
            if keep is None or not any(s == state for s, _ in partitions):
                continue
            while True:
                if self.clock() >= deadline:
                    counts["more"] = 1
                    return
                row = store.run(operations.retain_archived(state, keep, self.batch))
                if row is None:
                    counts["busy"] = 1
                    return
                counts["expired"] += row["runs"]
                if row["runs"] < self.batch:
                    break


class VacuumWatch:
    """Vacuum the hot tables as soon as a long transaction ends.

    While any transaction of the cluster stays open, no row version newer than it can be
    removed: every claim, completion and archived run leaves dead versions in
    ``cyclone_steps`` and its indexes, and each claim walks past more of them (the claim
    index is in queue order, and the steps claimed during the hold come first). Once it
    ends, autovacuum cleans up at its next round for the database, up to
    ``autovacuum_naptime`` (60 s by default) later, and throttled; until then every claim
    still reads the dead part of the index. This watch looks every
    :data:`~cyclone_mp.config.VACUUM_WATCH_INTERVAL` seconds at the oldest transaction id
    still running (``xmin`` of a fresh snapshot): when the same one was the oldest for at
    least ``held_for`` seconds and then ends, with at least ``min_dead`` dead versions in
    the hot tables, it runs ``VACUUM cyclone_steps, cyclone_runs`` at once, on a thread and
    a connection of its own (:func:`cyclone_mp.store.server.vacuum_hot_tables`: one supervisor at
    a time; an autovacuum worker in its way, started while the transaction was still open
    and unable to remove anything, is cancelled by the server).

    A snapshot without a transaction id (a long read-only query) holds vacuum back too but
    has no id to watch; autovacuum cleans up after it as usual.

    Args:
        vacuum: runs the VACUUM; returns the seconds it took, or None when another
            supervisor was doing it. Raises DatabaseError.
        held_for: seconds the same oldest transaction must stay open to count as holding
            vacuum back.
        min_dead: dead row versions in the hot tables worth a VACUUM.
        clock: local monotonic clock in seconds.
    """

    def __init__(self, vacuum: Callable[[], float | None], *, held_for: float = VACUUM_HELD_FOR,
                 min_dead: int = VACUUM_MIN_DEAD, clock: Callable[[], float] = time.monotonic) -> None:
        self.vacuum = vacuum
        self.held_for = held_for
        self.min_dead = min_dead
        self.clock = clock
        self.oldest: int | None = None  # the oldest transaction id still running, as last seen
        self.since = 0.0  # when it was first seen the oldest (local monotonic)
        self.thread: threading.Thread | None = None
        self.done: list[float | None] = []  # what each VACUUM returned (seconds, or None: another did it)
        self.failed = 0

    @property
    def held(self) -> bool:
        """True while the oldest transaction seen has been the oldest for ``held_for`` seconds."""
        return self.oldest is not None and self.clock() - self.since >= self.held_for

    def decide(self, xmin: int, dead: int) -> bool:
        """Pure but for the clock: given the oldest transaction id still running (``xmin``)
        and the hot tables' ``dead`` versions now, whether to vacuum them now (the
        transaction that held vacuum back ended)."""
        if xmin == self.oldest:
            return False
        ended = self.held
        self.oldest, self.since = xmin, self.clock()
        return ended and dead >= self.min_dead

    def run_once(self, store: Store) -> bool:
        """Look at the horizon; start the VACUUM (on its own thread) when :meth:`decide`
        says so and none is running. Returns True when one was started.

        Raises:
            DatabaseError: the look failed.
        """
        row = store.run(operations.xmin_horizon())
        if not self.decide(int(row["xmin"]), int(row["dead"])):
            return False
        if self.thread is not None and self.thread.is_alive():
            return False
        self.thread = threading.Thread(target=self._vacuum, name="cyclone-vacuum", daemon=True)
        self.thread.start()
        return True

    def _vacuum(self) -> None:
        try:
            took = self.vacuum()
        except DatabaseError as exc:
            self.failed += 1
            log.warning("vacuum of the hot tables after a long transaction: %s", exc)
            return
        self.done.append(took)
        if took is not None:
            log.info("vacuumed the hot tables after a long transaction ended (%.1fs)", took)
