"""Held steps: what a supervisor claimed beyond its idle children (``prefetch``) and what it
queues behind busy children (pipelining). A part of process control with its own state.

How many steps to hold is :meth:`Holding.prefetch_room` (what the children can start
within about 0.25 s, at most the supervisor's share of the fleet's budget,
:meth:`Holding.prefetch_share`); idle children take held steps oldest claim first
(:meth:`Holding.take`), busy ones get the next few queued while attempts are short
(pipelining); a held step nobody started in time is released, available at once with no
attempt used (:meth:`Holding.expire`). Never a database call: releases go to the outcome
writer. Starting a step on a child is process control's (the ``start`` it is given).
"""

from __future__ import annotations

import collections
from typing import TYPE_CHECKING, Any, Callable, Iterable

from .attempts import Held, fence_margin, hold_bound, startable
from .config import (PIPELINE_DEPTH, PIPELINE_MAX_STEP, PIPELINE_ONE_MAX_STEP, PREFETCH_FLEET, PREFETCH_MAX_WAIT,
                     PREFETCH_SHARE_MIN)
from .flow import rated
from .limits.declared import row_limits
from .messages import RELEASE, LeaseDone, LeaseKey, Outcome

if TYPE_CHECKING:
    from .config import Config
    from .childproc import ChildProc
    from .pool import ChildPool


class Holding:
    """Held steps and pipelining (see the module docstring).

    Args:
        config: the supervisor's :class:`~cyclone_mp.config.Config`.
        pool: the :class:`~cyclone_mp.pool.ChildPool` (idle and busy children).
        writer: the outcome writer (``post``: a held step's release).
        keeper: posts a message to the lease keeper (a lease given up).
        clock: local monotonic clock in seconds.
        side_by_side: async steps that run several attempts to a child: name -> at most how many.
        start: ``start(item, child) -> bool`` starts a held step on a child (False: the
            child was replaced first, the step waits).
        flush: writes every child's queued tasks (one write per child).
        stats: process control's counters (``pipelined``).
    """

    def __init__(self, config: Config, pool: ChildPool, *, writer: Any, keeper: Callable[[Any], None],
                 clock: Callable[[], float], side_by_side: dict[str, int],
                 start: Callable[[Held, ChildProc], bool], flush: Callable[[], None], stats: dict[str, int]) -> None:
        self.config = config
        self.pool = pool
        self.writer = writer
        self.keeper = keeper
        self.clock = clock
        self.side_by_side = side_by_side
        self.start = start
        self.flush = flush
        self.stats = stats
        self.held: collections.deque[Held] = collections.deque()
        self.fleet = 1  # live supervisors on the database, this one included (from the registry)
        self.hold_off = False  # a held step waited too long: hold none until the next result
        self.claim_hold = PREFETCH_MAX_WAIT  # the shortest hold bound among the last claim's rows
        #: no held step is due for :meth:`expire` before this (local monotonic seconds): a
        #: lower bound, kept by :meth:`add` and made exact by each scan, so a turn looks at
        #: the held steps only when one may be due (steps leave ``held`` in many places, and
        #: come in only through :meth:`add` or back to its front after a failed start)
        self.expiry_bound = float("inf")

    def __len__(self) -> int:
        return len(self.held)

    # -- how many to hold -------------------------------------------------------------------------

    def prefetch_share(self) -> int:
        """The most steps this supervisor may hold beyond its idle children: ``Config.prefetch``,
        and with other supervisors live on the database (:attr:`fleet`, from the registry)
        no more than its share of :data:`~cyclone_mp.config.PREFETCH_FLEET`, never below
        :data:`~cyclone_mp.config.PREFETCH_SHARE_MIN` (claims of many supervisors at once
        skip each other's locked rows, and their held steps outwait the hold bound
        on a busy host)."""
        want = self.config.prefetch
        if self.fleet > 1:
            want = min(want, max(PREFETCH_SHARE_MIN, PREFETCH_FLEET // self.fleet))
        return want

    def prefetch_room(self, *, draining: bool, step_seconds: float | None, held: int | None = None) -> int:
        """How many steps to hold beyond the idle children (:meth:`prefetch_share`).

        Zero unless ``prefetch`` is set, and zero until attempt durations are known
        (``step_seconds``, a moving average). The expected wait of a held step,
        ``len(held) / workers`` attempts, is kept under half the time a held step may wait
        (:func:`~cyclone_mp.attempts.hold_bound`). An attempt counts with its share of a
        new child's start-up when ``max_steps_per_child`` recycles children. A held step
        released for waiting too long stops prefetching until the next attempt ends. The
        buffer is refilled once it is half empty, so refills ride on few statements.
        ``held``: the held steps to judge that by (default: those held now).
        """
        want = self.prefetch_share()
        if not want or draining or step_seconds is None or self.hold_off:
            return 0
        wait = self.claim_hold / 2
        cycle = max(step_seconds, 1e-4)
        ready = self.pool.ready_seconds
        if self.config.max_steps_per_child is not None and ready is not None:
            cycle += ready / self.config.max_steps_per_child  # a recycled slot's restart, shared
        cap = min(want, int(self.config.workers * wait / cycle))
        if (len(self.held) if held is None else held) > cap // 2:
            return 0
        return cap

    def pipeline_depth(self, step_seconds: float | None) -> int:
        """Steps a busy child may have queued behind the one it runs (0: none). Attempts
        (``step_seconds``, a moving average) under PIPELINE_MAX_STEP (10 ms) queue as many as
        start within half the hold bound of the last claim's rows, at most PIPELINE_DEPTH,
        the rule :meth:`prefetch_room` keeps for held steps; under PIPELINE_ONE_MAX_STEP
        (0.1 s) one; longer ones none."""
        if step_seconds is None or step_seconds >= PIPELINE_ONE_MAX_STEP:
            return 0
        if step_seconds >= PIPELINE_MAX_STEP:
            return 1
        return max(1, min(PIPELINE_DEPTH, int(self.claim_hold / 2 / max(step_seconds, 1e-4))))

    def pipeline_room(self, *, draining: bool, step_seconds: float | None, arriving: bool = False) -> int:
        """The free places in the busy children's queues (:meth:`pipeline_depth` a child),
        with prefetch only. A claim counts them beside :meth:`prefetch_room`, so a small
        ``prefetch`` bounds what waits in the supervisor while the children's queues stay
        full: one statement is in flight at a time, and its claim is all the steps that
        arrive before the next. ``arriving``: a claim's rows were just held and are about
        to start (the next claim is made first): each idle child counts as busy with an
        empty queue, as it will be once they do (not with async steps run side by side,
        whose children queue nothing)."""
        if not self.prefetch_share() or draining or self.hold_off:
            return 0
        depth = self.pipeline_depth(step_seconds)
        if not depth:
            return 0
        young = self.clock() - PIPELINE_ONE_MAX_STEP
        room = sum(max(0, self._queue_most(c, depth, young) - len(c.queued)) for c in self.pool.children)
        if arriving and not self.side_by_side:
            room += sum(self._runs_left(c, depth) for c in self.pool.idle())
        return room

    def _queue_most(self, child: Any, depth: int, young: float) -> int:
        """How many steps ``child`` may have queued (0: none): ``depth`` behind a live
        attempt started after ``young``, not cancelled and not waiting for threads it left
        (they end in a kill, or after kill_grace at most), on a child not due for recycling,
        and no more than ``max_steps_per_child`` lets it run."""
        att = child.attempt
        if (att is None or child.returncode is not None or att.cancel_reason is not None or child.recycle_due
                or att.lingering is not None or att.started <= young):
            return 0
        return self._runs_left(child, depth)

    def _runs_left(self, child: Any, depth: int) -> int:
        """``depth``, or fewer when ``max_steps_per_child`` recycles ``child`` sooner: the
        steps it may queue behind the one it runs."""
        cap = self.config.max_steps_per_child
        return depth if cap is None else max(0, min(depth, cap - child.steps_run - 1))

    def side_by_side_room(self) -> int:
        """Attempts the children could start beside their running async ones
        (``async_concurrency``), beyond the idle children."""
        if not self.side_by_side:
            return 0
        most = max(self.side_by_side.values())
        room = 0
        for child in self.pool.children:
            if child.concurrent:
                step = next(iter(child.concurrent.values())).step_name
                room += max(0, self.side_by_side.get(step, 1) - len(child.concurrent))
            elif child.ready and child.attempt is None and child.returncode is None:
                room += most - 1  # an idle child takes up to the most of one step
        return room

    # -- claimed rows in, held steps out ------------------------------------------------------------

    def add(self, rows: Iterable[dict[str, Any]], sent: float, now: float) -> bool:
        """Hold the rows of a claim sent at ``sent`` (local monotonic seconds), arrived at
        ``now``. A rate-limited row took its rate slot with the claim: it goes first, to
        start on an idle child now or be given back (:meth:`give_back_rated`). True when
        a rate-limited row came."""
        cap = PREFETCH_MAX_WAIT if self.config.prefetch else float("inf")
        ttl = self.config.lease_ttl
        rated_rows: list[Held] = []
        first = float("inf")  # the earliest release among them
        shortest = PREFETCH_MAX_WAIT  # their shortest hold bound
        bounds: dict[float | None, tuple[float, float]] = {}  # timeout -> (short bound, bound): few distinct
        append = self.held.append
        for row in rows:
            timeout = row["timeout"]
            known = bounds.get(timeout)
            if known is None:
                short = hold_bound(ttl, timeout, PREFETCH_MAX_WAIT)
                known = bounds[timeout] = (short, short if cap == PREFETCH_MAX_WAIT else hold_bound(ttl, timeout, cap))
            short, bound = known
            if short < shortest:
                shortest = short
            if rated(row):
                rated_rows.append(Held((row["id"], row["lease_generation"]), row, sent, now, now, sent))
                first = now
                continue
            if now + bound < first:
                first = now + bound
            append(Held((row["id"], row["lease_generation"]), row, sent, now, now + bound, sent))
        self.held.extendleft(reversed(rated_rows))
        if first != float("inf"):  # some rows came
            self.claim_hold = shortest
            self.expiry_bound = min(self.expiry_bound, first, sent + ttl - fence_margin(ttl))
        return bool(rated_rows)

    def give_back_rated(self) -> None:
        """Release the rate-limited rows no idle child took: a rate limit counts handler
        starts, so they are never held or queued."""
        if any(rated(h.row) for h in self.held):
            keep: collections.deque[Held] = collections.deque()
            for item in self.held:
                (self.release if rated(item.row) else keep.append)(item)
            self.held = keep

    def drop(self, key: LeaseKey) -> bool:
        """Forget the held step of lease ``key`` (its lease is gone); True if it was held."""
        before = len(self.held)
        self.held = collections.deque(h for h in self.held if h.key != key)
        return len(self.held) != before

    def renewed(self, key: LeaseKey, sent: float) -> None:
        """A renewal of a held step's lease held: it lasts until ``sent + lease_ttl``."""
        for held in self.held:
            if held.key == key:
                held.lease_sent = max(held.lease_sent, sent)
                return

    def release(self, item: Held) -> None:
        """Give a held step back: available at once, no attempt used."""
        self.writer.post(Outcome(item.key, RELEASE, item.row["step_name"], item.row["attempt"],
                                 item.row["run_kind"] != "step", held=True))

    def release_at(self) -> float | None:
        """When a held step may be due for :meth:`expire` (None: none is held): released
        for waiting too long, or dropped with its lease."""
        return self.expiry_bound if self.held else None

    # -- starting them -------------------------------------------------------------------------------

    def take(self, *, step_seconds: float | None) -> None:
        """Start held steps on idle children, oldest claim first, then queue the next ones
        behind busy children (pipelining). Process control calls this only while the
        lease keeper is connected (their leases can be kept) and not draining."""
        if not self.held:
            return
        now = self.clock()
        if self.side_by_side:  # async handlers run several to a child
            self._take_side_by_side(now)
        for child in self.pool.idle():
            while self.held:
                item = self.held.popleft()
                if startable(now, claim_sent=item.sent, lease_sent=item.lease_sent, lease_ttl=self.config.lease_ttl,
                             timeout=item.row["timeout"]):
                    if not self.start(item, child):  # the child holds more than the step's memory cap: replaced
                        self.held.appendleft(item)
                    break
                self.release(item)  # frozen or stalled past half its lease: never start it
        self.flush()  # an idle child starts now, before the others' queues are filled
        if self.held and rated(self.held[0].row):  # (claimed rate-limited rows are held first)
            self.give_back_rated()  # one no idle child took is never queued
        try:
            self._pipeline(step_seconds)
        finally:
            self.flush()  # each child's new tasks in one write

    def _take_side_by_side(self, now: float) -> None:
        """Start held steps of ``async_concurrency`` steps beside the others of their step in
        a child with room (one running that step and fewer than its limit), else on an idle
        child, oldest claim first."""
        keep: collections.deque[Held] = collections.deque()
        for item in self.held:
            limit = self.side_by_side.get(item.row["step_name"])
            child = self._room_for(item.row["step_name"], limit) if limit else None
            if child is None:
                keep.append(item)
            elif startable(now, claim_sent=item.sent, lease_sent=item.lease_sent, lease_ttl=self.config.lease_ttl,
                           timeout=item.row["timeout"]):
                self.start(item, child)
            else:
                self.release(item)
        self.held = keep

    def _room_for(self, step_name: str, limit: int) -> Any:
        """A child that can run one more attempt of ``step_name`` beside its others."""
        best = None
        for child in self.pool.children:
            if not child.ready or child.returncode is not None or child.recycle_due or child.attempt is not None:
                continue
            running = child.concurrent
            if running and len(running) < limit and next(iter(running.values())).step_name == step_name:
                if best is None or len(running) > len(best.concurrent):  # fill a child before the next
                    best = child
        return best if best is not None else next(iter(self.pool.idle()), None)

    def _pipeline(self, step_seconds: float | None) -> None:
        """Pipelining: while attempts are short, a busy child also gets the next held steps,
        so it starts each the moment the one before ends instead of waiting for process
        control: up to :meth:`pipeline_depth`, a step only where it would start within
        half its own hold bound (a short timeout's is short), and nothing behind an
        attempt that has run PIPELINE_ONE_MAX_STEP (0.1 s). A queued step that has not
        started within its hold bound is released (``AttemptEndings.release_queued``)."""
        depth = self.pipeline_depth(step_seconds)
        if not depth or step_seconds is None:
            return
        ttl = self.config.lease_ttl
        young = self.clock() - PIPELINE_ONE_MAX_STEP
        low = [c for c in self.pool.children
               if c.attempt is not None and len(c.queued) <= depth // 2 and c.attempt.started > young]
        took = True
        while took:
            took = False
            for child in low:
                if not self.held:
                    return
                if rated(self.held[0].row):  # a rate-limited step starts at once or not at all
                    return
                if (len(child.queued) < self._queue_most(child, depth, young)
                        # the slot's caps are set per attempt: only behind an attempt with the same
                        and row_limits(self.held[0].row) == child.attempt.limits
                        and (len(child.queued) + 1) * step_seconds
                        <= hold_bound(ttl, self.held[0].row["timeout"], PREFETCH_MAX_WAIT) / 2):
                    self.start(self.held.popleft(), child)
                    self.stats["pipelined"] += 1
                    took = True

    def expire(self, now: float, *, draining: bool) -> None:
        """Release held steps nobody took in time, and all of them when draining (available
        at once, no attempt or reclaim counted); drop those whose lease could not be kept
        (their lease expires; the sweep reclaims them)."""
        if not self.held:
            self.expiry_bound = float("inf")
            return
        if not draining and now < self.expiry_bound:
            return  # none is due yet
        ttl = self.config.lease_ttl
        margin = fence_margin(ttl)
        keep: collections.deque[Held] = collections.deque()
        bound = float("inf")
        for item in self.held:
            lease_by = item.lease_sent + ttl - margin
            if now >= lease_by:
                self.keeper(LeaseDone((item.key,)))
                continue
            if draining or now >= item.release_at:
                if not draining:
                    self.hold_off = True
                self.release(item)
                continue
            keep.append(item)
            bound = min(bound, lease_by, item.release_at)
        self.held = keep
        self.expiry_bound = bound
