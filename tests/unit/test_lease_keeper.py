"""The lease keeper's turns on a fake store and a fake clock (seconds): when a lease is
renewed, what a renewal carries, which leases share a statement, and what process control
is told when a renewal matched nothing or the database went away. No database, no
thread: each test drives ``turn`` itself."""

from __future__ import annotations

import random
from typing import Any, Iterator

import pytest

from cyclone_mp.config import Config
from cyclone_mp.errors import DatabaseError, DatabaseUnavailable
from cyclone_mp.leases import LeaseKeeper
from cyclone_mp.messages import DatabaseState, LeaseDone, LeaseLost, Progress, Renewed, Started, Track

from fake_clock import Clock

OWNER = "host:1:abc"
A, B = (7, 1), (8, 1)  # (step id, lease generation)


class FakeStore:
    """The two calls the keeper makes. ``renew_many`` matches every step except those in
    ``lost`` and raises for a statement that holds a step of ``locked``, or the next of
    ``outages``; ``state`` answers from ``rows``. It stands for the session and its
    ``leases`` queries both (``store.leases`` is itself)."""

    broken = False

    def __init__(self) -> None:
        self.renewals: list[list[tuple[Any, ...]]] = []  # the items of each renew_many call
        self.lost: set[int] = set()
        self.locked: set[int] = set()
        self.outages = 0
        self.rows: dict[int, dict[str, Any] | None] = {}
        self.leases = self

    def renew_many(self, *, owner: str, items: list[tuple[Any, ...]], ttl: float) -> list[bool]:
        assert owner == OWNER and ttl == 3.0
        self.renewals.append(items)
        if self.outages:
            self.outages -= 1
            raise DatabaseUnavailable("connection lost")
        if any(item[0] in self.locked for item in items):
            raise DatabaseError("lock timeout")
        return [item[0] not in self.lost for item in items]

    def state(self, step_id: int) -> dict[str, Any] | None:
        return self.rows.get(step_id)

    def close(self) -> None:
        pass


@pytest.fixture(autouse=True)
def middle_of_every_range(monkeypatch):
    """first_beat's phase and the renewals' jitter take the middle of their range: the
    first renewal 0.75 of an interval after the claim, then one every interval."""
    monkeypatch.setattr(random, "uniform", lambda lo, hi: (lo + hi) / 2)


@pytest.fixture
def store() -> FakeStore:
    return FakeStore()


@pytest.fixture
def told() -> list[Any]:
    return []


@pytest.fixture
def keeper(store: FakeStore, clock: Clock, told: list[Any]) -> Iterator[LeaseKeeper]:
    """A connected keeper (lease_ttl 3 s: a heartbeat interval of 1 s) on the fake store."""
    k = LeaseKeeper("postgresql://unused", Config.build(lease_ttl=3.0), owner=OWNER, tell=told.append, clock=clock)
    k.store, k.db_ok = store, True  # connected, as its thread's _connect leaves it
    yield k
    k.inbox.close()


def at(keeper: LeaseKeeper, clock: Clock, now: float) -> float:
    """One turn of the keeper at ``now``; returns when it asks to run again."""
    clock.now = now
    return keeper.turn(now)


def test_a_claimed_lease_is_first_renewed_in_the_second_half_of_an_interval_then_every_interval(keeper, clock, store,
                                                                                                 told):
    keeper.inbox.post(Track((A,), sent=100.0))
    assert at(keeper, clock, 100.0) == pytest.approx(100.75)  # its first beat
    assert store.renewals == [] and told == []
    assert at(keeper, clock, 100.75) == pytest.approx(101.75)
    assert store.renewals == [[(7, 1, None, None)]] and told == [Renewed(A, 100.75)]
    at(keeper, clock, 101.5)
    assert len(store.renewals) == 1  # not due yet
    at(keeper, clock, 101.75)
    assert len(store.renewals) == 2 and told[-1] == Renewed(A, 101.75)


def test_leases_due_together_share_one_statement_and_a_done_lease_is_not_renewed(keeper, clock, store, told):
    keeper.inbox.post(Track((A, B), sent=100.0))
    at(keeper, clock, 100.75)
    assert store.renewals == [[(7, 1, None, None), (8, 1, None, None)]]
    assert told == [Renewed(A, 100.75), Renewed(B, 100.75)]
    keeper.inbox.post(LeaseDone((A,)))
    at(keeper, clock, 101.75)
    assert store.renewals[-1] == [(8, 1, None, None)]
    keeper.inbox.post(LeaseDone((B,)))
    assert at(keeper, clock, 102.75) == pytest.approx(103.75)  # nothing held: one interval from now
    assert len(store.renewals) == 2


def test_held_lists_the_leases_it_renews_until_each_is_done_or_lost(keeper, clock, store, told):
    assert keeper.held() == []
    keeper.inbox.post(Track((A, B), sent=100.0))
    at(keeper, clock, 100.0)
    assert sorted(keeper.held()) == [A, B]
    keeper.inbox.post(LeaseDone((A,)))
    at(keeper, clock, 100.5)
    assert keeper.held() == [B]
    store.lost, store.rows = {8}, {8: None}
    at(keeper, clock, 100.75)
    assert keeper.held() == [] and told[-1] == LeaseLost(B, "cancelled")


def test_progress_and_the_start_delay_go_with_the_next_renewal_once(keeper, clock, store):
    keeper.inbox.post(Track((A,), sent=100.0))
    keeper.inbox.post(Progress(A, {"done": 1, "total": 4}))
    keeper.inbox.post(Started(((A, 0.25),)))
    at(keeper, clock, 100.75)
    at(keeper, clock, 101.75)
    assert store.renewals == [[(7, 1, {"done": 1, "total": 4}, 0.25)], [(7, 1, None, None)]]


@pytest.mark.parametrize("row, reason, counted", [
    ({"state": "running", "lease_owner": "other:2:def", "lease_generation": 2, "timed_out": False,
      "last_error_kind": None, "last_error_generation": None}, "lease_lost", 1),  # reclaimed by another
    ({"state": "running", "lease_owner": OWNER, "lease_generation": 1, "timed_out": True,
      "last_error_kind": None, "last_error_generation": None}, "timeout", 0),  # ours, past its DB deadline
    (None, "cancelled", 0),  # the run was pruned
])
def test_a_renewal_that_matched_nothing_says_why_and_forgets_the_lease(keeper, clock, store, told, row, reason,
                                                                       counted):
    store.lost, store.rows = {7}, {7: row}
    keeper.inbox.post(Track((A, B), sent=100.0))
    at(keeper, clock, 100.75)
    assert told == [LeaseLost(A, reason), Renewed(B, 100.75)]
    assert keeper.stats.get("lease_lost", 0) == counted
    at(keeper, clock, 101.75)
    assert store.renewals[-1] == [(8, 1, None, None)]  # the lost one is renewed no more


def test_an_outage_tells_process_control_and_the_renewal_is_tried_again_within_half_an_interval(keeper, clock,
                                                                                                store, told):
    keeper.inbox.post(Track((A,), sent=100.0))
    store.outages = 1
    at(keeper, clock, 100.75)
    assert told == [DatabaseState(False)] and not keeper.db_ok
    at(keeper, clock, 101.0)
    assert len(store.renewals) == 1  # no connection: nothing tried
    keeper.store, keeper.db_ok = store, True  # reconnected
    at(keeper, clock, 101.2)
    assert len(store.renewals) == 1  # before its retry
    at(keeper, clock, 101.25)  # half an interval after the failed one
    assert len(store.renewals) == 2 and told[-1] == Renewed(A, 101.25)


def test_a_locked_row_holds_back_only_its_own_renewal(keeper, clock, store, told):
    store.locked = {8}
    keeper.inbox.post(Track((A, B), sent=100.0))
    at(keeper, clock, 100.75)
    # the statement for both failed; then one by one: A renewed, B tried again half an interval later
    assert store.renewals == [[(7, 1, None, None), (8, 1, None, None)], [(7, 1, None, None)], [(8, 1, None, None)]]
    assert told == [Renewed(A, 100.75)] and keeper.db_ok
    store.locked = set()
    assert at(keeper, clock, 101.0) == pytest.approx(101.25)
    at(keeper, clock, 101.25)
    assert store.renewals[-1] == [(8, 1, None, None)] and told[-1] == Renewed(B, 101.25)
