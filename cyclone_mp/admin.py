"""The sync client's reads and operator actions on runs, queues and schedules (SPEC 6):
:class:`RunAdmin`, the layer of :class:`~cyclone_mp.Client` between its planning
(:class:`~cyclone_mp.planning.ClientBase`) and its connections. Each method plans its
operation (:mod:`cyclone_mp.store.operations`) and runs it with ``self._run``.
"""

from __future__ import annotations

from typing import Any, Callable, Iterable

from .durations import Duration
from .errors import InvalidTransition
from .filters import When
from .planning import ClientBase
from .schedules import ACTIVE_WITHIN
from .status import RunStatus, StepStatus
from .steps import check_name
from .store import Store, operations
from .store.operations import Op


class RunAdmin(ClientBase):
    """Reads and operator actions of :class:`~cyclone_mp.Client` (see there)."""

    def _run(self, plan: Callable[[], Op], within: float | None = None) -> Any:  # pragma: no cover - Client's
        raise NotImplementedError

    def _call(self, fn: Callable[[Store], Any], within: float | None = None) -> Any:  # pragma: no cover - Client's
        raise NotImplementedError

    def status(self, run_id: str) -> RunStatus:
        """The run and each of its steps, as the database has them.

        Raises:
            RunNotFound: no run has that id.
        """
        return RunStatus.from_rows(*self._run(lambda: operations.get_run(run_id)))

    def map_items(self, run_id: str, node: str, *, state: str | Iterable[str] | None = None, after: int = -1,
                  limit: int = 100) -> list[StepStatus]:
        """The items of map node ``node`` (``wf.map``) in item order, a page at a time:
        those after item index ``after`` (-1: from the first), at most ``limit`` (up to
        10,000), in ``state`` (a state or several) when given. Each is a
        :class:`StepStatus` with ``kind="item"`` and ``item`` its index; pass the last
        one's ``item`` as ``after`` for the next page.

        Raises:
            RunNotFound: no run has that id. ConfigurationError: a bad argument.
        """
        plan = self._plan_map_items(run_id, node, state, after, limit)
        return [StepStatus.from_row(row) for row in self._run(plan)]

    def schedules(self) -> list[dict[str, Any]]:
        """Every schedule the supervisors have defined (``mux.schedule``): ``name``,
        ``target`` and ``spec`` (of the definition that decided it last), ``next_at`` (the
        next slot, database clock), ``last_slot``, ``last_run_id``, ``runs``, ``skipped``,
        ``seen_at``, ``active`` (a live supervisor defines it: seen within the last
        minute) and ``definitions``: the definitions live supervisors declare (two during
        a rolling deploy that changed it), each with ``fingerprint``, ``target``, ``spec``,
        ``first_seen_at``, ``seen_at`` and ``in_force``, the one in force first."""
        rows = self._call(lambda store: store.schedules.list_all(ACTIVE_WITHIN))
        return [{**row, "active": row["age"] is not None and row["age"] < ACTIVE_WITHIN} for row in rows]

    def delete_schedule(self, name: str) -> None:
        """Forget a schedule's row (one no supervisor defines any more: a renamed or removed
        ``mux.schedule``). The runs it enqueued stay.

        Raises:
            LookupError: no schedule has that name.
            InvalidTransition: it is active (a supervisor ticked it within the last
                minute): it would be made again; remove it from the mux first.
        """
        row = self._call(lambda store: store.schedules.delete(name, ACTIVE_WITHIN))
        if row is None:
            raise LookupError(f"no schedule named {name!r}")
        if not row["deleted"]:
            raise InvalidTransition(
                f"schedule {name!r} is active (a supervisor ticked it {row['age']:.0f}s ago) and would be made "
                "again: remove it from the app's mux and restart its supervisors, then delete it")

    def cancel(self, run_id: str) -> int:
        """Cancel the run and all its non-terminal steps in one transaction (seed).

        An in-flight handler learns of it on its next heartbeat and is killed after
        ``kill_grace``. Returns how many steps were cancelled.

        Raises:
            RunNotFound: no run has that id.
            InvalidTransition: the run is already completed, discarded or cancelled.
        """
        return self._run(lambda: operations.cancel_run(run_id))

    def retry(self, run_id: str) -> int:
        """Reopen the run's discarded steps, or the step of a cancelled single-step run
        (``max_attempts`` raised, no attempt consumed).

        Returns how many steps were reopened.

        Raises:
            RunNotFound: no run has that id.
            InvalidTransition: the run has no discarded (or cancelled single) step.
        """
        return self._run(lambda: operations.retry_run(run_id))

    def pause(self, run_id: str) -> int:
        """Pause a run: waiting steps become paused, running ones finish (SPEC 6).

        Returns how many steps were paused.

        Raises:
            RunNotFound: no run has that id.
            InvalidTransition: the run is not running.
        """
        return self._run(lambda: operations.pause_run(run_id))

    def resume(self, run_id: str) -> int:
        """Resume a paused run: each step returns to the state it was paused from (SPEC 6).

        Returns how many steps were restored.

        Raises:
            RunNotFound: no run has that id.
            InvalidTransition: the run is not paused.
        """
        return self._run(lambda: operations.resume_run(run_id))

    def pause_queue(self, queue: str, reason: str | None = None) -> bool:
        """Pause a queue: from the moment this returns no supervisor claims a step of it
        (every claim looks); steps already running finish, held ones that had been claimed
        start. Returns True when it was not paused yet. ``reason`` is shown by
        ``cyclone-mp queue list`` and ``workers``.

        Raises:
            ConfigurationError: ``queue`` is not a valid queue name.
            DatabaseError: the database failed.
        """
        check_name(queue, "queue")
        return self._run(lambda: operations.pause_queue(queue, reason))

    def resume_queue(self, queue: str) -> bool:
        """Resume a paused queue: its supervisors are woken and claim its steps at once.
        Returns True when it was paused."""
        check_name(queue, "queue")
        return self._run(lambda: operations.resume_queue(queue))

    def paused_queues(self) -> list[dict[str, Any]]:
        """The paused queues: ``{"queue", "paused_at", "reason"}`` each, oldest first."""
        return self._run(operations.paused_queues)

    def signal(self, run_id: str, name: str, payload: Any = None) -> bool:
        """Send signal ``name``; the first one per name is kept (returns False for a repeat).

        A signal sent before its node is reached is kept and used when it is (SPEC 6).

        Raises:
            RunNotFound: no run has that id.
            PayloadError: the payload is not a JSON value PostgreSQL can store, or is
                over a limit (see :func:`~cyclone_mp.protocol.check_value`).
            ConfigurationError: an invalid signal name.
        """
        return self._run(self._plan_signal(run_id, name, payload))

    def runs(self, state: str | Iterable[str] | None = None, limit: int = 50, *, step: str | None = None,
             queue: str | None = None, key: str | None = None, schedule: str | None = None,
             since: When | None = None, until: When | None = None, archived: bool = False) -> list[dict[str, Any]]:
        """Recent runs, newest first, at most ``limit``: dicts of ``id``, ``name``, ``kind``,
        ``state``, ``created_at``, ``finished_at``, ``steps`` (how many), ``key`` (the
        concurrency keys of its steps), ``waiting_on`` (the limit that holds one of its
        steps back), ``schedule`` (the schedule that enqueued it) and ``archived``.

        Every filter is optional: ``state`` (one state or several); ``step``, ``queue``
        and ``key``: a step of the run has that step name, queue and concurrency key (one
        step matching all those given); ``schedule``: the schedule that enqueued it;
        ``since`` and ``until``: it was created in that window, each an aware datetime
        or a duration before now on the database clock (seconds, a timedelta, or text
        such as ``"10m"``). Finished runs move to the archive ``archive_after`` (10
        minutes) after they finish: ``archived=True`` lists those too.

        Raises:
            ConfigurationError: an unknown state, an empty name, a naive datetime, a
                negative duration, a limit below 1.
            DatabaseError: the database failed or cannot be reached.
        """
        return self._run(self._plan_runs(state, limit, archived, dict(
            step=step, queue=queue, key=key, schedule=schedule, since=since, until=until)))

    def prune(self, older_than: Duration, *, state: str | Iterable[str] | None = None, step: str | None = None,
              queue: str | None = None, key: str | None = None, schedule: str | None = None,
              since: When | None = None, until: When | None = None) -> int:
        """Delete runs that finished (completed, discarded or cancelled) more than
        ``older_than`` seconds ago, with their steps, hot or archived; returns how many
        runs were deleted. The filters of :meth:`runs` narrow which (``state``: of the
        finished states).

        Running and paused runs are never touched. Deletes in batches, and, unless a
        filter besides ``state`` is given, drops whole archive partitions whose day is
        older, so it is safe to run while supervisors work. The supervisors apply a
        retention by themselves with ``retain_completed`` and friends.

        Raises:
            ConfigurationError: ``older_than`` is negative, or a filter is invalid (a
                state that is not a finished one).
            DatabaseBusy: an archive partition's lock could not be had within 5 s.
            DatabaseError: the database failed or cannot be reached.
        """
        return self._run(self._plan_prune(older_than, state, dict(
            step=step, queue=queue, key=key, schedule=schedule, since=since, until=until)))

    def workers(self, within: float = 15.0) -> list[dict[str, Any]]:
        """Live supervisors (refreshed within ``within`` seconds) and their children."""
        return self._run(lambda: operations.list_workers(within))

    def unserved_steps(self, status: RunStatus, within: float = 15.0) -> list[StepStatus]:
        """The run's unfinished task steps that no live supervisor would claim: none of
        the supervisors seen within ``within`` seconds (the ``cyclone_workers`` registry)
        claims from the step's queue, or (when its registry row lists the step names it
        runs) runs the step, or it is draining. ``enqueue --wait`` warns about them at
        once instead of waiting in silence. Empty when every step is served.

        Raises:
            DatabaseError: the database failed or cannot be reached.
        """
        return self._unserved(status, self.workers(within))
