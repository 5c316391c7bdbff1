"""The outcome writer's turns on a fake store and a fake clock (seconds): outcomes and
the claim they free in one statement, a claim alone, what is kept through an outage,
a success whose CAS failed, a timeout not yet due, a rejected error entry, a release,
reaped attempts. No database, no thread: each test drives ``turn`` itself."""

from __future__ import annotations

from types import SimpleNamespace
from typing import Any, Iterator

import pytest

from cyclone_mp import decisions
from cyclone_mp.config import Config
from cyclone_mp.errors import DatabaseBusy, DatabaseError, DatabaseUnavailable
from cyclone_mp.messages import COMPLETE, FAIL, RELEASE, Claimed, LeaseDone, Outcome, Poll, Track, Written
from cyclone_mp.outcomes import RETRY_AFTER, OutcomeWriter
from cyclone_mp.store import FORENSIC_KEYS, ClaimResult, FailResult, Settled

from fake_clock import Clock

OWNER = "host:1:abc"


class FakeStore:
    """The writer's calls, answering from what the test sets: ``settled`` (or
    ``settle_error``) for the batch statement, ``claimed`` for a claim alone, ``applied``
    for writes alone (``complete``: a bool; ``fail``: "applied", "lost" or "not_yet"),
    ``rows`` for ``state``. Every call is recorded in ``calls`` as (name, kwargs). It
    stands for the session and its ``claims``, ``outcomes`` and ``leases`` queries (each
    is itself)."""

    broken = False

    def __init__(self) -> None:
        self.calls: list[tuple[str, dict[str, Any]]] = []
        self.settled = Settled(completed=set(), failed=set(), claimed=[])
        self.settle_error: Exception | None = None
        self.claimed: list[dict[str, Any]] = []
        self.applied: list[Any] = []  # answers of complete/fail/release, in order
        self.fail_error: Exception | None = None
        self.mark_dead_error: Exception | None = None
        self.rows: dict[int, dict[str, Any] | None] = {}
        self.claims = self.outcomes = self.leases = self

    def settle(self, **kw: Any) -> Settled:
        self.calls.append(("settle", kw))
        if self.settle_error is not None:
            raise self.settle_error
        return self.settled

    def claim(self, **kw: Any) -> ClaimResult:
        self.calls.append(("claim", kw))
        return ClaimResult(self.claimed, None, None)

    def complete(self, **kw: Any) -> bool:
        self.calls.append(("complete", kw))
        return self.applied.pop(0)

    def fail(self, **kw: Any) -> FailResult:
        self.calls.append(("fail", kw))
        if self.fail_error is not None:
            error, self.fail_error = self.fail_error, None
            raise error
        return FailResult(self.applied.pop(0))

    def release(self, **kw: Any) -> bool:
        self.calls.append(("release", kw))
        return self.applied.pop(0)

    def annotate(self, **kw: Any) -> None:
        self.calls.append(("annotate", kw))

    def mark_dead(self, keys: list[Any], unstarted: Any = ()) -> None:
        self.calls.append(("mark_dead", {"keys": keys, "unstarted": set(unstarted)}))
        if self.mark_dead_error is not None:
            error, self.mark_dead_error = self.mark_dead_error, None
            raise error

    def state(self, step_id: int) -> dict[str, Any] | None:
        return self.rows.get(step_id)

    def close(self) -> None:
        pass

    def named(self, name: str) -> list[dict[str, Any]]:
        return [kw for called, kw in self.calls if called == name]


@pytest.fixture
def store() -> FakeStore:
    return FakeStore()


@pytest.fixture
def told() -> SimpleNamespace:
    """What the writer told the lease keeper and process control, in order."""
    return SimpleNamespace(keeper=[], control=[])


@pytest.fixture
def writer(store: FakeStore, clock: Clock, told: SimpleNamespace) -> Iterator[OutcomeWriter]:
    """A connected writer (lease_ttl 3 s) on the fake store; backoff 1 s after every attempt."""
    w = OutcomeWriter("postgresql://unused", Config.build(lease_ttl=3.0), owner=OWNER, names=["ok"],
                      backoff_for=lambda name: lambda attempt: 1.0, tell_keeper=told.keeper.append,
                      tell_control=told.control.append, load=lambda message: None, clock=clock)
    w.store, w.db_ok = store, True  # connected, as its thread's _connect leaves it
    yield w
    w.inbox.close()


def done(step_id: int, output: Any = None) -> Outcome:
    return Outcome((step_id, 1), COMPLETE, "ok", 1, False, output=output or {"n": step_id})


def failed(step_id: int, **fields: Any) -> Outcome:
    fields.setdefault("entry", {"type": "ValueError", "message": "no"})
    return Outcome((step_id, 1), FAIL, "ok", 1, False, error_kind=decisions.ERROR, **fields)


def claimed_rows(*ids: int) -> list[dict[str, Any]]:
    return [{"id": i, "lease_generation": 1} for i in ids]


def test_outcomes_and_the_claim_they_free_go_in_one_statement(writer, store, told):
    store.settled = Settled(completed={(1, 1)}, failed={(2, 1)}, claimed=claimed_rows(9),
                            failed_kinds={(2, 1): decisions.ERROR})
    writer.post_batch((done(1), failed(2)), claim=2)
    assert not writer.idle
    writer.turn(100.0)
    [call] = store.calls
    assert call[0] == "settle" and call[1]["limit"] == 2 and call[1]["owner"] == OWNER
    assert call[1]["completions"] == [(1, 1, {"n": 1}, None, None)]
    [failure] = call[1]["failures"]
    assert (failure.id, failure.generation, failure.kind, failure.delay) == (2, 1, decisions.ERROR, 1.0)
    assert failure.entry == {"worker": OWNER, "lease_generation": 1, "type": "ValueError", "message": "no"}
    assert told.keeper == [Track(((9, 1),), 100.0), LeaseDone(((1, 1), (2, 1)))]  # renew the new, stop the ended
    assert told.control == [Claimed(tuple(claimed_rows(9)), 100.0, 2), Poll(), Written(1)]
    assert writer.idle
    assert writer.stats == {"batches": 1, "claimed": 1, "completed": 1, "failed": 1}


def test_batches_posted_while_the_writer_was_busy_go_in_its_next_statement_as_one(writer, store, told):
    """Process control posts what ends while a statement is in flight; the writer's next
    turn writes every waiting batch in one statement, with their claims added up, and says
    so in one Written."""
    store.settled = Settled(completed={(1, 1), (2, 1)}, failed={(3, 1)}, claimed=claimed_rows(7, 8, 9),
                            failed_kinds={(3, 1): decisions.ERROR})
    writer.post_batch((done(1),), claim=2, start_now=1)
    writer.post_batch((done(2), failed(3)), claim=1, start_now=0)
    writer.turn(100.0)
    [call] = store.calls
    assert call[0] == "settle" and call[1]["limit"] == 3 and call[1]["start_now"] == 1
    assert [c[:2] for c in call[1]["completions"]] == [(1, 1), (2, 1)]
    assert [(f.id, f.generation) for f in call[1]["failures"]] == [(3, 1)]
    assert told.control == [Claimed(tuple(claimed_rows(7, 8, 9)), 100.0, 3), Poll(), Written(2)]
    assert writer.idle


def test_a_claim_with_nothing_ended_is_a_statement_of_its_own(writer, store, told):
    store.claimed = claimed_rows(5, 6)
    writer.post_batch((), claim=3)
    writer.turn(100.0)
    assert [name for name, _ in store.calls] == ["claim"] and store.calls[0][1]["limit"] == 3
    assert told.keeper == [Track(((5, 1), (6, 1)), 100.0)]
    assert told.control == [Claimed(tuple(claimed_rows(5, 6)), 100.0, 3), Written(1)]
    assert writer.stats == {"claim_statements": 1, "claimed": 2}


def test_during_an_outage_a_claim_fails_at_once_and_outcomes_are_kept_with_their_leases(writer, store, told, clock):
    store.settle_error = DatabaseUnavailable("connection lost")
    writer.post_batch((done(1),), claim=1)
    writer.turn(100.0)
    assert not writer.db_ok and not writer.idle
    assert told.keeper == []  # no LeaseDone: the lease is still renewed while the write waits
    assert told.control == [Claimed((), 100.0, 1, failed=True), Written(1)]
    writer.post_batch((), claim=1)
    writer.turn(100.1)  # still down: answered at once, nothing asked of the store
    assert told.control[-2:] == [Claimed((), 100.0, 1, failed=True), Written(1)]
    assert len(store.calls) == 1
    writer.store, writer.db_ok = store, True  # reconnected
    store.applied = [True]
    clock.now = 100.2
    writer.turn(100.2)
    assert store.named("complete") == [{"owner": OWNER, "items": [(1, 1, {"n": 1}, None, None)], "workflows": False,
                                        "spawns": None}]
    assert told.keeper == [LeaseDone(((1, 1),))] and writer.idle


@pytest.mark.parametrize("timed_out", [True, False])
def test_a_success_whose_cas_failed_counts_once_as_a_timeout_only_when_past_its_deadline(writer, store, told,
                                                                                         timed_out):
    store.rows = {1: {"state": "running", "lease_owner": OWNER, "lease_generation": 1, "timed_out": timed_out}}
    store.applied = ["applied"]
    writer.post_batch((done(1),))
    writer.turn(100.0)
    if timed_out:  # ours and past its DB deadline: a timeout, written once it is due
        [fail] = store.named("fail")
        assert (fail["kind"], fail["require_timed_out"]) == (decisions.TIMEOUT, True)
        assert fail["entry"]["message"] == "returned after the database deadline"
        assert writer.stats.get("failed") == 1
    else:  # anything else (cancelled, reclaimed, written, or not past its deadline): dropped
        assert store.named("fail") == [] and writer.stats.get("late_completions_dropped") == 1
    assert told.keeper == [LeaseDone(((1, 1),))] and writer.idle


@pytest.mark.parametrize("row, annotated", [
    ({"state": "discarded", "lease_generation": 1, "last_error_kind": "timeout", "last_error_generation": 1}, True),
    ({"state": "available", "lease_generation": 1, "last_error_kind": "timeout", "last_error_generation": 1}, True),
    ({"state": "available", "lease_generation": 1, "last_error_kind": "reclaim_limit", "last_error_generation": 1},
     False),
    ({"state": "running", "lease_generation": 2, "last_error_kind": "timeout", "last_error_generation": 1}, False),
    ({"state": "cancelled", "lease_generation": 1, "last_error_kind": None, "last_error_generation": None}, False),
], ids=["swept and discarded", "swept and retried", "not a timeout", "claimed again", "cancelled"])
def test_a_late_success_after_the_sweeps_timeout_adds_its_details_to_that_entry(writer, store, told, row, annotated):
    """A handler that returned after the recovery sweep wrote its attempt's timeout: the
    return is still dropped (counted once), and that entry gets its details (progress,
    start delay, a note) only when it is this attempt's timeout."""
    store.rows = {1: {"lease_owner": OWNER, "timed_out": True, **row}}
    writer.post_batch((done(1)._replace(progress={"done": 3}, start_delay=0.5),))
    writer.turn(100.0)
    assert store.named("fail") == [] and writer.stats.get("late_completions_dropped") == 1
    if annotated:
        [call] = store.named("annotate")
        assert (call["id"], call["generation"], call["progress"]) == (1, 1, {"done": 3})
        assert call["entry"]["returned_late"] is True and call["entry"]["start_delay"] == 0.5
        assert call["note"] == "the handler returned after the database deadline"
    else:
        assert store.named("annotate") == []
    assert told.keeper == [LeaseDone(((1, 1),))] and writer.idle


def test_a_timeout_not_yet_due_on_the_database_clock_waits_for_it(writer, store, told, clock):
    writer.post_batch((failed(2, require_timed_out=True),))  # the batch statement did not take it
    store.applied = ["not_yet", "applied"]
    assert writer.turn(100.0) == pytest.approx(100.0 + RETRY_AFTER)  # kept, tried again shortly
    assert len(store.named("fail")) == 1 and told.keeper == [] and not writer.idle
    clock.now = 100.0 + RETRY_AFTER
    writer.turn(clock.now)
    assert len(store.named("fail")) == 2 and told.keeper == [LeaseDone(((2, 1),))] and writer.idle


def test_a_rejected_error_entry_is_written_again_with_its_plain_fields_only(writer, store, told):
    store.fail_error = DatabaseError("invalid input syntax for type json")
    store.applied = ["applied"]
    writer.post_batch((failed(2, entry={"type": "ValueError", "message": "bad \x00", "pid": 42, "elapsed": 0.5}),))
    writer.turn(100.0)
    first, second = store.named("fail")
    assert first["entry"]["message"] == "bad \x00"
    assert set(second["entry"]) <= FORENSIC_KEYS | {"message", "lease_generation"}
    assert (second["entry"]["pid"], second["entry"]["elapsed"]) == (42, 0.5)  # the forensics stay
    assert "type" not in second["entry"]  # what was refused goes; what the writer says stays
    assert second["entry"]["message"] == "error entry rejected by the database: invalid input syntax for type json"
    assert writer.db_ok and told.keeper == [LeaseDone(((2, 1),))]


def test_an_output_that_cannot_be_encoded_fails_its_step_and_loses_no_neighbour(writer, store, told):
    """A write whose values fail before the database (json.dumps raising RecursionError
    on an output too deep for it) must not take the batch's other outcomes with it: the
    batch is written again one by one, that step fails as output_invalid, the others are
    written, and nothing is left pending."""
    deep = RecursionError("maximum recursion depth exceeded while encoding a JSON object")
    store.settle_error = deep

    def complete(**kw: Any) -> bool:
        store.calls.append(("complete", kw))
        [item] = kw["items"]
        if item[0] == 2:
            raise deep
        return True

    store.complete = complete  # type: ignore[method-assign]
    store.applied = ["applied"]  # the output_invalid failure of step 2
    writer.post_batch((done(1), done(2, output=[[1]]), done(3)))
    writer.turn(100.0)
    assert [kw["items"][0][0] for kw in store.named("complete")] == [1, 2, 3]
    [fail] = store.named("fail")
    assert (fail["id"], fail["kind"]) == (2, decisions.OUTPUT_INVALID)
    assert "could not be sent to the database (RecursionError" in fail["entry"]["message"]
    assert writer.idle and writer.alone.pending == []
    assert {key for message in told.keeper if isinstance(message, LeaseDone) for key in message.keys} == {
        (1, 1), (2, 1), (3, 1)}


def test_a_claim_that_fails_unexpectedly_is_still_answered(writer, store, told):
    """Process control counts the steps its claims are bringing: a claim that raised
    something other than a database error must still say it is over (failed), or those
    slots would stay counted as on their way and never be claimed for again."""
    def claim(**kw: Any) -> ClaimResult:
        raise KeyError("lease_generation")

    store.claim = claim  # type: ignore[method-assign]
    writer.post_batch((), claim=3)
    writer.turn(100.0)
    assert told.control == [Claimed((), 100.0, 3, failed=True), Written(1)]


def test_a_release_is_written_alone_and_makes_its_step_claimable_at_once(writer, store, told):
    store.applied = [True]
    writer.post_batch((Outcome((3, 1), RELEASE, "ok", 1, False, held=True),))
    writer.turn(100.0)
    assert store.named("release") == [{"owner": OWNER, "id": 3, "generation": 1}]
    assert writer.stats == {"prefetch_released": 1}
    assert told.control == [Poll(), Written(1)] and told.keeper == [LeaseDone(((3, 1),))]


def test_a_held_steps_release_is_not_counted_among_the_batches_process_control_waits_for(writer, store, told):
    """Process control counts the batches it posts (``batches_out``) and posts the next
    statement once Written says they are done; a held step's release (``post``) is not
    among them, so Written must not count it, or the count would reach 0 while a
    statement is still in flight."""
    store.applied = [True]
    store.settled = Settled(completed={(1, 1)}, failed=set(), claimed=[])
    writer.post(Outcome((3, 1), RELEASE, "ok", 1, False, held=True))
    writer.turn(100.0)
    assert store.named("release") == [{"owner": OWNER, "id": 3, "generation": 1}]
    assert told.control == [Poll()]
    writer.post(Outcome((4, 1), RELEASE, "ok", 1, False, held=True))
    writer.post_batch((done(1),))
    store.applied = [True]
    writer.turn(100.0)
    assert told.control[1:] == [Poll(), Written(1)]


def test_reaped_attempts_are_recorded_after_the_outcomes_posted_before_them(writer, store):
    store.settled = Settled(completed={(1, 1)}, failed=set(), claimed=[])
    writer.post_batch((done(1),))
    writer.post_dead(((4, 1), (5, 2)))
    writer.turn(100.0)
    assert [name for name, _ in store.calls] == ["settle", "mark_dead"]
    assert store.named("mark_dead") == [{"keys": [(4, 1), (5, 2)], "unstarted": set()}]
    assert writer.stats["reaped_recorded"] == 2


def test_attempts_that_never_started_are_recorded_dead_as_unstarted(writer, store):
    """A held or queued step cancelled before its handler started: recorded with the
    reaped ones in one statement, marked as never started, and kept so through an outage."""
    writer.post_dead(((4, 1),))
    writer.post_dead(((6, 3), (7, 1)), started=False)
    store.mark_dead_error = DatabaseUnavailable("connection lost")
    writer.turn(100.0)
    assert store.named("mark_dead") == [{"keys": [(4, 1), (6, 3), (7, 1)], "unstarted": {(6, 3), (7, 1)}}]
    writer.store, writer.db_ok = store, True  # reconnected
    writer.post_dead(((8, 1),))
    writer.turn(100.1)
    assert store.named("mark_dead")[-1] == {"keys": [(4, 1), (6, 3), (7, 1), (8, 1)], "unstarted": {(6, 3), (7, 1)}}
    writer.post_dead(((9, 1),))
    writer.turn(100.2)
    assert store.named("mark_dead")[-1] == {"keys": [(9, 1)], "unstarted": set()}


def test_a_release_whose_row_moved_on_reports_the_attempt_dead(writer, store, told):
    """A release is written only once nothing of its attempt runs; when its row moved on
    (cancelled meanwhile, its dead_by set), the step need not wait for dead_by: the
    attempt is recorded dead, as never started when it was claimed ahead."""
    store.applied = [False, False]
    writer.post(Outcome((3, 1), RELEASE, "ok", 1, False, held=True))
    writer.post_batch((Outcome((4, 2), RELEASE, "ok", 1, False),))
    writer.turn(100.0)
    assert [name for name, _ in store.calls] == ["release", "release", "mark_dead"]
    assert store.named("mark_dead") == [{"keys": [(3, 1), (4, 2)], "unstarted": {(3, 1)}}]
    assert LeaseDone(((3, 1), (4, 2))) in told.keeper


def test_reaped_attempts_are_kept_through_a_busy_database(writer, store):
    """A lock wait or a statement timeout: nothing was recorded, so the next turn tries
    again (else their steps would wait for dead_by)."""
    writer.post_dead(((4, 1),), started=False)
    store.mark_dead_error = DatabaseBusy("canceling statement due to lock timeout")
    writer.turn(100.0)
    writer.turn(100.1)
    assert store.named("mark_dead") == [{"keys": [(4, 1)], "unstarted": {(4, 1)}}] * 2
    assert writer.stats["reaped_recorded"] == 1


def test_an_outcome_whose_run_is_locked_elsewhere_waits_for_a_later_statement_and_holds_back_nothing(
        writer, store, told, clock):
    """The settle statement skipped a row whose run another session holds locked (it
    waited for nothing): its outcome is neither dropped nor written alone (which would
    wait for the lock); it rides with the next statement, and goes alone (in a
    statement of its own, which skips it again) after a backoff when none comes."""
    store.settled = Settled(completed={(1, 1)}, failed=set(), claimed=claimed_rows(7), skipped={(2, 1)})
    writer.post_batch((done(1), done(2)), claim=2)
    writer.turn(100.0)
    assert told.keeper[-1] == LeaseDone(((1, 1),))  # (2, 1) keeps its lease: its write is still to come
    assert not writer.idle and writer.alone.pending == [] and writer.deferred == [done(2)]
    assert Claimed(tuple(claimed_rows(7)), 100.0, 2) in told.control  # the claim went on
    store.settled = Settled(completed={(3, 1)}, failed=set(), claimed=[], skipped={(2, 1)})
    writer.post_batch((done(3),))
    writer.turn(100.0)
    assert [[i for i, *_ in kw["completions"]] for kw in store.named("settle")] == [[1, 2], [2, 3]]
    assert writer.turn(100.0) == writer.deferred_at > 100.0  # nothing to write until then: no statement
    assert len(store.named("settle")) == 2
    store.settled = Settled(completed={(2, 1)}, failed=set(), claimed=[])
    clock.now = writer.deferred_at
    writer.turn(clock.now)
    assert [[i for i, *_ in kw["completions"]] for kw in store.named("settle")][-1] == [2]
    assert writer.idle and writer.deferred == [] and told.keeper[-1] == LeaseDone(((2, 1),))
    assert "complete" not in [name for name, _ in store.calls] and "state" not in [name for name, _ in store.calls]
