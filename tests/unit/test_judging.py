"""The judge of an attempt's ending, on evidence alone: a result, an exit, a cancel, a cap."""

from __future__ import annotations

import dataclasses
import signal
from typing import Any

import pytest

from cyclone_mp import decisions, judging
from cyclone_mp.attempts import Attempt
from cyclone_mp.messages import COMPLETE, FAIL, RELEASE, SNOOZE


def attempt(**fields: Any) -> Attempt:
    att = Attempt(key=(7, 1), run_id="r", node="n", step_name="s", attempt=2, timeout=None, token="t7",
                  child=None, workflow=False, started=10.0, deadline=None, lease_sent=10.0)
    for name, value in fields.items():
        setattr(att, name, value)
    return att


def test_the_entry_of_a_result_says_its_numbers_and_a_failures_words():
    ok = judging.result_entry(41, {"ok": True, "cpu": 0.5, "maxrss_kb": 900, "message": "x"}, 1.23456)
    assert ok == {"pid": 41, "cpu_seconds": 0.5, "peak_rss_kb": 900, "elapsed": 1.235}
    bad = judging.result_entry(41, {"ok": False, "type": "ValueError", "message": "no", "traceback": "tb"}, 2.0)
    assert (bad["type"], bad["message"], bad["traceback"]) == ("ValueError", "no", "tb")


def test_a_success_completes_with_its_output_and_spawns():
    ending = judging.of_result(attempt(), {"ok": True, "output": 3, "spawns": [{"a": 1}]}, {"pid": 1})
    out = ending.outcome
    assert (out.kind, out.output, out.spawns, out.key, out.attempt) == (COMPLETE, 3, ({"a": 1},), (7, 1), 2)
    assert ending.counter is None


@pytest.mark.parametrize("reason, fenced, late", [
    ("cancelled", False, True), ("lease_lost", False, True), ("lease_lost", True, False), ("timeout", False, False),
])
def test_a_success_after_a_cancel_is_late_unless_the_lease_may_still_be_ours(reason, fenced, late):
    ending = judging.of_result(attempt(cancel_reason=reason, fenced=fenced), {"ok": True}, {"pid": 1})
    if late:
        assert (ending.outcome, ending.label, ending.counter) == (None, "late", "late_completions_dropped")
    else:
        assert ending.outcome.kind == COMPLETE


def test_a_failure_fails_with_its_kind_and_a_snooze_spends_nothing():
    failed = judging.of_result(attempt(), {"ok": False, "kind": "permanent"}, {"pid": 1}).outcome
    assert (failed.kind, failed.error_kind) == (FAIL, decisions.PERMANENT)
    snoozed = judging.of_result(attempt(), {"ok": False, "kind": SNOOZE, "snooze": "2.5"}, {"pid": 1}).outcome
    assert (snoozed.kind, snoozed.snooze) == (SNOOZE, 2.5)


def test_a_cap_decides_a_failure_and_an_over_cap_success_unless_a_cancel_came_first():
    cap = (decisions.MEMORY_LIMIT, {"pid": 1, "cause": "memory"})
    for result in ({"ok": False, "kind": "error"}, {"ok": True}):
        out = judging.of_result(attempt(), result, {"pid": 1}, cap).outcome
        assert (out.kind, out.error_kind, out.entry) == (FAIL, decisions.MEMORY_LIMIT, cap[1])
    out = judging.of_result(attempt(cancel_reason="timeout"), {"ok": False}, {"pid": 1}, cap).outcome
    assert out.error_kind == decisions.TIMEOUT


def test_a_cancels_reason_decides_what_is_written():
    timeout = judging.of_cancel(attempt(cancel_reason="timeout"), {"pid": 1}).outcome
    assert (timeout.error_kind, timeout.require_timed_out, timeout.entry["message"]) == (
        decisions.TIMEOUT, True, "timed out")
    assert judging.of_cancel(attempt(cancel_reason="shutdown"), {}).outcome.kind == RELEASE
    for reason in ("cancelled", "lease_lost"):
        ending = judging.of_cancel(attempt(cancel_reason=reason), {"pid": 1})
        assert (ending.outcome, ending.label, ending.counter) == (None, reason, "cancelled_attempts")
    killed = judging.of_cancel(attempt(cancel_reason="cancelled"), {"killed_by_supervisor": True})
    assert (killed.outcome.error_kind, killed.counter) == (decisions.ERROR, "cancelled_attempts")
    assert judging.of_cancel(attempt(cancel_reason="protocol_error"), {}).outcome.error_kind == decisions.ERROR


def test_an_entry_given_to_the_judge_is_not_changed():
    entry = {"pid": 1}
    judging.of_cancel(attempt(cancel_reason="timeout"), entry)
    judging.of_exit(attempt(killed_by="timeout", cancel_reason="timeout"), entry, -9, child_killed=True)
    assert entry == {"pid": 1}


@pytest.mark.parametrize("reason, kind, held", [
    (None, RELEASE, False), ("shutdown", RELEASE, False), (judging.RELEASED, RELEASE, True), ("timeout", FAIL, False),
])
def test_an_unstarted_step_is_released_unless_a_cancel_decided_it(reason, kind, held):
    out = judging.of_unstarted(attempt(cancel_reason=reason), 5).outcome
    assert (out.kind, out.held) == (kind, held)
    if kind == FAIL:
        assert out.entry["message"] == "cancelled before it started"


def test_a_killed_childs_attempt_ends_as_its_kill():
    att = attempt(killed_by="timeout", cancel_reason="timeout", lingering=["worker-1"])
    ending = judging.of_exit(att, {"pid": 1}, -signal.SIGKILL, child_killed=True)
    entry = ending.outcome.entry
    assert (ending.outcome.error_kind, entry["trigger"], entry["lingering_threads"]) == (
        decisions.TIMEOUT, "timeout", ["worker-1"])
    assert "threads the handler started" in entry["message"]


def test_a_failed_attempt_whose_threads_outlived_kill_grace_ends_as_its_failure():
    att = attempt(killed_by="lingering_threads", lingering=["worker-1"])
    att.lingering_result = {"t": "result", "ok": False, "type": "ValueError", "message": "bad", "traceback": "tb"}
    ending = judging.of_exit(att, {"pid": 1}, -signal.SIGKILL, child_killed=True)
    entry = ending.outcome.entry
    assert (ending.outcome.error_kind, entry["type"], entry["message"], entry["trigger"]) == (
        decisions.ERROR, "ValueError", "bad", "lingering_threads")
    assert entry["lingering_threads"] == ["worker-1"] and entry["killed_by_supervisor"] is True


def test_a_snooze_whose_threads_outlived_kill_grace_is_still_a_snooze():
    """No attempt spent (SPEC 2): what the handler reported decides, as if its threads had ended."""
    att = attempt(killed_by="lingering_threads", lingering=["worker-1"])
    att.lingering_result = {"t": "result", "ok": False, "kind": "snooze", "snooze": 30.0,
                            "type": "cyclone_mp.errors.Snooze", "message": "later"}
    out = judging.of_exit(att, {"pid": 1}, -signal.SIGKILL, child_killed=True).outcome
    assert (out.kind, out.snooze, out.entry["lingering_threads"]) == (SNOOZE, 30.0, ["worker-1"])


def test_a_watchdog_kill_is_judged_by_what_was_due():
    """The watchdog killed a child process control missed: a cancel's kill, a failed
    attempt's lingering threads (its failure then decides, not a lost lease), or the fence."""
    assert judging.watchdog_trigger(attempt(cancel_reason="timeout", kill_at=12.0), 30.0) == "timeout"
    lingering = attempt(lingering=["worker-1"], kill_at=12.0)
    assert judging.watchdog_trigger(lingering, 30.0) == "lingering_threads"
    assert judging.watchdog_trigger(lingering, 1.0) == "lease_fence"  # its fence (11.0) came first
    assert judging.watchdog_trigger(attempt(), 30.0) == "lease_fence"


def test_a_child_that_died_on_its_own_fails_its_attempt_with_how_it_died():
    died = judging.of_exit(attempt(), {"pid": 1}, -signal.SIGSEGV, child_killed=False).outcome
    assert (died.error_kind, died.entry["message"]) == (
        decisions.CHILD_EXITED, "child process exited unexpectedly (signal SIGSEGV)")
    code = judging.of_exit(attempt(), {"pid": 1}, 3, child_killed=False).outcome
    assert code.entry["message"].endswith("(exit code 3)") and code.entry["killed_by_supervisor"] is False
    front = judging.of_exit(attempt(), {"pid": 1}, -9, child_killed=True).outcome
    assert front.entry["trigger"] == "previous_attempt"
    cancelled = judging.of_exit(attempt(cancel_reason="lease_lost"), {"pid": 1}, 1, child_killed=False)
    assert (cancelled.outcome, cancelled.entry["cancel_reason"]) == (None, "lease_lost")
    cap = (decisions.MEMORY_LIMIT, {"cause": "oom"})
    assert judging.of_exit(attempt(), {}, -9, child_killed=False, cap=cap).outcome.entry == cap[1]


def test_side_by_side_attempts_of_a_dead_child():
    killed_for = judging.of_side_by_side_exit(attempt(killed_by="timeout", cancel_reason="timeout"), {},
                                              child_killed=True)
    assert killed_for.outcome.error_kind == decisions.TIMEOUT
    beside = judging.of_side_by_side_exit(attempt(), {}, child_killed=True).outcome
    assert beside.kind == RELEASE
    crashed = judging.of_side_by_side_exit(attempt(), {}, child_killed=False).outcome
    assert crashed.error_kind == decisions.CHILD_EXITED


def test_the_observers_label():
    att = attempt()
    ending = judging.of_result(att, {"ok": True}, {})
    assert judging.label(att, ending.outcome) == "completed"
    assert judging.label(att, judging.released(att)) == "released"
    lost = attempt(cancel_reason="lease_lost")
    assert judging.label(lost, judging.failed(lost, decisions.ERROR, {})) == "lease_lost"
    assert judging.label(att, judging.failed(att, decisions.TIMEOUT, {})) == decisions.TIMEOUT


def test_an_attempts_first_fields_are_in_the_order_a_start_passes_them():
    """AttemptStarts.start builds an Attempt by position (once a step): its first fields
    keep this order, or each value would land in the wrong field."""
    names = [f.name for f in dataclasses.fields(Attempt)][:16]
    assert names == ["key", "run_id", "node", "step_name", "attempt", "timeout", "token", "child", "workflow",
                     "started", "deadline", "lease_sent", "backoff_spec", "trace", "limits", "claimed"]
