"""Claiming for process control: how many steps to ask the outcome writer for (free
children plus room to hold, minus what is held and on its way; none while draining or
disconnected), how many of them start at once, and what a claim that came back does:
its rows start on idle children or are held, rows cancelled as they came are dropped,
and the next poll is set from the result (backoff when empty or failed, at once when
full, no later than a rate limit's free slot).
"""

from __future__ import annotations

from typing import TYPE_CHECKING

from .messages import Claimed, LeaseDone, LeaseKey

if TYPE_CHECKING:
    from .control import ProcessControl


class Claims:
    """The claims of ``control`` (a :class:`~cyclone_mp.control.ProcessControl`), on its thread."""

    def __init__(self, control: ProcessControl) -> None:
        self.control = control

    def on_claimed(self, message: Claimed) -> None:
        """Start claimed rows on idle children at once (however long they took to come
        back: their leases count from the claim's sending), hold the rest. With prefetch,
        the outcomes gathered while the claim was out go to the writer once the rows are
        held and before they start (when due, :meth:`Reports.flush_at
        <cyclone_mp.reports.Reports.flush_at>`), with a claim for the room the rows leave:
        the database runs that statement while process control starts them, instead of
        waiting for it between two statements. The next poll
        comes after the poll interval's backoff, and no later than the claim's ``wait``
        (a rate-limited step's next free slot) when it has one."""
        self.control.claiming = max(0, self.control.claiming - message.limit)
        self.control.claim_after_written = False  # this claim's result says when to claim again
        now = self.control.clock()
        rows = list(message.rows)
        if self.control.cancelled_unclaimed:
            gone = [r for r in rows if self.control.cancelled_unclaimed.pop((r["id"], r["lease_generation"]), None)]
            if gone:  # cancelled as the claim came back: nothing to run, nothing to renew, nothing to wait for
                keys = tuple((r["id"], r["lease_generation"]) for r in gone)
                self.control.keeper(LeaseDone(keys))
                self.control.writer.post_dead(keys, started=False)
                rows = [r for r in rows if r not in gone]
        # a rate-limited step took its rate slot with this claim: it starts on an idle child
        # now, ahead of what is held, or is given back at once (never held or queued)
        rated = self.control.holding.add(rows, message.sent, now)
        if self.control.draining:
            self.control.holding.expire(now, draining=True)
        elif rows and message.limit and self.control.config.prefetch:  # (not the loader's rows)
            self.control.reports.send_outcomes(arriving=True)
        self.control.take_held()
        if rated:
            self.control.holding.give_back_rated()
        lo, hi = self.control.config.poll_interval
        if message.failed:
            self.control.poll_delay = min(hi, max(lo, self.control.poll_delay * 2))
            self.control.next_poll = now + self.control.poll_delay
        elif rows and len(rows) == message.limit:
            self.control.poll_delay = lo
            self.control.next_poll = now  # maybe more to take once a slot frees
        elif rows:
            self.control.poll_delay = lo
            self.control.next_poll = now + lo
        else:
            self.control.poll_delay = min(hi, max(lo, self.control.poll_delay * 2))
            self.control.next_poll = now + self.control.poll_delay
        if message.wait is not None:  # a rate limit held a step back: its slot frees then
            self.control.next_poll = min(self.control.next_poll, now + message.wait)

    def forget_cancelled(self, key: LeaseKey, *, ours: bool) -> None:
        """A cancel of ``key`` was heard. Ours: its lease is renewed no more. Not (yet)
        ours: remembered for a lease's time, since the cancel may have crossed the claim
        that took it, whose rows are then dropped as they arrive (:meth:`on_claimed`)."""
        if ours:
            self.control.keeper(LeaseDone((key,)))
            return
        now = self.control.clock()
        cancelled = self.control.cancelled_unclaimed
        if len(cancelled) > 1024:
            for old in [k for k, at in cancelled.items() if now - at > self.control.config.lease_ttl]:
                del cancelled[old]
        cancelled[key] = now

    def claim_limit(self, *, standalone: bool, arriving: bool = False) -> int:
        """Steps to claim now: free slots plus room to hold (with prefetch, the free places
        in busy children's queues too), minus what is held and what claims on their way
        will bring (0 when draining or disconnected). A claim rides with the outcomes that
        free its slots (:meth:`Reports.send_outcomes
        <cyclone_mp.reports.Reports.send_outcomes>`: one statement writes them and claims,
        so a supervisor never holds more rows than it has slots and room); one on its own waits
        until the writer is done with every batch posted (a write it keeps for later, a row
        locked elsewhere or an outage, holds back nothing). ``arriving``: the held steps
        include a claim's rows that are about to start (see :meth:`held_after_start`)."""
        control = self.control
        if control.draining or not control.db_ok or (standalone and control.batches_out):
            return 0
        free = self._free(arriving)
        if arriving:
            prefetch = control.holding.prefetch_room(draining=False, step_seconds=control.step_seconds,
                                                     held=self.held_after_start(free))
        else:
            prefetch = control.prefetch_room()
        return max(0, free + prefetch - len(control.held) - control.claiming)

    def held_after_start(self, free: int | None = None) -> int:
        """The steps still held once the held ones have started on the idle children and
        filled their queues (:meth:`on_claimed` claims again before they start); ``free``:
        those places, when already counted (``_free(True)``)."""
        return max(0, len(self.control.held) - (self._free(True) if free is None else free))

    def _free(self, arriving: bool) -> int:
        """Idle children, places beside async attempts and in busy children's queues (and,
        ``arriving``, in the queues the idle children will have)."""
        control = self.control
        return (len(control.pool.idle()) + control.holding.side_by_side_room()
                + control.holding.pipeline_room(draining=control.draining, step_seconds=control.step_seconds,
                                                arriving=arriving))

    def start_now(self, claim: int) -> int:
        """Of a claim of ``claim`` steps, how many idle children can start at once: the
        claim takes no more rate-limited steps (a rate limit counts handler starts)."""
        return max(0, min(claim, len(self.control.pool.idle()) - len(self.control.held)))

    def request_claim(self, now: float) -> None:
        """A claim on its own (on the poll interval, or when woken), through the outcome
        writer, which makes every claim: the lease keeper only renews. With prefetch one
        statement is in flight at a time (see :meth:`Reports.flush_at
        <cyclone_mp.reports.Reports.flush_at>`): the claim waits for it (``Written``)."""
        if self.control.config.prefetch and self.control.batches_out:
            self.control.claim_after_written = True
            self.control.next_poll = now + self.control.poll_delay
            return
        limit = self.claim_limit(standalone=True)
        if limit <= 0:
            self.control.next_poll = now + self.control.poll_delay
            return
        if self.control.outcomes:  # what ended goes with it, in the same statement
            self.control.reports.send_outcomes(force=True)
            return
        self.control.claiming += limit
        self.control.batches_out += 1
        self.control.writer.post_batch((), limit, self.start_now(limit))
