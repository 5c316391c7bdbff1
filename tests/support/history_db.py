"""The history of runs as a test reads and makes it: one ``History`` pass with a policy
(``history``), which table holds a run (``where``: "hot", "archive" or "gone"), finished
runs back-dated (``finished_at``) or made without a supervisor (``cancelled_runs``), the
database's clock (``db_now``). Times are the database's (``timestamptz``)."""

from __future__ import annotations

import contextlib
import datetime as dt
import time
from typing import Any, Iterator

import cyclone_mp as cy
from cyclone_mp.history import History, Policy
from cyclone_mp.store import Store, connect

import handlers as h

FOREVER = {"completed": None, "discarded": None, "cancelled": None}


def sql(dsn: str, query: str, *args: Any) -> list[dict[str, Any]]:
    with connect(dsn) as conn:
        return conn.execute(query, args).fetchall()


@contextlib.contextmanager
def store_on(dsn: str) -> Iterator[Store]:
    store = Store.open(dsn)
    try:
        yield store
    finally:
        store.close()


def history(dsn: str, *, archive_after: float | None = 0.0, wait_busy: bool = True,
            **retain: float | None) -> dict[str, int]:
    """One history pass with this policy (as a supervisor's maintenance runs it). With
    ``wait_busy``, a pass that found another one at work (``busy``: the env's supervisor's
    own, begun before the test back-dated its rows) is made again until one does the work
    (at most 30 s)."""
    deadline = time.monotonic() + 30.0
    while True:
        with store_on(dsn) as store:
            counts = History(Policy(archive_after, {**FOREVER, **retain})).run_once(store)
        if not (wait_busy and counts["busy"]) or time.monotonic() > deadline:
            return counts
        time.sleep(0.05)


def where(dsn: str, run_id: str) -> str:
    """Which table holds the run: "hot", "archive" or "gone" (its steps checked with it)."""
    hot = sql(dsn, "SELECT count(*) AS n FROM cyclone_steps WHERE run_id = %s", run_id)[0]["n"]
    cold = sql(dsn, "SELECT count(*) AS n FROM cyclone_steps_archive WHERE run_id = %s", run_id)[0]["n"]
    in_runs = sql(dsn, "SELECT count(*) AS n FROM cyclone_runs WHERE id = %s", run_id)[0]["n"]
    in_archive = sql(dsn, "SELECT count(*) AS n FROM cyclone_runs_archive WHERE id = %s", run_id)[0]["n"]
    if in_runs:
        assert hot and not cold and not in_archive, (hot, cold, in_archive)
        return "hot"
    if in_archive:
        assert cold and not hot, (hot, cold)
        return "archive"
    assert not hot and not cold
    return "gone"


def finished_at(dsn: str, run_id: str, when: dt.datetime) -> None:
    """Make a finished run look as if it finished at ``when`` (its steps too)."""
    with connect(dsn) as conn:
        conn.execute("UPDATE cyclone_runs SET finished_at = %s, created_at = %s - interval '1 second' "
                     "WHERE id = %s", (when, when, run_id))
        conn.execute("UPDATE cyclone_steps SET finished_at = %s WHERE run_id = %s AND finished_at IS NOT NULL",
                     (when, run_id))


def db_now(dsn: str) -> dt.datetime:
    return sql(dsn, "SELECT now() AS now")[0]["now"]


def cancelled_runs(client: cy.Client, n: int) -> list[str]:
    """``n`` finished runs without a supervisor: enqueued for later, then cancelled."""
    ids = client.enqueue_many(h.ok, [{"i": i} for i in range(n)], delay=3600)
    for run_id in ids:
        client.cancel(run_id)
    return ids
