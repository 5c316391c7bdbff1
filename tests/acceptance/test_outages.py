"""Database outages and shutdown signals (issue 4): nothing is lost, nothing is done twice."""

from __future__ import annotations

import collections
import logging
import signal
import threading
import time

import psycopg
import pytest
from psycopg import sql

import handlers as h
from cyclone_mp.errors import DatabaseError, DatabaseUnavailable
from cyclone_mp.store import Store, connect, translate
from waiting import counter_grows, registry_infos, wait_for


def count_lines(path, prefix):
    counts: collections.Counter[str] = collections.Counter()
    if path.exists():
        for line in path.read_text().splitlines():
            parts = line.split()
            if parts and parts[0] == prefix:
                counts[parts[-1]] += 1
    return counts


@pytest.mark.parametrize("prefetch", [0, pytest.param(4, marks=pytest.mark.slow)])  # held steps: the chaos test too
def test_postgres_restart_mid_run_loses_nothing(cyclone_server, cyclone_env_factory, tmp_path, prefetch):
    """Immediate stop of PostgreSQL, start again 2 s later: every step ends terminal once
    (with prefetch too: held steps and a batch statement in flight meet the outage)."""
    if not cyclone_server.restartable:
        pytest.skip("needs the embedded test server (restartable)")
    env = cyclone_env_factory(workers=2, lease_ttl=4.0, kill_grace=0.5, prefetch=prefetch)
    log = tmp_path / "log"
    ids = [env.enqueue(h.sleeper, {"seconds": 0.4, "log": str(log)}) for _ in range(12)]
    env.mux().register(h.ok)
    cyclone_server.checkpoint()  # the restart's recovery replays only what follows
    handle = env.start_worker()
    env.wait_for_state(ids[1], None, ("running", "completed"), timeout=10)
    time.sleep(0.3)
    cyclone_server.restart(down_for=2.0)
    statuses = [env.run_until_complete(run_id, timeout=60) for run_id in ids]
    assert [s.state for s in statuses] == ["completed"] * len(ids)
    assert handle.alive(), "the supervisor must survive the outage"
    # a handler may have run twice only if its lease was lost during the outage (reclaimed)
    assert all(s.step.attempt == 1 for s in statuses)
    # the supervisor reconnected and still takes new work
    assert env.run_until_complete(env.enqueue(h.ok, {"after": "outage"}), timeout=30).state == "completed"


def test_outage_longer_than_the_lease_kills_the_child_then_reclaims(cyclone_server, cyclone_env_factory, tmp_path):
    """A child whose lease could not be renewed before lease_expiry is killed (someone else
    may reclaim it); after the outage the step is reclaimed and completes exactly once."""
    if not cyclone_server.restartable:
        pytest.skip("needs the embedded test server (restartable)")
    env = cyclone_env_factory(workers=1, lease_ttl=1.0, kill_grace=0.3)
    log = tmp_path / "log"
    run_id = env.enqueue(h.sleeper, {"seconds": 3.0, "log": str(log)})
    cyclone_server.checkpoint()  # the restart's recovery replays only what follows
    handle = env.start_worker()
    env.wait_for_state(run_id, None, "running", timeout=10)
    pids_before = env.child_pids()
    cyclone_server.restart(down_for=2.5)
    run = env.run_until_complete(run_id, timeout=60)
    assert run.state == "completed" and run.step.attempt == 1
    assert run.step.reclaims == 1, "the lost lease must have been reclaimed, not silently kept"
    starts, ends = count_lines(log, "start"), count_lines(log, "end")
    assert sum(ends.values()) == 1, f"the handler must finish exactly once, got {ends}"
    assert sum(starts.values()) == 2
    assert handle.alive()
    assert not any(p in env.child_pids() for p in pids_before), "the unrenewable child was not killed"


def test_second_sigterm_goes_straight_to_the_hard_stop(cyclone_env_factory, tmp_path):
    env = cyclone_env_factory(workers=1, shutdown_grace=60, kill_grace=0.3, lease_ttl=2)
    log = tmp_path / "log"
    run_id = env.enqueue(h.sleeper, {"seconds": 60, "log": str(log)})
    handle = env.start_worker()
    # the handler runs (a claim its child has not started yet is released by a drain at once)
    wait_for(lambda: count_lines(log, "start"), 15, "the handler to start")
    t0 = time.monotonic()
    env.terminate_worker(signal.SIGTERM)
    wait_for(lambda: any(info.get("draining") for info in registry_infos(env.dsn)), 10, "the supervisor to drain")
    assert handle.alive(), "the first SIGTERM drains (shutdown_grace=60)"
    env.terminate_worker(signal.SIGTERM)
    assert handle.popen.wait(timeout=10) == 0
    assert time.monotonic() - t0 < 5
    step = env.status(run_id).step
    assert (step.state, step.attempt, step.reclaims, step.errors) == ("available", 1, 0, [])


def test_shutdown_writes_completed_work_before_exit(cyclone_env_factory, tmp_path):
    env = cyclone_env_factory(workers=2, shutdown_grace=10, worker="thread")
    log = tmp_path / "log"
    ids = [env.enqueue(h.sleeper, {"seconds": 0.8, "log": str(log)}) for _ in range(2)]
    handle = env.start_worker()
    # both handlers run (a claimed step whose child is not ready yet is released by the drain)
    wait_for(lambda: sum(count_lines(log, "start").values()) == 2, 30, "both handlers to start")
    stopper = threading.Thread(target=handle.client.shutdown)
    stopper.start()
    stopper.join(timeout=15)
    assert not stopper.is_alive()
    assert [env.status(r).step.state for r in ids] == ["completed", "completed"]


def test_held_steps_outlive_a_short_outage(cyclone_server, cyclone_env_factory):
    """Prefetched steps held when the database goes away are released once it is back
    (their lease still valid), never dropped to the sweep: with max_reclaims=0 that
    discarded steps that never ran (found by a chaos run). The outage: the database
    refuses new connections and its backends are terminated, for 1.5 s."""
    env = cyclone_env_factory(worker="thread", workers=2, prefetch=16, lease_ttl=10)
    env.mux().register(h.sleeper)
    client = env.client()
    # Steps of 0.15 s are not pipelined (one queued in a child could wait behind the
    # first long step and be released): the held steps stay in the supervisor.
    short = client.enqueue_many(h.sleeper, [{"seconds": 0.15}] * 6, max_reclaims=0)
    long = client.enqueue_many(h.sleeper, [{"seconds": 2.5}] * 2, max_reclaims=0)
    tail = client.enqueue_many(h.sleeper, [{"seconds": 0.15}] * 12, max_reclaims=0)
    sup = env.start_worker().client.supervisor

    def both_children_on_long_steps_with_steps_held() -> bool:
        runs = {c.attempt.run_id for c in sup.children if c.attempt is not None}
        return runs == set(long) and len(sup.prefetched) >= 2

    wait_for(both_children_on_long_steps_with_steps_held, 30, "held steps behind two long ones", interval=0.002)
    dbname = psycopg.conninfo.conninfo_to_dict(env.dsn)["dbname"]
    with psycopg.connect(cyclone_server.admin_dsn, autocommit=True) as admin:
        admin.execute(sql.SQL("ALTER DATABASE {} ALLOW_CONNECTIONS false").format(sql.Identifier(dbname)))
        admin.execute("SELECT pg_terminate_backend(pid) FROM pg_stat_activity WHERE datname = %s", (dbname,))
        assert sup.prefetched, "the steps were released before the outage began"
        time.sleep(1.5)
        admin.execute(sql.SQL("ALTER DATABASE {} ALLOW_CONNECTIONS true").format(sql.Identifier(dbname)))
    statuses = [env.run_until_complete(run_id, timeout=60) for run_id in short + long + tail]
    assert [s.state for s in statuses] == ["completed"] * len(statuses)
    assert all((s.step.attempt, s.step.reclaims) == (1, 0) for s in statuses)


@pytest.mark.long  # about 6 s: CI runs it with the long tests, outside README's 12 minutes
def test_an_outage_does_not_spin_the_database_threads(cyclone_server, cyclone_env_factory, monkeypatch):
    """While the database refuses connections, the lease keeper (a lease due for renewal),
    the outcome writer (a completion to write again) and maintenance (a sweep due) wait for
    their next connect: a due time already past turned each of them 20,000-54,000 times a
    second through the outage, more than a core between them. Afterwards the step's
    completion is written once."""
    from cyclone_mp.leases import LeaseKeeper
    from cyclone_mp.outcomes import OutcomeWriter
    from cyclone_mp.sweep import Maintenance

    turns: collections.Counter[str] = collections.Counter()
    for cls in (LeaseKeeper, OutcomeWriter, Maintenance):
        def counted(self, now, _turn=cls.turn, _name=cls.__name__):
            turns[_name] += 1
            return _turn(self, now)
        monkeypatch.setattr(cls, "turn", counted)
    env = cyclone_env_factory(worker="thread", workers=1, lease_ttl=6)
    env.mux().register(h.sleeper)
    run_id = env.client().enqueue(h.sleeper, {"seconds": 1.0})
    sup = env.start_worker().client.supervisor
    wait_for(lambda: any(c.attempt is not None for c in sup.children), 30, "the step running")
    dbname = psycopg.conninfo.conninfo_to_dict(env.dsn)["dbname"]
    with psycopg.connect(cyclone_server.admin_dsn, autocommit=True) as admin:
        admin.execute(sql.SQL("ALTER DATABASE {} ALLOW_CONNECTIONS false").format(sql.Identifier(dbname)))
        try:
            admin.execute("SELECT pg_terminate_backend(pid) FROM pg_stat_activity WHERE datname = %s", (dbname,))
            time.sleep(0.5)  # every part has met the outage (the step ends in it)
            before = dict(turns)
            time.sleep(2.0)
            during = {name: turns[name] - before.get(name, 0) for name in turns}
        finally:
            admin.execute(sql.SQL("ALTER DATABASE {} ALLOW_CONNECTIONS true").format(sql.Identifier(dbname)))
    assert set(during) == {"LeaseKeeper", "OutcomeWriter", "Maintenance"}, during
    assert all(n <= 100 for n in during.values()), during  # a few reconnects and messages; tens of thousands before
    status = env.run_until_complete(run_id, timeout=60)
    assert (status.state, status.step.attempt, status.step.reclaims) == ("completed", 1, 0)


def test_a_lost_listen_connection_is_an_outage_not_a_rejected_query(cyclone_env_factory, caplog):
    env = cyclone_env_factory(worker="thread", workers=1, lease_ttl=5)
    env.mux().register(h.ok)
    sup = env.start_worker().client.supervisor
    wait_for(lambda: sup.listener is not None and sup.listener.conn is not None, 15, "a LISTEN connection")
    pid = sup.listener.conn.info.backend_pid
    with caplog.at_level(logging.INFO, logger="cyclone_mp.supervisor"):
        with connect(env.dsn) as conn:
            conn.execute("SELECT pg_terminate_backend(%s)", (pid,))
        wait_for(lambda: sup.listener.conn is not None and sup.listener.conn.info.backend_pid != pid, 15,
                 "a new LISTEN connection")
    assert not [r for r in caplog.records if "rejected" in r.getMessage()]
    assert env.run_until_complete(env.enqueue(h.ok, {"after": "listen lost"}), timeout=30).state == "completed"


def test_a_listen_dsn_that_never_answers_delays_no_renewal(cyclone_env_factory, caplog):
    """LISTEN has a thread of its own: a ``listen_dsn`` whose connects hang (black-holed,
    each for its 2 s connect timeout, again and again) leaves renewals on time. A 3 s
    step under a 1 s lease completes on its first attempt, never fenced or reclaimed; it
    is claimed by polling alone."""
    from cyclone_mp.testing.env import through, upstream_of
    from cyclone_mp.testing.network import FaultProxy

    proxy = FaultProxy(upstream_of(cyclone_env_factory().dsn))
    proxy.partition()
    try:
        env = cyclone_env_factory(worker="thread", workers=1, lease_ttl=1.0, listen_dsn=through(
            cyclone_env_factory().dsn, proxy))
        env.mux().register(h.sleeper)
        sup = env.start_worker().client.supervisor
        with caplog.at_level(logging.INFO, logger="cyclone_mp.supervisor"):
            status = env.run_until_complete(env.enqueue(h.sleeper, {"seconds": 3.0}), timeout=60)
        assert (status.state, status.step.attempt, status.step.reclaims) == ("completed", 1, 0)
        assert sup.control.stats["lease_lost"] == 0 and sup.control.stats["fence_kills"] == 0
        assert sup.listener is not None and sup.listener.conn is None  # it never got to listen
        assert any("LISTEN unavailable" in r.getMessage() for r in caplog.records)
    finally:
        proxy.close()


@pytest.mark.parametrize("prefetch", [0, 16])
def test_a_rejected_claim_backs_off_instead_of_retrying_every_tick(cyclone_env_factory, monkeypatch, prefetch):
    """A claim the database rejects (not an outage: say a schema change broke it for a
    while) backs off as an empty claim does; it used to be retried on every tick,
    thousands of times a second."""
    from cyclone_mp.store import Claims

    env = cyclone_env_factory(worker="thread", workers=1, poll_interval=(0.1, 1.0), prefetch=prefetch)
    env.mux().register(h.ok)
    sup = env.start_worker().client.supervisor
    wait_for(lambda: sup.db_ok, 15, "the supervisor connected")
    calls = []

    def rejected(self, **kwargs):
        calls.append(time.monotonic())
        raise DatabaseError("database error: FeatureNotSupported: cached plan must not change result type")

    monkeypatch.setattr(Claims, "claim", rejected)
    time.sleep(2.0)
    monkeypatch.undo()
    assert 1 <= len(calls) <= 12, f"{len(calls)} claims in 2 s"
    assert sup.db_ok  # a rejection is not an outage
    assert env.run_until_complete(env.enqueue(h.ok, {"after": "rejections"}), timeout=30).state == "completed"


@pytest.mark.parametrize("prefetch", [0, 32])
def test_a_migration_that_changes_a_column_type_under_a_running_supervisor(cyclone_env_factory, caplog, prefetch):
    """A prepared statement whose result type changed fails on every run ("cached plan
    must not change result type"): each connection drops its prepared statements after
    the first such error, so the supervisor claims again and the client's calls work
    (a call is tried once more)."""
    env = cyclone_env_factory(worker="thread", workers=2, prefetch=prefetch)
    env.mux().register(h.ok)
    client = env.client()
    before = client.enqueue_many(h.ok, [{"i": i} for i in range(60)])
    handle = env.start_worker()
    assert {env.run_until_complete(r, timeout=30).state for r in before} == {"completed"}
    with connect(env.dsn) as conn:
        conn.execute("ALTER TABLE cyclone_steps ALTER COLUMN node TYPE varchar(400)")
    after = client.enqueue_many(h.ok, [{"i": i} for i in range(60, 120)])
    statuses = [env.run_until_complete(r, timeout=30) for r in after]
    assert {(s.state, s.step.attempt) for s in statuses} == {("completed", 1)}
    assert handle.client.supervisor.stats["completed"] == 120
    stale = [r for r in caplog.records if "plan went stale" in r.getMessage()]
    # met once per connection that had prepared a statement reading the column (the
    # supervisor's parts, the client's pool), never on every tick
    assert 1 <= len(stale) <= 12, [r.getMessage() for r in stale]


def test_a_completion_that_meets_a_stale_prepared_statement_is_written_again_not_failed(cyclone_env_factory, monkeypatch):
    """The tick's statement and then the one-by-one write of its completions both meet a
    statement a schema change invalidated: that is no fault of the output, so the write
    is tried again (it used to become a failed attempt: "the database rejected the
    handler's output")."""
    from cyclone_mp.store import Outcomes

    real_settle = Outcomes.settle
    stale_left = [2]

    def settle(self, **kwargs):
        if kwargs.get("completions") and stale_left[0]:
            stale_left[0] -= 1
            try:
                raise psycopg.errors.FeatureNotSupported("cached plan must not change result type")
            except psycopg.Error as cause:
                raise DatabaseError(f"database error: FeatureNotSupported: {cause}") from cause
        return real_settle(self, **kwargs)

    monkeypatch.setattr(Outcomes, "settle", settle)
    env = cyclone_env_factory(worker="thread", workers=2, prefetch=16)
    env.mux().register(h.ok)
    ids = env.client().enqueue_many(h.ok, [{"i": i} for i in range(20)], max_attempts=1)
    env.start_worker()
    steps = [env.run_until_complete(r, timeout=30).step for r in ids]
    assert stale_left == [0]
    assert [(s.state, s.attempt, s.errors) for s in steps] == [("completed", 1, [])] * 20


def test_a_session_frozen_inside_a_transaction_stalls_the_others_only_briefly(cyclone_env_factory):
    """Helper-17: a supervisor SIGSTOPped while its sweep held a run row lock stalled
    every other supervisor for the whole freeze (no renewal, no claim, no sweep). Each of
    cyclone_mp's sessions now ends after Config.idle_in_transaction_limit (1 s here) idle
    inside a transaction, which releases its locks."""
    from cyclone_mp.config import Config

    limit = Config.build(lease_ttl=3.0).idle_in_transaction_limit
    assert limit == 1.0
    env = cyclone_env_factory(workers=1, lease_ttl=3.0)
    env.mux().register(h.ok)
    run_id = env.enqueue(h.ok, {})
    frozen = Store.open(env.dsn, generic_plans=True, idle_in_transaction=limit)  # as a supervisor opens it
    try:
        frozen.conn.execute("BEGIN")
        frozen.conn.execute("SELECT id FROM cyclone_runs WHERE id = %s FOR UPDATE", (run_id,))
        t0 = time.monotonic()
        env.start_worker()  # its completion needs that run's lock
        assert env.run_until_complete(run_id, timeout=30).state == "completed"
        assert time.monotonic() - t0 < 15
        with pytest.raises(DatabaseUnavailable):  # the server ended the frozen session: an outage to its owner
            frozen.leases.state(0)
    finally:
        frozen.close()


def test_every_session_of_a_client_and_its_supervisor_limits_idle_transactions(cyclone_env_factory):
    env = cyclone_env_factory(worker="thread", workers=1, lease_ttl=3.0)
    env.mux().register(h.ok)
    run_id = env.enqueue(h.ok, {})
    client = env.start_worker().client
    assert env.run_until_complete(run_id, timeout=30).state == "completed"
    sup = client.supervisor
    show = "SHOW idle_in_transaction_session_timeout"
    wait_for(lambda: all(p.store is not None for p in (sup.keeper, sup.writer, sup.maintenance)), 15, "connected")
    seen = [part.store.conn.execute(show).fetchone() for part in (sup.keeper, sup.writer, sup.maintenance)]
    seen.append(client._call(lambda store: store.conn.execute(show).fetchone()))
    assert [row["idle_in_transaction_session_timeout"] for row in seen] == ["1s"] * 4


def test_a_client_call_whose_session_the_server_ended_mid_transaction_runs_again(cyclone_env_factory):
    """Helper-18: a worker frozen inside its startup migration exited rc 1 once resumed,
    because the server had ended its idle transaction. Nothing of a transaction whose
    body failed was committed, so a Client call runs it once more on a fresh connection."""
    env = cyclone_env_factory(lease_ttl=3.0)  # sessions end after 1 s idle in a transaction
    client = env.client()
    tries = []

    def frozen_once(store):
        with store.tx() as cur:
            cur.execute("SELECT count(*) AS n FROM cyclone_runs")
            tries.append(store.conn.info.backend_pid)
            if len(tries) == 1:
                time.sleep(2.0)  # as if the process were stopped here
            cur.execute("SELECT count(*) AS n FROM cyclone_runs")
            return cur.fetchone()["n"]

    assert client._call(translate(frozen_once)) == 0  # as every query method is wrapped
    assert len(tries) == 2 and tries[0] != tries[1]  # the second try ran on another session


def test_a_sweep_leaves_the_expired_leases_its_own_supervisor_holds(cyclone_env):
    """A supervisor's own sweep never reclaims a lease its keeper still renews (expired,
    say, by an outage longer than ``lease_ttl``): the keeper renews it at its next
    connect, and the outcome writer may hold its outcome. Its DB deadline still applies,
    another generation of the step is not protected, and another supervisor's sweep
    reclaims it as any expired lease."""
    from cyclone_mp.sweep import Sweeper

    env = cyclone_env
    env.mux().register(h.ok)
    run_ids = [env.client().enqueue(h.ok, {"i": i}) for i in range(3)]
    store = Store.open(env.dsn)
    try:
        rows = store.claims.claim(owner="sup-a", queues=["default"], names=["ok"], limit=5, ttl=30).rows
        held, timed_out, other_generation = sorted(rows, key=lambda r: r["id"])
        for run_id in run_ids:
            env.expire_lease(run_id)
        with connect(env.dsn) as conn:
            conn.execute("UPDATE cyclone_steps SET timeout = interval '1 millisecond' WHERE id = %s",
                         (timed_out["id"],))
        keys = [(r["id"], r["lease_generation"]) for r in (held, timed_out)]
        keys.append((other_generation["id"], other_generation["lease_generation"] - 1))

        def backoff(name):
            return lambda attempt: 0.0

        counts = Sweeper("sup-a", backoff, held=lambda: keys).run_once(store)
        assert (counts["reclaim"], counts["timeout"], counts["none"]) == (1, 1, 0)
        with connect(env.dsn) as conn:
            state = {r["id"]: r["state"] for r in conn.execute("SELECT id, state FROM cyclone_steps").fetchall()}
        assert state[held["id"]] == "running"  # still sup-a's: its keeper renews it
        assert state[other_generation["id"]] == "available"
        assert Sweeper("sup-b", backoff, held=lambda: keys).run_once(store)["reclaim"] == 1
        assert env.status(run_ids[run_ids.index(held["run_id"])]).step.reclaims == 1
    finally:
        store.close()


def test_its_own_sweep_does_not_rerun_a_step_whose_completion_waits_to_be_written(cyclone_env_factory, tmp_path,
                                                                                  monkeypatch):
    """A handler ends while the database is out of reach for longer than ``lease_ttl``
    (here the keeper renews nothing and the outcome writer writes nothing: they stand for
    an outage both still wait out). The lease expires; the supervisor's own sweep, which
    got through first, leaves it (without that, it reclaimed the step 5 times out of 5
    after an 8 s outage, and the handler ran again). The completion is then written, once:
    attempt 1, no reclaim."""
    from cyclone_mp.leases import LeaseKeeper
    from cyclone_mp.outcomes import OutcomeWriter

    reachable = threading.Event()
    reachable.set()
    writer_turn, renew_due = OutcomeWriter.turn, LeaseKeeper._renew_due

    def writer_waits(self, now):
        if reachable.is_set():
            return writer_turn(self, now)
        time.sleep(0.02)  # its inbox stays unread
        return self.clock() + 0.02

    def keeper_waits(self, now):
        if reachable.is_set():
            renew_due(self, now)

    monkeypatch.setattr(OutcomeWriter, "turn", writer_waits)
    monkeypatch.setattr(LeaseKeeper, "_renew_due", keeper_waits)
    env = cyclone_env_factory(worker="thread", workers=1, lease_ttl=1.5, poll_interval=(0.05, 0.2))
    env.mux().register(h.sleeper)
    log = tmp_path / "log"
    run_id = env.client().enqueue(h.sleeper, {"seconds": 0.3, "log": str(log)})
    sup = env.start_worker().client.supervisor
    wait_for(lambda: any(c.attempt is not None for c in sup.children), 30, "the step running")
    reachable.clear()
    try:
        wait_for(lambda: sum(count_lines(log, "end").values()) == 1, 10, "the handler to end")
        with connect(env.dsn) as conn:
            wait_for(lambda: conn.execute("SELECT lease_expiry < now() AS expired FROM cyclone_steps "
                                          "WHERE run_id = %s", (run_id,)).fetchone()["expired"], 10,
                     "the lease to expire")
        counter_grows(lambda: sup.stats["sweeps"], 3, what="sweeps")
        step = env.status(run_id).step
        assert (step.state, step.reclaims) == ("running", 0)
    finally:
        reachable.set()
    status = env.run_until_complete(run_id, timeout=30)
    assert (status.state, status.step.attempt, status.step.reclaims) == ("completed", 1, 0)
    assert sum(count_lines(log, "start").values()) == 1
    assert sup.stats["late_completions_dropped"] == 0
