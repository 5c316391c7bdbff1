"""raise cy.Snooze(seconds): the step runs again later without spending an attempt, and
its snoozes are counted (bounded by max_snoozes)."""

from __future__ import annotations

import datetime as dt

import pytest

import cyclone_mp as cy

import live_handlers as lh


def test_three_snoozes_then_success_spend_no_attempt(cyclone_env_factory, tmp_path):
    log = str(tmp_path / "snooze.log")
    env = cyclone_env_factory(workers=1, poll_interval=(0.05, 0.2))
    env.mux().register(lh.live_snoozer)
    run_id = env.enqueue(lh.live_snoozer, {"log": log, "times": 3, "seconds": 0.3})
    env.start_worker()
    status = env.run_until_complete(run_id, timeout=30)
    step = status.step
    assert (status.state, step.attempt, step.snoozes, step.errors) == ("completed", 1, 3, [])
    starts = lh.records(log, "start")
    assert len(starts) == 4 and {r["attempt"] for r in starts} == {1}
    gaps = [b["t"] - a["t"] for a, b in zip(starts, starts[1:])]
    assert all(g >= 0.3 for g in gaps), gaps  # each one ran again only after its snooze
    assert step.output == {"starts": 4}


def test_snoozing_past_max_snoozes_discards(cyclone_env_factory, tmp_path):
    log = str(tmp_path / "snooze.log")
    env = cyclone_env_factory(workers=1, poll_interval=(0.05, 0.2))
    env.mux().register(lh.live_snoozer)
    run_id = env.enqueue(lh.live_snoozer, {"log": log, "times": 100, "seconds": 0.01})
    env.start_worker()
    status = env.run_until_complete(run_id, timeout=30)
    step = status.step
    assert (status.state, step.error_kind, step.snoozes, step.attempt) == ("discarded", "snooze_limit", 6, 1)
    assert "max_snoozes=5" in step.error and len(lh.records(log, "start")) == 6


def test_snooze_takes_seconds():
    assert cy.Snooze(dt.timedelta(minutes=1)).seconds == 60.0
    for bad in (-1, float("nan"), "soon", True, 10**9):
        with pytest.raises(ValueError):
            cy.Snooze(bad)
