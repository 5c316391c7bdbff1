"""A single enqueue (issue 23): one round trip on a warm pool, and every option still counts.

A pooled connection is checked without a round trip (``cyclone_mp.connections.check_pooled``:
only when the server said something on it while it was idle); a step's options are
composed once and kept. These tests pin what must not change with that: one statement
per enqueue, a connection the server ended replaced without an error, and the options
of each enqueue (the step's, the client's, the call's, a key computed from the input)
on its row.
"""

from __future__ import annotations

import os
import tempfile
import time

import pytest

import cyclone_mp as cy
from cyclone_mp.store import connect

import flow_handlers as fh
import handlers as h
from waiting import wait_for


@cy.step("prioritized", priority=3, max_attempts=7, timeout=9)
def prioritized(ctx: cy.Context, inp: dict) -> None:
    return None


def _pool_conn(client):
    """(get, put) of the one pooled connection of a warm client, sync or async."""
    if isinstance(client, cy.Client):
        pool = client._calls.pool()
        return pool.getconn, pool.putconn
    facade = client  # clients.SyncOverAsync
    pool = facade.call(facade.async_client._calls.pool())
    return (lambda: facade.call(pool.getconn())), (lambda conn: facade.call(pool.putconn(conn)))


def round_trips(trace_text: str) -> int:
    """Round trips in a libpq trace: each ends with the server's ReadyForQuery."""
    return sum(1 for line in trace_text.splitlines() if line.startswith("B\t") and "ReadyForQuery" in line)


def test_a_single_enqueue_is_one_round_trip(api_env):
    """On a warm pool an enqueue sends one statement and waits once (libpq's trace of the
    pooled connection: one ReadyForQuery), for both clients; its run is written."""
    from psycopg import pq

    client = api_env.client()
    for _ in range(8):  # warm: the pool's connection is open and the statement prepared
        client.enqueue(h.ok, {})
    get, put = _pool_conn(client)
    conn = get()
    fd, path = tempfile.mkstemp(prefix="libpq-trace-")
    try:
        conn.pgconn.trace(fd)
        conn.pgconn.set_trace_flags(pq.Trace.SUPPRESS_TIMESTAMPS | pq.Trace.REGRESS_MODE)
        put(conn)
        run_id = client.enqueue(h.ok, {"traced": True})
        conn.pgconn.untrace()
        with open(path) as fh:
            text = fh.read()
    finally:
        os.close(fd)
        os.unlink(path)
    assert round_trips(text) == 1, text
    assert api_env.status(run_id).step.state == "available"


def test_a_pooled_connection_the_server_ended_is_replaced_without_an_error(api_env):
    """The server ends the idle pooled connection (pg_terminate_backend, as a restart
    does): the next enqueue goes through on a new connection, once."""
    client = api_env.client()
    client.enqueue(h.ok, {})
    app = "cyclone_mp client" if isinstance(client, cy.Client) else "cyclone_mp async client"
    with connect(api_env.dsn) as admin:
        pids = [r["pid"] for r in admin.execute(
            "SELECT pid FROM pg_stat_activity WHERE application_name = %s AND datname = current_database()",
            (app,)).fetchall()]
        assert pids
        for pid in pids:
            admin.execute("SELECT pg_terminate_backend(%s)", (pid,))
        wait_for(lambda: not admin.execute("SELECT 1 FROM pg_stat_activity WHERE pid = ANY(%s)", (pids,)).fetchall(),
                 10, "the pooled sessions ended")
        run_id = client.enqueue(h.ok, {"after": "terminate"})
        rows = admin.execute("SELECT r.id::text AS id, s.state FROM cyclone_runs r JOIN cyclone_steps s ON s.run_id = r.id"
                             " WHERE r.input = %s::jsonb", ('{"after": "terminate"}',)).fetchall()
    assert rows == [{"id": run_id, "state": "available"}]


def _row(dsn: str, run_id: str) -> dict:
    with connect(dsn) as conn:
        return conn.execute(
            "SELECT s.priority, s.max_attempts, extract(epoch FROM s.timeout)::float8 AS timeout, s.queue,"
            " s.concurrency_key, s.concurrency, r.input FROM cyclone_steps s JOIN cyclone_runs r ON r.id = s.run_id"
            " WHERE s.run_id = %s", (run_id,)).fetchone()


def test_each_enqueue_gets_its_own_options_though_a_step_row_is_kept(api_env):
    """The step's options over the client's, the call's over both, a step's key computed
    from each input; an enqueue without options after one with them gets the step's."""
    client = api_env.client()
    api_env.mux().register(prioritized)
    plain = client.enqueue(prioritized, {"n": 1})
    custom = client.enqueue(prioritized, {"n": 2}, priority=1, max_attempts=2, queue="other")
    again = client.enqueue("prioritized", {"n": 3})
    assert _row(api_env.dsn, plain) == {"priority": 3, "max_attempts": 7, "timeout": 9.0, "queue": "default",
                                        "concurrency_key": "", "concurrency": None, "input": {"n": 1}}
    assert _row(api_env.dsn, custom) == {"priority": 1, "max_attempts": 2, "timeout": 9.0, "queue": "other",
                                         "concurrency_key": "", "concurrency": None, "input": {"n": 2}}
    assert _row(api_env.dsn, again) == {**_row(api_env.dsn, plain), "input": {"n": 3}}
    keyed = [client.enqueue(fh.per_tenant, {"tenant": t}) for t in ("a", "b", "a")]
    assert [(_row(api_env.dsn, r)["concurrency_key"], _row(api_env.dsn, r)["concurrency"]) for r in keyed] == [
        ("a", 2), ("b", 2), ("a", 2)]


def test_an_input_stored_as_given(api_env):
    """The checked JSON text is what is stored: unicode, floats, nesting and null come
    back equal (the input is encoded once now, not twice)."""
    value = {"text": "caf\u00e9 \u2603 \U0001f600", "f": 0.1, "big": 2 ** 62, "nested": [[{"a": None}]], "t": True}
    run_id = api_env.client().enqueue(h.ok, value)
    assert _row(api_env.dsn, run_id)["input"] == value
    assert api_env.client().enqueue(h.ok, None) and api_env.status(run_id).input == value
