"""Claims as process control makes them, on a fake clock and fake children: with prefetch,
the statement after a claim (the outcomes gathered meanwhile, and the next claim) is
posted before the claim's rows start, with a claim for the room those rows leave."""

from __future__ import annotations

import types

from cyclone_mp.claiming import Claims
from cyclone_mp.config import PIPELINE_DEPTH, Config
from cyclone_mp.holding import Holding
from cyclone_mp.limits.declared import row_limits
from cyclone_mp.messages import COMPLETE, Claimed, Outcome
from cyclone_mp.reports import Reports

NOW = 100.0


def rows(n: int, start: int = 1) -> list[dict]:
    return [{"id": i, "lease_generation": 1, "timeout": None, "step_name": "s", "attempt": 1, "run_kind": "task",
             "rated": False} for i in range(start, start + n)]


def control(prefetch: int, *, idle: int = 2, draining: bool = False):
    """A process control of ``idle`` idle children with one outcome gathered; ``posted``
    records each batch the writer gets, with how many rows were held or started then."""
    children = [types.SimpleNamespace(pid=i, attempt=None, queued=[], concurrent={}, ready=True, returncode=None,
                                      recycle_due=False, steps_run=0) for i in range(idle)]
    pool = types.SimpleNamespace(children=children, ready_seconds=None,
                                 idle=lambda: [c for c in children if c.attempt is None])
    config = Config.build(workers=idle, prefetch=prefetch)
    started: list = []
    posted: list = []

    def start(item, child):
        if child.attempt is None:
            child.attempt = types.SimpleNamespace(started=NOW, cancel_reason=None, lingering=None, limits=row_limits(item.row))
        else:
            child.queued.append(item)
        started.append(item.key)
        return True

    def post_batch(outcomes, claim, start_now):
        posted.append({"outcomes": len(outcomes), "claim": claim, "start_now": start_now,
                       "held": len(ctl.holding.held), "started": len(started)})

    ctl = types.SimpleNamespace(
        config=config, pool=pool, draining=draining, db_ok=True, claiming=0, batches_out=1,
        claim_after_written=False, cancelled_unclaimed={}, keeper=lambda message: None, clock=lambda: NOW,
        step_seconds=0.001, poll_delay=0.1, next_poll=NOW,
        outcomes=[(Outcome((1000, 1), COMPLETE, "s", 1, False), None)], outcomes_since=NOW,
        writer=types.SimpleNamespace(idle=False, post_batch=post_batch))
    ctl.holding = Holding(config, pool, writer=types.SimpleNamespace(post=lambda o: None), keeper=ctl.keeper,
                          clock=ctl.clock, side_by_side={}, start=start, flush=lambda: None, stats={"pipelined": 0})
    ctl.held = ctl.holding.held
    ctl.prefetch_room = lambda: ctl.holding.prefetch_room(draining=ctl.draining, step_seconds=ctl.step_seconds)
    ctl.take_held = lambda: ctl.holding.take(step_seconds=ctl.step_seconds)
    ctl.claims, ctl.reports = Claims(ctl), Reports(ctl)
    return ctl, posted, started


def test_the_next_statement_goes_before_the_claimed_rows_start_with_the_room_they_leave():
    ctl, posted, started = control(prefetch=64)
    ctl.claiming = 40
    ctl.claims.on_claimed(Claimed(tuple(rows(40)), NOW - 0.01, 40))
    # posted once the rows are held, before any starts; the claim leaves them their places
    # (2 idle children, each running one and queuing up to the depth, and prefetch 64)
    assert posted == [{"outcomes": 1, "claim": 2 + 2 * PIPELINE_DEPTH + 64 - 40, "start_now": 0,
                       "held": 40, "started": 0}]
    assert ctl.claiming == posted[0]["claim"] and ctl.batches_out == 2 and not ctl.outcomes
    assert len(started) == 40 and not ctl.holding.held  # then the rows went to the children


def test_without_prefetch_or_while_draining_outcomes_wait_for_the_statement_to_be_written():
    for ctl, posted, started in (control(prefetch=0), control(prefetch=64, draining=True)):
        ctl.claiming = 2
        ctl.claims.on_claimed(Claimed(tuple(rows(2)), NOW - 0.01, 2))
        assert posted == [] and len(ctl.outcomes) == 1


def test_a_loaders_rows_and_rows_the_children_cannot_take_post_nothing_early():
    """The loader's rows (``limit`` 0) come while a statement is in flight: nothing goes
    before it is written. Rows beyond what the children and their queues take are held:
    the outcomes wait for more to share a statement, as they do while held steps keep
    every child busy (COALESCE_PER_WORKER)."""
    ctl, posted, _ = control(prefetch=64)
    ctl.claims.on_claimed(Claimed(tuple(rows(1)), NOW - 0.01, 0))
    assert posted == [] and len(ctl.outcomes) == 1
    ctl, posted, _ = control(prefetch=64)
    ctl.step_seconds = 0.02  # 20 ms steps: one queued behind each running one
    ctl.claiming = 8
    ctl.claims.on_claimed(Claimed(tuple(rows(8)), NOW - 0.01, 8))
    assert posted == [] and len(ctl.outcomes) == 1 and len(ctl.holding.held) == 4


def test_async_steps_run_side_by_side_get_no_queues_of_their_own_in_the_claim():
    ctl, posted, _ = control(prefetch=64)
    ctl.holding.side_by_side = {"a": 10}
    assert ctl.holding.pipeline_room(draining=False, step_seconds=0.001, arriving=True) == 0
