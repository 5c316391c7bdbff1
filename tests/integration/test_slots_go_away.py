"""The slot rows of limited (step, key) groups go away once none of the group's steps
waits or runs: a key used once does not keep its rows for ever."""

from __future__ import annotations

import time

import pytest

import cyclone_mp as cy
from cyclone_mp.store import connect

import flow_handlers as fh


def slots(dsn: str) -> int:
    with connect(dsn) as conn:
        return conn.execute("SELECT count(*) AS n FROM cyclone_slots").fetchone()["n"]


@pytest.mark.long  # 6 s: 30,000 keys; the history pass's test below prunes slots in the default run (CI runs the long ones)
def test_prune_leaves_no_slot_of_a_finished_group_among_30000_keys(cyclone_dsn):
    """30,000 keys of a step with a concurrency and a rate limit (3 slot rows each), every
    run finished (cancelled): prune deletes the runs and every slot row; a group with a
    step still waiting keeps its rows."""
    client = cy.Client(cyclone_dsn)
    try:
        ids = client.enqueue_many(fh.per_tenant, [{"tenant": f"t{i:05d}"} for i in range(30_000)],
                                  rate_limit=(1, 60.0), delay=3600)
        waiting = client.enqueue(fh.per_tenant, {"tenant": "still-waiting"}, rate_limit=(1, 60.0), delay=3600)
        assert slots(cyclone_dsn) == 30_001 * 3
        with connect(cyclone_dsn) as conn:  # finish them all at once (30,000 cancels one by one take minutes)
            conn.execute("UPDATE cyclone_steps SET state = 'cancelled', finished_at = now() - interval '1 hour' "
                         "WHERE run_id = ANY(%s::uuid[])", (ids,))
            conn.execute("UPDATE cyclone_runs SET state = 'cancelled', finished_at = now() - interval '1 hour' "
                         "WHERE id = ANY(%s::uuid[])", (ids,))
        started = time.monotonic()
        assert client.prune(older_than=60) == 30_000
        took = time.monotonic() - started
        with connect(cyclone_dsn) as conn:
            left = conn.execute("SELECT DISTINCT key FROM cyclone_slots").fetchall()
        assert [r["key"] for r in left] == ["still-waiting"]
        assert client.status(waiting).state == "running"
        print(f"prune of 30,000 runs and 90,000 slot rows: {took:.1f} s")
    finally:
        client.close()


def test_the_history_pass_deletes_the_slots_of_groups_that_finished(cyclone_env_factory):
    """A supervisor's history pass deletes the slots of groups whose steps all finished
    (a concurrency slot once its holder is over, a rate slot once its period passed)."""
    env = cyclone_env_factory(workers=2, lease_ttl=3, poll_interval=(0.05, 0.3))
    env.mux().register(fh.per_tenant)
    ids = env.client().enqueue_many(fh.per_tenant, [{"tenant": f"t{i}"} for i in range(20)], rate_limit=(5, 0.5))
    assert slots(env.dsn) == 20 * 7
    env.start_worker()
    for run_id in ids:
        assert env.run_until_complete(run_id, timeout=60).state == "completed"
    deadline = time.monotonic() + 30  # the history pass runs every 5 s (on one supervisor)
    while slots(env.dsn) and time.monotonic() < deadline:
        time.sleep(0.2)
    assert slots(env.dsn) == 0
    # a group enqueued again gets its rows back, and runs
    again = env.enqueue(fh.per_tenant, {"tenant": "t1"}, rate_limit=(5, 0.5))
    assert env.run_until_complete(again, timeout=30).state == "completed"
