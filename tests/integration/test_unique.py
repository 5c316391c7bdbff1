"""cy.Unique: one run per "same" enqueue while a run holds its place, enforced by the
database's unique index (a second enqueue returns the first run's id)."""

from __future__ import annotations

import threading

import pytest

import cyclone_mp as cy
from cyclone_mp.store import connect

import live_handlers as lh


def runs(dsn: str, name: str) -> int:
    with connect(dsn) as conn:
        return conn.execute("SELECT count(*) AS n FROM cyclone_runs WHERE name = %s", (name,)).fetchone()["n"]


def test_the_same_input_enqueues_one_run_a_different_one_another(cyclone_dsn):
    client = cy.Client(cyclone_dsn, cy.Mux().register(lh.live_unique))
    try:
        a = client.enqueue(lh.live_unique, {"x": 1, "y": 2})
        assert client.enqueue(lh.live_unique, {"y": 2, "x": 1}) == a  # same input, key order aside
        b = client.enqueue(lh.live_unique, {"x": 2})
        assert b != a
        assert client.enqueue_many(lh.live_unique, [{"x": 1, "y": 2}, {"x": 3}, {"x": 2}])[::2] == [a, b]
        assert runs(cyclone_dsn, "live_unique") == 3
        client.cancel(a)  # cancelled does not hold the place (default states): a new run may start
        c = client.enqueue(lh.live_unique, {"x": 1, "y": 2})
        assert c not in (a, b)
    finally:
        client.close()


def test_racing_enqueues_make_one_run(cyclone_dsn):
    """16 clients enqueue the same input at once: the unique index lets one run in."""
    ids: list[str] = []
    lock = threading.Lock()

    def enqueue() -> None:
        client = cy.Client(cyclone_dsn, cy.Mux().register(lh.live_unique))
        try:
            run_id = client.enqueue(lh.live_unique, {"same": True})
            with lock:
                ids.append(run_id)
        finally:
            client.close()

    threads = [threading.Thread(target=enqueue) for _ in range(16)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    assert len(set(ids)) == 1 and runs(cyclone_dsn, "live_unique") == 1


def test_a_period_window_and_states(cyclone_env_factory):
    """by=(), period=1 h, states running/paused: one live run per hour; once it completed,
    another may start in the same window."""
    env = cyclone_env_factory(workers=1)
    env.mux().register(lh.live_hourly)
    first = env.enqueue(lh.live_hourly, {"a": 1})
    assert env.enqueue(lh.live_hourly, {"b": 2}) == first
    env.start_worker()
    assert env.run_until_complete(first).state == "completed"
    again = env.enqueue(lh.live_hourly, {"c": 3})
    assert again != first


def test_unique_checks_its_parts():
    with pytest.raises(cy.ConfigurationError):
        cy.Unique(by=("colour",))
    with pytest.raises(cy.ConfigurationError):
        cy.Unique(states=("sleeping",))
    with pytest.raises(cy.ConfigurationError):
        cy.step("u", unique="yes")(lambda ctx, inp: None)
