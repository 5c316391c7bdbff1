"""Enforcement: which attempts are due a cancel or a kill, and when to look next (pure).

:func:`due_actions` is the judge: given attempts, the local monotonic time and the
lease's and kill's settings, it says what to do (a :class:`Cancel` at the worker-clock
deadline or when the lease cannot be kept, a :class:`Kill` at ``kill_at`` or at the
local fence, whichever comes first). It changes nothing; process control carries the
actions out. :class:`Deadlines` keeps the attempts in a heap by the next instant each
needs a look (:func:`due_at`), so a turn looks at the due ones only, never at every
attempt. An entry is a lower bound: a renewal moves an attempt's fence later without
touching the heap, and the attempt is simply looked at early and pushed back. Whatever
makes an attempt due *earlier* (a cancel sets ``kill_at``; a queued attempt starts and
can be killed) pushes it again. The fence and its margin: :mod:`cyclone_mp.attempts`.
"""

from __future__ import annotations

import dataclasses
import heapq
import itertools
import time
from typing import Any, Callable, Iterable

from .attempts import Attempt, fence_cancel_at, fence_margin

TIMEOUT = "timeout"
LEASE_LOST = "lease_lost"
LEASE_FENCE = "lease_fence"
#: The trigger of a kill no cancel came before: a failed attempt's threads outlived kill_grace.
LINGERING = "lingering_threads"


@dataclasses.dataclass(frozen=True)
class Cancel:
    """Cancel ``att`` over its pipe with ``reason`` (``timeout`` or ``lease_lost``); a
    running one is killed ``kill_grace`` seconds later unless it ends first."""

    att: Attempt
    reason: str


@dataclasses.dataclass(frozen=True)
class Kill:
    """SIGKILL the tree of the child running ``att``; ``trigger`` is what made it due
    (``lease_fence``, the cancel's reason, or ``kill``)."""

    att: Attempt
    trigger: str


def running(att: Attempt) -> bool:
    """True while ``att`` runs in its child (not queued behind another attempt): only then
    is there a handler to kill."""
    child = att.child
    return child.attempt is att or att.token in child.concurrent


def due_at(att: Attempt, lease_ttl: float, kill_grace: float) -> float | None:
    """The next instant (local monotonic seconds) :func:`due_actions` may have something
    to do for ``att``; None when nothing is ever due (it ended, or it is queued and
    already cancelled: it is dropped unstarted or pushed again as it starts)."""
    if att.ended:
        return None
    due = None
    if att.cancel_reason is None:
        due = fence_cancel_at(att, lease_ttl, kill_grace)
        if att.deadline is not None and att.deadline < due:
            due = att.deadline
    if running(att):
        if att.kill_at is not None and (due is None or att.kill_at < due):
            due = att.kill_at
        if att.guards_lease():
            fence_kill = att.fence(lease_ttl) - fence_margin(lease_ttl)
            if due is None or fence_kill < due:
                due = fence_kill
    return due


def due_actions(attempts: Iterable[Attempt], now: float, lease_ttl: float,
                kill_grace: float) -> list[Cancel | Kill]:
    """What is due for ``attempts`` at ``now`` (local monotonic seconds), in order: for each
    attempt a cancel (at its deadline: ``timeout``; past the point where its lease can no
    longer be kept: ``lease_lost``), then a kill when its cancel's ``kill_at`` (``now +
    kill_grace`` for a cancel decided here) or its fence's kill (``fence - margin``, while
    it guards its lease) has come; a failed attempt whose threads outlive it has a
    ``kill_at`` and no cancel (trigger :data:`LINGERING`). Ended attempts get nothing.
    Pure: nothing is changed."""
    actions: list[Cancel | Kill] = []
    for att in attempts:
        if att.ended:
            continue
        reason, kill_at = att.cancel_reason, att.kill_at
        is_running = running(att)
        if reason is None and att.deadline is not None and now >= att.deadline:
            reason = TIMEOUT
        elif reason is None and now >= fence_cancel_at(att, lease_ttl, kill_grace):
            reason = LEASE_LOST
        if reason is not att.cancel_reason:
            actions.append(Cancel(att, reason))  # type: ignore[arg-type]
            if is_running:
                kill_at = now + kill_grace
        if not is_running:
            continue
        kill_by, trigger = kill_at, reason or LINGERING
        fence_kill = att.fence(lease_ttl) - fence_margin(lease_ttl)
        if reason not in (TIMEOUT, "cancelled") and (kill_by is None or fence_kill < kill_by):
            kill_by, trigger = fence_kill, LEASE_FENCE
        if kill_by is not None and now >= kill_by:
            actions.append(Kill(att, trigger))
    return actions


class Deadlines:
    """Attempts by the next instant each needs a look (:func:`due_at`), in a heap.

    :meth:`push` when an attempt starts, is cancelled, or starts running after waiting
    in its child's queue; :meth:`take_due` gives those due by ``now`` (each once) and
    forgets them: push them back after acting. Entries of ended attempts are dropped as
    they come up, or all at once when they are most of the heap (:meth:`forget`)."""

    def __init__(self, lease_ttl: float, kill_grace: float) -> None:
        self.lease_ttl = lease_ttl
        self.kill_grace = kill_grace
        self._heap: list[tuple[float, int, Attempt]] = []
        self._order = itertools.count()
        self._ended = 0  # entries whose attempt has ended since the last compaction (about)
        #: an uncancelled attempt's next look is the same queued or running: its fence cancel
        #: (three quarters of a lease at the latest) comes before its fence kill (the lease
        #: less the margin), which holds for every lease of 0.04 s and more
        self.start_keeps_entry = 0.75 * lease_ttl <= lease_ttl - fence_margin(lease_ttl)

    def __len__(self) -> int:
        return len(self._heap)

    def push(self, att: Attempt) -> None:
        """Look at ``att`` again at its :func:`due_at` (nothing if none)."""
        due = due_at(att, self.lease_ttl, self.kill_grace)
        if due is not None:
            heapq.heappush(self._heap, (due, next(self._order), att))

    def forget(self) -> None:
        """An attempt ended: its entries are dead weight. Once they are over half the
        heap (and it holds more than 64), the heap is rebuilt without them."""
        self._ended += 1
        if self._ended > 64 and self._ended * 2 > len(self._heap):
            self._heap = [entry for entry in self._heap if not entry[2].ended]
            heapq.heapify(self._heap)
            self._ended = 0

    def next_at(self) -> float | None:
        """The earliest instant something may be due (None: nothing is)."""
        heap = self._heap
        while heap and heap[0][2].ended:
            heapq.heappop(heap)
        return heap[0][0] if heap else None

    def take_due(self, now: float) -> list[Attempt]:
        """The live attempts with an entry due by ``now``, each once, removed from the heap."""
        heap, due, seen = self._heap, [], set()
        while heap and heap[0][0] <= now:
            att = heapq.heappop(heap)[2]
            if not att.ended and id(att) not in seen:
                seen.add(id(att))
                due.append(att)
        return due


WATCHDOG_HOLD_BACK = 0.5  # fraction of lease_ttl: a child's later due time is sent to the watchdog once the earlier one sent is this close
WATCHDOG_SLACK = 0.25  # seconds the watchdog waits past a cancel's kill before it kills (the fence: half its margin)


class WatchdogDue:
    """When each child must be dead at the latest, as the watchdog process hears it (it
    kills a child whose time passed while process control was frozen, SPEC 9).

    :meth:`mark` a child whose attempts changed; :meth:`tell` then sends each marked
    child's time once per turn (pipelined steps change a child's attempts thousands of
    times a second): a little after the kill of its cancel, or three quarters of the
    fence's margin before the fence, whichever is first (None: idle). A later time than
    the one the watchdog holds is sent once that one comes within WATCHDOG_HOLD_BACK of a
    lease (:meth:`refresh`), so renewals cost no message each.

    Args:
        link: the :class:`~cyclone_mp.watchdoglink.WatchdogLink`.
        lease_ttl: seconds.
    """

    def __init__(self, link: Any, lease_ttl: float) -> None:
        self.link = link
        self.lease_ttl = lease_ttl
        self.horizon = lease_ttl * WATCHDOG_HOLD_BACK
        self._marked: set[Any] = set()

    def mark(self, child: Any) -> None:
        self._marked.add(child)

    def tell(self, clock: Callable[[], float]) -> None:
        """Send the due time of every marked child (``clock``: process control's, whose
        times are converted to ``time.monotonic()``, the watchdog's)."""
        if not self._marked:
            return
        ttl = self.lease_ttl
        margin = fence_margin(ttl)
        after_kill = max(WATCHDOG_SLACK, margin)
        mono = time.monotonic()
        offset = 0.0 if clock is time.monotonic else mono - clock()
        for child in self._marked:
            if child.returncode is not None:
                continue
            times = []
            for att in (child.attempt, *child.queued, *child.concurrent.values()):
                if att is None or att.ended:
                    continue
                if att.guards_lease():  # a quarter of the margin after process control's own kill
                    times.append(att.fence(ttl) - margin * 0.75)
                if att.kill_at is not None:
                    times.append(att.kill_at + after_kill)
            self.link.due(child.pid, min(times) + offset if times else None, now=mono, horizon=self.horizon)
        self._marked.clear()

    def refresh(self) -> None:
        """Send the later due times held back that are now within the horizon."""
        self.link.refresh(time.monotonic(), self.horizon)

    def next_refresh(self) -> float | None:
        """When (``time.monotonic()``) :meth:`refresh` next has something to send, or None."""
        return self.link.next_refresh(self.horizon)
