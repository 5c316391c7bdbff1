"""History that stays small (issue 22): the archive tables, retention, and every read path.

Finished runs are moved to ``cyclone_runs_archive`` / ``cyclone_steps_archive`` (migration
0017) by :class:`cyclone_mp.history.History`, which the supervisors' maintenance runs;
these tests call its ``run_once`` directly on a store (STYLE pattern 4), and once let a
real supervisor do it. What is checked is what a user sees: rows in which table, which
partitions exist, what ``status``/``wait``/``result``/``runs``/the CLI/the dashboard
return, and which runs a retention deleted.
"""

from __future__ import annotations

import asyncio
import datetime as dt
import json
import os
import pathlib
import subprocess
import sys
import threading
import time
from typing import Any

import psycopg
import pytest
from click.testing import CliRunner

import cyclone_mp as cy
from cyclone_mp import sweep
from cyclone_mp.dashboard.params import RunQuery
from cyclone_mp.dashboard.views import Dashboard
from cyclone_mp.history import History, Policy, VacuumWatch
from cyclone_mp.store.operations import HISTORY_LOCK
from cyclone_mp.store import Q, connect, vacuum_hot_tables

import handlers as h
import workflow_handlers as wh
from history_db import FOREVER, cancelled_runs, db_now, finished_at, history, sql, store_on, where
from waiting import wait_for

REPO = pathlib.Path(__file__).resolve().parents[2]


def partitions(dsn: str) -> set[tuple[str, dt.date]]:
    rows = sql(dsn, "SELECT state, day FROM (" + Q["archive_partitions"] + ") x WHERE state IS NOT NULL")
    return {(r["state"], r["day"]) for r in rows}


def run_cli(*args: str, dsn: str) -> subprocess.CompletedProcess[str]:
    env = {k: v for k, v in os.environ.items() if k != "CYCLONE_DSN"}
    env["PYTHONPATH"] = os.pathsep.join([str(REPO), *filter(None, env.get("PYTHONPATH", "").split(os.pathsep))])
    env["COLUMNS"] = "200"
    return subprocess.run([sys.executable, "-m", "cyclone_mp_cli.main", "--dsn", dsn, *args], cwd=REPO, env=env,
                          capture_output=True, text=True, timeout=60)


# -- the read paths -------------------------------------------------------------------------------


def test_archived_runs_are_found_by_status_wait_result_runs_cli_and_dashboard(cyclone_env_factory) -> None:
    env = cyclone_env_factory(worker="thread")
    client, dsn = env.client(), env.dsn
    done = env.enqueue(h.ok, {"n": 1})
    failed = env.enqueue(h.permanent, {})
    assert env.run_until_complete(done).state == "completed"
    assert env.run_until_complete(failed).state == "discarded"
    before = client.status(done)

    counts = history(dsn)
    assert counts["archived"] == 2 and counts["busy"] == 0
    assert where(dsn, done) == "archive" and where(dsn, failed) == "archive"

    status = client.status(done)
    assert status.archived and status.state == "completed"
    assert status.step.output == before.step.output == {"echo": {"n": 1}, "attempt": 1, "run_id": done}
    assert status.step.started_at == before.step.started_at and status.finished_at == before.finished_at
    assert client.status(done[:8]).id == done  # a short id from a table
    assert client.wait(done, timeout=5).archived
    assert client.result(done, timeout=5) == before.step.output
    with pytest.raises(cy.RunFailed) as failure:
        client.result(failed, timeout=5)
    assert failure.value.status.step.error_kind == "permanent"
    assert {done, failed}.isdisjoint(r["id"] for r in client.runs())  # the hot tables only, unless asked
    assert {done, failed} <= {r["id"] for r in client.runs(archived=True)}
    assert [r["id"] for r in client.runs(state="discarded", archived=True)] == [failed]

    async def from_async() -> tuple[bool, Any]:
        async with cy.AsyncClient(dsn) as aclient:
            return (await aclient.status(done)).archived, await aclient.result(done, timeout=5)

    assert asyncio.run(from_async()) == (True, before.step.output)

    shown = run_cli("status", done, dsn=dsn)
    assert shown.returncode == 0, shown.stderr
    assert "completed" in shown.stdout and "(archived)" in shown.stdout
    as_json = json.loads(run_cli("status", done, "--json", dsn=dsn).stdout)
    assert as_json["archived"] is True and as_json["steps"]["ok"]["output"] == before.step.output
    listed = run_cli("runs", "--archived", "--json", dsn=dsn)
    assert {done, failed} <= {r["id"] for r in json.loads(listed.stdout)}

    board = Dashboard(client)
    page = board.run(done)
    assert page["state"] == "completed" and [s["name"] for s in page["steps"]] == ["ok"]
    runs = board.runs(RunQuery(state="completed"))
    assert [r["id"] for r in runs["runs"]] == [done] and runs["total"] == 1
    with connect(dsn) as conn:  # the archived counts are the planner's estimates (autovacuum's ANALYZE)
        conn.execute("ANALYZE cyclone_runs_archive")
    overview = board.overview()
    assert overview["runs"]["total"] == 0  # the hot tables: nothing live, nothing recent
    assert overview["archived"]["by_state"] == {"completed": 1, "discarded": 1, "cancelled": 0}
    assert (overview["throughput"]["completed"], overview["throughput"]["discarded"]) == (1, 1)
    assert [k["run_id"] for k in overview["kills"]] == []  # (a permanent error is no kill)


def test_a_run_moved_while_it_is_waited_for_is_delivered(cyclone_env_factory) -> None:
    """client.wait reads the archive too: a run archived before the waiter looks is found."""
    env = cyclone_env_factory(worker="thread")
    client = env.client()
    run_id = cancelled_runs(client, 1)[0]
    history(env.dsn)
    assert where(env.dsn, run_id) == "archive"
    status = client.wait(run_id, timeout=5)
    assert status.state == "cancelled" and status.archived
    with pytest.raises(cy.RunCancelled):
        client.result(run_id, timeout=5)


def test_retry_and_signal_bring_an_archived_run_back(cyclone_env_factory) -> None:
    env = cyclone_env_factory(worker="thread")
    client, dsn = env.client(), env.dsn
    env.mux().register(wh.approval)
    single = cancelled_runs(client, 1)[0]
    flow = client.enqueue(wh.approval, {"x": 1})
    assert client.signal(flow, "approve", {"ok": True}) is True  # kept before the node is reached
    client.cancel(flow)
    assert history(dsn)["archived"] == 2

    # the archived run keeps its signal (the dashboard shows it), and actions say why not
    page = Dashboard(client).run(flow)
    assert [(s["name"], s["payload"]) for s in page["signals"]] == [("approve", {"ok": True})]
    with pytest.raises(cy.InvalidTransition, match="cancelled"):
        client.cancel(single)
    with pytest.raises(cy.InvalidTransition, match="cancelled"):
        client.pause(single)
    assert where(dsn, single) == "archive"

    assert client.retry(single) == 1  # moved back, then retried as a hot run is
    assert where(dsn, single) == "hot"
    status = client.status(single)
    assert not status.archived and status.state == "running" and status.step.state == "available"

    assert client.signal(flow, "later", 1) is True  # moved back with its first signal
    assert where(dsn, flow) == "hot"
    got = {r["name"]: r["payload"] for r in sql(dsn, "SELECT name, payload FROM cyclone_signals WHERE run_id = %s", flow)}
    assert got == {"approve": {"ok": True}, "later": 1}
    assert client.status(flow).state == "cancelled"
    assert history(dsn)["archived"] == 1  # the signalled run is finished: archived again
    assert where(dsn, flow) == "archive"
    with pytest.raises(cy.RunNotFound):
        client.retry("0" * 8 + "-0000-4000-8000-000000000000")


def test_an_idempotency_key_still_finds_its_archived_run(cyclone_env_factory) -> None:
    env = cyclone_env_factory(worker="thread")
    client, dsn = env.client(), env.dsn
    env.mux().register(wh.approval)
    single = client.enqueue(h.ok, {}, delay=3600, idempotency_key="order-1")
    flow = client.enqueue(wh.approval, {}, idempotency_key="order-2")
    client.cancel(single)
    client.cancel(flow)
    history(dsn)
    assert where(dsn, single) == where(dsn, flow) == "archive"

    assert client.enqueue(h.ok, {"again": True}, idempotency_key="order-1") == single
    assert client.enqueue(wh.approval, {"again": True}, idempotency_key="order-2") == flow
    with psycopg.connect(dsn) as conn, conn.transaction():  # inside the caller's transaction too
        assert client.enqueue(h.ok, {}, idempotency_key="order-1", conn=conn) == single
    assert sql(dsn, "SELECT count(*) AS n FROM cyclone_runs")[0]["n"] == 0
    assert sql(dsn, "SELECT count(*) AS n FROM cyclone_steps")[0]["n"] == 0
    fresh = client.enqueue(h.ok, {}, delay=3600, idempotency_key="order-3")
    assert fresh not in (single, flow) and where(dsn, fresh) == "hot"


# -- what moves and what stays ---------------------------------------------------------------------


def test_live_runs_are_never_archived_nor_deleted(cyclone_env_factory) -> None:
    env = cyclone_env_factory(worker="thread")
    client, dsn = env.client(), env.dsn
    env.mux().register(wh.approval)
    flow = client.enqueue(wh.approval, {"x": 1})  # prepare completes, approve waits for its signal
    env.start_worker()
    env.wait_for_state(flow, "approve", "waiting_signal", timeout=30)
    env.workers[0].client.shutdown()
    available = client.enqueue(h.ok, {})
    later = client.enqueue(h.ok, {}, delay=3600)
    paused = client.enqueue(h.ok, {}, delay=3600)
    client.pause(paused)
    running = client.enqueue(h.ok, {})
    with store_on(dsn) as store:  # claimed by a supervisor that never finishes it
        store.claims.claim(owner="test-owner", queues=["default"], names=["ok"], limit=1, ttl=3600)
    long_ago = db_now(dsn) - dt.timedelta(days=30)
    with connect(dsn) as conn:  # old enough for any setting
        conn.execute("UPDATE cyclone_runs SET created_at = %s", (long_ago,))
        conn.execute("UPDATE cyclone_steps SET finished_at = %s WHERE finished_at IS NOT NULL", (long_ago,))
    states = {r["id"]: r["state"] for r in sql(dsn, "SELECT id::text, state FROM cyclone_runs")}
    assert sorted(states.values()) == ["paused"] + ["running"] * 4
    steps_before = sql(dsn, "SELECT * FROM cyclone_steps ORDER BY id")

    counts = history(dsn, completed=0.0, discarded=0.0, cancelled=0.0)
    assert counts["archived"] == counts["deleted"] == 0
    assert sql(dsn, "SELECT * FROM cyclone_steps ORDER BY id") == steps_before
    assert {r["id"]: r["state"] for r in sql(dsn, "SELECT id::text, state FROM cyclone_runs")} == states
    assert sql(dsn, "SELECT count(*) AS n FROM cyclone_runs_archive")[0]["n"] == 0
    assert [s.state for s in client.status(flow).steps.values()] == ["completed", "waiting_signal", "pending"]
    assert {available, later, paused, running} <= set(states)


def test_retention_drops_whole_partitions_and_deletes_only_older_rows(cyclone_env_factory) -> None:
    env = cyclone_env_factory(worker="thread")
    client, dsn = env.client(), env.dsn
    done = [env.enqueue(h.ok, {"i": i}) for i in range(4)]
    failed = env.enqueue(h.permanent, {})
    for run_id in done + [failed]:
        env.run_until_complete(run_id)
    cancelled = cancelled_runs(client, 1)[0]
    now = db_now(dsn)
    day = (now - dt.timedelta(days=3)).astimezone(dt.timezone.utc).date()
    midnight = dt.datetime.combine(day, dt.time(), dt.timezone.utc)
    old, early, late, new = done
    finished_at(dsn, old, midnight - dt.timedelta(hours=12))  # the day before: a whole partition
    finished_at(dsn, early, midnight + dt.timedelta(hours=1))  # the cut-off's day, before it
    finished_at(dsn, late, midnight + dt.timedelta(hours=23))  # the cut-off's day, after it
    finished_at(dsn, failed, midnight - dt.timedelta(hours=12))
    finished_at(dsn, cancelled, midnight - dt.timedelta(hours=12))
    history(dsn)  # this pass, or the env's supervisor's own if it came first, archives them (made again while busy)
    assert sql(dsn, "SELECT count(*) AS n FROM cyclone_runs_archive")[0]["n"] == 6
    before = partitions(dsn)
    assert {("completed", day - dt.timedelta(days=1)), ("completed", day), ("discarded", day - dt.timedelta(days=1)),
            ("cancelled", day - dt.timedelta(days=1))} <= before

    keep_completed = (now - (midnight + dt.timedelta(hours=12))).total_seconds()  # cut-off: noon of that day
    counts = history(dsn, completed=keep_completed, discarded=None, cancelled=10 * 86400.0)
    assert counts["partitions_dropped"] == 1 and counts["dropped_runs"] == 1  # dropped, not deleted
    assert counts["expired"] == 1  # the one run before noon, deleted in its partition
    assert before - partitions(dsn) == {("completed", day - dt.timedelta(days=1))}
    assert [where(dsn, r) for r in (old, early, late, new, failed, cancelled)] == \
        ["gone", "gone", "archive", "archive", "archive", "archive"]
    with pytest.raises(cy.RunNotFound):
        client.status(old)
    assert client.status(late).state == "completed"
    assert history(dsn, completed=keep_completed, cancelled=10 * 86400.0)["expired"] == 0  # nothing left to do


def test_retention_without_archive_deletes_from_the_hot_tables(cyclone_env_factory) -> None:
    # (the supervisor's own maintenance must not archive either: its first pass makes partitions)
    env = cyclone_env_factory(worker="thread", archive_after=None)
    client, dsn = env.client(), env.dsn
    done = env.enqueue(h.ok, {})
    env.run_until_complete(done)
    cancelled = cancelled_runs(client, 1)[0]
    counts = history(dsn, archive_after=None, completed=0.0)
    assert (counts["deleted"], counts["archived"]) == (1, 0)
    assert where(dsn, done) == "gone" and where(dsn, cancelled) == "hot"
    assert partitions(dsn) == set()  # nothing archived: no partition made


def test_prune_deletes_archived_runs_too(cyclone_env_factory) -> None:
    env = cyclone_env_factory(worker="thread")
    client, dsn = env.client(), env.dsn
    old, recent, hot = cancelled_runs(client, 3)
    finished_at(dsn, old, db_now(dsn) - dt.timedelta(days=3))
    finished_at(dsn, recent, db_now(dsn) - dt.timedelta(minutes=5))
    with store_on(dsn) as store:
        History(Policy(60.0, FOREVER)).run_once(store)  # archives the two older than a minute
    assert [where(dsn, r) for r in (old, recent, hot)] == ["archive", "archive", "hot"]
    assert client.prune(older_than=86400) == 1
    assert [where(dsn, r) for r in (old, recent, hot)] == ["gone", "archive", "hot"]
    assert ("cancelled", (db_now(dsn) - dt.timedelta(days=3)).astimezone(dt.timezone.utc).date()) not in partitions(dsn)
    assert client.prune(older_than=0) == 2
    assert [where(dsn, r) for r in (old, recent, hot)] == ["gone"] * 3


# -- bounded, one supervisor at a time, short locks --------------------------------------------------


def test_history_moves_in_bounded_batches_and_resumes(cyclone_env_factory) -> None:
    env = cyclone_env_factory(worker="thread")
    client, dsn = env.client(), env.dsn
    cancelled_runs(client, 35)
    work = History(Policy(0.0, FOREVER), batch=10, budget=0.0)  # one batch per pass
    with store_on(dsn) as store:
        passes = [work.run_once(store) for _ in range(5)]
    assert [p["archived"] for p in passes] == [10, 10, 10, 5, 0]
    assert [p["batches"] for p in passes] == [1, 1, 1, 1, 0]
    assert [p["more"] for p in passes] == [1, 1, 1, 0, 0]
    assert sql(dsn, "SELECT count(*) AS n FROM cyclone_runs_archive")[0]["n"] == 35
    with store_on(dsn) as store:  # with a budget: one pass does it all, still 10 runs a statement
        cancelled_runs(client, 25)
        counts = History(Policy(0.0, FOREVER), batch=10, budget=30.0).run_once(store)
    assert (counts["archived"], counts["batches"], counts["more"]) == (25, 3, 0)


def test_one_supervisor_at_a_time_does_history_work(cyclone_env_factory) -> None:
    env = cyclone_env_factory(worker="thread")
    client, dsn = env.client(), env.dsn
    ids = cancelled_runs(client, 60)
    with psycopg.connect(dsn, autocommit=True) as other:  # another supervisor's transaction holds it
        other.execute("SELECT pg_advisory_lock(%s)", (HISTORY_LOCK,))
        counts = history(dsn, wait_busy=False)
        assert counts["busy"] == 1 and counts["archived"] == 0
        assert sql(dsn, "SELECT count(*) AS n FROM cyclone_runs")[0]["n"] == 60
        other.execute("SELECT pg_advisory_unlock(%s)", (HISTORY_LOCK,))

    results: list[dict[str, int]] = []
    errors: list[BaseException] = []

    def supervisor() -> None:
        try:
            with store_on(dsn) as store:
                work = History(Policy(0.0, FOREVER), batch=3, budget=30.0)
                for _ in range(40):
                    results.append(work.run_once(store))
        except BaseException as exc:  # noqa: BLE001 - reported below
            errors.append(exc)

    threads = [threading.Thread(target=supervisor) for _ in range(2)]
    for t in threads:
        t.start()
    for t in threads:
        t.join(60)
    assert not errors, errors
    assert sum(r["archived"] for r in results) == 60
    rows = sql(dsn, "SELECT id::text FROM cyclone_runs_archive")
    assert sorted(r["id"] for r in rows) == sorted(ids)


def test_a_partition_drop_waits_briefly_for_its_lock_then_tries_again(cyclone_env_factory) -> None:
    env = cyclone_env_factory(worker="thread")
    client, dsn = env.client(), env.dsn
    old = cancelled_runs(client, 1)[0]
    finished_at(dsn, old, db_now(dsn) - dt.timedelta(days=3))
    history(dsn)
    with psycopg.connect(dsn) as reader:  # a long read of the archive holds a lock on it
        reader.execute("SELECT count(*) FROM cyclone_runs_archive")
        started = time.monotonic()
        counts = history(dsn, cancelled=86400.0)
        took = time.monotonic() - started
        assert counts["partitions_dropped"] == 0 and counts["more"] == 1
        assert took < 5.0  # 0.2 s of lock wait, not the reader's whole transaction
        assert where(dsn, old) == "archive"
        fresh = client.enqueue(h.ok, {}, delay=3600)  # the hot tables never wait for it
        assert client.cancel(fresh) == 1
    assert history(dsn, cancelled=86400.0)["partitions_dropped"] == 1
    assert where(dsn, old) == "gone"


def test_the_supervisors_maintenance_archives_finished_runs(cyclone_env_factory, monkeypatch) -> None:
    monkeypatch.setattr(sweep, "HISTORY_INTERVAL", 0.2)
    env = cyclone_env_factory(worker="thread", archive_after=0.5)
    run_id = env.enqueue(h.ok, {"n": 7})
    env.run_until_complete(run_id)
    wait_for(lambda: env.client().status(run_id).archived, timeout=30, what="the run archived by maintenance")
    assert where(env.dsn, run_id) == "archive"
    assert env.workers[0].client.supervisor.stats["archived"] >= 1
    assert env.client().result(run_id) == {"echo": {"n": 7}, "attempt": 1, "run_id": run_id}


# -- schema and options --------------------------------------------------------------------------------


def test_the_archive_has_every_column_of_the_hot_tables(cyclone_dsn: str) -> None:
    """A column added to cyclone_runs or cyclone_steps must reach the archive and the
    column lists that move rows (sql/history.sql), or a move would lose it."""
    def columns(table: str) -> list[str]:
        return [r["column_name"] for r in sql(cyclone_dsn, "SELECT column_name FROM information_schema.columns "
                                                           "WHERE table_name = %s ORDER BY ordinal_position", table)]

    def listed(fragment: str) -> list[str]:
        return [c.strip() for c in Q[fragment].split(",")]

    assert columns("cyclone_runs") == listed("run_row_columns_expr")
    assert columns("cyclone_steps") == listed("step_row_columns_expr")
    # (a column added later lands after the archive's own: rows move by name, not position)
    assert sorted(columns("cyclone_runs_archive")) == sorted(columns("cyclone_runs") + ["signals", "archived_at"])
    assert sorted(columns("cyclone_steps_archive")) == sorted(columns("cyclone_steps") + ["run_state", "run_finished_at"])


def test_history_options() -> None:
    config = cy.Client("postgresql://unused", archive_after="15m", retain_completed="7d",
                       retain_discarded=dt.timedelta(days=30), retain_cancelled=3600).config
    assert (config.archive_after, config.retain_completed, config.retain_discarded, config.retain_cancelled) == \
        (900.0, 7 * 86400.0, 30 * 86400.0, 3600.0)
    default = cy.Client("postgresql://unused").config
    assert (default.archive_after, default.retention) == (600.0, FOREVER)
    policy = Policy(600.0, {"completed": 60.0, "discarded": None, "cancelled": 3600.0})
    assert [policy.move_after(s) for s in FOREVER] == [60.0, 600.0, 600.0]
    assert [policy.archives(s) for s in FOREVER] == [False, True, True]
    assert not Policy(None, FOREVER).active
    for bad in ({"archive_after": "soon"}, {"retain_completed": -1}, {"retain_discarded": "7 weeks"}):
        with pytest.raises(cy.ConfigurationError):
            cy.Client("postgresql://unused", **bad)

    from cyclone_mp_cli import main as cli_main
    from cyclone_mp_cli.params import DURATION_OR_NEVER

    assert DURATION_OR_NEVER.convert("7d", None, None) == 7 * 86400.0
    assert DURATION_OR_NEVER.convert("never", None, None) is None
    shown = CliRunner().invoke(cli_main.cli, ["worker", "--help"]).output
    for option in ("--archive-after", "--retain-completed", "--retain-discarded", "--retain-cancelled"):
        assert option in shown
    bad = CliRunner().invoke(cli_main.cli, ["worker", "x:mux", "--retain-completed", "7 weeks"])
    assert bad.exit_code == 2 and "not a duration" in bad.output


def test_a_run_passed_over_is_archived_when_the_walk_starts_again(cyclone_env_factory) -> None:
    """A run an operator holds locked is skipped (SKIP LOCKED), and the walk goes on from
    where it reached, not from the oldest finished step, until HISTORY_WALK_RESTART has
    passed (a long transaction keeps every archived step in the index it walks)."""
    env = cyclone_env_factory(worker="thread")
    client, dsn = env.client(), env.dsn
    held, other = cancelled_runs(client, 2)
    now = [0.0]
    work = History(Policy(0.0, FOREVER), restart_every=60.0, clock=lambda: now[0])
    with store_on(dsn) as store, psycopg.connect(dsn) as operator:
        operator.execute("SELECT 1 FROM cyclone_runs WHERE id = %s FOR UPDATE", (held,))
        assert work.run_once(store)["archived"] == 1
        operator.rollback()
        assert where(dsn, held) == "hot" and where(dsn, other) == "archive"
        later = cancelled_runs(client, 1)[0]
        assert work.run_once(store)["archived"] == 1  # the new one, past the cursor
        assert where(dsn, later) == "archive" and where(dsn, held) == "hot"
        now[0] = 61.0  # the walk starts again from the oldest finished step
        assert work.run_once(store)["archived"] == 1
    assert where(dsn, held) == "archive"


# -- long transactions: the hot tables are vacuumed once one ends ------------------------------------


def test_the_vacuum_watch_decides_when_a_long_transaction_ended() -> None:
    now = [0.0]
    watch = VacuumWatch(lambda: 0.0, held_for=10.0, min_dead=100, clock=lambda: now[0])
    seen = []
    for t, xmin in ((0, 100), (5, 180), (10, 260), (15, 260), (20, 260), (25, 260), (30, 900), (35, 901)):
        now[0] = t
        seen.append(watch.decide(xmin, 500))
    # short transactions come and go; 260 stays the oldest from 10 s to 25 s: it held vacuum
    # back, and its end (at 30 s) is when to vacuum, once
    assert seen == [False, False, False, False, False, False, True, False]
    for t, xmin in ((40, 950), (45, 950), (55, 950), (60, 990)):
        now[0] = t
        last = watch.decide(xmin, 50)
    assert last is False  # held and ended, but too little to clean up


def test_the_hot_tables_are_vacuumed_when_a_long_transaction_ends(cyclone_env_factory, cyclone_server) -> None:
    env = cyclone_env_factory(worker="thread")
    client, dsn = env.client(), env.dsn
    client.enqueue_many(h.ok, [{}] * 20, delay=3600)

    def vacuums() -> int:
        return sql(dsn, "SELECT vacuum_count AS n FROM pg_stat_user_tables WHERE relname = 'cyclone_steps'")[0]["n"]

    before = vacuums()
    now = [0.0]
    watch = VacuumWatch(lambda: vacuum_hot_tables(dsn), held_for=10.0, min_dead=10, clock=lambda: now[0])
    # the horizon is the cluster's: no test database is cloned in the background meanwhile
    with cyclone_server.quiet(), store_on(dsn) as store, psycopg.connect(dsn) as holder:
        holder.execute("SELECT pg_current_xact_id()")  # idle in transaction, with an xid
        with psycopg.connect(dsn, autocommit=True) as writer:
            for _ in range(60):  # others go on: transaction ids and dead row versions pile up
                writer.execute("UPDATE cyclone_steps SET priority = priority")
        wait_for(lambda: sql(dsn, "SELECT n_dead_tup AS n FROM pg_stat_user_tables "
                                  "WHERE relname = 'cyclone_steps'")[0]["n"] >= 10, timeout=10, what="dead tuples counted")
        assert watch.run_once(store) is False  # the holder is the oldest transaction running
        now[0] = 11.0
        assert watch.run_once(store) is False and watch.held  # held back: vacuuming now would remove nothing
        holder.rollback()
        assert watch.run_once(store) is True
        watch.thread.join(30)
    assert watch.done == [pytest.approx(watch.done[0])] and watch.done[0] is not None
    # (PostgreSQL 14's statistics collector reports a moment after the VACUUM; 15+ at once)
    wait_for(lambda: vacuums() == before + 1, timeout=10, what="the VACUUM counted")
    wait_for(lambda: sql(dsn, "SELECT n_dead_tup AS n FROM pg_stat_user_tables WHERE relname = 'cyclone_steps'")[0]["n"]
             == 0, timeout=10, what="no dead row versions left")
    assert vacuums() == before + 1


def test_the_history_pass_is_one_supervisors_turn_per_interval(cyclone_dsn: str) -> None:
    """Many supervisors, one history pass per interval for all (the maintenance turn of
    migration 0018, as the sweep's): the first to ask takes it, the others are told when
    it ends."""
    with store_on(cyclone_dsn) as a, store_on(cyclone_dsn) as b:
        mine = a.sweep.turn("supervisor-a", 5.0, "history").mine
        theirs, wait, _ = b.sweep.turn("supervisor-b", 5.0, "history")
        assert mine and not theirs and 4.0 < wait <= 5.0
        assert b.sweep.turn("supervisor-b", 5.0, "sweep")[0]  # each task has its own turn
    rows = sql(cyclone_dsn, "SELECT task, holder FROM cyclone_maintenance ORDER BY task")
    assert [(r["task"], r["holder"]) for r in rows] == [("history", "supervisor-a"), ("sweep", "supervisor-b")]
