"""Enforcement as a pure judge over a deadline heap, on a fake clock: which attempts are
cancelled and killed when, and that a turn looks only at the attempts that are due."""

from __future__ import annotations

import collections
import dataclasses
from typing import Any

from cyclone_mp.attempts import Attempt, fence_cancel_at, fence_margin, hold_bound, startable
from cyclone_mp.enforcement import LINGERING, Cancel, Deadlines, Kill, due_actions, due_at

TTL = 10.0  # lease_ttl: the fence's margin is 1 s, its kill at lease_sent + 9
GRACE = 2.0  # kill_grace


@dataclasses.dataclass(eq=False)
class FakeChild:
    attempt: Any = None
    queued: collections.deque = dataclasses.field(default_factory=collections.deque)
    concurrent: dict = dataclasses.field(default_factory=dict)


def attempt(token: str = "t1", *, deadline: float | None = None, lease_sent: float = 0.0, child: Any = None,
            run: bool = True) -> Attempt:
    child = child or FakeChild()
    att = Attempt(key=(int(token[1:]), 1), run_id="r", node="n", step_name="s", attempt=1, timeout=None,
                  token=token, child=child, workflow=False, started=0.0, deadline=deadline, lease_sent=lease_sent)
    if run:
        child.attempt = att
    else:
        child.queued.append(att)
    return att


def cancel(att: Attempt, reason: str, now: float) -> None:
    """What process control does with a Cancel (the parts enforcement reads)."""
    att.cancel_reason = reason
    if att.child.attempt is att:
        att.kill_at = now + GRACE


def test_a_timeout_cancels_at_the_deadline_and_kills_after_the_grace():
    att = attempt(deadline=5.0, lease_sent=0.0)
    assert due_actions([att], 4.99, TTL, GRACE) == []
    assert due_actions([att], 5.0, TTL, GRACE) == [Cancel(att, "timeout")]
    cancel(att, "timeout", 5.0)
    assert due_at(att, TTL, GRACE) == 7.0  # the kill; a timed-out attempt no longer guards its lease
    assert due_actions([att], 6.99, TTL, GRACE) == []
    assert due_actions([att], 7.0, TTL, GRACE) == [Kill(att, "timeout")]


def test_a_failed_attempts_lingering_threads_are_killed_at_its_kill_at_without_a_cancel():
    """Process control sets kill_at (failure + kill_grace) and no cancel: the kill comes
    then, named for the threads, and the lease fence still wins if it is earlier."""
    att = attempt(deadline=50.0, lease_sent=0.0)
    att.kill_at = 3.0
    assert due_at(att, TTL, GRACE) == 3.0
    assert due_actions([att], 2.99, TTL, GRACE) == []
    assert due_actions([att], 3.0, TTL, GRACE) == [Kill(att, LINGERING)]
    late = attempt("t2", lease_sent=0.0)
    late.kill_at = 9.5  # the fence's kill (9) comes first
    assert due_actions([late], 9.0, TTL, GRACE)[-1] == Kill(late, "lease_fence")


def test_an_unrenewed_lease_is_cancelled_then_killed_before_the_fence():
    att = attempt(lease_sent=0.0)
    cancel_at = fence_cancel_at(att, TTL, GRACE)
    assert cancel_at == 7.5  # three quarters of the lease (9 - 2 = 7 would be earlier)
    assert due_at(att, TTL, GRACE) == cancel_at
    assert due_actions([att], 7.49, TTL, GRACE) == []
    assert due_actions([att], 7.5, TTL, GRACE) == [Cancel(att, "lease_lost")]
    cancel(att, "lease_lost", 7.5)
    # its cancel's kill (9.5) comes after the fence's (9): the fence's kill it is
    assert due_at(att, TTL, GRACE) == TTL - fence_margin(TTL) == 9.0
    assert due_actions([att], 9.0, TTL, GRACE) == [Kill(att, "lease_fence")]


def test_a_fence_reached_at_once_cancels_and_kills_in_one_look():
    """A frozen loop that wakes past the fence: the cancel and the fence's kill, together."""
    att = attempt(lease_sent=0.0)
    assert due_actions([att], 9.5, TTL, GRACE) == [Cancel(att, "lease_lost"), Kill(att, "lease_fence")]


def test_a_renewal_moves_the_fence_and_nothing_is_due_early():
    att = attempt(lease_sent=0.0)
    att.lease_sent = 5.0
    assert due_actions([att], 7.5, TTL, GRACE) == []
    assert due_at(att, TTL, GRACE) == 12.5


def test_an_operators_cancel_is_killed_at_kill_grace_whatever_the_fence():
    att = attempt(lease_sent=0.0)
    cancel(att, "cancelled", 1.0)
    assert due_at(att, TTL, GRACE) == 3.0
    assert due_actions([att], 3.0, TTL, GRACE) == [Kill(att, "cancelled")]
    att.kill_at = 20.0  # a long kill_grace: the fence does not apply to an operator's cancel
    assert due_actions([att], 15.0, TTL, GRACE) == []


def test_a_queued_attempt_is_cancelled_never_killed():
    child = FakeChild()
    front = attempt("t1", child=child)
    queued = attempt("t2", child=child, run=False, deadline=1.0)
    assert due_actions([queued], 1.0, TTL, GRACE) == [Cancel(queued, "timeout")]
    cancel(queued, "timeout", 1.0)
    assert queued.kill_at is None
    assert due_at(queued, TTL, GRACE) is None  # nothing more, until it starts running
    assert due_actions([queued], 50.0, TTL, GRACE) == []
    child.queued.popleft()
    child.attempt = queued  # it started after all: a cancel the child saw too late
    queued.kill_at = 2.0 + GRACE
    assert due_actions([queued], 4.0, TTL, GRACE) == [Kill(queued, "timeout")]
    assert front.ended is False


def test_an_ended_attempt_gets_nothing():
    att = attempt(deadline=1.0)
    att.ended = True
    assert due_actions([att], 100.0, TTL, GRACE) == []
    assert due_at(att, TTL, GRACE) is None


def test_zero_kill_grace_kills_with_the_cancel():
    att = attempt(deadline=1.0)
    assert due_actions([att], 1.0, TTL, 0.0) == [Cancel(att, "timeout"), Kill(att, "timeout")]


def test_the_heap_gives_the_due_attempts_only():
    deadlines = Deadlines(TTL, GRACE)
    atts = [attempt(f"t{i}", deadline=float(i), lease_sent=float(i)) for i in range(1, 1001)]
    for att in atts:
        deadlines.push(att)
    assert deadlines.next_at() == 1.0
    due = deadlines.take_due(10.0)
    assert due == atts[:10]  # ten looked at, not a thousand
    assert due_actions(due, 10.0, TTL, GRACE) == [Cancel(a, "timeout") for a in atts[:10]]
    assert deadlines.next_at() == 11.0


def test_a_stale_entry_is_looked_at_early_and_pushed_back():
    deadlines = Deadlines(TTL, GRACE)
    att = attempt(lease_sent=0.0)
    deadlines.push(att)
    att.lease_sent = 5.0  # renewed: the entry (7.5) is now early
    due = deadlines.take_due(7.5)
    assert due == [att] and due_actions(due, 7.5, TTL, GRACE) == []
    deadlines.push(att)
    assert deadlines.next_at() == 12.5


def test_a_pushed_attempt_appears_once_per_look_and_ended_ones_go_away():
    deadlines = Deadlines(TTL, GRACE)
    att = attempt(deadline=1.0)
    deadlines.push(att)
    cancel(att, "timeout", 1.0)
    deadlines.push(att)
    assert deadlines.take_due(10.0) == [att]  # two entries, one look
    others = [attempt(f"t{i}", deadline=100.0) for i in range(2, 202)]
    for other in others:
        deadlines.push(other)
    for other in others[:150]:
        other.ended = True
        deadlines.forget()
    assert len(deadlines) < 100  # compacted: ended attempts are not kept alive by the heap
    assert deadlines.take_due(1000.0) == others[150:]


def test_hold_bound_and_startable():
    assert hold_bound(30.0, None, 0.25) == 0.25
    assert hold_bound(0.4, None, 0.25) == 0.1  # a quarter of the lease
    assert hold_bound(30.0, 1.0, 0.25) == 0.1  # a tenth of the timeout
    assert startable(4.9, claim_sent=0.0, lease_sent=0.0, lease_ttl=TTL, timeout=None)
    assert not startable(5.0, claim_sent=0.0, lease_sent=0.0, lease_ttl=TTL, timeout=None)  # half the lease spent
    assert startable(5.0, claim_sent=0.0, lease_sent=2.0, lease_ttl=TTL, timeout=None)  # renewed meanwhile
    assert not startable(3.0, claim_sent=0.0, lease_sent=2.0, lease_ttl=TTL, timeout=3.0)  # its DB deadline


class FakeLink:
    def __init__(self) -> None:
        self.said: list[tuple[int, float | None]] = []

    def due(self, pid, when, *, now, horizon):
        self.said.append((pid, when))


def test_the_watchdog_hears_each_marked_child_once_per_turn():
    import time

    from cyclone_mp.enforcement import WatchdogDue

    link = FakeLink()
    watch = WatchdogDue(link, TTL)
    child = FakeChild()
    child.pid, child.returncode = 42, None
    att = attempt(child=child, lease_sent=100.0)
    clock = time.monotonic
    for _ in range(3):
        watch.mark(child)  # marked three times: told once
    watch.tell(clock)
    assert link.said == [(42, 100.0 + TTL - fence_margin(TTL) * 0.75)]  # a quarter margin after our own kill
    cancel(att, "timeout", 101.0)  # no longer guards its lease: a little after its cancel's kill
    watch.mark(child)
    watch.tell(clock)
    assert link.said[-1] == (42, 103.0 + max(0.25, fence_margin(TTL)))
    att.ended, child.attempt = True, None
    watch.mark(child)
    watch.tell(clock)
    assert link.said[-1] == (42, None)  # idle
    watch.tell(clock)
    assert len(link.said) == 3  # nothing marked: nothing said


def test_an_uncancelled_attempt_needs_its_first_look_at_the_same_time_queued_or_running():
    """Process control leaves a queued attempt's heap entry as it is when the attempt starts
    running uncancelled (``Deadlines.start_keeps_entry``): its next look (fence cancel or
    deadline) comes before its fence kill, so starting to run changes nothing about when
    it is due. Under a lease of 0.04 s the fence kill can come first: then it is pushed."""
    assert not Deadlines(0.02, GRACE).start_keeps_entry and Deadlines(0.04, GRACE).start_keeps_entry
    queued, running = attempt("t1", lease_sent=1.0, run=False), attempt("t2", lease_sent=1.0)
    assert due_at(running, 0.02, 0.0) < due_at(queued, 0.02, 0.0)  # 1.010 (the fence kill) before 1.015
    for ttl in (0.02, 0.03, 0.04, 0.5, 3.0, 10.0, 60.0):
        for grace in (0.0, 0.5, 2.0, 30.0, 120.0):
            for deadline in (None, 0.1, 5.0, 1000.0):
                queued = attempt("t1", deadline=deadline, lease_sent=1.0, run=False)
                running = attempt("t2", deadline=deadline, lease_sent=1.0)
                if Deadlines(ttl, grace).start_keeps_entry:
                    assert due_at(queued, ttl, grace) == due_at(running, ttl, grace), (ttl, grace, deadline)
