"""The engine on the test server's PostgreSQL, whichever version it is (CI runs the suite
on 14 to 18: ``CYCLONE_TEST_POSTGRES``), and maintenance that fails loudly.

- every named statement of the ``sql/*.sql`` files is accepted by this server (PREPARE: syntax,
  functions, operators, catalog columns);
- a server older than 14 is refused by ``migrate()`` and so by every supervisor, in one line;
- the maintenance turn works from the row as migration 0018 left it (``ran_at`` =
  ``-infinity``, which PostgreSQL before 17 cannot subtract from);
- a settle statement skips a row whose run another session holds locked, waiting for nothing;
- a cancelled attempt reported dead (never started, or reaped) frees its step at once;
- a SIGKILLed supervisor's step is reclaimed and completed by another within
  ``lease_ttl`` + 2 poll intervals, and a wedged step is discarded at its DB deadline;
- a sweep that keeps failing shows in ``workers``, the dashboard, the metrics and the log.
"""

from __future__ import annotations

import json
import logging
import re
import time
import urllib.request

import psycopg
import pytest

import cyclone_mp as cy
from cyclone_mp.store import operations
from cyclone_mp.store import connect
from cyclone_mp.store.queries import Q

import handlers as h
import scenario_handlers as sh
from cli_run import run_cli


def wait_until(predicate, timeout: float, interval: float = 0.05):
    deadline = time.monotonic() + timeout
    while True:
        value = predicate()
        if value or time.monotonic() > deadline:
            return value
        time.sleep(interval)


def server_version_num(dsn: str) -> int:
    with psycopg.connect(dsn) as conn:
        return int(conn.info.server_version)


# -- statements ------------------------------------------------------------------------------------


def test_every_named_statement_is_accepted_by_this_server(cyclone_dsn: str) -> None:
    """PREPARE each statement of the sql/*.sql files (parameters as $n, types inferred by the
    server): what differs between versions in syntax, functions, operators or catalog
    columns fails here, on the version CI runs this on."""
    rejected = {}
    with psycopg.connect(cyclone_dsn, autocommit=True) as conn:
        for name, text in Q.items():
            if name.endswith(("_ctes", "_expr")):
                continue  # fragments: spliced into the statements below
            params: list[str] = []

            def number(match: re.Match) -> str:
                if match[1] not in params:
                    params.append(match[1])
                return f"${params.index(match[1]) + 1}"

            body = re.sub(r"%\((\w+)\)[sb]", number, text).replace("%%", "%")
            body = re.sub(r"\{\d+\}", "", body)  # list_runs' and the archive's placeholders
            result = conn.pgconn.prepare(f"check_{name}".encode(), body.encode())
            if result.status != psycopg.pq.ExecStatus.COMMAND_OK:
                rejected[name] = (result.error_message or b"").decode().strip().splitlines()[0]
    assert not rejected, rejected


def test_a_server_older_than_14_is_refused_in_one_line(cyclone_dsn: str, monkeypatch) -> None:
    """migrate() checks server_version_num first; a supervisor migrates before it starts,
    so it refuses too, before any child or lease exists."""
    monkeypatch.setattr(operations.core, "MIN_SERVER_VERSION", server_version_num(cyclone_dsn) + 1)
    client = cy.Client(cyclone_dsn, cy.Mux().register(h.ok))
    try:
        with pytest.raises(cy.UnsupportedServer) as caught:
            client.migrate()
        message = str(caught.value)
        assert "\n" not in message and "server_version_num" in message and "is not supported" in message
        assert isinstance(caught.value, cy.ConfigurationError)
        with pytest.raises(cy.UnsupportedServer):
            client.start()
        assert client.supervisor is None or not client.supervisor.children
    finally:
        client.close()


def test_the_maintenance_turn_works_from_a_row_made_by_migration_0018(cyclone_dsn: str) -> None:
    """0018 made ran_at '-infinity'; the turn's statement subtracts only finite times, so
    PostgreSQL before 17 takes it too (it failed there with SQLSTATE 22008 on every call)."""
    from cyclone_mp.store import Store

    with connect(cyclone_dsn) as conn:
        conn.execute("UPDATE cyclone_maintenance SET ran_at = '-infinity', succeeded_at = NULL")
    store = Store.open(cyclone_dsn)
    try:
        first = store.sweep.turn("a", 1.0)
        second = store.sweep.turn("b", 1.0)
        assert first.mine and first.since_success is None
        assert not second.mine and 0.0 < second.wait <= 1.0
        store.sweep.succeeded("sweep")
        assert 0.0 <= store.sweep.turn("b", 1.0).since_success < 5.0
    finally:
        store.close()


# -- recovery --------------------------------------------------------------------------------------


def test_a_settle_skips_a_row_whose_run_another_session_holds_locked(cyclone_env) -> None:
    """Three claimed steps, the run of the second held locked by another session: the
    settle statement writes the other two at once (no lock wait: lock_timeout is 1 s
    here), says the second was skipped, and changes nothing of it; a completion or a
    failure of it written alone raises DatabaseBusy at once; once the lock goes, it is
    written."""
    from cyclone_mp.errors import DatabaseBusy
    from cyclone_mp.store import Store

    cyclone_env.mux().register(h.ok)
    client = cyclone_env.client()
    run_ids = [client.enqueue(h.ok, {}) for _ in range(3)]
    store = Store.open(cyclone_env.dsn)
    locker = psycopg.connect(cyclone_env.dsn)
    try:
        where = {"owner": "test:1:x", "queues": ["default"], "names": [h.ok.name], "ttl": 30}
        rows = {r["run_id"]: r for r in store.claims.claim(limit=3, **where).rows}
        items = [(rows[r]["id"], rows[r]["lease_generation"], {"n": i}, None) for i, r in enumerate(run_ids)]
        locker.execute("SELECT 1 FROM cyclone_runs WHERE id = %s FOR UPDATE", (run_ids[1],))
        started = time.monotonic()
        settled = store.outcomes.settle(completions=items, limit=0, **where)
        assert time.monotonic() - started < 0.5
        assert settled.completed == {items[0][:2], items[2][:2]} and settled.skipped == {items[1][:2]}
        with pytest.raises(DatabaseBusy):
            store.outcomes.complete(owner=where["owner"], items=[items[1]])
        with pytest.raises(DatabaseBusy):  # a failure written alone: NOWAIT, never lock_timeout
            store.outcomes.fail(owner=where["owner"], id=items[1][0], generation=items[1][1], kind="error",
                                entry={"message": "x"}, backoff=lambda attempt: 0.0)
        assert time.monotonic() - started < 0.5
        assert client.status(run_ids[1]).step.state == "running"
        locker.rollback()
        assert store.outcomes.complete(owner=where["owner"], items=[items[1]]) == {items[1][:2]}
    finally:
        locker.close()
        store.close()
    assert [client.status(r).state for r in run_ids] == ["completed"] * 3


def test_renewals_due_together_take_one_round_trip(cyclone_env) -> None:
    """Three leases renewed through a link with 0.3 s of round trip: one round trip for
    all (a heartbeat must fit in lease_ttl / 3, so a second one halves the distance a
    database may be), and each says whether it matched (a stale generation does not)."""
    from cyclone_mp.store import Store
    from cyclone_mp.testing.env import through, upstream_of
    from cyclone_mp.testing.network import FaultProxy

    cyclone_env.mux().register(h.ok)
    for _ in range(3):
        cyclone_env.client().enqueue(h.ok, {})
    proxy = FaultProxy(upstream_of(cyclone_env.dsn))
    store = Store.open(through(cyclone_env.dsn, proxy), generic_plans=True)
    try:
        owner = "test:1:rtt"
        rows = store.claims.claim(owner=owner, queues=["default"], names=[h.ok.name], limit=3, ttl=30).rows
        items = [(r["id"], r["lease_generation"], {"done": 1}, None) for r in rows]
        items[2] = (items[2][0], items[2][1] + 1, None, None)  # not its lease
        proxy.add_latency(0.3)
        took = []
        for _ in range(3):
            started = time.monotonic()
            assert store.leases.renew_many(owner=owner, items=items, ttl=30) == [True, True, False]
            took.append(time.monotonic() - started)
        assert min(took) < 0.5, took  # two round trips would be 0.6 s
    finally:
        proxy.add_latency(0)
        store.close()
        proxy.close()


def test_a_cancelled_attempt_reported_dead_frees_its_step_and_one_that_never_started_says_so(cyclone_env) -> None:
    """client.cancel of two claimed steps sets dead_by on both; the supervisor reports them
    dead (mark_dead), one as never started: both may run again at once, and only the
    unstarted one's cancel entry is rewritten (jsonb_set on the last entry)."""
    from cyclone_mp.store import Store

    cyclone_env.mux().register(h.ok)
    client = cyclone_env.client()
    run_ids = [client.enqueue(h.ok, {}) for _ in range(2)]
    store = Store.open(cyclone_env.dsn)
    try:
        rows = store.claims.claim(owner="test:1:x", queues=["default"], names=[h.ok.name], limit=2, ttl=30).rows
        keys = {r["run_id"]: (r["id"], r["lease_generation"]) for r in rows}
        for run_id in run_ids:
            client.cancel(run_id)
        assert all(client.status(r).step.dead_by is not None for r in run_ids)
        ran, unstarted = (keys[r] for r in run_ids)
        store.leases.mark_dead([ran, unstarted], unstarted={unstarted})
    finally:
        store.close()
    ran_step, unstarted_step = (client.status(r).step for r in run_ids)
    assert ran_step.dead_by is None and unstarted_step.dead_by is None
    assert ran_step.errors[-1]["message"] == "cancelled while running (client.cancel)"
    assert "started_at" in ran_step.errors[-1] and "elapsed" in ran_step.errors[-1]
    entry = unstarted_step.errors[-1]
    assert entry["message"] == "cancelled before it started (client.cancel)" and len(unstarted_step.errors) == 1
    assert "started_at" not in entry and "elapsed" not in entry
    assert entry["claimed_at"] and entry["lease_generation"] == unstarted[1] and entry["kind"] == "cancelled"


def test_a_crashed_supervisors_step_is_reclaimed_and_a_wedged_one_discarded_on_time(cyclone_env_factory, tmp_path):
    """Acceptance of crash recovery on this version: the step of a SIGKILLed supervisor is
    running again under another within lease_ttl + 2 poll intervals (+ 1 s for a loaded
    machine) and completes once; a wedged step is discarded at its DB deadline."""
    ttl, poll = 1.0, 0.2
    env = cyclone_env_factory(workers=2, lease_ttl=ttl, poll_interval=(0.05, poll), kill_grace=0.5)
    env.mux().register(sh.sc_ok, sh.sc04_writer, h.deque_wedge)
    log = tmp_path / "writer.log"
    run_id = env.enqueue(sh.sc04_writer, {"log": str(log), "seconds": 3.0})
    first = env.start_worker()
    running = env.wait_for_state(run_id, None, "running", owner=first)
    time.sleep(0.5)
    env.crash_worker()
    crashed = time.monotonic()
    second = env.start_worker()
    again = env.wait_for_state(run_id, None, "running", timeout=10, owner=second)
    assert time.monotonic() - crashed <= ttl + 2 * poll + 1.0
    assert (again.reclaims, again.attempt) == (1, running.attempt)
    done = env.run_until_complete(run_id, timeout=20)
    assert (done.state, done.step.attempt, done.step.reclaims) == ("completed", 1, 1)

    wedge = env.enqueue(h.deque_wedge, {}, timeout=1, max_attempts=1)
    started = env.wait_for_state(wedge, None, "running", timeout=10)
    settled = env.run_until_complete(wedge, timeout=20)
    step = settled.step
    assert (settled.state, step.state, step.error_kind) == ("discarded", "discarded", "timeout")
    # discarded at the DB deadline (started_at + timeout), give or take a sweep tick and the kill's grace
    assert (step.finished_at - started.started_at).total_seconds() <= 1.0 + poll + 0.5 + 1.0


# -- maintenance that fails loudly -----------------------------------------------------------------


FAIL_SWEEP = """
CREATE FUNCTION cyclone_test_refuse() RETURNS trigger LANGUAGE plpgsql AS $$
BEGIN RAISE EXCEPTION 'the test refuses the sweep''s turn' USING ERRCODE = 'P0001'; END $$;
CREATE TRIGGER cyclone_test_refuse BEFORE UPDATE OR INSERT ON cyclone_maintenance
    FOR EACH ROW WHEN (NEW.task = 'sweep') EXECUTE FUNCTION cyclone_test_refuse();
"""


def scrape(port: int) -> str:
    with urllib.request.urlopen(f"http://127.0.0.1:{port}/metrics", timeout=5) as response:
        return response.read().decode()


def sample(text: str, name: str) -> float | None:
    found = re.search(rf"^{re.escape(name)} (\S+)$", text, flags=re.M)
    return float(found.group(1)) if found else None


def test_a_failing_sweep_shows_in_workers_the_dashboard_the_metrics_and_the_log(cyclone_env_factory, caplog):
    """The sweep's statement fails on every turn (a trigger refuses it): within 3 turns
    and a registry refresh the supervisor reports the sweep failing in its registry row
    (``cyclone-mp workers``, the dashboard), counts every failure in the metrics, the
    last successful sweep's age grows, and the log says it once; it clears once the
    sweep works again."""
    pytest.importorskip("prometheus_client")
    caplog.set_level(logging.INFO, logger="cyclone_mp.supervisor")
    poll = 0.2
    env = cyclone_env_factory(worker="thread", workers=1, poll_interval=(0.05, poll), registry_interval=0.2,
                              metrics_port=0)
    env.mux().register(h.ok)
    handle = env.start_worker()
    sup = handle.client.supervisor
    assert wait_until(lambda: sup.stats["sweeps"] >= 1, timeout=10)
    port = sup.metrics.port
    with connect(env.dsn) as conn:
        conn.execute(FAIL_SWEEP)
    refused = time.monotonic()

    def failing() -> dict | None:
        rows = env.client().workers()
        return ((rows[0]["info"].get("maintenance") or {}).get("failing") or {}).get("sweep") if rows else None

    report = wait_until(failing, timeout=15)
    took = time.monotonic() - refused
    assert report and report["failures"] >= 3 and "refuses the sweep" in report["error"], report
    assert took <= 3 * (poll + 0.05) + 0.2 + 2.0, took  # 3 turns, a registry refresh, a loaded machine

    text = scrape(port)
    assert sample(text, 'cyclone_maintenance_failures_total{task="sweep"}') >= 3
    age = sample(text, "cyclone_last_sweep_age_seconds")
    assert age is not None and age >= took - 0.5

    # the CLI and the dashboard show it
    cli = run_cli("workers", dsn=env.dsn)
    assert cli.returncode == 0, cli.stderr
    assert "FAILING: maintenance task sweep failed" in cli.stdout and "refuses the sweep" in cli.stdout
    as_json = run_cli("workers", "--json", dsn=env.dsn)
    assert "sweep" in json.loads(as_json.stdout)[0]["info"]["maintenance"]["failing"]
    from cyclone_mp.dashboard.views import worker_view

    view = worker_view(env.client().workers()[0])
    assert [f["task"] for f in view["failing"]] == ["sweep"] and view["last_sweep_age"] is not None

    # said once in the log, however many turns fail
    wait_until(lambda: sup.maintenance.health.failures("sweep") >= 6, timeout=10)
    said = [r for r in caplog.records if "has failed 3 times in a row" in r.getMessage()]
    assert len(said) == 1 and "not reclaimed" in said[0].getMessage()

    with connect(env.dsn) as conn:
        conn.execute("DROP TRIGGER cyclone_test_refuse ON cyclone_maintenance")
    assert wait_until(lambda: not failing(), timeout=15)
    assert sample(scrape(port), "cyclone_last_sweep_age_seconds") < 5.0
    assert any("works again" in r.getMessage() for r in caplog.records)
