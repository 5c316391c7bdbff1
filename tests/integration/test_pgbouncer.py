"""The engine through PgBouncer in transaction mode (issue 22, acceptance 1).

Every test runs twice: with ``max_prepared_statements`` off (the supervisors prepare
nothing, ``prepared_statements=False``) and on (PgBouncer 1.21 or later keeps named
prepared statements per server connection, ``prepared_statements=True``). The pool has
fewer server connections than there are clients, so clients really share them: any
session state the engine relied on would leak or be missing. The core cases are the
engine suite's: the SPEC 3 table, cancel, crash reclaim and workflows.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import psycopg
import pytest

from cyclone_mp.store import PooledConnection, Store
from cyclone_mp.testing import Env
from cyclone_mp.testing.pgbouncer import PgBouncer, PgBouncerMissing

import handlers as h
import workflow_handlers as wh
from waiting import wait_exited

MODES = {"prepared-off": 0, "prepared-on": 100}  # PgBouncer's max_prepared_statements


@pytest.fixture(scope="module", params=list(MODES))
def bouncer(request, cyclone_server):
    """``(mode, PgBouncer)``: one PgBouncer per mode for this module, 3 server connections per database."""
    try:
        pgb = PgBouncer(cyclone_server.admin_dsn, max_prepared_statements=MODES[request.param], pool_size=3)
    except PgBouncerMissing as exc:
        pytest.skip(str(exc))
    try:
        yield request.param, pgb
    finally:
        pgb.close()
        assert pgb.pid is None


@pytest.fixture
def bounced(bouncer, cyclone_dsn):
    """``factory(**options) -> Env`` whose client and supervisors reach the test's database
    through PgBouncer, with the options of the mode."""
    mode, pgb = bouncer
    made: list[Env] = []

    def factory(**options):
        options = {"lease_ttl": 1.0, "pgbouncer": True, "prepared_statements": mode == "prepared-on", **options}
        env = Env(pgb.dsn(cyclone_dsn), **options)
        made.append(env)
        return env

    try:
        yield factory
    finally:
        for env in reversed(made):
            env.close()


def _prepared_on_servers(pgb: PgBouncer) -> int:
    """Prepared statements PgBouncer holds on its server connections (1.21 and later)."""
    return sum(int(row.get("prepared_statements") or 0) for row in pgb.show("SERVERS"))


def test_the_state_table_through_pgbouncer(bounced, bouncer):
    env = bounced()
    ok = env.enqueue(h.ok, {"x": 1})
    raises = env.enqueue(h.raises, {})
    permanent = env.enqueue(h.permanent, {})
    exits = env.enqueue(h.exits, {"code": 7})
    timeout = env.enqueue(h.cooperative, {})
    env.start_worker()
    run = env.run_until_complete(ok)
    assert (run.state, run.step.attempt, run.step.output["echo"]) == ("completed", 1, {"x": 1})
    step = env.run_until_complete(raises).step
    assert (step.state, step.attempt, step.error_kind) == ("discarded", 3, "error")
    assert [e["attempt"] for e in step.errors] == [1, 2, 3]
    step = env.run_until_complete(permanent).step
    assert (step.state, step.attempt, step.error_kind) == ("discarded", 1, "permanent")
    step = env.run_until_complete(exits).step
    assert (step.state, step.attempt, step.error_kind) == ("discarded", 2, "child_exited")
    assert [e["exit_code"] for e in step.errors] == [7, 7]
    step = env.run_until_complete(timeout).step
    assert (step.state, step.attempt, step.error_kind) == ("discarded", 2, "timeout")
    mode, pgb = bouncer
    if mode == "prepared-on":
        assert _prepared_on_servers(pgb) > 0  # PgBouncer kept the supervisors' prepared statements


def test_cancel_through_pgbouncer(bounced):
    env = bounced(kill_grace=0.5, workers=1)
    run_id = env.enqueue(h.sleeper, {"seconds": 60})
    env.start_worker()
    env.wait_for_state(run_id, None, "running", timeout=15)
    [pid] = env.child_pids()
    assert env.client().cancel(run_id) == 1
    step = env.status(run_id).step
    assert (step.state, step.attempt, step.error) == ("cancelled", 1, None)
    # the heartbeat (every lease_ttl/3) finds the cancel; the child is killed after kill_grace
    assert wait_exited([pid], 1.0 / 3 + 0.5 + 3.0) == []


def test_crash_reclaim_through_pgbouncer(bounced, tmp_path):
    env = bounced()
    log = tmp_path / "log"
    run_id = env.enqueue(h.sleeper, {"seconds": 1.5, "log": str(log)})
    env.start_worker()
    generation = env.wait_for_state(run_id, None, "running", timeout=15).lease_generation
    env.crash_worker()
    env.start_worker()
    step = env.run_until_complete(run_id, timeout=30).step
    assert (step.state, step.attempt, step.reclaims, step.lease_generation) == ("completed", 1, 1, generation + 1)
    assert step.errors == []
    assert sum(1 for line in log.read_text().splitlines() if line.startswith("end")) == 1


def test_workflows_and_signals_through_pgbouncer(bounced, tmp_path):
    env = bounced()
    folder = tmp_path / "runs"
    folder.mkdir()
    diamond = env.enqueue(wh.diamond, {"dir": str(folder), "x": 42})
    approval = env.enqueue(wh.approval, {"dir": str(folder), "x": 1})
    env.start_worker()
    assert env.client().signal(approval, "approve", {"by": "alice"}) is True
    run = env.run_until_complete(diamond, timeout=30)
    assert {n: s.state for n, s in run.steps.items()} == dict.fromkeys("abcd", "completed")
    assert run.steps["d"].output["upstream"] == {"b": run.steps["b"].output, "c": run.steps["c"].output}
    run = env.run_until_complete(approval, timeout=30)
    assert run.state == "completed" and run.steps["publish"].output["upstream"] == {"approve": {"by": "alice"}}
    assert all(s.attempt == 1 and s.reclaims == 0 for s in run.steps.values())


def test_waits_poll_through_pgbouncer_and_listen_on_listen_dsn(bounced, cyclone_dsn):
    polling = bounced()
    listening = bounced(listen_dsn=cyclone_dsn)
    quick = polling.enqueue(h.ok, {"x": 2})
    polling.start_worker()
    assert polling.client().wait(quick, timeout=20).state == "completed"
    assert polling.client()._waiter().listening_connections == 0  # LISTEN through PgBouncer reaches nobody
    listening.mux().register(h.ok)
    other = listening.enqueue(h.ok, {"x": 3})
    listening.start_worker()
    assert listening.client().wait(other, timeout=20).state == "completed"
    assert listening.client()._waiter().listening_connections == 1
    with psycopg.connect(cyclone_dsn) as conn:  # the supervisors' LISTEN connections, all direct
        listeners = conn.execute("SELECT count(*) FROM pg_stat_activity WHERE datname = current_database()"
                                 " AND application_name LIKE 'cyclone_mp listener %%'").fetchone()[0]
    assert listeners == 1  # the one with listen_dsn; the other polls


# Slow-marked: in one CI run (prepared-on) and one local run of this file with the metrics
# tests (prepared-off), the second client waited PgBouncer's query_wait_timeout (120 s) for
# the single server connection; alone it passes. Not understood yet: issue 22 stays open.
@pytest.mark.slow
@pytest.mark.parametrize("mode", list(MODES))
def test_settings_are_per_transaction_and_never_leak(mode, cyclone_server, cyclone_dsn):
    """Through one shared server connection, a supervisor's connection sees its
    lock_timeout in every statement and transaction; the next client sees the default."""
    try:
        one = PgBouncer(cyclone_server.admin_dsn, pool_size=1, max_prepared_statements=MODES[mode])
    except PgBouncerMissing as exc:
        pytest.skip(str(exc))
    with one:
        dsn = one.dsn(cyclone_dsn)
        store = Store.open(dsn, generic_plans=True, lock_timeout=0.25, statement_timeout=3.0,
                           idle_in_transaction=2.0, pgbouncer=True, prepare=mode == "prepared-on")
        other = psycopg.connect(dsn, autocommit=True, prepare_threshold=None)
        try:
            assert isinstance(store.conn, PooledConnection)
            for _ in range(7):  # past psycopg's prepare threshold
                row = store.conn.execute("SELECT current_setting('lock_timeout') AS lock,"
                                         " current_setting('statement_timeout') AS statement").fetchone()
                assert (row["lock"], row["statement"]) == ("250ms", "3s")
                assert other.execute("SHOW lock_timeout").fetchone()[0] == "0"
            with store.conn.transaction():
                row = store.conn.execute("SELECT current_setting('idle_in_transaction_session_timeout') AS idle,"
                                         " current_setting('plan_cache_mode') AS plans").fetchone()
            assert row["idle"] == "2s"
            assert row["plans"] == ("force_generic_plan" if mode == "prepared-on" else "auto")
            assert other.execute("SHOW idle_in_transaction_session_timeout").fetchone()[0] == "0"
            assert store.conn.prepare_threshold == (0 if mode == "prepared-on" else None)
        finally:
            store.close()
            other.close()


def test_the_cli_goes_through_pgbouncer_with_its_global_option(bouncer, cyclone_dsn):
    """``cyclone-mp --pgbouncer`` (and CYCLONE_PGBOUNCER) reach every command's client."""
    mode, pgb = bouncer
    if mode != "prepared-off":
        pytest.skip("the option's wiring does not depend on the mode")
    repo = Path(__file__).resolve().parents[2]
    env = {**os.environ, "CYCLONE_PGBOUNCER": "1"}
    env.pop("CYCLONE_DSN", None)
    base = [sys.executable, "-m", "cyclone_mp_cli.main", "--dsn", pgb.dsn(cyclone_dsn)]
    made = subprocess.run([*base, "enqueue", "tests/support/cli_app.py:mux", "echo", "--input", '{"a": 1}', "--json"],
                          cwd=repo, env=env, capture_output=True, text=True, timeout=60)
    assert made.returncode == 0, made.stderr
    run_id = json.loads(made.stdout)["run_id"] if made.stdout.strip().startswith("{") else made.stdout.strip()
    shown = subprocess.run([*base, "--no-prepared-statements", "status", run_id, "--json"], cwd=repo, env=env,
                           capture_output=True, text=True, timeout=60)
    assert shown.returncode == 0, shown.stderr
    assert json.loads(shown.stdout)["state"] == "running"
