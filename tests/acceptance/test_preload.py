"""Children import the handlers' modules before they are ready (issue 8: children start
from a process that has imported the app), so a step's first attempt in a fresh child
does not spend its timeout importing, and a module that cannot be imported fails the
attempts of its steps, never the child."""

from __future__ import annotations

import time

import pytest

import handlers as h
import import_handlers as ih


@pytest.mark.parametrize("start_method", ["zygote", "spawn"])
def test_a_slow_import_happens_before_the_child_is_ready_not_in_the_first_attempt(cyclone_env_factory, monkeypatch,
                                                                                  start_method):
    monkeypatch.setenv("IMPORT_HANDLERS_SLEEP", "1.5")
    env = cyclone_env_factory(worker="thread", workers=1, start_method=start_method)
    env.mux().register(ih.imported_quick)
    run_id = env.enqueue(ih.imported_quick, {}, timeout=1)
    t0 = time.monotonic()
    handle = env.start_worker()
    started_after = time.monotonic() - t0
    step = env.run_until_complete(run_id, timeout=30).step
    # Imported in the attempt, the 1.5 s would time out attempt 1 (timeout 1 s).
    assert (step.state, step.attempt, step.errors) == ("completed", 1, [])
    child = handle.client.supervisor.children[0]
    if start_method == "spawn":
        assert child.ready_after >= 1.5  # the child imported it before it said ready
    else:  # the zygote imported it (issue 23) before the supervisor's first child was forked
        assert started_after >= 1.5 and child.ready_after < 1.5


def test_a_module_that_fails_to_import_fails_its_attempts_not_the_child(cyclone_env_factory, monkeypatch):
    monkeypatch.setenv("IMPORT_HANDLERS_FAIL", "1")
    env = cyclone_env_factory(worker="thread", workers=1)
    env.mux().register(ih.imported_quick)
    run_id = env.enqueue(ih.imported_quick, {})
    handle = env.start_worker()
    step = env.run_until_complete(run_id, timeout=30).step
    # no retry can heal it: discarded at its first attempt (tests/acceptance/test_permanent_errors.py)
    assert (step.state, step.attempt, step.error_kind) == ("discarded", 1, "not_importable")
    assert [(e["attempt"], e["type"]) for e in step.errors] == [(1, "builtins.RuntimeError")]
    assert "broken on purpose" in step.errors[0]["message"]
    assert handle.client.supervisor.stats["children_spawned"] == 1  # ready despite the import error


@pytest.mark.parametrize("how", ["exit", "hang"])
def test_a_module_whose_import_kills_or_hangs_the_child_stops_only_its_own_steps(cyclone_env_factory, monkeypatch, how):
    """The child dies (os._exit) or hangs while importing the module: later children
    leave it out, so other steps run at once and its own steps fail at their first
    attempts (child_exited, or a timeout), as they did before children imported ahead."""
    monkeypatch.setenv(f"IMPORT_HANDLERS_{how.upper()}", "1")
    monkeypatch.setattr("cyclone_mp.pool.PRELOAD_TIMEOUT", 1.0)
    env = cyclone_env_factory(worker="thread", workers=1, kill_grace=0.2)
    env.mux().register(ih.imported_quick)
    env.mux().register(h.ok)
    good = env.client().enqueue_many(h.ok, [{"i": i} for i in range(5)])
    bad = env.enqueue(ih.imported_quick, {}, timeout=1)
    handle = env.start_worker()
    for run_id in good:
        assert env.run_until_complete(run_id, timeout=30).state == "completed"
    step = env.run_until_complete(bad, timeout=30).step
    kind = "child_exited" if how == "exit" else "timeout"
    assert (step.state, step.attempt, [e["kind"] for e in step.errors]) == ("discarded", 2, [kind, kind])
    assert handle.client.supervisor.stats["children_spawned"] <= 4  # no crash loop: one preload death, one per attempt


def test_children_recycled_after_each_step_with_slow_imports_get_no_claim_and_release_churn(
        cyclone_env_factory, monkeypatch):
    """With ``max_steps_per_child=1`` a slot is free again only after a new child has
    imported the app (0.7 s here); steps prefetched for it would wait past the 0.5 s a
    held step may wait and be released, claimed again, released again."""
    monkeypatch.setenv("IMPORT_HANDLERS_SLEEP", "0.7")
    env = cyclone_env_factory(worker="thread", workers=2, prefetch=16, max_steps_per_child=1)
    env.mux().register(ih.imported_quick)
    ids = env.client().enqueue_many(ih.imported_quick, [{}] * 12)
    handle = env.start_worker()
    steps = [env.run_until_complete(r, timeout=60).step for r in ids]
    assert {(s.state, s.attempt, s.reclaims, len(s.errors)) for s in steps} == {("completed", 1, 0, 0)}
    assert len({s.output["pid"] for s in steps}) == 12  # one child per step
    stats = handle.client.supervisor.stats
    assert stats["prefetch_released"] <= 2 and stats["claimed"] <= 14, stats  # at most one per child, before the start-up time was known
