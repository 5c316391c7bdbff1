"""Held steps (prefetch and pipelining) as a part of their own, on a fake clock and fake
children: how many to hold, which start where, which are given back and when."""

from __future__ import annotations

import types

from cyclone_mp.config import PIPELINE_DEPTH, PREFETCH_FLEET, PREFETCH_MAX_WAIT, PREFETCH_SHARE_MIN, Config
from cyclone_mp.holding import Holding
from cyclone_mp.limits.declared import row_limits
from cyclone_mp.messages import RELEASE, LeaseDone

NOW = [100.0]


class FakePool:
    def __init__(self, idle: int = 0) -> None:
        self.children = [types.SimpleNamespace(pid=i, attempt=None, queued=[], concurrent={}, ready=True,
                                               returncode=None, recycle_due=False) for i in range(idle)]
        self.ready_seconds = None

    def idle(self):
        return [c for c in self.children if c.attempt is None]


def holding(config: Config, pool: FakePool | None = None, started: list | None = None):
    posted, kept = [], []

    def start(item, child):
        child.attempt = item
        (started if started is not None else []).append((item.key, child.pid))
        return True

    part = Holding(config, pool or FakePool(), writer=types.SimpleNamespace(post=posted.append), keeper=kept.append,
                   clock=lambda: NOW[0], side_by_side={}, start=start, flush=lambda: None, stats={"pipelined": 0})
    return part, posted, kept


def rows(n: int, *, timeout=None, rated=False, start=1):
    return [{"id": i, "lease_generation": 1, "timeout": timeout, "step_name": "s", "attempt": 1,
             "run_kind": "task", "rated": rated} for i in range(start, start + n)]


def test_the_share_of_the_fleet_and_the_room_to_hold():
    part, _, _ = holding(Config.build(workers=2, prefetch=256))
    assert part.prefetch_share() == 256
    part.fleet = 16
    assert part.prefetch_share() == PREFETCH_FLEET // 16
    part.fleet = 10_000
    assert part.prefetch_share() == PREFETCH_SHARE_MIN
    part.fleet = 1
    assert part.prefetch_room(draining=False, step_seconds=None) == 0  # durations unknown: none
    assert part.prefetch_room(draining=True, step_seconds=0.001) == 0
    # 2 workers, a held step may wait half of PREFETCH_MAX_WAIT: 2 * 0.25 / 0.01 = 50 steps of 10 ms
    assert PREFETCH_MAX_WAIT == 0.5 and part.prefetch_room(draining=False, step_seconds=0.01) == 50
    part.add(rows(26), sent=NOW[0], now=NOW[0])
    assert part.prefetch_room(draining=False, step_seconds=0.01) == 0  # over half full: no refill yet
    part.hold_off = True
    part.held.clear()
    assert part.prefetch_room(draining=False, step_seconds=0.01) == 0  # one waited too long: none until a result


def test_idle_children_take_the_oldest_claim_first_and_stale_ones_are_released():
    started: list = []
    part, posted, _ = holding(Config.build(workers=2, prefetch=16, lease_ttl=10), FakePool(idle=2), started)
    part.add(rows(1, start=1), sent=NOW[0] - 6.0, now=NOW[0])  # claimed 6 s ago: over half its lease spent
    part.add(rows(3, start=2), sent=NOW[0], now=NOW[0])
    part.take(step_seconds=None)
    assert started == [((2, 1), 0), ((3, 1), 1)]
    assert [o.key for o in posted] == [(1, 1)] and posted[0].kind == RELEASE  # given back, never started
    assert [h.key for h in part.held] == [(4, 1)]


def test_held_steps_are_released_at_their_bound_and_dropped_when_their_lease_cannot_be_kept():
    part, posted, kept = holding(Config.build(workers=1, prefetch=16, lease_ttl=10))
    part.add(rows(1, start=1), sent=NOW[0], now=NOW[0])
    release_at = part.release_at()
    assert release_at == NOW[0] + PREFETCH_MAX_WAIT  # (under lease_ttl / 4)
    part.expire(release_at - 0.01, draining=False)
    assert not posted
    part.expire(release_at, draining=False)
    assert [o.key for o in posted] == [(1, 1)] and part.hold_off
    part.add(rows(1, start=2), sent=NOW[0] - 9.5, now=NOW[0])  # its lease expires within the fence's margin
    part.expire(NOW[0], draining=False)
    assert kept == [LeaseDone(((2, 1),))] and not part.held


def test_each_held_step_waits_at_most_its_own_bound_and_the_shortest_sets_the_claims_hold():
    """A held step's bound is min(PREFETCH_MAX_WAIT, lease_ttl / 4, timeout / 10), each
    row its own, however many rows share a timeout; the shortest among a claim's rows is
    the hold the next claims size for, and the earliest release is when to look again."""
    part, _, _ = holding(Config.build(workers=1, prefetch=16, lease_ttl=10))
    claim = (rows(1, start=1) + rows(1, timeout=2.0, start=2) + rows(1, start=3) + rows(1, timeout=0.5, start=4)
             + rows(1, timeout=2.0, start=5))
    part.add(claim, sent=NOW[0] - 0.01, now=NOW[0])
    assert {h.key[0]: round(h.release_at - NOW[0], 6) for h in part.held} == {
        1: PREFETCH_MAX_WAIT, 2: 0.2, 3: PREFETCH_MAX_WAIT, 4: 0.05, 5: 0.2}
    assert {(h.sent, h.arrived, h.lease_sent) for h in part.held} == {(NOW[0] - 0.01, NOW[0], NOW[0] - 0.01)}
    assert part.claim_hold == 0.05 and part.release_at() == NOW[0] + 0.05
    # without prefetch a held step (one that found no idle child) waits up to a quarter
    # lease, however long; the claims still size for the prefetch bound
    part, _, _ = holding(Config.build(workers=1, prefetch=0, lease_ttl=10))
    part.add(rows(1, start=1) + rows(1, timeout=2.0, start=2), sent=NOW[0], now=NOW[0])
    assert {h.key[0]: round(h.release_at - NOW[0], 6) for h in part.held} == {1: 2.5, 2: 0.2}
    assert part.claim_hold == 0.2 and part.release_at() == NOW[0] + 0.2
    # a rate-limited row is due at once (it starts now or is given back)
    part, _, _ = holding(Config.build(workers=1, prefetch=16, lease_ttl=10))
    part.add(rows(1, rated=True, start=1), sent=NOW[0], now=NOW[0])
    assert part.release_at() == NOW[0] and part.claim_hold == PREFETCH_MAX_WAIT


def test_rate_limited_rows_go_first_and_are_never_held():
    started: list = []
    part, posted, _ = holding(Config.build(workers=1, prefetch=16), FakePool(idle=1), started)
    assert part.add(rows(2, start=1) + rows(2, rated=True, start=10), sent=NOW[0], now=NOW[0]) is True
    part.take(step_seconds=None)
    assert started == [((10, 1), 0)]  # the rated one first, on the one idle child
    part.give_back_rated()
    assert [o.key for o in posted] == [(11, 1)]  # the other rated one is given back at once
    assert [h.key for h in part.held] == [(1, 1), (2, 1)]


def busy(pool: FakePool, queued: int, *, started: float | None = None) -> None:
    """Every child of ``pool`` runs an attempt (started at ``started``, default now) with
    ``queued`` steps queued behind it."""
    for child in pool.children:
        child.attempt = types.SimpleNamespace(started=NOW[0] if started is None else started, cancel_reason=None,
                                              lingering=None, limits=row_limits(rows(1)[0]))
        child.steps_run = 0
        child.queued = [object()] * queued


def test_a_busy_childs_queue_is_as_deep_as_half_the_hold_bound_allows():
    part, _, _ = holding(Config.build(workers=2, prefetch=64))
    assert part.pipeline_depth(None) == 0  # durations unknown
    assert part.pipeline_depth(0.2) == 0  # long attempts: none
    assert part.pipeline_depth(0.02) == 1  # tens of ms: one
    assert part.pipeline_depth(0.0001) == PIPELINE_DEPTH  # no-ops: the most
    assert part.pipeline_depth(0.005) == 50  # 0.25 s (half of 0.5) / 5 ms
    part.add(rows(1, timeout=1.0), sent=NOW[0], now=NOW[0])  # a 1 s timeout: held 0.1 s at most
    assert part.pipeline_depth(0.005) == 10 and part.pipeline_depth(0.0001) == PIPELINE_DEPTH


def test_a_claim_counts_the_free_places_in_busy_childrens_queues_only_with_prefetch():
    pool = FakePool(idle=2)
    part, _, _ = holding(Config.build(workers=2, prefetch=64), pool)
    busy(pool, queued=10)
    assert part.pipeline_room(draining=False, step_seconds=0.001) == 2 * (PIPELINE_DEPTH - 10)
    assert part.pipeline_room(draining=False, step_seconds=None) == 0
    assert part.pipeline_room(draining=True, step_seconds=0.001) == 0
    pool.children[0].attempt.cancel_reason = "timeout"  # nothing more queues behind a cancelled attempt
    pool.children[1].queued = [object()] * PIPELINE_DEPTH  # full
    assert part.pipeline_room(draining=False, step_seconds=0.001) == 0
    busy(pool, queued=0, started=NOW[0] - 1.0)  # running for 1 s: nothing queues behind it
    assert part.pipeline_room(draining=False, step_seconds=0.001) == 0
    part.hold_off = True
    busy(pool, queued=0)
    assert part.pipeline_room(draining=False, step_seconds=0.001) == 0  # a held step waited too long
    without, _, _ = holding(Config.build(workers=2, prefetch=0), pool)
    assert without.pipeline_room(draining=False, step_seconds=0.001) == 0  # prefetch=0: idle children only


def test_pipelining_fills_each_busy_child_up_to_its_depth():
    pool = FakePool(idle=2)
    started: list = []

    def start(item, child):
        child.queued.append(item)
        started.append(item.key)
        return True

    part, _, _ = holding(Config.build(workers=2, prefetch=256), pool)
    part.start = start
    busy(pool, queued=0)
    part.add(rows(200), sent=NOW[0], now=NOW[0])
    part.take(step_seconds=0.005)  # 50 a child
    assert [len(c.queued) for c in pool.children] == [50, 50] and len(part.held) == 100


def test_a_step_is_queued_only_where_it_starts_within_half_its_own_hold_bound():
    """The depth follows the last claim (no timeout: the most for 1 ms steps), but steps of an
    earlier claim with a 0.2 s timeout may wait 0.02 s: 10 a child at 1 ms a step."""
    pool = FakePool(idle=2)

    def start(item, child):
        child.queued.append(item)
        return True

    part, _, _ = holding(Config.build(workers=2, prefetch=256), pool)
    part.start = start
    busy(pool, queued=0)
    part.add(rows(40, timeout=0.2), sent=NOW[0], now=NOW[0])
    part.add(rows(40, start=100), sent=NOW[0], now=NOW[0])
    assert part.pipeline_depth(0.001) == PIPELINE_DEPTH
    part.take(step_seconds=0.001)
    assert [len(c.queued) for c in pool.children] == [10, 10] and len(part.held) == 60


def test_the_room_in_a_queue_stops_where_max_steps_per_child_recycles_the_child():
    pool = FakePool(idle=2)
    part, _, _ = holding(Config.build(workers=2, prefetch=64, max_steps_per_child=20), pool)
    busy(pool, queued=3)
    pool.children[1].steps_run = 18  # _pipeline queues nothing more behind it (18 + 2 + 3 > 20)
    assert part.pipeline_room(draining=False, step_seconds=0.001) == (20 - 0 - 1 - 3) + 0


def test_rows_on_their_way_count_each_idle_child_as_busy_with_an_empty_queue():
    """A claim made once the last claim's rows are held, before they start (``arriving``),
    leaves them the queues they will fill: an idle child runs one and queues up to its depth."""
    pool = FakePool(idle=2)
    part, _, _ = holding(Config.build(workers=2, prefetch=64), pool)
    busy(pool, queued=10)
    pool.children[1].attempt = None  # idle
    pool.children[1].queued = []
    assert part.pipeline_room(draining=False, step_seconds=0.001) == PIPELINE_DEPTH - 10
    assert part.pipeline_room(draining=False, step_seconds=0.001, arriving=True) == 2 * PIPELINE_DEPTH - 10
    assert part.pipeline_room(draining=False, step_seconds=0.2, arriving=True) == 0  # long attempts: no queue
    capped, _, _ = holding(Config.build(workers=2, prefetch=64, max_steps_per_child=20), pool)
    pool.children[0].steps_run, pool.children[1].steps_run = 0, 5
    assert capped.pipeline_room(draining=False, step_seconds=0.001, arriving=True) == (20 - 1 - 10) + (20 - 5 - 1)


def test_rate_limited_rows_no_idle_child_took_are_given_back_before_the_queues_fill():
    """They are held first; left at the front, they would keep the steps behind them out
    of the busy children's queues until the next turn."""
    pool = FakePool(idle=2)

    def start(item, child):
        if child.attempt is None:
            child.attempt = types.SimpleNamespace(started=NOW[0], cancel_reason=None, lingering=None, limits=row_limits(item.row))
            child.steps_run = 0
        else:
            child.queued.append(item)
        return True

    part, posted, _ = holding(Config.build(workers=2, prefetch=64), pool)
    part.start = start
    busy(pool, queued=0)
    pool.children[1].attempt = None  # one idle child
    part.add(rows(10, start=10) + rows(3, rated=True), sent=NOW[0], now=NOW[0])
    part.take(step_seconds=0.001)
    assert pool.children[1].attempt is not None and [o.key for o in posted] == [(2, 1), (3, 1)]
    assert not part.held and sum(len(c.queued) for c in pool.children) == 10
