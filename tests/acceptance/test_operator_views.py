"""What the operator's views say right after a change: ``workers`` shows a child busy as
soon as it takes a step (not idle until the next ``registry_interval``), and the
dashboard counts the archived runs of a small archive exactly (the planner's estimate
said 0 before autovacuum's first ANALYZE of it)."""

from __future__ import annotations

import time
from typing import Any

import cyclone_mp as cy
from cyclone_mp.dashboard.views import Dashboard

import handlers as h
from history_db import cancelled_runs, history, where
from waiting import wait_for


def _child_of(client: cy.Client, run_id: str) -> dict[str, Any] | None:
    for row in client.workers():
        for kid in row["info"].get("children") or []:
            if kid.get("run_id") == run_id:
                return kid
    return None


def test_a_child_that_takes_a_step_shows_busy_at_once(cyclone_env_factory) -> None:
    """With a registry row written every 5 s, a child that starts a (wedged) step shows
    its run in ``client.workers()`` within about half a second of the step's start."""
    env = cyclone_env_factory(worker="thread", workers=1, registry_interval=5.0, kill_grace=0.2)
    env.mux().register(h.sleeper)
    client = env.client()
    env.start_worker()
    rows = wait_for(lambda: client.workers() or None, 10, "the supervisor's first registry row")
    kids = rows[0]["info"]["children"]
    assert [kid.get("run_id") for kid in kids] == [None] and "ready" in kids[0]  # one idle (or starting) child
    run_id = client.enqueue(h.sleeper, {"seconds": 30})
    wait_for(lambda: client.status(run_id).step.state == "running", 10, "the step to start")
    started = time.monotonic()
    kid = wait_for(lambda: _child_of(client, run_id), 4, "the child to show its step in the registry")
    took = time.monotonic() - started
    assert took < 1.5, f"workers showed the child idle for {took:.2f}s after it took the step"
    assert kid["step"] == "sleeper" and kid["attempt"] == 1
    client.cancel(run_id)


def test_the_dashboard_counts_a_small_archive_exactly(cyclone_env_factory) -> None:
    env = cyclone_env_factory(worker="thread")
    client = env.client()
    ids = cancelled_runs(client, 8)
    history(env.dsn)  # moved to the archive; no ANALYZE has run on it
    assert all(where(env.dsn, run_id) == "archive" for run_id in ids)
    overview = Dashboard(client).overview()
    assert overview["archived"] == {"by_state": {"completed": 0, "discarded": 0, "cancelled": 8}, "total": 8,
                                    "exact": True}
    counts, exact = _reads(client, cap=5)  # past the cap: at least the cap, from the estimate
    assert counts["cancelled"] >= 5 and not exact


def _reads(client: cy.Client, cap: int) -> tuple[dict[str, int], bool]:
    from cyclone_mp.dashboard_queries import DashboardReads

    return client._call(lambda store: DashboardReads(store).archived_counts(cap))
