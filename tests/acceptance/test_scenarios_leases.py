"""The failure scenarios SC-06..SC-08 of the shared scenarios/README.md: a lease holds
while every core is saturated (SC-06, a soak under ``@pytest.mark.slow``) and while a
supervisor drains, claiming nothing new (SC-07); a shutdown past its grace releases the
step and never strands it (SC-08). Heartbeats are read from a trigger that logs every
UPDATE of a step row (:func:`install_lease_log`: the database clock, no sampling gaps).

Every test ends with the README's "check after every scenario"
(``scenario_support.check_after``); the autouse fixture in ``tests/conftest.py`` also
fails a test that leaves any descendant of the test process. Handlers live in
``scenario_handlers.py`` (module level, so child processes can import them) and report
what they did as JSON lines in files under ``tmp_path``.
"""

from __future__ import annotations

import datetime as dt
import signal
import time
from typing import Any

import pytest

from cyclone_mp.store import connect

import scenario_handlers as sh
from scenario_support import check_after, gone_at, records, registry_row, wait_records
from waiting import wait_for as wait_until

UTC = dt.timezone.utc


def install_lease_log(dsn: str) -> None:
    """Record every UPDATE of a step row (owner, generation, heartbeat_at, ...) in sc_lease_log.

    A trigger in the test's own database, so every heartbeat is seen on the database
    clock with no sampling gaps (better than polling ``heartbeat_at``).
    """
    with connect(dsn) as conn:
        conn.execute("""
            CREATE TABLE sc_lease_log (
                seq bigserial PRIMARY KEY, step_id bigint, state text, lease_owner text,
                lease_generation bigint, heartbeat_at timestamptz, lease_expiry timestamptz,
                reclaims int, attempt int, logged_at timestamptz DEFAULT clock_timestamp())
        """)
        conn.execute("""
            CREATE FUNCTION sc_log_lease() RETURNS trigger LANGUAGE plpgsql AS $$
            BEGIN
                INSERT INTO sc_lease_log (step_id, state, lease_owner, lease_generation, heartbeat_at,
                                          lease_expiry, reclaims, attempt)
                VALUES (NEW.id, NEW.state, NEW.lease_owner, NEW.lease_generation, NEW.heartbeat_at,
                        NEW.lease_expiry, NEW.reclaims, NEW.attempt);
                RETURN NEW;
            END $$
        """)
        conn.execute("CREATE TRIGGER sc_lease_log AFTER UPDATE ON cyclone_steps "
                     "FOR EACH ROW EXECUTE FUNCTION sc_log_lease()")


def lease_log(dsn: str, step_id: int) -> list[dict[str, Any]]:
    with connect(dsn) as conn:
        return conn.execute("SELECT * FROM sc_lease_log WHERE step_id = %s ORDER BY seq", (step_id,)).fetchall()


def heartbeats(log: list[dict[str, Any]]) -> list[dt.datetime]:
    """Distinct ``heartbeat_at`` values written while the step was running (the claim included)."""
    return sorted({r["heartbeat_at"] for r in log if r["state"] == "running" and r["heartbeat_at"] is not None})


def gaps(times: list[dt.datetime]) -> list[float]:
    return [(b - a).total_seconds() for a, b in zip(times, times[1:])]


def as_dt(t: float) -> dt.datetime:
    return dt.datetime.fromtimestamp(t, tz=UTC)


# -- SC-06 ----------------------------------------------------------------------------------------------


@pytest.mark.slow  # a soak: every core saturated for several lease periods
def test_sc06_heartbeats_hold_under_cpu_saturation(cyclone_env_factory, tmp_path):
    """SC-06: ``lease_ttl=3`` (a renewal every 1 s); eight children busy-loop for 10 s
    on this 2-core machine while a second supervisor polls the same database. No
    reclaim, ``reclaims=0``, ``lease_generation`` unchanged, each step completes once,
    and the largest gap between two heartbeats of one step is under lease_ttl/3 + 0.5 s.

    Heartbeats are read from a trigger on ``cyclone_steps`` that logs every UPDATE
    (database clock, no sampling gaps)."""
    ttl = 3.0
    env = cyclone_env_factory(workers=8, lease_ttl=ttl, kill_grace=0.5, poll_interval=(0.05, 0.2))
    install_lease_log(env.dsn)
    for s in (sh.sc_ok, sh.sc06_busy):
        env.mux().register(s)
    log = tmp_path / "busy.log"
    w1 = env.start_worker()
    wait_until(lambda: len(env.child_pids()) == 8, timeout=20, what="eight children")
    run_ids = [env.enqueue(sh.sc06_busy, {"log": str(log), "seconds": 10.0}) for _ in range(8)]
    for run_id in run_ids:
        env.wait_for_state(run_id, None, "running", timeout=15, owner=w1)
    w2 = env.start_worker(workers=2)  # polls (claims, sweeps) the same database
    statuses = [env.run_until_complete(r, timeout=60) for r in run_ids]

    done = records(log, "done")
    assert sorted(r["run"] for r in done) == sorted(run_ids), "a step ran more or less than once"
    assert len(records(log, "start")) == 8
    worst = 0.0
    for run in statuses:
        st = run.step
        assert (st.state, st.attempt, st.reclaims, st.lease_generation) == ("completed", 1, 0, 1), st
        assert st.lease_owner == w1.supervisor_id
        log_rows = lease_log(env.dsn, st.id)
        assert {r["lease_generation"] for r in log_rows} == {1}
        assert {r["lease_owner"] for r in log_rows} == {w1.supervisor_id}, "the second supervisor took a step"
        assert {r["reclaims"] for r in log_rows} == {0}
        beats = heartbeats(log_rows)
        assert len(beats) >= 8, f"only {len(beats)} heartbeats in 10 s"
        g = gaps(beats)
        worst = max(worst, *g)
        assert max(g) < ttl / 3 + 0.5, f"heartbeat gap {max(g):.2f}s (gaps {[round(x, 2) for x in g]})"
        assert (st.finished_at - beats[-1]).total_seconds() < ttl, "the lease ran out before completion"
    print(f"SC-06: largest heartbeat gap {worst:.3f}s (bound {ttl / 3 + 0.5:.1f}s)")
    assert w2.alive()
    check_after(env, w1)


# -- SC-07 ----------------------------------------------------------------------------------------------


def test_sc07_draining_keeps_heartbeating(cyclone_env_factory, tmp_path):
    """SC-07: the handler takes 5 s, ``lease_ttl=1.5``; the supervisor gets SIGTERM 1 s
    in (``shutdown_grace=10``) while a second supervisor polls. The draining supervisor
    claims nothing new but keeps heartbeating; the second never claims the step; it ends
    ``completed``, ``attempt=1``, ``reclaims=0``; the supervisor exits 0.

    The second supervisor starts first (one slot, kept busy by a 4 s step so the first
    one claims the 5 s step); the draining one still has an idle slot when a new step
    is enqueued, and must leave it to the second."""
    ttl = 1.5
    env = cyclone_env_factory(workers=2, lease_ttl=ttl, shutdown_grace=10.0, kill_grace=0.5)
    install_lease_log(env.dsn)
    for s in (sh.sc_ok, sh.sc07_five_seconds):
        env.mux().register(s)
    blocker = env.enqueue(sh.sc_ok, {"i": "blocker", "sleep": 4.0})
    w2 = env.start_worker(workers=1)
    env.wait_for_state(blocker, None, "running", owner=w2)
    w1 = env.start_worker()
    log = tmp_path / "five.log"
    run_id = env.enqueue(sh.sc07_five_seconds, {"log": str(log), "seconds": 5.0})
    env.wait_for_state(run_id, None, "running", owner=w1)
    start = wait_records(log, "start")[0]
    wait_until(lambda: time.time() >= start["t"] + 1.0, timeout=5)
    assert env.terminate_worker() is w1
    t_term = time.time()

    seen: list[Any] = []  # the last row read: what the failure shows (CI once saw no drain for 5 s)

    def w1_draining() -> bool:
        seen[:] = [registry_row(env, w1.supervisor_id)]
        return bool((seen[0] or {}).get("info", {}).get("draining"))

    deadline = time.monotonic() + 5
    while not w1_draining():
        assert time.monotonic() < deadline, f"w1 not draining 5 s after SIGTERM (at {t_term:.3f}); its row: {seen[0]}"
        time.sleep(0.02)
    other = env.enqueue(sh.sc_ok, {"i": "while draining"})
    other_run = env.run_until_complete(other, timeout=15)
    assert other_run.state == "completed"
    assert other_run.step.lease_owner == w2.supervisor_id, "the draining supervisor claimed a new step"
    assert {r["lease_owner"] for r in lease_log(env.dsn, other_run.step.id) if r["state"] == "running"} \
        == {w2.supervisor_id}

    assert w1.popen.wait(timeout=20) == 0, "the drained supervisor must exit 0"
    t_exit = time.time()
    assert t_exit >= start["t"] + 4.5, "the supervisor exited before its handler finished"

    run = env.run_until_complete(run_id, timeout=5)
    st = run.step
    assert (run.state, st.state, st.attempt, st.reclaims, st.lease_generation) == ("completed", "completed", 1, 0, 1)
    assert st.lease_owner == w1.supervisor_id and st.errors == []
    assert records(log, "cancel_seen") == [], "the draining handler was cancelled"
    assert len(records(log, "start")) == 1 and len(records(log, "done")) == 1
    rows = lease_log(env.dsn, st.id)
    assert {r["lease_owner"] for r in rows} == {w1.supervisor_id}, "the second supervisor claimed the step"
    beats = heartbeats(rows)
    during_drain = [b for b in beats if b > as_dt(t_term)]
    assert len(during_drain) >= 5, f"only {len(during_drain)} heartbeats while draining"
    assert max(during_drain) >= as_dt(start["t"] + 4.0), "heartbeats stopped during the drain"
    g = gaps(beats)
    assert max(g) < ttl / 3 + 0.5, f"heartbeat gap {max(g):.2f}s"
    check_after(env, w2, pids=[start["pid"]])  # the drained supervisor's child is gone too


# -- SC-08 ----------------------------------------------------------------------------------------------


@pytest.mark.parametrize("variant", ["grace_expires", "then_sigkill"])
def test_sc08_shutdown_past_grace_releases_never_strands(cyclone_env_factory, tmp_path, variant):
    """SC-08: the handler sleeps 20 s (ignoring the cancel); ``shutdown_grace=2``;
    SIGTERM at 1 s. After the grace the child is cancelled (reason ``shutdown``), then
    killed after ``kill_grace``, and the step is released to ``available`` at once (no
    attempt, no reclaim); the supervisor exits 0. Variant: SIGTERM, then SIGKILL 0.5 s
    later: the lease expires and the step is reclaimed. Either way it later completes
    exactly once and nothing stays ``running``."""
    ttl, grace, kill_grace = 1.0, 2.0, 0.5
    env = cyclone_env_factory(workers=1, lease_ttl=ttl, shutdown_grace=grace, kill_grace=kill_grace)
    for s in (sh.sc_ok, sh.sc08_long_then_short):
        env.mux().register(s)
    log = tmp_path / "long.log"
    run_id = env.enqueue(sh.sc08_long_then_short, {"log": str(log), "first": 20.0, "later": 0.3})
    w1 = env.start_worker()
    start = wait_records(log, "start")[0]
    child = start["pid"]
    wait_until(lambda: time.time() >= start["t"] + 1.0, timeout=5)
    assert env.terminate_worker() is w1
    t_term = time.time()

    if variant == "grace_expires":
        died = gone_at([child], timeout=grace + kill_grace + 5)
        assert child in died, "the child outlived the shutdown grace"
        assert grace + kill_grace - 0.2 <= died[child] - t_term <= grace + kill_grace + 1.5, died[child] - t_term
        cancel = records(log, "cancel_seen")
        assert [r["reason"] for r in cancel] == ["shutdown"]
        assert grace - 0.2 <= cancel[0]["t"] - t_term <= grace + 1.0
        assert died[child] - cancel[0]["t"] >= kill_grace - 0.15, "killed before kill_grace"
        assert w1.popen.wait(timeout=15) == 0, "a drained supervisor must exit 0"
        st = env.status(run_id).step
        assert (st.state, st.attempt, st.reclaims, st.errors, st.lease_owner) == ("available", 1, 0, [], None)
        with connect(env.dsn) as conn:
            row = conn.execute("SELECT scheduled_at <= now() AS due FROM cyclone_steps WHERE id = %s", (st.id,)).fetchone()
        assert row["due"], "a released step must be claimable at once"
        expected_reclaims = 0
    else:
        time.sleep(0.5)
        w1.popen.send_signal(signal.SIGKILL)
        assert w1.popen.wait(timeout=10) == -signal.SIGKILL
        t_kill = time.time()
        died = gone_at([child], timeout=3)
        assert child in died and died[child] - t_kill <= 1.0, "the child outlived its SIGKILLed supervisor"
        expected_reclaims = 1

    w2 = env.start_worker()
    run = env.run_until_complete(run_id, timeout=20)
    st = run.step
    assert (run.state, st.state, st.attempt, st.reclaims) == ("completed", "completed", 1, expected_reclaims)
    assert st.lease_owner == w2.supervisor_id and st.errors == [] and st.output == {"first": False}
    assert len(records(log, "start")) == 2
    assert len(records(log, "done")) == 1, "the step completed more or less than once"
    check_after(env, w2, pids=[child])
