"""What the supervisor's parts report as it happens, for metrics and traces.

The parts call an :class:`Observer` at the events they already handle: the lease keeper
and the outcome writer when they claim, the writer and maintenance when an attempt's end
is written (what the database now holds), process control when an attempt ends in its
child and when it kills one, the lease keeper when it renews, maintenance when it reads
the queues. The default observer does nothing; :class:`~cyclone_mp.metrics.Metrics`
(Prometheus) and :class:`~cyclone_mp.tracing.Tracer` (OpenTelemetry) listen. No event
costs a database call of its own.

Every method is called from a part's thread (several at once): an observer must be
thread-safe, cheap, and must never raise (:class:`Observers` guards each call).
:class:`Stats` sums the parts' own counters.
"""

from __future__ import annotations

import dataclasses
import logging
from collections.abc import Mapping
from typing import Any, Callable, Iterator, Sequence

log = logging.getLogger("cyclone_mp.supervisor")


@dataclasses.dataclass(frozen=True)
class Probes:
    """What the supervisor lets an observer read at any time (from any thread; cheap):
    ``children_alive()`` its live child processes; ``last_sweep_age()`` seconds since the
    fleet's last successful recovery sweep (None: unknown); ``live()`` and ``ready()``
    ``(ok, reason)`` for ``/healthz`` and ``/readyz`` (:mod:`cyclone_mp.health`)."""

    children_alive: Callable[[], int] = lambda: 0
    last_sweep_age: Callable[[], "float | None"] = lambda: None
    live: Callable[[], tuple[bool, str]] = lambda: (True, "ok")
    ready: Callable[[], tuple[bool, str]] = lambda: (True, "ok")


class Observer:
    """The events (all no-ops here). Times are seconds."""

    #: seconds between two reads of the queues' depth by maintenance (None: never read)
    queue_depth_interval: float | None = None

    def claimed(self, rows: Sequence[dict[str, Any]]) -> None:
        """Steps were claimed: claim rows (``step_name``, ``pickup``: seconds from claimable
        to claimed on the database clock, ``run_id``, ``node``, ``attempt``...)."""

    def written(self, step_name: str | None, outcome: str) -> None:
        """An attempt's end is in the database: ``outcome`` is ``"completed"`` or the error
        kind stored (``timeout``, ``error``, ``reclaim_limit``...). Called once per row
        written, by whoever wrote it (the writer, or the sweep)."""

    def written_many(self, step_names: Sequence[str | None], outcome: str) -> None:
        """:meth:`written` for each row of one write with the same ``outcome`` (the
        writer's batch of completions: one call per batch, not per row)."""
        for step_name in step_names:
            self.written(step_name, outcome)

    def attempt_ended(self, attempt: Any, outcome: str, entry: dict[str, Any]) -> None:
        """An attempt ended in its child (process control): ``attempt`` is the
        :class:`~cyclone_mp.attempts.Attempt`, ``outcome`` how it ended (``completed``, an
        error kind, ``released``, ``cancelled``, ``lease_lost``, ``late``), ``entry`` its
        forensics (pid, exit code or signal, killed_by_supervisor, trigger, CPU seconds,
        peak RSS, elapsed...)."""

    def killed(self, trigger: str) -> None:
        """A child was SIGKILLed, for ``trigger`` (``timeout``, ``cancelled``,
        ``lease_lost``, ``lease_fence``, ``shutdown``, ``watchdog``, ``protocol_error``...)."""

    def heartbeat_lag(self, seconds: float) -> None:
        """The oldest lease held went ``seconds`` without a successful renewal (0: none held)."""

    def queue_depths(self, rows: Sequence[dict[str, Any]]) -> None:
        """Per queue served: ``queue``, ``depth`` (claimable steps), ``oldest`` (seconds the
        oldest has been claimable, or None)."""

    def queues_paused(self, served: Sequence[str], paused: Sequence[str]) -> None:
        """Of the queues ``served``, these are ``paused`` (read with the registry refresh)."""

    def discarded(self, event: dict[str, Any]) -> None:
        """This supervisor wrote a step discarded: ``event`` is ``{"run_id", "node",
        "step_name", "error_kind", "error"}`` (``mux.on_step_discarded``)."""

    def maintenance_failed(self, task: str) -> None:
        """An attempt of a maintenance task failed (``sweep``, ``schedules``, ``history``,
        ``registry``, ``queue_depths``, ``vacuum_watch``: :mod:`cyclone_mp.health`)."""

    def start(self, probes: "Probes") -> None:
        """The supervisor starts; ``probes`` read its live state (children, the last
        sweep's age, liveness, readiness). Raises ConfigurationError when the observer
        cannot work (a metrics port in use)."""

    def close(self) -> None:
        """The supervisor stopped."""

    def find(self, kind: str) -> Any:
        """The observer of class name ``kind`` among these (``"Metrics"``, ``"Tracer"``), or None."""
        return self if type(self).__name__ == kind else None


class Observers(Observer):
    """Several observers as one; an observer that raises is logged, never the part's problem."""

    def __init__(self, observers: Sequence[Observer]) -> None:
        self.observers = list(observers)
        intervals = [o.queue_depth_interval for o in self.observers if o.queue_depth_interval is not None]
        self.queue_depth_interval = min(intervals) if intervals else None

    def _each(self, name: str, *args: Any) -> None:
        for observer in self.observers:
            try:
                getattr(observer, name)(*args)
            except Exception:  # noqa: BLE001 - telemetry must never break the supervisor
                log.exception("%s.%s failed", type(observer).__name__, name)

    def claimed(self, rows: Sequence[dict[str, Any]]) -> None:
        self._each("claimed", rows)

    def written(self, step_name: str | None, outcome: str) -> None:
        self._each("written", step_name, outcome)

    def written_many(self, step_names: Sequence[str | None], outcome: str) -> None:
        self._each("written_many", step_names, outcome)

    def attempt_ended(self, attempt: Any, outcome: str, entry: dict[str, Any]) -> None:
        self._each("attempt_ended", attempt, outcome, entry)

    def killed(self, trigger: str) -> None:
        self._each("killed", trigger)

    def heartbeat_lag(self, seconds: float) -> None:
        self._each("heartbeat_lag", seconds)

    def queue_depths(self, rows: Sequence[dict[str, Any]]) -> None:
        self._each("queue_depths", rows)

    def maintenance_failed(self, task: str) -> None:
        self._each("maintenance_failed", task)

    def queues_paused(self, served: Sequence[str], paused: Sequence[str]) -> None:
        self._each("queues_paused", served, paused)

    def discarded(self, event: dict[str, Any]) -> None:
        self._each("discarded", event)

    def start(self, probes: "Probes") -> None:
        """Start each observer; unlike an event, a failure here is raised (a metrics port
        in use must stop the supervisor with a clear error, not leave it unobserved)."""
        for observer in self.observers:
            observer.start(probes)

    def close(self) -> None:
        self._each("close")

    def find(self, kind: str) -> Any:
        return next((o for o in self.observers if o.find(kind) is not None), None)


NO_OBSERVER = Observer()


#: The supervisor's counters (:attr:`cyclone_mp.supervisor.Supervisor.stats`), 0 until counted.
STAT_KEYS = ("claimed", "completed", "failed", "killed", "grandchildren_killed", "released", "lease_lost", "reclaimed",
             "swept_timeouts", "reclaim_limits", "children_spawned", "children_forked", "late_completions_dropped",
             "cancelled_attempts", "prefetch_released", "batches", "claim_statements", "pipelined", "fence_kills",
             "watchdog_kills", "scheduled", "limit_kills", "archived", "history_deleted", "partitions_dropped",
             "expired", "sweeps", "sweep_turns_skipped", "history_turns_skipped", "vacuums")


class Stats(Mapping[str, int]):
    """A live, read-only view of a supervisor's counters: each read sums the parts' own
    counters by name (every part counts on its own thread)."""

    def __init__(self, counters: Callable[[], list[dict[str, int]]]) -> None:
        self._counters = counters  # each part's own counters (Supervisor.counters)

    def _totals(self) -> dict[str, int]:
        totals = dict.fromkeys(STAT_KEYS, 0)
        for counts in self._counters():
            for key, value in list(counts.items()):
                totals[key] = totals.get(key, 0) + value
        return totals

    def __getitem__(self, key: str) -> int:
        return self._totals()[key]

    def __iter__(self) -> Iterator[str]:
        return iter(self._totals())

    def __len__(self) -> int:
        return len(self._totals())

    def __repr__(self) -> str:
        return repr(self._totals())
