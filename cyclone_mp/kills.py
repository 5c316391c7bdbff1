"""Deadlines, fences, cancels and kills for process control: a renewal that moves a
lease's fence, a lost lease that cancels its attempt, the due actions of
:func:`~cyclone_mp.enforcement.due_actions` carried out (a cooperative cancel over the
child's pipe, then the SIGKILL of its tree at ``kill_grace`` or at the lease's fence),
a cap's kill, and the watchdog told when each child must be dead at the latest (and
what it killed itself while this process was frozen).
"""

from __future__ import annotations

import contextlib
import logging
import selectors
import time
from typing import TYPE_CHECKING, Any, Callable, Iterable, TypeVar

import psutil

from .attempts import Attempt
from .enforcement import LEASE_FENCE, LEASE_LOST, Cancel, Kill, due_actions, running
from .messages import LeaseLost, Renewed

if TYPE_CHECKING:
    from .childproc import ChildProc
    from .control import ProcessControl

log = logging.getLogger("cyclone_mp.supervisor")
T = TypeVar("T")


def each(items: Iterable[T], fn: Callable[[T], Any]) -> None:
    """``fn`` on every item, one failing holding back none of the others; the first
    failure is raised once all have run."""
    failed: Exception | None = None
    for item in items:
        try:
            fn(item)
        except Exception as exc:  # noqa: BLE001 - raised after the others
            failed = failed or exc
    if failed is not None:
        raise failed


WATCHDOG_RESTART_EVERY = 1.0  # seconds: a watchdog that keeps dying is started again no more often


class Kills:
    """The kills of ``control`` (a :class:`~cyclone_mp.control.ProcessControl`), on its thread."""

    def __init__(self, control: ProcessControl) -> None:
        self.control = control
        self.watchdog_restart_at = 0.0  # no new watchdog before this (time.monotonic())

    def cancel(self, att: Attempt, reason: str, now: float) -> None:
        if att.cancel_reason is not None or att.ended:
            return
        att.cancel_reason = reason
        att.killed_by = None
        if att.child.attempt is att or att.token in att.child.concurrent:  # a queued one is dropped, nothing to kill
            kill_at = now + self.control.config.kill_grace  # (a failed attempt's lingering threads: no later than theirs)
            att.kill_at = kill_at if att.kill_at is None else min(att.kill_at, kill_at)
            self.control.deadlines.push(att)
        att.child.cancel(att.token, reason)
        self.watch(att.child)

    def on_renewed(self, message: Renewed) -> None:
        """A renewal held: the lease lasts at least until ``sent + lease_ttl`` (the fence)."""
        att = self.control.attempts.get(message.key)
        if att is not None:
            att.lease_sent = max(att.lease_sent, message.sent)
            self.watch(att.child)
            return
        self.control.holding.renewed(message.key, message.sent)

    def on_lease_lost(self, message: LeaseLost) -> None:
        """A renewal matched nothing: cancel the attempt with the reason the row gives
        (SPEC 4); ``kill_grace`` later it is killed. A held step is dropped, and reported
        dead to the outcome writer (it never started)."""
        att = self.control.attempts.get(message.key)
        if message.reason == "cancelled":  # heard by the listener: the keeper renews it no more
            ours = att is not None or any(h.key == message.key for h in self.control.held)
            self.control.claims.forget_cancelled(message.key, ours=ours)
        if att is None:
            if self.control.holding.drop(message.key):  # held, never started: its retry need not wait
                self.control.writer.post_dead((message.key,), started=False)
            return
        if att.ended:
            return
        reason = "lease_lost" if message.reason == "finished" else message.reason
        att.fenced = False  # the row says so: nothing to write for it
        if reason == "lease_lost":
            self.control.stats["lease_lost"] += 1
        self.cancel(att, reason, self.control.clock())

    def enforce(self, now: float) -> None:
        """Carry out what :func:`~cyclone_mp.enforcement.due_actions` says is due for the
        attempts whose deadlines came (:class:`~cyclone_mp.enforcement.Deadlines`): cancel
        at the worker-clock deadline or when the lease cannot be kept; kill at ``kill_at``
        or at the fence, whichever comes first. A due kill is carried out whatever
        happened to the step's row since."""
        due = self.control.deadlines.take_due(now)
        if not due:
            return
        try:  # this one failing is tried again next turn; the phase is logged as failed
            each(due_actions(due, now, self.control.config.lease_ttl, self.control.config.kill_grace),
                 lambda action: self._carry_out(action, now))
        finally:  # every attempt taken goes back with its next due time, whatever failed
            for att in due:
                self.control.deadlines.push(att)

    def _carry_out(self, action: Cancel | Kill, now: float) -> None:
        att = action.att
        if isinstance(action, Cancel):
            if action.reason == LEASE_LOST:  # we could not renew in time: someone else may reclaim it soon
                self.control.stats["lease_lost"] += 1
                att.fenced = True
                log.warning("lease of step %d not renewed in time; cancelling its attempt", att.step_id)
            self.cancel(att, action.reason, now)
            return
        child = att.child
        self.control.io.read(child)  # it may have ended just now, and the child started the next
        if att.ended or not running(att):
            return
        if att.cancel_reason is None and action.trigger == LEASE_FENCE:  # before any cancel could: cancel, kill now
            att.cancel_reason, att.fenced = LEASE_LOST, True
            child.cancel(att.token, LEASE_LOST)
        if action.trigger == LEASE_FENCE:
            self.control.stats["fence_kills"] += 1
        att.killed_by = action.trigger
        self.control.pool.kill(child, action.trigger)
        self.control.endings.on_child_exit(child)

    def kill_over_limits(self, now: float) -> None:
        """Kill every attempt the resource-limit sampling found over a cap (when a sample
        is due); one kill that fails does not hold back the others (it is raised after them,
        and that attempt is found over its cap again at the next sample)."""
        each(self.control.limit_watch.due(now), lambda found: self.kill_for_limit(*found))

    def kill_for_limit(self, att: Attempt, kind: str) -> None:
        """Kill the tree of an attempt :class:`~cyclone_mp.limits.watch.LimitWatch` found over
        a cap (unless it ended meanwhile)."""
        child = att.child
        self.control.io.read(child)  # it may have ended just now
        if att.ended or child.attempt is not att:
            return
        att.killed_for = att.killed_by = kind
        self.control.stats["limit_kills"] += 1
        self.control.limit_watch.final_sample(att)  # the tree as it was, before the kill empties it
        for pid, _ in att.usage.left if att.usage is not None else ():  # out of the cgroups the kill goes through
            with contextlib.suppress(psutil.Error):
                child.descendants_seen.setdefault(pid, psutil.Process(pid))
        self.control.pool.kill(child, kind)
        self.control.endings.on_child_exit(child)

    def kill_for(self, child: ChildProc, trigger: str) -> None:
        """Kill ``child`` for breaking the pipe protocol: its attempt fails as an error."""
        if child.attempt is not None:
            child.attempt.killed_by = trigger
        self.control.pool.kill(child, trigger)

    def watch(self, child: ChildProc) -> None:
        """``child``'s attempts changed: the watchdog hears its due time before this turn
        ends, and before the child is sent another task (:class:`~cyclone_mp.enforcement.WatchdogDue`)."""
        self.control.watch_due.mark(child)

    def tell_watchdog(self) -> None:
        self.control.watch_due.tell(self.control.clock)

    def read_watchdog(self) -> None:
        for pid in self.control.watchdog.reports():
            self.control.watchdog_killed.add(pid)
            self.control.stats["watchdog_kills"] += 1
            self.control.observer.killed("watchdog")
            log.warning("the watchdog killed child %d (the supervisor was late: frozen or stalled)", pid)
        if self.control.watchdog.exited:
            self.restart_watchdog()

    def restart_watchdog(self) -> None:
        """The watchdog exited (killed by someone, say): its socket leaves the selector (at
        end of file it would wake every select) and a new watchdog takes over what it knew
        (:meth:`~cyclone_mp.watchdoglink.WatchdogLink.restart`), at most once every
        WATCHDOG_RESTART_EVERY seconds. Until then a frozen supervisor's children and its
        own death have no backstop."""
        watchdog, now = self.control.watchdog, time.monotonic()
        with contextlib.suppress(KeyError, ValueError):
            self.control.selector.unregister(watchdog.fileno())
        if now < self.watchdog_restart_at:
            return
        self.watchdog_restart_at = now + WATCHDOG_RESTART_EVERY
        old = watchdog.pid
        try:
            watchdog.restart()
        except OSError as exc:
            log.error("the watchdog (pid %d) exited and no new one could be started (%s); trying again in %gs",
                      old, exc, WATCHDOG_RESTART_EVERY)
            return
        self.control.selector.register(watchdog.fileno(), selectors.EVENT_READ, ("watchdog", None))
        self.control.stats["watchdog_restarts"] = self.control.stats.get("watchdog_restarts", 0) + 1
        log.warning("the watchdog (pid %d) exited; a new one (pid %d) took over", old, watchdog.pid)
