"""Database errors are classified by SQLSTATE, never by exception class: a call the
server rejects (an index row too large; a 10 kB idempotency key is refused before) is
that call's error, not an outage; a terminated session and a full disk are outages, and
the supervisor outlasts a full disk; a fan-in too big for jsonb or for one task is
claimed, loaded with its own statement timeout, and fails its join saying its size."""

from __future__ import annotations

import json
import logging
import secrets
from typing import Any

import psycopg
import pytest

from cyclone_mp import protocol
from cyclone_mp.errors import (
    ConfigurationError, DatabaseBusy, DatabaseDiskFull, DatabaseError, DatabaseUnavailable, QueryRejected,
)
from cyclone_mp.store import NodeRow, Store, classify, connect, operations

import handlers as h
import hostile_handlers as hh
from waiting import wait_for


# -- 1. database errors classified by SQLSTATE ---------------------------------------------------


@pytest.mark.parametrize("error,expected", [
    (psycopg.errors.ProgramLimitExceeded, QueryRejected),  # 54000: jsonb over 256 MB, index row too large
    (psycopg.errors.StatementTooComplex, QueryRejected),  # 54001
    (psycopg.errors.NumericValueOutOfRange, QueryRejected),  # 22003
    (psycopg.errors.UntranslatableCharacter, QueryRejected),  # 22P05
    (psycopg.errors.UniqueViolation, QueryRejected),  # 23505
    (psycopg.errors.AdminShutdown, DatabaseUnavailable),  # 57P01
    (psycopg.errors.CannotConnectNow, DatabaseUnavailable),  # 57P03
    (psycopg.errors.ConnectionFailure, DatabaseUnavailable),  # 08006
    (psycopg.errors.IdleInTransactionSessionTimeout, DatabaseUnavailable),  # 25P03
    (psycopg.OperationalError, DatabaseUnavailable),  # no SQLSTATE: the connection was lost
    (psycopg.errors.QueryCanceled, DatabaseBusy),  # 57014 statement_timeout: nothing done, try again (issue 17)
    (psycopg.errors.LockNotAvailable, DatabaseBusy),  # 55P03 lock_timeout: the same
    (psycopg.errors.UndefinedTable, DatabaseError),  # 42P01: neither
    (psycopg.errors.DiskFull, DatabaseDiskFull),  # 53100: an outage, named
    (psycopg.errors.OutOfMemory, DatabaseUnavailable),  # 53200: the same
])
def test_classify_by_sqlstate_not_by_exception_class(error, expected):
    got = classify(error("total size of jsonb object elements exceeds the maximum of 268435455 bytes"))
    assert type(got) is expected, got
    if expected is QueryRejected:
        assert got.sqlstate == error.sqlstate and f"SQLSTATE {error.sqlstate}" in str(got)
        assert str(got).startswith("the database rejected the call")


def test_a_broken_connection_is_an_outage_whatever_the_sqlstate():
    assert type(classify(psycopg.errors.ProgramLimitExceeded("x"), broken=True)) is DatabaseUnavailable


def test_index_row_too_large_is_a_rejected_call_not_an_outage(cyclone_dsn):
    """Issue 18 fault 1: a 10 kB idempotency key reported "database unavailable: index
    row requires 10016 bytes" (and a supervisor took the same class of error for an
    outage). Written past the client's check, it is a QueryRejected of that call, and
    the connection goes on."""
    store = Store.open(cyclone_dsn)
    try:
        key = secrets.token_hex(5000)  # 10,000 characters, incompressible
        node = NodeRow(node="ok", step_name="ok", kind="task", depends_on=(), queue="default", priority=0,
                       state="available", max_attempts=1, max_reclaims=None, timeout=None)
        with pytest.raises(QueryRejected) as info:
            store.runs.enqueue(name="ok", kind="step", input={}, nodes=[node], delay=0, idempotency_key=key)
        assert info.value.sqlstate == "54000" and "index row requires" in str(info.value)
        assert not isinstance(info.value, DatabaseUnavailable)
        assert not store.broken
        run_id, created = store.runs.enqueue(name="ok", kind="step", input={}, nodes=[node], delay=0,
                                                 idempotency_key="short")
        assert created and run_id
    finally:
        store.close()


def test_a_terminated_session_is_an_outage(cyclone_dsn):
    store = Store.open(cyclone_dsn)
    try:
        pid = store.conn.info.backend_pid
        with psycopg.connect(cyclone_dsn, autocommit=True) as admin:
            admin.execute("SELECT pg_terminate_backend(%s)", (pid,))
        with pytest.raises(DatabaseUnavailable):
            store.run(operations.list_runs())
    finally:
        store.close()


def test_a_full_disk_is_named_and_is_an_outage_not_a_rejected_call():
    error = classify(psycopg.errors.DiskFull('could not extend file "base/16384/16390": No space left on device'))
    assert type(error) is DatabaseDiskFull and isinstance(error, DatabaseUnavailable)
    assert str(error) == ("the database server's disk is full (SQLSTATE 53100): could not extend file "
                          '"base/16384/16390": No space left on device')
    assert str(classify(psycopg.errors.OutOfMemory("out of memory"))).startswith(
        "the database server is out of memory (SQLSTATE 53200)")


DISK_FULL = """
CREATE FUNCTION cyclone_test_disk_full() RETURNS trigger LANGUAGE plpgsql AS $$
BEGIN
    RAISE EXCEPTION 'could not extend file "base/1/2": No space left on device' USING ERRCODE = 'disk_full';
END $$;
CREATE TRIGGER cyclone_test_disk_full BEFORE UPDATE ON cyclone_steps FOR EACH ROW
    WHEN (NEW.state = 'completed') EXECUTE FUNCTION cyclone_test_disk_full();
CREATE TRIGGER cyclone_test_disk_full BEFORE INSERT ON cyclone_runs FOR EACH ROW
    EXECUTE FUNCTION cyclone_test_disk_full();
"""


def test_a_full_disk_is_an_outage_the_supervisor_outlasts(cyclone_env_factory, caplog):
    """The server refuses writes with SQLSTATE 53100 (here a trigger raises it: on every
    completion and every new run). An enqueue fails with DatabaseDiskFull, saying so; the
    supervisor takes it for an outage (it keeps the outcome and writes it again once
    space is back), never for a bad row: the step completes once, on its first attempt."""
    env = cyclone_env_factory(worker="thread")
    env.mux().register(h.ok)
    run_id = env.enqueue(h.ok, {"n": 1})
    with connect(env.dsn) as conn:
        conn.execute(DISK_FULL)
    caplog.set_level(logging.INFO, logger="cyclone_mp")
    with pytest.raises(DatabaseDiskFull, match=r"^the database server's disk is full \(SQLSTATE 53100\)"):
        env.client().enqueue(h.ok, {"n": 2})
    handle = env.start_worker()
    wait_for(lambda: any("disk is full" in r.getMessage() and "database lost" in r.getMessage()
                         for r in caplog.records), 30, "the writer to meet the full disk")
    with connect(env.dsn) as conn:
        row = conn.execute("SELECT state, errors FROM cyclone_steps WHERE run_id = %s", (run_id,)).fetchone()
        assert (row["state"], row["errors"]) == ("running", [])  # not failed as a bad row: kept to write again
        conn.execute("DROP FUNCTION cyclone_test_disk_full() CASCADE")
    done = env.run_until_complete(run_id, timeout=30)
    assert (done.state, done.step.attempt, done.step.errors) == ("completed", 1, [])
    assert handle.alive()


def test_idempotency_key_of_10kB_is_bad_input(cyclone_env):
    """Issue 18 fault 1, second half: the key's size is checked at enqueue."""
    with pytest.raises(ConfigurationError, match="at most 1024 bytes"):
        cyclone_env.enqueue(h.ok, {}, idempotency_key="k" * 10_000)
    with pytest.raises(ConfigurationError, match="NUL"):
        cyclone_env.enqueue(h.ok, {}, idempotency_key="a\x00b")
    assert cyclone_env.enqueue(h.ok, {}, idempotency_key="é" * 512)  # 1024 bytes: the limit itself


@pytest.mark.slow  # 280 MB through PostgreSQL: 30 s alone, minutes on a busy machine
def test_a_fan_in_past_jsonbs_limit_is_claimed_and_is_not_an_outage(cyclone_env_factory, caplog, tmp_path):
    """Issue 18 fault 1, the issue's exact case: five 56 MB outputs into one join exceed
    jsonb's 256 MB. Claiming the join used to fail every time and was taken for an
    outage ("database lost; reconnecting" 58 times in 40 s): no heartbeats, and an
    unrelated handler running meanwhile was killed as lease_lost. The claim now builds
    the upstream outputs as text (1 GB) and the child reads them under the payload
    rules: the join ends with a clear outcome, the supervisor never loses its database,
    and the unrelated step completes."""
    ttl = 4.0  # long enough for the supervisor to move 56 MB outputs between two renewals
    env = cyclone_env_factory(worker="thread", workers=2, lease_ttl=ttl, max_payload=64 * 1024 * 1024)
    env.mux().register(hh.fan_in, hh.sleep_until)
    flag = tmp_path / "release"
    unrelated = env.enqueue(hh.sleep_until, {"path": str(flag), "max": 120})
    handle = env.start_worker()
    env.wait_for_state(unrelated, None, "running", timeout=30)
    caplog.set_level(logging.INFO, logger="cyclone_mp")
    run_id = env.client().enqueue(hh.fan_in, {"mb": 56})

    def states() -> dict[str, dict[str, Any]]:  # (status() would read 280 MB of outputs each time)
        with connect(env.dsn) as conn:
            return {r["node"]: r for r in conn.execute(
                "SELECT node, state, error_kind, error FROM cyclone_steps WHERE run_id = %s", (run_id,))}

    wait_for(lambda: all(states()[f"part{i}"]["state"] == "completed" for i in range(5)), 120, "the five 56 MB parts")
    first = len(caplog.records)
    join = wait_for(lambda: (lambda s: s if s["state"] in ("completed", "discarded") else None)(states()["join"]),
                    300, "the join to end", interval=0.2)
    if join["state"] == "discarded":  # the fan-in is over max_payload: a clear, permanent error
        assert join["error_kind"] == "permanent" and "upstream" in (join["error"] or ""), join
    flag.write_text("go")
    done = env.run_until_complete(unrelated, timeout=30)
    assert (done.state, done.step.attempt, done.step.errors) == ("completed", 1, [])
    assert done.step.output == {"saw_file": True}
    assert handle.alive()
    lost = [r.getMessage() for r in caplog.records[first:] if "database lost" in r.getMessage()]
    assert not lost, lost[:3]


def test_a_fan_in_is_loaded_with_its_own_statement_timeout(cyclone_env):
    """The upstream outputs too big to come with a claim are loaded by maintenance, whose
    session's statement_timeout is a write's bound: a big fan-in failed its join as
    "database busy: statement timeout". The load has its own (here the session's is
    1 ms), and says the upstream object's size."""
    run_id = cyclone_env.enqueue(hh.noisy_fan_in, {"bytes": 400_000})
    with connect(cyclone_env.dsn) as conn:
        conn.execute("UPDATE cyclone_steps SET state = 'completed', output = to_jsonb("
                     "(SELECT string_agg(md5(i::text || node), '') FROM generate_series(1, 12500) i))"
                     " WHERE run_id = %s AND node <> 'join'", (run_id,))
        join = conn.execute("SELECT id FROM cyclone_steps WHERE run_id = %s AND node = 'join'",
                            (run_id,)).fetchone()["id"]
    store = Store.open(cyclone_env.dsn, statement_timeout=0.001)
    try:
        with pytest.raises(DatabaseBusy, match="statement timeout"):  # the session's bound alone
            store.payloads.load(join)
        payload = store.payloads.load(join, statement_timeout=60)
        upstream = json.loads(payload["upstream"])
        assert sorted(upstream) == [f"part{i}" for i in range(5)] and len(upstream["part0"]) == 400_000
        assert payload["upstream_outputs"] == 5 and payload["upstream_bytes"] == len(payload["upstream"].encode())
        over = store.payloads.load(join, statement_timeout=60, max_upstream=payload["upstream_bytes"] - 1)
        assert over["upstream"] is None and over["upstream_bytes"] == payload["upstream_bytes"]
    finally:
        store.close()


def test_the_upstream_size_message_names_the_size_and_the_limit():
    limit = protocol.upstream_limit(64 * 1024 * 1024)
    assert limit == (1 << 30) - 64 * 1024 * 1024 - protocol.FRAME_ENVELOPE
    assert protocol.upstream_too_big("join", 5, 1_234_500_000, limit) == (
        "the upstream outputs of step 'join' total 1234.5 MB (5 outputs), over the 1007 MB a step's upstream "
        "outputs may total (they reach the step as one JSON text, and PostgreSQL's text values hold at most 1 GB)")


def test_a_fan_in_over_the_limit_fails_its_join_saying_its_size(cyclone_env_factory, monkeypatch):
    """A join whose upstream outputs total more than a task can carry (here the limit is
    made 1 MB, for five 0.4 MB outputs) is discarded at once, permanently, with a
    message that says their size and the limit: never a statement timeout."""
    from cyclone_mp import loader

    monkeypatch.setattr(loader, "upstream_limit", lambda max_payload: 1_000_000)
    env = cyclone_env_factory(worker="thread")
    env.mux().register(hh.noisy_fan_in)
    run_id = env.enqueue(hh.noisy_fan_in, {"bytes": 400_000})
    handle = env.start_worker()
    run = env.run_until_complete(run_id, timeout=60)
    join = run.steps["join"]
    assert (run.state, join.state, join.error_kind, join.attempt) == ("discarded", "discarded", "permanent", 1)
    assert join.error.startswith("the upstream outputs of step 'join' total 2.0 MB (5 outputs), over the 1 MB a "
                                 "step's upstream outputs may total"), join.error
    assert "timeout" not in join.error
    assert all(run.steps[f"part{i}"].state == "completed" for i in range(5))
    assert handle.alive()


# -- 4. a run another session holds locked holds back its own step only ------------------------


def test_a_run_locked_elsewhere_holds_back_only_its_own_step(cyclone_env_factory):
    """4,000 no-ops; another session holds the run row of one of them locked (``SELECT
    ... FOR UPDATE``, as an operator's transaction might). The other 3,999 complete at the
    supervisor's usual pace: the settle statements skip the locked run instead of
    waiting on it past lock_timeout (1 s here) and failing with every outcome of their
    batch and their claim. The locked one completes once the lock goes, its first
    attempt, never reclaimed."""
    import time

    env = cyclone_env_factory(workers=2, lease_ttl=30)
    env.mux().register(h.ok)
    client = env.client()
    run_ids = client.enqueue_many(h.ok, [{}] * 4000)
    locked = run_ids[50]
    locker = psycopg.connect(env.dsn)
    try:
        locker.execute("SELECT 1 FROM cyclone_runs WHERE id = %s FOR UPDATE", (locked,))
        started = time.monotonic()
        env.start_worker()

        def finished() -> int:
            with connect(env.dsn) as conn:
                return conn.execute("SELECT count(*) AS n FROM cyclone_steps WHERE state = 'completed'").fetchone()["n"]

        wait_for(lambda: finished() == 3999, 60, "the 3,999 other steps")
        took = time.monotonic() - started
        print(f"3,999 steps beside a locked run in {took:.2f} s")
        assert took < 8, took  # waiting on it a second at a time, they were not done after 60 s
        assert client.status(locked).step.state == "running"
        locker.rollback()
        status = env.run_until_complete(locked, timeout=15)
        assert (status.state, status.step.attempt, status.step.reclaims) == ("completed", 1, 0)
    finally:
        locker.close()
