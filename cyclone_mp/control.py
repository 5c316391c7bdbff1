"""Process control: the supervisor's loop over its children (SPEC 1, 4, 9).

This is the supervisor's own thread (``PR_SET_PDEATHSIG`` follows the thread that
creates a child). It never calls the database: claims and outcomes are the outcome
writer's (:mod:`cyclone_mp.outcomes`), renewals the lease keeper's, the sweep
maintenance's; they talk by messages (:mod:`cyclone_mp.messages`), so a slow or
partitioned database delays durable transitions, never a kill. The watchdog is told
when each child must be dead at the latest, so the fence holds while this thread is
frozen too. The loop composes its parts: claims (:mod:`~cyclone_mp.claiming`), held
steps (:mod:`~cyclone_mp.holding`), starts (:mod:`~cyclone_mp.starting`), the children's
sockets (:mod:`~cyclone_mp.childio`), lost leases, deadlines and kills
(:mod:`~cyclone_mp.kills`), endings (:mod:`~cyclone_mp.endings`, judged by
:mod:`~cyclone_mp.judging`), caps (:class:`~cyclone_mp.limits.watch.LimitWatch`), reports.
"""

from __future__ import annotations

import collections
import logging
import math
import selectors
import threading
import time
from typing import Any, Callable

from .attempts import Attempt, Held
from .childio import ChildIO
from .childproc import ChildProc
from .claiming import Claims
from .config import Config
from .endings import AttemptEndings
from .enforcement import Deadlines, WatchdogDue
from .holding import Holding
from .kills import Kills
from .limits.confinement import Confinement
from .limits.procfs import peak_rss_kb
from .limits.watch import LimitWatch
from .mailbox import Inbox
from .messages import Claimed, DatabaseState, Fleet, LeaseKey, LeaseLost, Outcome, Poll, Renewed, Written
from .mux import Mux
from .pool import ChildPool
from .reports import Reports
from .starting import AttemptStarts
from .telemetry import NO_OBSERVER, Observer
from .watchdoglink import WatchdogLink

log = logging.getLogger("cyclone_mp.supervisor")

STRAY_CHECK_INTERVAL = 0.25  # seconds between looks for handler processes reparented to us
ZYGOTE_START_WAIT = 10.0  # seconds the start waits for the zygote's imports before it goes on (children come later)
#: seconds the loop waits at least (unless a child, the inbox or the watchdog wakes it) after
#: a turn in which a phase failed: a phase that fails on every turn leaves its due time in
#: the past (a claim, say), which would otherwise turn the loop without pause on a core
#: the children need; deadlines and kills are then looked at up to this much late
PHASE_FAILED_WAIT = 0.05


class ProcessControl:
    """The supervisor's process-control loop (see the module docstring).

    Args:
        owner: the supervisor's id.
        mux: the registered steps (their handlers' module paths).
        config: the supervisor's :class:`~cyclone_mp.config.Config`.
        keeper: posts a message to the lease keeper.
        writer: the :class:`~cyclone_mp.outcomes.OutcomeWriter` (``post``, ``post_batch``, ``post_dead``).
        watchdog: the :class:`~cyclone_mp.watchdoglink.WatchdogLink`.
        clock: local monotonic clock in seconds (injectable; schedules work only). It runs at
            ``time.monotonic``'s rate: a child's own start of a handler is mapped onto it.
        wall_clock: local wall clock in epoch seconds, for ``ctx.deadline`` (and the start
            time of an attempt's span) only.
        observer: told how each attempt ended and of each kill (:mod:`cyclone_mp.telemetry`).
        confinement: the child slots' cgroups and how limits are enforced
            (:class:`~cyclone_mp.limits.confinement.Confinement`; default: none, rlimits and sampling).
        dedicated: this process runs only the supervisor (``client.run()``): every
            process it adopts is a handler's.
    """

    def __init__(self, owner: str, mux: Mux, config: Config, *, keeper: Callable[[Any], None], writer: Any,
                 watchdog: WatchdogLink, clock: Callable[[], float] = time.monotonic,
                 wall_clock: Callable[[], float] = time.time, observer: Observer = NO_OBSERVER,
                 confinement: Confinement | None = None, dedicated: bool = False) -> None:
        self.owner = owner
        self.mux = mux
        self.config = config
        self.keeper = keeper
        self.writer = writer
        self.watchdog = watchdog
        self.clock = clock
        self.wall_clock = wall_clock
        self.inbox = Inbox()
        self.selector = selectors.DefaultSelector()
        self.selector.register(self.inbox.fileno(), selectors.EVENT_READ, ("inbox", None))
        self.selector.register(watchdog.fileno(), selectors.EVENT_READ, ("watchdog", None))
        # every child imports the handlers' modules before it is ready: no first attempt spends its timeout importing
        preload = sorted({(s.ref.module, s.ref.path) for s in mux.steps.values()}, key=str)
        self.observer = observer
        self.confinement = confinement or Confinement.none()
        if any(s.options.memory_limit is not None or s.options.max_processes is not None for s in mux.steps.values()):
            self.confinement.v1_at_birth = True  # the handlers declare caps held in v1 cgroups (where they are)
        if any(s.options.max_processes is not None for s in mux.steps.values()):
            self.confinement.wants_userns()  # ... or held in each child's user namespace (no pids cgroup)
        self.pool = ChildPool(owner, workers=config.workers, limit=config.max_payload, preload=preload,
                              selector=self.selector, watchdog=watchdog, clock=clock, on_kill=observer.killed,
                              confinement=self.confinement, dedicated=dedicated, start_method=config.start_method)
        self.limit_watch = LimitWatch(self.confinement)  # running attempts with resource limits: sampled
        self.attempts: dict[LeaseKey, Attempt] = {}
        self.deadlines = Deadlines(config.lease_ttl, config.kill_grace)  # when each attempt needs a look
        self.outcomes: list[tuple[Outcome, float | None]] = []  # (outcome, its attempt's deadline), not yet sent
        self.outcomes_since: float | None = None
        self.watchdog_killed: set[int] = set()
        self.cancelled_unclaimed: dict[LeaseKey, float] = {}  # cancels heard before their claim came back
        self.batches_out = 0  # Batch messages the outcome writer has not said it is done with (Written)
        self.claim_after_written = False  # a claim on its own waited for the statement in flight
        self._phase_errors: dict[str, tuple[int, float]] = {}  # phase -> (errors not logged, last logged)
        self._phase_failed = False  # a phase of this turn failed (the wait after it is PHASE_FAILED_WAIT at least)
        self.turned_at = time.monotonic()  # when the loop last began a turn (read by /healthz)
        self.watch_due = WatchdogDue(watchdog, config.lease_ttl)  # when each child must be dead at the latest
        self.db_ok = False
        self.claiming = 0  # steps asked for by claims not yet back
        self.taking_deferred = False  # the children's messages are being handled: take_held waits for the last
        self.take_due = False  # take_held was asked for meanwhile
        start = clock()
        self.next_poll = start
        self.poll_delay = config.poll_interval[0]
        self._next_stray_check = start
        self._next_sample = start
        self.limit_watch.next_check = start
        self.next_snapshot = start
        self.draining = False
        self.drain_deadline: float | None = None
        self.hard_stop = False
        # Plain flags: set from signal handlers, where taking a lock (threading.Event)
        # could deadlock with the interrupted code; the inbox's wake-up is a write(2).
        self._shutdown_req = False
        self._stop_req = False
        self.step_seconds: float | None = None  # moving average of attempt durations
        self.endings = AttemptEndings(self)  # how each attempt ends, from its child's messages and exit
        self.starts = AttemptStarts(self)  # how each attempt starts on a child
        self.claims = Claims(self)  # how many steps to claim, and what a claim that came back does
        self.kills = Kills(self)  # deadlines, fences, renewals, lost leases, cancels and kills
        self.io = ChildIO(self, start)  # the children's sockets: written, read, their messages handed on
        self.reports = Reports(self)  # outcomes to the writer, snapshots to the registry
        #: async steps whose attempts run several to a child: step name -> how many at most
        self.side_by_side = {s.name: s.options.async_concurrency for s in mux.steps.values()
                             if (s.options.async_concurrency or 1) > 1}
        self.snapshot: dict[str, Any] = {"workers": config.workers, "queues": list(config.queues),
                                         "names": list(mux.step_names), "children": [],
                                         "limits": self.confinement.mechanism.as_dict()}
        self.stats = {"pipelined": 0, "cancelled_attempts": 0, "fence_kills": 0, "watchdog_kills": 0,
                      "lease_lost": 0, "late_completions_dropped": 0, "limit_kills": 0}
        self.holding = Holding(config, self.pool, writer=writer, keeper=keeper, clock=clock,
                               side_by_side=self.side_by_side, start=self.starts.start, flush=self.io.flush_queued,
                               stats=self.stats)

    @property
    def children(self) -> list[ChildProc]:
        return self.pool.children

    @property
    def held(self) -> collections.deque[Held]:
        """Claimed steps no child has taken yet (:class:`~cyclone_mp.holding.Holding`)."""
        return self.holding.held

    def prefetch_room(self) -> int:
        """Steps to hold beyond the idle children (:meth:`~cyclone_mp.holding.Holding.prefetch_room`)."""
        return self.holding.prefetch_room(draining=self.draining, step_seconds=self.step_seconds)

    def take_held(self) -> None:
        """Start held steps on idle children and queue more behind busy ones (none while
        the lease keeper is disconnected: their leases cannot be kept, nor when draining).
        While the children's messages of a turn are handled (:meth:`ChildIO.check
        <cyclone_mp.childio.ChildIO.check>`), it is done once after the last of them: one
        take and one write per child for the many results a read brings, not one per result."""
        if self.taking_deferred:
            self.take_due = True
            return
        if self.holding.held and not self.draining and self.db_ok:
            self.holding.take(step_seconds=self.step_seconds)

    def in_flight(self) -> list[Attempt]:
        """The attempts running now (a copy, safe to read from another thread)."""
        for _ in range(5):
            try:
                return [a for a in list(self.attempts.values()) if not a.ended]
            except RuntimeError:  # changed while copied: try again
                continue
        return []

    # -- requests from other threads ------------------------------------------------------------

    def request_shutdown(self) -> None:
        """Soft stop: claim nothing more; in-flight handlers get ``shutdown_grace`` (SPEC 5).
        Safe in a signal handler (it sets flags and wakes the inbox, whose lock is reentrant)."""
        self._shutdown_req = True
        self.inbox.wake()

    def request_stop(self) -> None:
        """Hard stop: cancel every in-flight handler now, kill after ``kill_grace``. Safe
        in a signal handler."""
        self._shutdown_req = True
        self._stop_req = True
        self.inbox.wake()

    def tell(self, message: Any) -> None:
        """Post a message to this loop (from any thread)."""
        self.inbox.post(message)

    # -- the loop -------------------------------------------------------------------------------

    def run(self, running: threading.Event | None = None) -> None:
        """Run until drained or stopped (on the thread that owns the children). With a
        zygote, the first children are forked once it has imported the handlers (waited
        for here, at most ``ZYGOTE_START_WAIT``), so they exist when ``running`` is set,
        as spawned ones do."""
        try:  # the loop starts any child still missing (its "children's starts" phase)
            self.pool.maintain(self.clock(), draining=False)
            if self.pool.await_zygote(ZYGOTE_START_WAIT, stop=lambda: self._shutdown_req):
                self.pool.maintain(self.clock(), draining=False)
        except Exception:  # noqa: BLE001 - nothing may end the supervisor
            log.exception("starting the first children failed; the loop tries again")
        self.reports.publish_snapshot(self.clock())  # before maintenance's first registry row
        if running is not None:
            running.set()
        while True:
            self.turned_at = time.monotonic()  # /healthz: the loop turns
            try:
                now = self.clock()
                self._handle_requests(now)
                if self._drained(now):
                    break
                self._phase_failed = False
                self._turn(now)
                self.starts.tell_keeper()
                self.kills.tell_watchdog()
                wait = self._next_wake(self.clock())
                self._wait(max(wait, PHASE_FAILED_WAIT) if self._phase_failed else wait)
            except Exception:  # noqa: BLE001 - nothing a step does may end the supervisor
                log.exception("unexpected error in the process-control loop; carrying on")
                time.sleep(0.1)
        self.reports.send_outcomes()

    def _drained(self, now: float) -> bool:
        """Draining and nothing left: no attempt, no held step, and no claim on its way
        (its rows are released once they come back), unless the drain's time is up (a
        claim that does not come back by then is left to its leases)."""
        if not self.draining or self.attempts or self.held:
            return False
        return not self.claiming or (self.drain_deadline is not None and now >= self.drain_deadline)

    def _handle_requests(self, now: float) -> None:
        if self._shutdown_req and not self.draining:
            self.draining = True
            self.drain_deadline = now + self.config.shutdown_grace
            log.info("shutdown: draining %d in-flight step(s) for up to %.1fs", len(self.attempts),
                     self.config.shutdown_grace)
        if self._stop_req and not self.hard_stop:
            self.hard_stop = True
            self.drain_deadline = now
        if self.draining and self.drain_deadline is not None and now >= self.drain_deadline:
            for att in list(self.attempts.values()):
                self.kills.cancel(att, "shutdown", now)

    def _turn(self, now: float) -> None:
        """One pass of the loop. Each phase runs on its own (:meth:`_phase`): one that fails
        (a descriptor limit hit while reading ``/proc``, say) is logged and the others
        still run, so the deadlines, fences and kills are enforced on every turn; the
        wait after such a turn is :data:`PHASE_FAILED_WAIT` at least."""
        phase = self._phase
        phase("inbox", self._read_inbox)
        if self.held and self.pool.idle():
            phase("held steps", self.take_held)
        phase("children's messages", self.io.check)
        phase("watchdog", self.kills.read_watchdog)
        phase("watchdog", self.watch_due.refresh)
        phase("children's starts", self._check_starts)
        now = self.clock()
        if now >= self._next_stray_check:
            self._next_stray_check = now + STRAY_CHECK_INTERVAL
            phase("stray processes", self._check_strays)
        phase("resource limits", lambda: self.kills.kill_over_limits(now))
        if now >= self._next_sample:
            self._next_sample = now + self.config.heartbeat_interval
            phase("sampling", self._sample_peaks)
        phase("held steps", lambda: self.holding.expire(self.clock(), draining=self.draining))
        phase("queued steps", lambda: self.endings.release_queued(self.clock()))
        phase("deadlines and kills", lambda: self.kills.enforce(self.clock()))
        phase("outcomes", self.reports.send_outcomes)
        now = self.clock()
        if self.db_ok and not self.draining and now >= self.next_poll:
            phase("claim", lambda: self.claims.request_claim(now))
        if now >= self.next_snapshot:
            self.next_snapshot = now + self.config.registry_interval
            phase("snapshot", lambda: self.reports.publish_snapshot(now))

    def _phase(self, name: str, fn: Callable[[], Any]) -> None:
        """Run one phase of a turn; an error is logged (at most once a minute per phase,
        with a count of the others) and the turn goes on."""
        try:
            fn()
        except Exception as exc:  # noqa: BLE001 - nothing may stop the loop's other phases
            self._phase_failed = True
            count, last = self._phase_errors.get(name, (0, -math.inf))
            now = time.monotonic()
            if now - last >= 60.0:
                log.exception("process control: %s failed (%d more since the last report): %s; carrying on",
                              name, count, exc)
                self._phase_errors[name] = (0, now)
            else:
                self._phase_errors[name] = (count + 1, last)

    def _check_starts(self) -> None:
        for child in self.pool.stuck_preloads(self.clock()):
            self.endings.on_child_exit(child)
        self.pool.maintain(self.clock(), self.draining)

    def _check_strays(self) -> None:
        if self.pool.reap_orphans():
            log.info("killed handler process(es) reparented to the supervisor")
        self.pool.tell_descendants()

    def _sample_peaks(self) -> None:
        for att in self.attempts.values():  # a crashed child cannot be read afterwards
            if att.child.attempt is att:
                att.peak_rss_kb = peak_rss_kb(att.child.pid) or att.peak_rss_kb

    def _next_wake(self, now: float) -> float:
        times = [now + 1.0, self._next_stray_check, self._next_sample]
        if len(self.pool.children) < self.config.workers and self.pool.respawn_at > now and not self.draining:
            times.append(self.pool.respawn_at)  # a child to start again after a backoff
        limits_at = self.limit_watch.wake_at()
        if limits_at is not None:
            times.append(limits_at)
        due_at = self.deadlines.next_at()
        if due_at is not None:
            times.append(due_at)
        if self.db_ok and not self.draining and (self.pool.idle() or self.prefetch_room()):
            times.append(self.next_poll)
        release_at = self.holding.release_at()
        if release_at is not None:
            times.append(release_at)
        mono = time.monotonic()
        for child in self.pool.children:
            times.extend(now + a.start_by - mono for a in child.queued if a.start_by is not None)
        if self.draining and self.drain_deadline is not None:
            times.append(self.drain_deadline)
        flush_at = self.reports.flush_at()
        if flush_at is not None:
            times.append(flush_at)
        refresh_at = self.watch_due.next_refresh()
        if refresh_at is not None:
            times.append(now + refresh_at - mono)
        return max(0.0, min(times) - now)

    def _wait(self, timeout: float) -> None:
        for key, _ in self.selector.select(timeout):
            kind, obj = key.data
            if kind == "child":  # read (or written) by ChildIO.check on this turn
                self.io.ready.add(obj)
            elif kind == "zygote" and self.pool.zygote is not None:  # read in the pool's maintain on this turn
                self.pool.zygote.readable = True

    # -- messages from the other parts ------------------------------------------------------------

    def _read_inbox(self) -> None:
        for message in self.inbox.take():
            if isinstance(message, Renewed):
                self.kills.on_renewed(message)
            elif isinstance(message, Claimed):
                self.claims.on_claimed(message)
            elif isinstance(message, Written):
                self.batches_out = max(0, self.batches_out - message.batches)
                if self.claim_after_written and not self.batches_out:  # a claim waited for it
                    self.claim_after_written = False
                    self.next_poll = min(self.next_poll, self.clock())
            elif isinstance(message, LeaseLost):
                self.kills.on_lease_lost(message)
            elif isinstance(message, Poll):
                self.next_poll = min(self.next_poll, self.clock())
            elif isinstance(message, Fleet):
                self.holding.fleet = max(1, message.live)
            elif isinstance(message, DatabaseState):
                self.db_ok = message.ok
                if message.ok:
                    self.next_poll = self.clock()

    # -- teardown -------------------------------------------------------------------------------------

    def close(self) -> None:
        """Stop every child and release this loop's descriptors."""
        self.reports.send_outcomes(force=True)
        self.pool.teardown()
        try:
            self.selector.close()
        except Exception:  # noqa: BLE001
            pass
        self.inbox.close()
