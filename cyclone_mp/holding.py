"""Held steps, for :class:`~cyclone_mp.control.ProcessControl`: what a supervisor claimed
beyond its idle children (``prefetch``) and what it queued behind busy
children (pipelining).

:class:`~cyclone_mp.control.ProcessControl` inherits these methods. How many steps to hold
is :meth:`HeldSteps.prefetch_room` (what the children can start within about 0.25 s, at
most the supervisor's share of the fleet's budget, :meth:`HeldSteps.prefetch_share`); idle
children take held steps oldest claim first (:meth:`HeldSteps._take_held`), busy ones get
the next few queued while attempts are short (:meth:`HeldSteps._pipeline`); a held or
queued step nobody started in time is released, available at once with no attempt used
(:meth:`HeldSteps._expire_held`, :meth:`HeldSteps._release_queued`). Never a database
call: releases go to the outcome writer.
"""

from __future__ import annotations

import collections
import time
from typing import TYPE_CHECKING, Any, Callable

from .attempts import Attempt, Held, fence_margin, startable
from .config import PIPELINE_DEPTH, PIPELINE_MAX_STEP, PIPELINE_ONE_MAX_STEP, PREFETCH_FLEET, PREFETCH_SHARE_MIN
from .endings import RELEASED
from .limits import Limits
from .messages import RELEASE, LeaseDone, Outcome

if TYPE_CHECKING:
    from .config import Config
    from .pool import ChildPool


def row_limits(row: dict[str, Any]) -> Limits:
    """A claimed row's resource limits (read once, kept in the row)."""
    limits = row.get("limits")
    if limits is None:
        limits = row["limits"] = Limits.of_row(row)
    return limits


class HeldSteps:
    """Prefetch and pipelining, for :class:`cyclone_mp.control.ProcessControl` (see the
    module docstring); the attributes are process control's."""

    config: Config
    pool: ChildPool
    held: collections.deque[Held]
    side_by_side: dict[str, int]
    fleet: int
    draining: bool
    db_ok: bool
    step_seconds: float | None
    next_poll: float
    stats: dict[str, int]
    writer: Any
    keeper: Callable[[Any], None]
    clock: Callable[[], float]
    _prefetch_hold: bool
    _claim_hold: float

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

    def prefetch_room(self) -> int:
        """How many steps to hold beyond the idle children (:meth:`prefetch_share`).

        Zero unless ``prefetch`` is set, and zero until attempt durations are known. The
        expected wait of a held step, ``len(held) / workers`` attempts, is kept under half
        the time a held step may wait (:func:`~cyclone_mp.attempts.hold_bound`). An attempt
        counts with its share of a new child's start-up when ``max_steps_per_child``
        recycles children. A held step released for waiting too long stops prefetching
        until the next attempt ends. The buffer is refilled once it is half empty, so
        refills ride on few statements.
        """
        want = self.prefetch_share()
        if not want or self.draining or self.step_seconds is None or self._prefetch_hold:
            return 0
        wait = self._claim_hold / 2
        cycle = max(self.step_seconds, 1e-4)
        ready = self.pool.ready_seconds
        if self.config.max_steps_per_child is not None and ready is not None:
            cycle += ready / self.config.max_steps_per_child  # a recycled slot's restart, shared
        cap = min(want, int(self.config.workers * wait / cycle))
        if len(self.held) > cap // 2:
            return 0
        return cap

    def _take_held(self) -> None:
        """Start held steps on idle children, oldest claim first (none while the lease keeper
        is disconnected: their leases cannot be kept)."""
        if not self.held or self.draining or not self.db_ok:
            return
        now = self.clock()
        if self.side_by_side:  # async handlers run several to a child
            self._take_side_by_side(now)
        for child in self.pool.idle():
            while self.held:
                item = self.held.popleft()
                if startable(now, claim_sent=item.sent, lease_sent=item.lease_sent, lease_ttl=self.config.lease_ttl,
                             timeout=item.row["timeout"]):
                    if not self._start(item, child):  # the child holds more than the step's memory cap: replaced
                        self.held.appendleft(item)
                    break
                self._release_held(item)  # frozen or stalled past half its lease: never start it
        self._send_queued()  # an idle child starts now, before the others' queues are filled
        try:
            self._pipeline()
        finally:
            self._send_queued()  # each child's new tasks in one write

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
                self._start(item, child)
            else:
                self._release_held(item)
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

    def _release_held(self, item: Held) -> None:
        self.writer.post(Outcome(item.key, RELEASE, item.row["step_name"], item.row["attempt"],
                                 item.row["run_kind"] != "step", held=True))

    def _pipeline(self) -> None:
        """Pipelining: while attempts are short, a busy child also gets the next held steps,
        so it starts each the moment the one before ends instead of waiting for this loop.
        Attempts under PIPELINE_MAX_STEP (10 ms) queue up to PIPELINE_DEPTH; under
        PIPELINE_ONE_MAX_STEP (0.1 s) one; longer ones none, and nothing is queued behind
        an attempt that has run that long. A queued step that has not started within its
        hold bound is released (:meth:`_release_queued`)."""
        if self.step_seconds is None or self.step_seconds >= PIPELINE_ONE_MAX_STEP:
            return
        depth = PIPELINE_DEPTH if self.step_seconds < PIPELINE_MAX_STEP else 1
        cap = self.config.max_steps_per_child
        young = self.clock() - PIPELINE_ONE_MAX_STEP
        low = [c for c in self.pool.children
               if c.attempt is not None and len(c.queued) <= depth // 2 and c.attempt.started > young]
        took = True
        while took:
            took = False
            for child in low:
                if not self.held:
                    return
                if self.held[0].row.get("rated"):  # a rate-limited step starts at once or not at all
                    return
                if (child.attempt is not None and len(child.queued) < depth and child.returncode is None
                        and child.attempt.cancel_reason is None and not child.recycle_due
                        and (cap is None or child.steps_run + 2 + len(child.queued) <= cap)
                        # the slot's caps are set per attempt: only behind an attempt with the same
                        and row_limits(self.held[0].row) == child.attempt.limits):
                    self._start(self.held.popleft(), child)
                    self.stats["pipelined"] += 1
                    took = True

    def _expire_held(self, now: float) -> None:
        """Release held steps nobody took in time, and all of them when draining (available
        at once, no attempt or reclaim counted); drop those whose lease could not be kept
        (their lease expires; the sweep reclaims them)."""
        if not self.held:
            return
        ttl = self.config.lease_ttl
        keep: collections.deque[Held] = collections.deque()
        for item in self.held:
            if now >= item.lease_sent + ttl - fence_margin(ttl):
                self.keeper(LeaseDone((item.key,)))
                continue
            if self.draining or now >= item.release_at:
                if not self.draining:
                    self._prefetch_hold = True
                self._release_held(item)
                continue
            keep.append(item)
        self.held = keep

    def _release_queued(self, now: float) -> None:
        """Take back steps queued in children that waited too long behind a longer attempt,
        as a held step would be: released, no attempt used. A child never starts a queued
        task after its ``start_by`` (the same monotonic clock in both processes), and it
        sends the result of the attempt in front before it looks; so once ``start_by`` has
        passed, a step still queued after this reads the child's socket never runs there.
        When draining, queued steps are cancelled over the pipe at once."""
        mono = time.monotonic()

        def past_start_by(att: Attempt) -> bool:
            return att.start_by is not None and mono >= att.start_by

        for child in list(self.pool.children):
            if self.draining:
                for att in child.queued:
                    self._cancel(att, RELEASED, now)
            if not any(map(past_start_by, child.queued)):
                continue
            self._child_io(child)  # a result sent before the child looked is handled first
            overdue = list(filter(past_start_by, child.queued))
            if not overdue:
                continue
            child.queued = collections.deque(att for att in child.queued if all(att is not o for o in overdue))
            self._prefetch_hold = True
            self.next_poll = min(self.next_poll, now)  # a free child takes it back at once
            for att in overdue:
                att.cancel_reason = att.cancel_reason or RELEASED
                self._settle_unstarted(att)
