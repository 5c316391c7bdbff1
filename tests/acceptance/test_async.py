"""``async def`` handlers (issue 24, acceptance 1): each runs as a task on its child's own
event loop; a cancel (timeout, client.cancel, shutdown) cancels that task, so its await
raises CancelledError at once; a loop blocked in C is killed after kill_grace."""

from __future__ import annotations

import datetime as dt

import async_handlers as ah
from waiting import wait_for


def _at(entry: dict) -> dt.datetime:
    return dt.datetime.fromisoformat(entry["at"])


def test_async_and_sync_handlers_share_a_mux_and_the_loop_is_reused(cyclone_env_factory):
    env = cyclone_env_factory(workers=1)
    env.mux().register(ah.echo, ah.sync_echo)
    first = env.run_until_complete(env.enqueue(ah.echo, {"n": 1}))
    mixed = env.run_until_complete(env.enqueue(ah.sync_echo, {"n": 2}))
    second = env.run_until_complete(env.enqueue(ah.echo, {"n": 3}))
    assert (first.state, mixed.state, second.state) == ("completed",) * 3
    assert first.step.output["echo"] == {"n": 1} and first.step.output["run_id"] == first.id
    assert mixed.step.output == {"echo": {"n": 2}, "pid": first.step.output["pid"]}
    # one child ran all three: its one event loop served both async attempts
    assert second.step.output["pid"] == first.step.output["pid"]
    assert second.step.output["loop"] == first.step.output["loop"]


def test_async_errors_and_permanent_are_recorded_like_sync_ones(cyclone_env):
    cyclone_env.mux().register(ah.fails, ah.permanent, ah.own_cancel)
    failed = cyclone_env.run_until_complete(cyclone_env.enqueue(ah.fails, {}))
    permanent = cyclone_env.run_until_complete(cyclone_env.enqueue(ah.permanent, {}))
    own = cyclone_env.run_until_complete(cyclone_env.enqueue(ah.own_cancel, {}))
    assert (failed.step.error_kind, failed.step.errors[0]["type"]) == ("error", "builtins.ValueError")
    assert (permanent.step.error_kind, permanent.step.attempt) == ("permanent", 1)
    # a CancelledError no cancel of ours caused is the handler's own error
    assert own.step.error_kind == "error"
    assert own.step.errors[0]["type"] == "asyncio.exceptions.CancelledError"


def test_timeout_cancels_the_task_at_once(cyclone_env, tmp_path):
    """Acceptance 1: asyncio.sleep(3600) with timeout=1 sees CancelledError, and the step
    records a timeout within 1 s + a tick."""
    marker = tmp_path / "marker"
    run = cyclone_env.run_until_complete(cyclone_env.enqueue(ah.sleeps, {"marker": str(marker)}))
    step = run.step
    assert (run.state, step.error_kind) == ("discarded", "timeout")
    entry = step.errors[0]
    # (the entry is the child's, type CancelledError, unless the sweep settled the timeout first)
    assert ah.marker_lines(marker) == ["started", "CancelledError timeout"]
    recorded_after = (_at(entry) - step.claimed_at).total_seconds()  # the timeout counts from the claim
    assert 1.0 <= recorded_after <= 1.0 + 0.5, recorded_after  # the Env's tick is 0.1 s; the rest is slack


def test_a_loop_blocked_in_c_is_killed_after_kill_grace(cyclone_env_factory, tmp_path):
    # A lease of 2 s, not the Env's 0.2 s: this is about the timeout's kill. With 0.2 s, a
    # renewal late on a loaded machine (one core burnt by the wedge) fenced the attempt and
    # the reclaimed step rightly ran again (two "started"; a fresh clone's first minutes).
    env = cyclone_env_factory(kill_grace=0.5, lease_ttl=2.0)
    marker = tmp_path / "marker"
    run_id = env.enqueue(ah.wedge, {"marker": str(marker)})
    env.run_until_complete(run_id)
    # the sweep may settle the timeout first; the kill's forensics join its entry then
    run = wait_for(lambda: (r := env.status(run_id)).step.errors and "killed_by_supervisor" in r.step.errors[0] and r,
                   10, "the kill's forensics")
    entry = run.step.errors[0]
    assert (run.step.error_kind, entry["killed_by_supervisor"], entry["trigger"]) == ("timeout", True, "timeout")
    assert entry["signal_name"] == "SIGKILL"
    assert ah.marker_lines(marker) == ["started"]
    # timeout + kill_grace, and the kill's own time; the deadline counts from the claim, a
    # little before the child started the attempt (where "elapsed" starts)
    assert 1.5 - 0.1 <= entry["elapsed"] <= 1.5 + 1.0


def test_client_cancel_reaches_the_task_and_ctx_cancellation_is_awaitable(cyclone_env, tmp_path):
    marker = tmp_path / "marker"
    run_id = cyclone_env.enqueue(ah.watcher, {"marker": str(marker)})
    cyclone_env.start_worker()
    wait_for(lambda: "started" in ah.marker_lines(marker), 10, "the handler to start")
    cyclone_env.client().cancel(run_id)
    lines = wait_for(lambda: len(ah.marker_lines(marker)) >= 3 and ah.marker_lines(marker), 5, "the cancel")
    assert lines == ["started", "watcher woke: cancelled", "CancelledError cancelled"]
    # the attempt ended without a kill: its forensics join the cancel entry, no kill recorded
    status = cyclone_env.status(run_id)
    assert status.state == "cancelled"
    assert not any(e.get("killed_by_supervisor") for e in status.step.errors)


def test_shutdown_cancels_the_task_and_releases_the_step(cyclone_env_factory, tmp_path):
    env = cyclone_env_factory(shutdown_grace=0.2, lease_ttl=2)  # no fence from a late renewal first
    marker = tmp_path / "marker"
    run_id = env.enqueue(ah.watcher, {"marker": str(marker)})
    env.start_worker()
    wait_for(lambda: "started" in ah.marker_lines(marker), 10, "the handler to start")
    handle = env.terminate_worker()
    handle.popen.wait(timeout=10)
    assert ah.marker_lines(marker)[1:] == ["watcher woke: shutdown", "CancelledError shutdown"]
    step = env.status(run_id).step
    assert (step.state, step.attempt, step.reclaims, step.errors) == ("available", 1, 0, [])


def test_registration_takes_async_handlers_and_refuses_generators():
    import pytest

    import cyclone_mp as cy

    assert ah.echo.is_async and not ah.sync_echo.is_async
    cy.Mux().register(ah.echo, ah.sync_echo)

    async def agen(ctx, inp):
        yield 1

    with pytest.raises(cy.ConfigurationError, match="generator"):
        cy.step("agen")(agen)
