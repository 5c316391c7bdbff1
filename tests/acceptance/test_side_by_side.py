"""async_concurrency: one child runs many attempts of an async step at once, each with its
own lease, timeout and cancel; a kill of one takes the child, and its siblings run again
without spending an attempt."""

from __future__ import annotations

import time

import pytest

import cyclone_mp as cy

import async_handlers as ah


@pytest.mark.long  # 6 s: the throughput of side-by-side awaits; the kill cases below stay in the default run (CI runs the long ones)
def test_five_hundred_one_second_awaits_on_two_children(cyclone_env_factory):
    """500 steps of `await asyncio.sleep(1)`, async_concurrency=50, 2 children: under 15 s
    (100 at a time: about 5 s of sleeping)."""
    env = cyclone_env_factory(workers=2, lease_ttl=10, poll_interval=(0.02, 0.2))
    env.mux().register(ah.side_by_side)
    ids = env.client().enqueue_many(ah.side_by_side, [{"seconds": 1.0}] * 500)
    started = time.monotonic()
    env.start_worker()
    for run_id in ids:
        assert env.run_until_complete(run_id, timeout=60).state == "completed"
    took = time.monotonic() - started
    assert took < 15.0, took
    assert {env.status(i).step.attempt for i in ids[:50]} == {1}


def test_a_wedged_one_is_killed_and_its_siblings_run_again_without_spending_attempts(cyclone_env_factory, tmp_path):
    """One of 20 blocks its child's event loop past its 2 s timeout: the child is killed
    at kill_grace; the wedged attempt is a timeout, the 19 others (stuck behind it) are
    given back and complete on attempt 1."""
    log = str(tmp_path / "side.log")
    env = cyclone_env_factory(workers=1, lease_ttl=10, kill_grace=1, poll_interval=(0.02, 0.2))
    env.mux().register(ah.side_by_side)
    wedged = env.enqueue(ah.side_by_side, {"wedge": 30, "log": log}, timeout=2, max_attempts=1)
    time.sleep(0.05)
    others = env.client().enqueue_many(ah.side_by_side, [{"seconds": 3.0, "log": log}] * 19)
    env.start_worker()
    status = env.run_until_complete(wedged, timeout=40)
    assert (status.state, status.step.error_kind) == ("discarded", "timeout")
    deadline = time.monotonic() + 10  # the sweep settles it at the deadline; the kill's forensics follow
    while not status.step.errors[-1].get("killed_by_supervisor") and time.monotonic() < deadline:
        time.sleep(0.1)
        status = env.status(wedged)
    assert status.step.errors[-1].get("killed_by_supervisor")
    for run_id in others:
        done = env.run_until_complete(run_id, timeout=40)
        assert (done.state, done.step.attempt, done.step.errors) == ("completed", 1, [])
    pids = {line.split()[2] for line in open(log)}
    assert len(pids) >= 2  # the siblings ran again in the fresh child


def test_async_concurrency_needs_an_async_handler():
    with pytest.raises(cy.ConfigurationError, match="async def"):
        cy.step("sync_many", async_concurrency=4)(lambda ctx, inp: None)
    with pytest.raises(cy.ConfigurationError, match="resource limits"):
        async def limited(ctx, inp):
            return None
        cy.step("limited_many", async_concurrency=4, memory_limit="1GiB")(limited)
