"""The recovery sweep's decisions on fakes: what one pass does with its candidates, and
when a supervisor's maintenance sweeps, waits for another's turn, goes on at once after a
full page, or looks again after a failed ask (no database, no threads)."""

from __future__ import annotations

import random
from types import SimpleNamespace
from typing import Any

import pytest

from cyclone_mp import sweep
from cyclone_mp.config import SWEEP_LIMIT, Config
from cyclone_mp.health import MaintenanceHealth
from cyclone_mp.store.sweep import Expired, Turn


class FakeSweep:
    """The store's sweep calls a sweep pass makes (``store.sweep``), answering from a script."""

    def __init__(self, actions: list[str], timers: int = 0, discard: set[int] = frozenset()) -> None:
        self.rows = [{"id": i} for i in range(len(actions))]
        self.actions = actions
        self.timers = timers
        self.discard = discard
        self.expired: list[tuple[int, dict[str, Any]]] = []
        self.succeeded_tasks: list[str] = []
        self.limits: list[int] = []
        self.held: list[dict[str, Any]] = []

    def candidates(self, limit: int, **held: Any) -> list[dict[str, Any]]:
        self.limits.append(limit)
        self.held.append(held)
        return self.rows[:limit]

    def expire(self, id: int, backoff_for: Any, entry: dict[str, Any]) -> Expired:
        self.expired.append((id, entry))
        action = self.actions[id]
        return Expired(action, ("step", action) if action in ("timeout", "reclaim_limit") else None,
                       {"id": id} if id in self.discard else None)

    def fire_due_timers(self, limit: int) -> int:
        return self.timers

    def succeeded(self, task: str) -> None:
        self.succeeded_tasks.append(task)


def test_a_pass_settles_each_candidate_once_and_counts_by_action():
    written, discarded = [], []
    sweeper = sweep.Sweeper("sup-1", lambda name: lambda n: 1.0, written=lambda *a: written.append(a),
                            discarded=discarded.append)
    fake = FakeSweep(["timeout", "reclaim", "none", "reclaim_limit", "timeout"], timers=2, discard={3})
    counts = sweeper.run_once(SimpleNamespace(sweep=fake))
    assert counts == {"timeout": 2, "reclaim": 1, "reclaim_limit": 1, "none": 1, "timers": 2}
    assert [i for i, _ in fake.expired] == [0, 1, 2, 3, 4]
    assert all(entry == {"swept_by": "sup-1"} for _, entry in fake.expired)  # who settled it, in the entry
    assert written == [("step", "timeout"), ("step", "reclaim_limit"), ("step", "timeout")]
    assert discarded == [{"id": 3}]
    assert fake.limits == [SWEEP_LIMIT] and fake.succeeded_tasks == ["sweep"]
    assert fake.held == [{"owner": "sup-1", "held": ()}]  # no keeper: nothing held


def test_a_pass_asks_for_candidates_without_the_leases_its_keeper_holds_now():
    held = [[(7, 2)], [(7, 2), (9, 1)]]
    sweeper = sweep.Sweeper("sup-1", lambda name: lambda n: 1.0, held=lambda: held.pop(0))
    fake = FakeSweep(["reclaim"])
    sweeper.run_once(SimpleNamespace(sweep=fake))
    sweeper.run_once(SimpleNamespace(sweep=fake))
    assert fake.held == [{"owner": "sup-1", "held": [(7, 2)]}, {"owner": "sup-1", "held": [(7, 2), (9, 1)]}]


def maintenance(turns: list[Turn | str], counts: dict[str, int] | None = None) -> Any:
    """A Maintenance without its thread or connection: ``turns`` answer its asks (the
    string "failed" for an ask the database failed); each sweep returns ``counts``."""
    m = object.__new__(sweep.Maintenance)
    m.config = Config.build(poll_interval=(0.1, 1.0))
    m.owner = "sup-1"
    m.stats = {}
    m.health = MaintenanceHealth(clock=lambda: 0.0)
    m.sweeping = False
    m.swept = 0
    asks = iter(turns)

    def attempt(task: str, fn: Any) -> Any:
        answer = next(asks)
        if answer == "failed":
            return sweep.FAILED
        return fn(SimpleNamespace(sweep=SimpleNamespace(turn=lambda owner, every, t: answer)))

    def run_sweep() -> dict[str, int]:
        m.swept += 1
        return dict(counts or {})

    m.attempt = attempt
    m.sweep = run_sweep
    return m


@pytest.fixture(autouse=True)
def no_jitter(monkeypatch):
    monkeypatch.setattr(random, "uniform", lambda lo, hi: 0.0)


def test_the_supervisor_that_takes_the_turn_sweeps_and_looks_again_an_interval_later():
    m = maintenance([Turn(True, 1.0, 0.5)], {"timeout": 3, "timers": 0})
    assert m.sweep_tick(100.0) == pytest.approx(101.0)  # sweep_every = poll_interval max
    assert m.swept == 1 and not m.sweeping
    assert m.health.last_sweep_age() is not None  # the fleet's last sweep was seen


def test_another_supervisors_turn_means_no_sweep_until_it_ends():
    m = maintenance([Turn(False, 0.7, 0.2)])
    assert m.sweep_tick(100.0) == pytest.approx(100.7)
    assert m.swept == 0 and m.stats == {"sweep_turns_skipped": 1}


def test_a_full_page_goes_on_at_once_without_asking_again():
    m = maintenance([Turn(True, 1.0, None)], {"reclaim": SWEEP_LIMIT})
    assert m.sweep_tick(100.0) == 100.0 and m.sweeping  # a mass expiry: the next pass now
    m.sweep = lambda: {"reclaim": 1}  # the rest fits in a page: back to the interval, no ask was made
    assert m.sweep_tick(100.0) == pytest.approx(101.0) and not m.sweeping


def test_a_failed_ask_looks_again_within_a_poll_interval_and_does_not_sweep():
    m = maintenance(["failed"])
    assert m.sweep_tick(100.0) == pytest.approx(100.0)  # now + uniform(lo, every), jitter 0 here
    assert m.swept == 0
