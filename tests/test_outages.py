"""Database outages and shutdown signals (issue 4): nothing is lost, nothing is done twice."""

from __future__ import annotations

import collections
import signal
import threading
import time

import pytest

import handlers as h


def count_lines(path, prefix):
    counts: collections.Counter[str] = collections.Counter()
    if path.exists():
        for line in path.read_text().splitlines():
            parts = line.split()
            if parts and parts[0] == prefix:
                counts[parts[-1]] += 1
    return counts


@pytest.mark.parametrize("prefetch", [0, 4])
def test_postgres_restart_mid_run_loses_nothing(cyclone_server, cyclone_env_factory, tmp_path, prefetch):
    """Immediate stop of PostgreSQL, start again 2 s later: every step ends terminal once
    (with prefetch too: held steps and a batch statement in flight meet the outage)."""
    if not cyclone_server.restartable:
        pytest.skip("needs the embedded test server (restartable)")
    env = cyclone_env_factory(workers=2, lease_ttl=4.0, kill_grace=0.5, prefetch=prefetch)
    log = tmp_path / "log"
    ids = [env.enqueue(h.sleeper, {"seconds": 0.4, "log": str(log)}) for _ in range(12)]
    env.mux().register(h.ok)
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


def test_second_sigterm_goes_straight_to_the_hard_stop(cyclone_env_factory):
    env = cyclone_env_factory(workers=1, shutdown_grace=60, kill_grace=0.3, lease_ttl=2)
    run_id = env.enqueue(h.sleeper, {"seconds": 60})
    handle = env.start_worker()
    env.wait_for_state(run_id, None, "running")
    t0 = time.monotonic()
    env.terminate_worker(signal.SIGTERM)
    time.sleep(0.3)
    assert handle.alive(), "the first SIGTERM drains (shutdown_grace=60)"
    env.terminate_worker(signal.SIGTERM)
    assert handle.popen.wait(timeout=10) == 0
    assert time.monotonic() - t0 < 5
    step = env.status(run_id).step
    assert (step.state, step.attempt, step.reclaims, step.errors) == ("available", 1, 0, [])


def test_shutdown_writes_completed_work_before_exit(cyclone_env_factory):
    env = cyclone_env_factory(workers=2, shutdown_grace=10, worker="thread")
    ids = [env.enqueue(h.sleeper, {"seconds": 0.8}) for _ in range(2)]
    handle = env.start_worker()
    for run_id in ids:
        env.wait_for_state(run_id, None, "running")
    stopper = threading.Thread(target=handle.client.shutdown)
    stopper.start()
    stopper.join(timeout=15)
    assert not stopper.is_alive()
    assert [env.status(r).step.state for r in ids] == ["completed", "completed"]
