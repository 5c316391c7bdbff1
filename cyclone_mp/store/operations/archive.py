"""Operations of history (:mod:`.core` explains operations): finished runs moved to the
archive's daily partitions, partitions made and dropped, retention, and the registry
of live supervisors.
"""

from __future__ import annotations

import datetime as dt
from typing import Any, Sequence

from ...filters import RunFilter
from ...noderows import to_us
from ...status import TERMINAL_RUN_STATES
from .core import Steps, operation, q
from .enqueue import delete_idle_slots

# -- history: the archive and retention ------------------------------------------------------------

FINISHED_STATES = TERMINAL_RUN_STATES  # a finished run's (and its steps') states, the archive's partitions
HISTORY_LOCK = 0x63796869737479  # "cyhisty": pg_try_advisory_xact_lock key of history work


def day_end(day: dt.date) -> dt.datetime:
    """The end of a UTC day (the upper bound of its archive partitions)."""
    return dt.datetime.combine(day, dt.time(), dt.timezone.utc) + dt.timedelta(days=1)


def archive_partitions() -> Steps[tuple[dt.datetime, set[tuple[str, dt.date]]]]:
    """The database clock and the archive's partitions as ``(state, UTC day)``."""
    rows = (yield q("archive_partitions")).rows
    return rows[0]["now"], {(r["state"], r["day"]) for r in rows if r["state"] is not None}


@operation(transaction=False)
def xmin_horizon() -> Steps[dict[str, Any]]:
    """``{"xmin", "dead"}``: the oldest transaction id still running, and the hot tables'
    dead row versions (see :class:`cyclone_mp.history.VacuumWatch`)."""
    return (yield q("xmin_horizon")).one()


@operation(transaction=False)
def read_archive_partitions() -> Steps[tuple[dt.datetime, set[tuple[str, dt.date]]]]:
    """:func:`archive_partitions` as an operation of its own."""
    return (yield from archive_partitions())


def _history_lock() -> Steps[bool]:
    """Take the history lock for this transaction; False when another supervisor holds it."""
    return bool((yield q("history_lock", {"key": HISTORY_LOCK})).one()["got"])


@operation(transaction=True)
def archive_batch(params: dict[str, Any]) -> Steps[dict[str, Any] | None]:
    """One history batch (``archive_runs``, params from
    :meth:`cyclone_mp.history.Policy.params`); None when another supervisor holds the
    history lock.

    Raises:
        DatabaseError: its cause a ``CheckViolation`` when an archive partition it needs is
            missing (see :func:`archive_days`).
    """
    if not (yield from _history_lock()):
        return None
    return (yield q("archive_runs", params)).one()


@operation(transaction=False)
def archive_days(params: dict[str, Any]) -> Steps[set[tuple[str, dt.date]]]:
    """The ``(state, UTC day)`` partitions :func:`archive_batch` with ``params`` would need."""
    return {(r["state"], r["day"]) for r in (yield q("archive_days", params)).rows}


@operation(transaction=True)
def make_archive_partitions(days: Sequence[tuple[str, dt.date]], *, lock_timeout: float) -> Steps[int | None]:
    """Make the missing archive partitions of ``days`` (``(state, UTC day)``), in one
    transaction whose DDL waits at most ``lock_timeout`` seconds for each lock; returns
    how many were made, or None when another supervisor holds the history lock.

    Raises:
        DatabaseBusy: a lock could not be had in time (nothing was made).
    """
    if not (yield from _history_lock()):
        return None
    made = 0
    for state, day in sorted(days):
        made += bool((yield q("make_archive_partition", {"state": state, "day": day,
                                                          "lock_timeout": f"{int(lock_timeout * 1000)}ms"})).one()["made"])
    return made


@operation(transaction=True)
def drop_archive_partition(state: str, day: dt.date, *, lock_timeout: float) -> Steps[int | None]:
    """Drop the archive partitions of ``(state, day)``; returns how many runs they held, or
    None when another supervisor holds the history lock.

    Raises:
        DatabaseBusy: the lock could not be had within ``lock_timeout`` seconds.
    """
    if not (yield from _history_lock()):
        return None
    return (yield from _drop_partition(state, day, lock_timeout))


def _drop_partition(state: str, day: dt.date, lock_timeout: float) -> Steps[int]:
    """``DROP`` the archive partitions of ``(state, day)``; how many runs they held."""
    return (yield q("drop_archive_partition", {"state": state, "day": day,
                                               "lock_timeout": f"{int(lock_timeout * 1000)}ms"})).one()["runs"]


@operation(transaction=True)
def retain_archived(state: str, older_than: float, limit: int) -> Steps[dict[str, Any] | None]:
    """Delete up to ``limit`` archived runs of ``state`` finished more than ``older_than``
    seconds ago, with their steps; returns ``{"runs", "steps"}`` deleted, or None when
    another supervisor holds the history lock."""
    if not (yield from _history_lock()):
        return None
    return (yield from _retain(state, older_than, limit))


def _retain(state: str, older_than: float, limit: int) -> Steps[dict[str, Any]]:
    """Delete up to ``limit`` archived runs of ``state`` older than ``older_than`` seconds."""
    return (yield q("retain_archived", {"state": state, "drop_us": to_us(older_than), "limit": limit})).one()


@operation(transaction=False)
def list_workers(within: float = 15.0) -> Steps[list[dict[str, Any]]]:
    """Supervisors that refreshed their row within ``within`` seconds."""
    return (yield q("list_workers", {"within_us": to_us(within)})).rows


@operation(transaction=False)
def delete_runs(run_ids: Sequence[str]) -> Steps[int]:
    """Delete these runs, whatever their state, with their steps and signals; returns how
    many were deleted (the demo's clean-up: its runs ran in a queue of its own)."""
    return (yield q("delete_runs", {"ids": list(run_ids)})).rowcount



@operation(transaction=False)
def prune(*, older_than: float, batch: int = 1000, lock_timeout: float = 5.0,
          filters: RunFilter = RunFilter()) -> Steps[int]:
    """Delete finished runs (completed, discarded, cancelled) that finished more than
    ``older_than`` seconds ago and match ``filters``, hot or archived: ``batch`` per
    statement (each its own transaction). Archived runs go by whole archive partitions (one
    UTC day of one state, a DROP that waits at most ``lock_timeout`` seconds for its lock)
    when every run of theirs is that old and no filter but the states narrows the choice,
    else row by row. Returns how many runs were deleted.

    Raises:
        DatabaseBusy: a partition's lock could not be had in time (nothing of it was lost).
    """
    params = {**filters.params(), "older_us": to_us(older_than), "limit": batch}
    total = 0
    while True:
        deleted = (yield q("prune_runs", params, prepare=False)).rowcount
        total += deleted
        if deleted < batch:
            break
    states = [s for s in FINISHED_STATES if filters.states is None or s in filters.states]
    if filters.narrows:
        while True:
            row = (yield q("prune_archived", params, prepare=False)).one()
            total += row["runs"]
            if row["runs"] < batch:
                break
    else:
        now, partitions = yield from archive_partitions()
        cutoff = now - dt.timedelta(seconds=older_than)
        for state, day in sorted(partitions):
            if state in states and day_end(day) <= cutoff:
                total += yield from _drop_partition(state, day, lock_timeout)
        for state in states:
            while True:
                row = yield from _retain(state, older_than, batch)
                total += row["runs"]
                if row["runs"] < batch:
                    break
    yield from delete_idle_slots(batch=batch)  # the groups whose last steps went
    return total
