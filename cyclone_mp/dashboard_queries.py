"""The dashboard's read-only queries, named ``dash_*`` in ``sql/dashboard.sql``.

:class:`DashboardReads` runs them on a :class:`~cyclone_mp.store.Store`'s connection
(the dashboard's views get one from the :class:`~cyclone_mp.Client`'s pool per page).
They run unprepared (``prepare=False``): PostgreSQL then plans each with its actual
parameter values, so an unused optional filter folds away and the index is used (a
generic prepared plan of "(x IS NULL OR col = x)" would scan the table). Database
errors are translated as the store's are (:func:`~cyclone_mp.store.session.translate`).
"""

from __future__ import annotations

import datetime as dt
from typing import Any

from .store import translate
from .store import Q, Store


#: Archived runs of a state counted row by row at each overview (an estimate past it).
ARCHIVED_COUNTED = 10_000


class DashboardReads:
    """The dashboard's reads on ``store``'s connection (no transaction of their own)."""

    def __init__(self, store: Store) -> None:
        self.store = store  # (its errors are translated as the store's: a broken connection says so)
        self.conn = store.conn

    def _rows(self, name: str, params: dict[str, Any]) -> list[dict[str, Any]]:
        with self.conn.cursor() as cur:
            cur.execute(Q[name], params, prepare=False)
            return cur.fetchall()

    @translate
    def now(self) -> dt.datetime:
        """The database clock (``now()``), an aware datetime."""
        return self._rows("dash_now", {})[0]["now"]

    @translate
    def run_counts(self) -> dict[str, int]:
        """Runs by state (states with no run are absent)."""
        return {row["state"]: int(row["n"]) for row in self._rows("dash_run_counts", {})}

    @translate
    def archived_counts(self, cap: int = ARCHIVED_COUNTED) -> tuple[dict[str, int], bool]:
        """Archived runs by state, and whether every count is exact: counted up to ``cap``
        per state, past that estimated from each partition's statistics."""
        rows = self._rows("dash_archived_counts", {"cap": cap})
        return {row["state"]: int(row["n"]) for row in rows}, all(row["exact"] for row in rows)

    @translate
    def step_counts(self) -> list[dict[str, Any]]:
        """Rows of ``name`` (step name, or ``(signal)``/``(timer)``), ``queue``, ``state``, ``n``."""
        return self._rows("dash_step_counts", {})

    @translate
    def throughput(self, minutes: int) -> list[dict[str, Any]]:
        """One row per minute of the last ``minutes`` (DB clock), oldest first:
        ``minute``, ``completed``, ``discarded`` (task steps, by ``finished_at``)."""
        return self._rows("dash_throughput", {"minutes": minutes})

    @translate
    def pickup(self, minutes: int) -> list[dict[str, Any]]:
        """One row per minute of the last ``minutes``: ``minute``, ``n``, ``p50``, ``p95``
        (pickup latency of the task steps that finished then, seconds)."""
        return self._rows("dash_pickup", {"minutes": minutes})

    @translate
    def kills_by_trigger(self, minutes: int) -> list[dict[str, Any]]:
        """One row per minute of the last ``minutes``: ``minute``, ``triggers`` ({trigger: kills})."""
        return self._rows("dash_kills_by_trigger", {"minutes": minutes})

    @translate
    def durations(self, minutes: int, limit: int = 50) -> list[dict[str, Any]]:
        """Per step (at most ``limit``): ``step``, ``n``, ``p50``, ``p95``, ``p99``, ``max``
        run time in seconds of the steps completed in the last ``minutes``."""
        return self._rows("dash_durations", {"minutes": minutes, "limit": limit})

    @translate
    def recent_kills(self, limit: int) -> list[dict[str, Any]]:
        """Steps whose latest error entry is a timeout, child exit or reclaim limit, newest first
        (``entry`` is that error entry)."""
        return self._rows("dash_recent_kills", {"limit": limit})

    @translate
    def runs(
        self, *, state: str | None = None, name: str | None = None, since: dt.datetime | None = None,
        until: dt.datetime | None = None, after: tuple[dt.datetime, str] | None = None, limit: int = 50,
        offset: int = 0,
    ) -> list[dict[str, Any]]:
        """One page of runs, newest first (``created_at DESC, id DESC``), each with ``steps``:
        a ``{state: count}`` of its steps. ``after`` is the ``(created_at, id)`` of the last
        row of the previous page (keyset); ``since``/``until`` bound ``created_at``."""
        return self._rows("dash_runs", {
            "state": state, "name": name, "since": since, "until": until,
            "after_at": after[0] if after else None, "after_id": after[1] if after else None,
            "limit": limit, "offset": offset,
        })

    @translate
    def count_runs(
        self, *, state: str | None = None, name: str | None = None, since: dt.datetime | None = None,
        until: dt.datetime | None = None, cap: int = 10_000,
    ) -> int:
        """How many runs match the filters, counting at most ``cap``."""
        rows = self._rows("dash_count_runs", {"state": state, "name": name, "since": since, "until": until,
                                                   "cap": cap})
        return int(rows[0]["n"])

    @translate
    def run_names(self, limit: int = 200) -> list[str]:
        """Distinct run names (step or workflow names), in order, at most ``limit``."""
        return [row["name"] for row in self._rows("dash_run_names", {"limit": limit})]

    @translate
    def run_signals(self, run_id: str) -> list[dict[str, Any]]:
        """The signals run ``run_id`` received: ``name``, ``payload``, ``created_at``."""
        return self._rows("dash_run_signals", {"run_id": run_id})
