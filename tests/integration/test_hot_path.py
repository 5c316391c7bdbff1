"""The hot statement (issue 8): one statement settles a tick, and its failures decide
exactly as the one-by-one path does.

Each comparison claims two identical steps, fails one with ``Outcomes.fail_many`` (the
batched statement without completions) and the other with ``Outcomes.fail`` (the path it
replaces), and compares the rows: single-step runs, paused runs and workflow runs.
"""

from __future__ import annotations

import datetime as dt
import time
from typing import Any

import psycopg
import psycopg.sql
from psycopg.types.json import Jsonb
import pytest

import cyclone_mp as cy
from cyclone_mp import decisions
from cyclone_mp.store import FailedAttempt, Store, connect

import handlers as h
import workflow_handlers as wh

OWNER = "test-owner"
COLUMNS = ("state, paused_from, attempt, max_attempts, error, error_kind, errors, lease_owner, "
           "finished_at IS NOT NULL AS finished")


def claim_two(env: Any, store: Store, step: cy.Step, **options: Any) -> tuple[list[str], list[dict[str, Any]]]:
    ids = [env.client().enqueue(step, {}, **options) for _ in range(2)]
    rows = store.claims.claim(owner=OWNER, queues=["default"], names=[step.name], limit=2, ttl=30).rows
    assert len(rows) == 2
    return ids, rows


def row_of(dsn: str, step_id: int) -> dict[str, Any]:
    with connect(dsn) as conn:
        row = conn.execute(f"SELECT {COLUMNS}, run_id::text AS run_id FROM cyclone_steps WHERE id = %s",
                           (step_id,)).fetchone()
        row["run_state"] = conn.execute("SELECT state FROM cyclone_runs WHERE id = %s",
                                        (row.pop("run_id"),)).fetchone()["state"]
    for e in row["errors"]:
        e.pop("at")  # a timestamp: present in both, equal in neither
    return row


def age(dsn: str, step_id: int, seconds: float) -> None:
    with connect(dsn) as conn:
        conn.execute("UPDATE cyclone_steps SET started_at = started_at - make_interval(secs => %s) WHERE id = %s",
                     (seconds, step_id))


@pytest.mark.parametrize("kind, options, aged, require_timed_out", [
    (decisions.ERROR, {}, False, False),                        # retried
    (decisions.ERROR, {"max_attempts": 1}, False, False),       # exhausted: discarded
    (decisions.PERMANENT, {}, False, False),                    # discarded at once
    (decisions.CHILD_EXITED, {"backoff": 7}, False, False),     # stored backoff spec
    (decisions.ERROR, {"timeout": 1}, True, False),             # the DB deadline passed: a timeout
    (decisions.TIMEOUT, {"timeout": 1, "max_attempts": 1}, True, True),
])
def test_fail_many_matches_fail(cyclone_env, kind, options, aged, require_timed_out):
    store = Store.open(cyclone_env.dsn)
    try:
        cyclone_env.mux().register(h.raises)
        _, (a, b) = claim_two(cyclone_env, store, h.raises, **options)
        if aged:
            age(cyclone_env.dsn, a["id"], 5)
            age(cyclone_env.dsn, b["id"], 5)
        entry = {"type": "builtins.ValueError", "message": "bad", "pid": 1}
        delay = 7.0 if "backoff" in options else 0.0
        applied = store.outcomes.fail_many(owner=OWNER, items=[FailedAttempt(
            id=a["id"], generation=a["lease_generation"], kind=kind, entry=entry, delay=delay,
            require_timed_out=require_timed_out)])
        assert applied == {(a["id"], a["lease_generation"])}
        assert store.outcomes.fail(owner=OWNER, id=b["id"], generation=b["lease_generation"], kind=kind, entry=entry,
                                   backoff=lambda n: delay, require_timed_out=require_timed_out).status == "applied"
        batched, single = row_of(cyclone_env.dsn, a["id"]), row_of(cyclone_env.dsn, b["id"])
        assert batched == single
        assert batched["errors"][0]["kind"] == batched["error_kind"]
    finally:
        store.close()


def test_fail_many_leaves_what_it_must_not_decide(cyclone_env):
    store = Store.open(cyclone_env.dsn)
    try:
        cyclone_env.mux().register(h.raises)
        (run_a, run_b), (a, b) = claim_two(cyclone_env, store, h.raises, timeout=60)
        stale = FailedAttempt(id=a["id"], generation=a["lease_generation"] + 1, kind=decisions.ERROR,
                              entry={}, delay=0.0, require_timed_out=False)  # another lease's
        early = FailedAttempt(id=b["id"], generation=b["lease_generation"], kind=decisions.TIMEOUT,
                              entry={}, delay=0.0, require_timed_out=True)  # DB deadline 60 s away
        assert store.outcomes.fail_many(owner=OWNER, items=[stale, early]) == set()
        for step_id in (a["id"], b["id"]):
            row = row_of(cyclone_env.dsn, step_id)
            assert (row["attempt"], row["errors"], row["lease_owner"]) == (1, [], OWNER)
        # a workflow's failure needs its run advanced in the same transaction: only when asked
        cyclone_env.mux().register(wh.diamond)
        cyclone_env.enqueue(wh.diamond, {})
        (w,) = store.claims.claim(owner=OWNER, queues=["default"], names=["a"], limit=1, ttl=30).rows
        failure = FailedAttempt(id=w["id"], generation=w["lease_generation"], kind=decisions.ERROR,
                                entry={}, delay=0.0, require_timed_out=False)
        assert store.outcomes.fail_many(owner=OWNER, items=[failure]) == set()
        assert row_of(cyclone_env.dsn, w["id"])["state"] == "running"
        applied = store.outcomes.fail_many(owner=OWNER, items=[failure], workflows=True)
        assert applied == {(w["id"], w["lease_generation"])}
    finally:
        store.close()


def run_rows(dsn: str, run_id: str) -> dict[str, Any]:
    """Every step of a run by node, with the run's state (``row_of``'s columns)."""
    with connect(dsn) as conn:
        ids = conn.execute("SELECT node, id FROM cyclone_steps WHERE run_id = %s", (run_id,)).fetchall()
    return {r["node"]: row_of(dsn, r["id"]) for r in ids}


@pytest.mark.parametrize("kind", [decisions.ERROR, decisions.PERMANENT])
@pytest.mark.parametrize("setup", ["paused", "workflow", "paused workflow"])
def test_fail_many_matches_fail_in_paused_and_workflow_runs(cyclone_env, setup, kind):
    """A retry in a paused run is held paused; a workflow's run is advanced (a discarded
    node discards the run), exactly as the one-by-one path does."""
    store = Store.open(cyclone_env.dsn)
    try:
        if "workflow" in setup:
            cyclone_env.mux().register(wh.diamond)
            run_ids = [cyclone_env.enqueue(wh.diamond, {}) for _ in range(2)]
            a, b = store.claims.claim(owner=OWNER, queues=["default"], names=["a"], limit=2, ttl=30).rows
        else:
            cyclone_env.mux().register(h.raises)
            run_ids, (a, b) = claim_two(cyclone_env, store, h.raises)
        if "paused" in setup:
            for run_id in run_ids:
                cyclone_env.client().pause(run_id)
        entry = {"type": "builtins.ValueError", "message": "bad", "pid": 1}
        by_id = {r["id"]: r for r in (a, b)}
        first, second = (by_id[s] for s in sorted(by_id))  # run order is claim order: match rows to runs
        applied = store.outcomes.fail_many(owner=OWNER, items=[FailedAttempt(
            id=first["id"], generation=first["lease_generation"], kind=kind, entry=entry, delay=0.0,
            require_timed_out=False)], workflows="workflow" in setup)
        assert applied == {(first["id"], first["lease_generation"])}
        assert store.outcomes.fail(owner=OWNER, id=second["id"], generation=second["lease_generation"], kind=kind,
                                   entry=entry, backoff=lambda n: 0.0).status == "applied"
        batched, single = (run_rows(cyclone_env.dsn, r["run_id"]) for r in (first, second))
        assert batched == single
        node = first["node"]
        expected = "discarded" if kind == decisions.PERMANENT else "paused" if "paused" in setup else "available"
        assert batched[node]["state"] == expected
        if "workflow" in setup and kind == decisions.PERMANENT and "paused" not in setup:
            assert batched[node]["run_state"] == "discarded"
    finally:
        store.close()


def test_a_flood_of_failures_ends_every_step_as_the_table_says(cyclone_env_factory):
    env = cyclone_env_factory(worker="thread", workers=2, lease_ttl=5)
    env.mux().register(h.raises)
    ids = env.client().enqueue_many(h.raises, [{}] * 40)
    handle = env.start_worker()
    statuses = [env.run_until_complete(run_id, timeout=60) for run_id in ids]
    for s in statuses:
        assert (s.state, s.step.state, s.step.attempt, s.step.error_kind) == ("discarded", "discarded", 3, "error")
        assert [(e["attempt"], e["kind"], e["worker"]) for e in s.step.errors] == [
            (n, "error", handle.supervisor_id) for n in (1, 2, 3)]
    assert handle.client.supervisor.stats["failed"] == 120


def test_one_statement_settles_completions_failures_and_the_next_claim(cyclone_env):
    store = Store.open(cyclone_env.dsn)
    statements: list[str] = []

    class Counting(psycopg.Cursor):
        def execute(self, query: Any, params: Any = None, **kwargs: Any) -> Any:
            statements.append(str(query))
            return super().execute(query, params, **kwargs)

    try:
        cyclone_env.mux().register(h.ok)
        run_ids = [cyclone_env.client().enqueue(h.ok, {"i": i}) for i in range(4)]
        a, b, c = store.claims.claim(owner=OWNER, queues=["default"], names=["ok"], limit=3, ttl=30).rows
        store.conn.cursor_factory = Counting
        settled = store.outcomes.settle(
            owner=OWNER,
            completions=[(a["id"], a["lease_generation"], {"done": 1}, None),
                         (b["id"], b["lease_generation"] + 1, {"late": 1}, None)],  # another lease's
            failures=[FailedAttempt(id=c["id"], generation=c["lease_generation"], kind=decisions.ERROR,
                                             entry={"message": "bad"}, delay=0.0, require_timed_out=False)],
            queues=["default"], names=["ok"], limit=2, ttl=30,
        )
        assert len(statements) == 1
        assert (settled.completed, settled.failed) == ({(a["id"], a["lease_generation"])}, {(c["id"], c["lease_generation"])})
        assert [r["run_id"] for r in settled.claimed] == [run_ids[3]]  # c waits for its next claim
        with connect(cyclone_env.dsn) as conn:
            rows = {r["id"]: r for r in conn.execute(
                "SELECT s.id, s.state, s.attempt, s.output, s.lease_owner, r.state AS run_state "
                "FROM cyclone_steps s JOIN cyclone_runs r ON r.id = s.run_id").fetchall()}
        assert (rows[a["id"]]["state"], rows[a["id"]]["output"], rows[a["id"]]["run_state"]) == (
            "completed", {"done": 1}, "completed")
        assert (rows[b["id"]]["state"], rows[b["id"]]["output"]) == ("running", None)
        assert (rows[c["id"]]["state"], rows[c["id"]]["attempt"], rows[c["id"]]["run_state"]) == (
            "available", 2, "running")
        assert (rows[settled.claimed[0]["id"]]["state"], rows[settled.claimed[0]["id"]]["lease_owner"]) == (
            "running", OWNER)
    finally:
        store.close()


def test_each_completion_is_matched_by_its_lease_and_carries_its_own_output(cyclone_env):
    """Outputs follow their rows whatever the order, and a step listed twice (a stale
    lease's item first) completes with its current lease's item, not the first one."""
    store = Store.open(cyclone_env.dsn, generic_plans=True)
    try:
        cyclone_env.mux().register(h.ok)
        for i in range(3):
            cyclone_env.client().enqueue(h.ok, {"i": i})
        a, b, c = store.claims.claim(owner=OWNER, queues=["default"], names=["ok"], limit=3, ttl=30).rows
        settled = store.outcomes.settle(owner=OWNER, completions=[
            (c["id"], c["lease_generation"], {"mine": "c"}, {"done": 3}, 0.25),
            (a["id"], a["lease_generation"] - 1, {"stale": "a"}, None, 9.0),  # an older lease of a
            (b["id"], b["lease_generation"], [1, "b"], None, None),
            (a["id"], a["lease_generation"], {"mine": "a"}, None, 0.5),
        ])
        assert settled.completed == {(x["id"], x["lease_generation"]) for x in (a, b, c)}  # each by its current lease
        with connect(cyclone_env.dsn) as conn:
            rows = {r["id"]: r for r in conn.execute(
                "SELECT id, state, output, progress, extract(epoch FROM start_delay)::float8 AS delay FROM cyclone_steps")}
        assert [tuple(rows[x["id"]][k] for k in ("state", "output", "progress", "delay")) for x in (a, b, c)] == [
            ("completed", {"mine": "a"}, None, 0.5), ("completed", [1, "b"], None, None),
            ("completed", {"mine": "c"}, {"done": 3}, 0.25)]
    finally:
        store.close()


AWKWARD_OUTPUTS = [
    None, "", "NULL", 'a "quoted" \\ back\\slash', "{braces}, commas, and spaces", "caf\u00e9 \u2603 \U0001f600",
    {"k": 'v"}', "nested": [None, {"x": "\\\""}]}, [1, 2.5, -3, 10 ** 30, True, False], 0, "\n\t",
]


def test_awkward_outputs_and_progress_are_stored_exactly(cyclone_env):
    """A tick's outputs, progress values and start delays reach the statement as array
    literals (store.queries.completion_arrays): quotes, backslashes, braces, commas, a
    JSON null, the text NULL, non-ASCII text and a 31-digit integer are stored as given."""
    store = Store.open(cyclone_env.dsn, generic_plans=True)
    try:
        cyclone_env.mux().register(h.ok)
        n = len(AWKWARD_OUTPUTS)
        for i in range(n):
            cyclone_env.client().enqueue(h.ok, {"i": i})
        rows = store.claims.claim(owner=OWNER, queues=["default"], names=["ok"], limit=n, ttl=30).rows
        assert len(rows) == n
        progress = [None if i % 2 else {"message": out} for i, out in enumerate(AWKWARD_OUTPUTS)]
        settled = store.outcomes.settle(owner=OWNER, completions=[
            (r["id"], r["lease_generation"], out, prog, None if i % 3 else 0.25)
            for i, (r, out, prog) in enumerate(zip(rows, AWKWARD_OUTPUTS, progress))])
        assert len(settled.completed) == n
        with connect(cyclone_env.dsn) as conn:
            got = {r["id"]: r for r in conn.execute(
                "SELECT id, state, output, progress, extract(epoch FROM start_delay)::float8 AS delay "
                "FROM cyclone_steps")}
        for i, (r, out, prog) in enumerate(zip(rows, AWKWARD_OUTPUTS, progress)):
            row = got[r["id"]]
            assert (row["state"], row["output"], row["progress"]) == ("completed", out, prog), i
            if i % 3 == 0:
                assert row["delay"] == 0.25, i
    finally:
        store.close()


def test_a_runs_completion_is_a_hot_update(cyclone_env):
    """Migration 0004: no index of cyclone_runs covers what a completion writes, so the
    run's update writes no index entry (PostgreSQL counts it in n_tup_hot_upd)."""
    cyclone_env.mux().register(h.ok)
    cyclone_env.client().enqueue_many(h.ok, [{"i": i} for i in range(20)])
    with connect(cyclone_env.dsn) as conn:
        indexed = conn.execute(
            "SELECT DISTINCT a.attname FROM pg_index i "
            "JOIN pg_attribute a ON a.attrelid = i.indrelid "
            " AND (a.attnum = ANY(i.indkey) OR pg_get_expr(i.indpred, i.indrelid) LIKE '%' || a.attname || '%' "
            "      OR pg_get_expr(i.indexprs, i.indrelid) LIKE '%' || a.attname || '%') "
            "WHERE i.indrelid = 'cyclone_runs'::regclass").fetchall()
    assert {r["attname"] for r in indexed} & {"state", "finished_at", "updated_at"} == set()
    store = Store.open(cyclone_env.dsn)
    try:
        rows = store.claims.claim(owner=OWNER, queues=["default"], names=["ok"], limit=20, ttl=30).rows
        done = store.outcomes.complete(owner=OWNER, items=[(r["id"], r["lease_generation"], None, None) for r in rows])
        assert len(done) == 20
    finally:
        store.close()  # a backend flushes its statistics when it exits
    with connect(cyclone_env.dsn) as conn:
        deadline = time.monotonic() + 10
        while True:
            stats = conn.execute("SELECT n_tup_upd, n_tup_hot_upd FROM pg_stat_user_tables "
                                 "WHERE relname = 'cyclone_runs'").fetchone()
            if stats["n_tup_upd"] >= 20 or time.monotonic() > deadline:
                break
            time.sleep(0.1)
            conn.execute("SELECT pg_stat_clear_snapshot()")
    assert stats["n_tup_upd"] == 20
    assert stats["n_tup_hot_upd"] >= 15  # all, unless a page had no room left


def test_an_error_entrys_time_is_utc_text_whatever_the_session_time_zone(cyclone_env):
    """The dashboard orders recent kills by the text of the latest entry's "at"
    (cyclone_steps_kills_idx): every path that writes an entry writes UTC, also when
    the database's TimeZone is not UTC (it used to follow the session's)."""
    with connect(cyclone_env.dsn) as conn:
        dbname = conn.info.dbname
        conn.execute(psycopg.sql.SQL("ALTER DATABASE {} SET timezone = 'Asia/Kolkata'").format(
            psycopg.sql.Identifier(dbname)))
        conn.commit()
    store = Store.open(cyclone_env.dsn)  # a new session: the +05:30 time zone
    try:
        assert store.conn.execute("SHOW timezone").fetchone()["TimeZone"] == "Asia/Kolkata"
        cyclone_env.mux().register(h.raises)
        _, (a, b) = claim_two(cyclone_env, store, h.raises, max_reclaims=0)
        assert store.outcomes.fail_many(owner=OWNER, items=[FailedAttempt(
            id=a["id"], generation=a["lease_generation"], kind=decisions.ERROR, entry={}, delay=0.0,
            require_timed_out=False)]) == {(a["id"], a["lease_generation"])}
        with connect(cyclone_env.dsn) as conn:
            conn.execute("UPDATE cyclone_steps SET lease_expiry = now() - interval '1 second' WHERE id = %s",
                         (b["id"],))
        assert store.sweep.expire(b["id"], lambda name: (lambda n: 0.0), {}).action == "reclaim_limit"
        (again,) = store.claims.claim(owner=OWNER, queues=["default"], names=[h.raises.name], limit=1, ttl=30).rows
        assert again["id"] == a["id"]  # its retry
        assert store.outcomes.fail(owner=OWNER, id=a["id"], generation=again["lease_generation"], kind=decisions.ERROR,
                                   entry={}, backoff=lambda n: 0.0).status == "applied"
        now = time.time()
        with connect(cyclone_env.dsn) as conn:
            entries = [r["e"] for r in conn.execute(
                "SELECT e FROM cyclone_steps, jsonb_array_elements(errors) e WHERE id = ANY(%s) ORDER BY id",
                ([a["id"], b["id"]],)).fetchall()]
        assert [e["kind"] for e in entries] == ["error", "error", "reclaim_limit"]
        for e in entries:
            assert e["at"].endswith("+00:00"), e["at"]
            at = dt.datetime.fromisoformat(e["at"]).timestamp()
            assert now - 60 < at <= now + 1
    finally:
        store.close()


def test_a_kill_after_the_sweep_stores_the_forensics_and_the_last_progress(cyclone_env):
    """The recovery sweep settles a timed-out attempt with the progress its heartbeats
    stored; progress reported after the last renewal reaches only the killing supervisor,
    whose late failure (its lease lost) adds it with the kill's forensics. Once the step
    was claimed again, the new attempt's progress stays and only the old entry is annotated."""
    store = Store.open(cyclone_env.dsn)
    try:
        cyclone_env.mux().register(h.raises)
        ids = [cyclone_env.client().enqueue(h.raises, {}, timeout=1, max_attempts=n) for n in (1, 2)]
        rows = store.claims.claim(owner=OWNER, queues=["default"], names=[h.raises.name], limit=2, ttl=30).rows
        assert len(rows) == 2
        by_run = {r["run_id"]: r for r in rows}
        once, twice = by_run[ids[0]], by_run[ids[1]]
        for row in rows:
            age(cyclone_env.dsn, row["id"], 5)
            assert store.sweep.expire(row["id"], lambda name: (lambda n: 0.0), {}).action == "timeout"
        store.leases.mark_dead([(twice["id"], twice["lease_generation"])])  # reaped: its retry is claimable
        (again,) = store.claims.claim(owner=OWNER, queues=["default"], names=[h.raises.name], limit=1, ttl=30).rows
        assert again["id"] == twice["id"] and again["lease_generation"] > twice["lease_generation"]
        with connect(cyclone_env.dsn) as conn:  # (its heartbeat's write: a renewal past its 1 s timeout matches nothing)
            conn.execute("UPDATE cyclone_steps SET progress = %s WHERE id = %s",
                         (Jsonb({"done": 9, "total": None, "message": "retry"}), again["id"]))
        killed = {"killed_by_supervisor": True, "signal": 9, "trigger": "timeout", "start_delay": 0.25,
                  "message": "child killed by the supervisor"}
        for row in (once, twice):
            result = store.outcomes.fail(
                owner=OWNER, id=row["id"], generation=row["lease_generation"], kind=decisions.TIMEOUT,
                entry=killed, backoff=lambda n: 0.0, require_timed_out=True,
                progress={"done": 1, "total": None, "message": "pids=1,2"})
            assert result.status == "lost"
        with connect(cyclone_env.dsn) as conn:
            stored = {r["id"]: r for r in conn.execute(
                "SELECT id, state, error, progress, errors, extract(epoch FROM start_delay) AS start_delay"
                "  FROM cyclone_steps WHERE id = ANY(%s)",
                ([once["id"], twice["id"]],)).fetchall()}
        assert stored[once["id"]]["state"] == "discarded"
        assert stored[once["id"]]["progress"] == {"done": 1, "total": None, "message": "pids=1,2"}
        assert float(stored[once["id"]]["start_delay"]) == 0.25
        assert stored[twice["id"]]["state"] == "running"
        assert stored[twice["id"]]["progress"] == {"done": 9, "total": None, "message": "retry"}
        assert stored[twice["id"]]["start_delay"] is None
        for row in stored.values():
            (entry,) = row["errors"]
            assert entry["kind"] == "timeout" and entry["killed_by_supervisor"] is True, entry
            assert entry["message"].endswith("; child killed by the supervisor"), entry
        for row in stored.values():  # the step's error is its last entry's message
            assert row["error"] == row["errors"][-1]["message"], row
    finally:
        store.close()
