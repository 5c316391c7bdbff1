"""A supervisor's maintenance turn on a fake store and a fake clock (seconds): which
tasks a turn does (sweep, registry row, schedules) and when it asks to run again; the
first registry row waits for process control's children, a child that took a step is
registered before the interval is over, and nothing is asked while the database is away.
No database, no thread: each test drives ``turn`` itself."""

from __future__ import annotations

import random
import threading
from types import SimpleNamespace
from typing import Any, Iterator

import pytest

import cyclone_mp as cy
from cyclone_mp import sweep
from cyclone_mp.config import VACUUM_WATCH_INTERVAL, Config
from cyclone_mp.messages import Fleet
from cyclone_mp.store import Turn

from fake_clock import Clock

OWNER = "host:1:abc"


class FakeStore:
    """The calls of a maintenance turn: the sweep's turn is always this supervisor's, a
    sweep pass finds nothing, and ``register`` answers ``(live, paused queues)``. It stands
    for the session and its ``sweep`` and ``registry`` queries (each is itself)."""

    broken = False

    def __init__(self) -> None:
        self.calls: list[str] = []
        self.registered: list[dict[str, Any]] = []  # the info of each registry row written
        self.live, self.paused = 1, []
        self.sweep = self.registry = self

    def turn(self, owner: str, every: float, task: str) -> Turn:
        self.calls.append(f"turn {task}")
        return Turn(True, every, None)

    def candidates(self, limit: int, **held: Any) -> list[dict[str, Any]]:
        self.calls.append("sweep")
        return []

    def fire_due_timers(self, limit: int) -> int:
        return 0

    def succeeded(self, task: str) -> None:
        pass

    def register(self, *, id: str, hostname: str, pid: int, info: dict[str, Any], live: float,
                        queues: Any) -> tuple[int, list[str]]:
        self.calls.append("register")
        self.registered.append(info)
        return self.live, self.paused

    def close(self) -> None:
        pass


@pytest.fixture(autouse=True)
def no_jitter(monkeypatch):
    monkeypatch.setattr(random, "uniform", lambda lo, hi: lo)


@pytest.fixture
def store() -> FakeStore:
    return FakeStore()


@pytest.fixture
def world(store: FakeStore, clock: Clock) -> Iterator[SimpleNamespace]:
    """A connected Maintenance (poll interval 0.1-1 s, registry every 2 s) whose process
    control publishes ``world.info`` and has started its children (``world.started``)."""
    told: list[Any] = []
    info: dict[str, Any] = {"children": [{"pid": 11, "run_id": None}]}
    started = threading.Event()
    started.set()
    config = Config.build(poll_interval=(0.1, 1.0), registry_interval=2.0)
    m = sweep.Maintenance("postgresql://unused", config, sweeper=sweep.Sweeper(OWNER, lambda name: lambda n: 1.0),
                          mux=cy.Mux(), owner=OWNER, snapshot=lambda: dict(info), tell_control=told.append,
                          started=started, history=SimpleNamespace(policy=SimpleNamespace(active=False)),
                          vacuum_watch=SimpleNamespace(run_once=lambda store: False), clock=clock)
    m.store, m.db_ok = store, True  # connected, as its thread's _connect leaves it
    yield SimpleNamespace(m=m, told=told, info=info, started=started)
    m.inbox.close()


def at(world: SimpleNamespace, clock: Clock, now: float) -> float:
    """One maintenance turn at ``now``; returns when it asks to run again."""
    clock.now = now
    return world.m.turn(now)


def test_a_first_turn_sweeps_and_registers_then_runs_again_at_its_earliest_task(world, clock, store):
    wake = at(world, clock, 100.0)
    assert store.calls == ["turn sweep", "sweep", "register"]
    assert world.m.stats == {"sweeps": 1, "reclaimed": 0, "swept_timeouts": 0, "reclaim_limits": 0}
    assert world.told == [Fleet(1)]  # the fleet's size, for process control's share of the prefetch
    assert store.registered[0]["children"] == [{"pid": 11, "run_id": None}] and "maintenance" in store.registered[0]
    # the earliest of: schedules (every poll interval; its minimum without jitter), newly
    # busy children (REGISTRY_SOON), the sweep (1 s), the registry (2 s), the vacuum watch
    assert wake == pytest.approx(100.1)
    assert (world.m.next_sweep, world.m.next_registry) == (pytest.approx(101.0), pytest.approx(102.0))
    assert world.m.next_vacuum_watch == pytest.approx(100.0 + VACUUM_WATCH_INTERVAL)


def test_the_sweep_and_the_registry_come_again_at_their_intervals(world, clock, store):
    at(world, clock, 100.0)
    store.calls.clear()
    at(world, clock, 100.5)
    assert store.calls == []  # neither is due; no child became busy
    at(world, clock, 101.0)
    assert store.calls == ["turn sweep", "sweep"]
    at(world, clock, 102.0)
    assert store.calls[-1] == "register"


def test_the_first_registry_row_waits_for_process_controls_children(world, clock, store):
    world.started.clear()
    assert at(world, clock, 100.0) == pytest.approx(100.05)  # looks again soon
    assert "register" not in store.calls
    world.started.set()
    at(world, clock, 100.05)
    assert store.calls.count("register") == 1


def test_a_child_that_took_a_step_is_registered_before_the_interval_is_over(world, clock, store):
    at(world, clock, 100.0)
    world.info["children"] = [{"pid": 11, "run_id": "r1"}]
    at(world, clock, 100.25)
    assert store.calls.count("register") == 2 and store.registered[-1]["children"][0]["run_id"] == "r1"
    at(world, clock, 100.5)
    assert store.calls.count("register") == 2  # still the same busy child: nothing new to say


def test_paused_queues_and_the_fleet_size_come_back_with_the_registry_row(world, clock, store):
    store.live, store.paused = 4, ["slow"]
    at(world, clock, 100.0)
    assert world.told == [Fleet(4)] and world.m.paused_queues == ["slow"]


def test_while_the_database_is_away_a_turn_asks_nothing(world, clock, store):
    world.m.db_ok = False
    assert at(world, clock, 100.0) == pytest.approx(100.0)  # its tasks stay due (the thread waits for a reconnect)
    assert store.calls == [] and world.told == []
