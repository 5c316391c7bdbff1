"""Pausing a queue: no supervisor claims its steps while it is paused (running ones
finish), resuming restarts claims at once; workers, metrics and the CLI say so."""

from __future__ import annotations

import json
import time

import pytest

import cyclone_mp as cy
from cyclone_mp.store import connect

import handlers as h
from cli_run import run_cli
from waiting import supervisor_turns


def claimed(dsn: str, queue: str) -> int:
    with connect(dsn) as conn:
        return conn.execute("SELECT count(*) AS n FROM cyclone_steps WHERE queue = %s AND lease_generation > 0",
                            (queue,)).fetchone()["n"]


@pytest.mark.parametrize("paused_for", [2.0, pytest.param(10.0, marks=pytest.mark.long)])  # (CI runs both)
def test_a_paused_queue_is_not_claimed_across_two_supervisors(cyclone_env_factory, paused_for):
    """Two supervisors serve two queues; "slow" is paused: for 10 s (2 s in the default
    suite) nothing of it is claimed (the other queue runs on), then resume: claims within
    a poll."""
    poll = 0.5
    env = cyclone_env_factory(workers=2, poll_interval=(0.05, poll), queues=["default", "slow"], registry_interval=0.2)
    env.mux().register(h.ok)
    client = env.client()
    assert client.pause_queue("slow", reason="maintenance window") is True
    assert client.pause_queue("slow") is False  # already
    held = client.enqueue_many(h.ok, [{"i": i} for i in range(20)], queue="slow")
    supervisors = [env.start_worker(), env.start_worker()]
    others = client.enqueue_many(h.ok, [{"i": i} for i in range(20)])  # queue default: runs
    for run_id in others:
        assert env.run_until_complete(run_id, timeout=30).state == "completed"
    deadline = time.monotonic() + paused_for
    while time.monotonic() < deadline:
        assert claimed(env.dsn, "slow") == 0
        time.sleep(0.2)
    for handle in supervisors:  # each polled meanwhile: the paused queue had its chances to be claimed
        supervisor_turns(env.dsn, "claim_statements", 2, supervisor_id=handle.supervisor_id)
    assert claimed(env.dsn, "slow") == 0
    rows = client.workers()
    assert all(r["info"].get("paused_queues") == ["slow"] for r in rows), [r["info"].get("paused_queues") for r in rows]
    listed = json.loads(run_cli("queue", "list", "--json", dsn=env.dsn).stdout)
    assert [(r["queue"], r["reason"]) for r in listed] == [("slow", "maintenance window")]
    assert "slow (paused)" in run_cli("workers", dsn=env.dsn).stdout

    assert run_cli("queue", "resume", "slow", dsn=env.dsn).stdout.strip() == "queue slow resumed"
    resumed = time.monotonic()  # the CLI's own start (an interpreter, about 0.5 s idle) is not the claim's
    while claimed(env.dsn, "slow") == 0 and time.monotonic() - resumed < 10:
        time.sleep(0.02)
    assert time.monotonic() - resumed <= poll + 1.0, time.monotonic() - resumed  # the resume's NOTIFY, or a poll
    for run_id in held:
        assert env.run_until_complete(run_id, timeout=30).state == "completed"
    assert client.paused_queues() == []


def test_queue_names_are_checked(cyclone_dsn):
    client = cy.Client(cyclone_dsn)
    try:
        for bad in ("", "x" * 10_000, "a\x00b"):
            try:
                client.pause_queue(bad)
            except cy.ConfigurationError:
                continue
            raise AssertionError(f"{bad!r} accepted")
    finally:
        client.close()
