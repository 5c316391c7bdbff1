"""Process control: children, pipes, deadlines, fences, cancels, kills, reaping (SPEC 1, 4, 9).

This is the supervisor's own thread (``PR_SET_PDEATHSIG`` follows the thread that
creates a child). It never calls the database: claims and outcomes are the outcome
writer's (:mod:`cyclone_mp.outcomes`), renewals the lease keeper's
(:mod:`cyclone_mp.leases`), the sweep maintenance's (:mod:`cyclone_mp.sweep`); they talk
by messages (:mod:`cyclone_mp.messages`). So a slow, locked or partitioned database
delays durable transitions, never a kill. The watchdog is told when each child must be
dead at the latest, so the fence holds while this thread is frozen too.

Where each job lives: a lost lease, :meth:`ProcessControl.on_lease_lost`; the
worker-clock timeout, the fence, the cancel and the kill, :meth:`ProcessControl._enforce`;
how an attempt ended, :mod:`cyclone_mp.endings`; prefetch and pipelining,
:mod:`cyclone_mp.holding`; resource limits and causes of death,
:class:`~cyclone_mp.limitwatch.LimitWatch`; the drain and the hard stop,
:meth:`ProcessControl._handle_requests`.
"""

from __future__ import annotations

import collections
import contextlib
import itertools
import logging
import math
import selectors
import threading
import time
from typing import Any, Callable

import psutil

from . import decisions, protocol
from .attempts import Attempt, Held, hold_bound
from .childproc import ChildProc
from .config import COALESCE_MAX, COALESCE_PER_WORKER, PREFETCH_MAX_WAIT, Config
from .endings import AttemptEndings
from .enforcement import LEASE_FENCE, LEASE_LOST, Cancel, Deadlines, WatchdogDue, due_actions, running
from .holding import Holding
from .limits.confinement import Confinement
from .limits.declared import format_size, row_limits
from .limits.procfs import peak_rss_kb
from .limits.watch import LimitWatch
from .mailbox import Inbox
from .limits.mechanism import PROCESSES_USERNS, SAMPLING
from .messages import (
    Claimed,
    DatabaseState,
    Fleet,
    LeaseDone,
    LeaseKey,
    LeaseLost,
    Outcome,
    Poll,
    Renewed,
    Started,
    Written,
)
from .mux import Mux
from .pool import ChildPool
from .telemetry import NO_OBSERVER, Observer
from .watchdoglink import WatchdogLink

log = logging.getLogger("cyclone_mp.supervisor")

STRAY_CHECK_INTERVAL = 0.25  # seconds between looks for handler processes reparented to us
IO_SWEEP_INTERVAL = 1.0  # seconds between reads of every child socket, readiness or not (a safety net)
ZYGOTE_START_WAIT = 10.0  # seconds the start waits for the zygote's imports before it goes on (children come later)
START_NOTED_AFTER = 0.01  # seconds from claim to start past which a running step's renewal records its start
SNAPSHOT_AFTER_START = 0.2  # seconds: a child that starts a step shows it in the registry snapshot this soon


class ProcessControl:
    """The supervisor's process-control loop (see the module docstring).

    Args:
        owner: the supervisor's id.
        mux: the registered steps (their handlers' module paths).
        config: the supervisor's :class:`~cyclone_mp.config.Config`.
        keeper: posts a message to the lease keeper.
        writer: the :class:`~cyclone_mp.outcomes.OutcomeWriter` (``post``, ``idle``).
        watchdog: the :class:`~cyclone_mp.watchdoglink.WatchdogLink`.
        clock: local monotonic clock in seconds (injectable; schedules work only).
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
        self._task_limits: dict[Any, dict[str, Any]] = {}  # (limits, rlimit flags) -> what a task message carries
        self.attempts: dict[LeaseKey, Attempt] = {}
        self.deadlines = Deadlines(config.lease_ttl, config.kill_grace)  # when each attempt needs a look
        self.outcomes: list[tuple[Outcome, float | None]] = []  # (outcome, its attempt's deadline), not yet sent
        self.outcomes_since: float | None = None
        self._io_ready: set[ChildProc] = set()
        self.watchdog_killed: set[int] = set()
        self._cancelled_unclaimed: dict[LeaseKey, float] = {}  # cancels heard before their claim came back
        self.batches_out = 0  # Batch messages the outcome writer has not said it is done with (Written)
        self._claim_after_written = False  # a claim on its own waited for the statement in flight
        self._phase_errors: dict[str, tuple[int, float]] = {}  # phase -> (errors not logged, last logged)
        self.turned_at = time.monotonic()  # when the loop last began a turn (read by /healthz)
        self.watch_due = WatchdogDue(watchdog, config.lease_ttl)  # when each child must be dead at the latest
        self.db_ok = False
        self.claiming = 0  # steps asked for by claims not yet back
        start = clock()
        self.next_poll = start
        self.poll_delay = config.poll_interval[0]
        self._next_io_sweep = start
        self._next_stray_check = start
        self._next_sample = start
        self.limit_watch.next_check = start
        self._next_snapshot = start
        self.draining = False
        self.drain_deadline: float | None = None
        self.hard_stop = False
        # Plain flags: set from signal handlers, where taking a lock (threading.Event)
        # could deadlock with the interrupted code; the inbox's wake-up is a write(2).
        self._shutdown_req = False
        self._stop_req = False
        self.step_seconds: float | None = None  # moving average of attempt durations
        self.endings = AttemptEndings(self)  # how each attempt ends, from its child's messages and exit
        self._tokens = itertools.count(1)
        self._hooks = mux.hook_refs()
        #: async steps whose attempts run several to a child: step name -> how many at most
        self.side_by_side = {s.name: s.options.async_concurrency for s in mux.steps.values()
                             if (s.options.async_concurrency or 1) > 1}
        self.snapshot: dict[str, Any] = {"workers": config.workers, "queues": list(config.queues),
                                         "names": list(mux.step_names), "children": [],
                                         "limits": self.confinement.mechanism.as_dict()}
        self.stats = {"pipelined": 0, "cancelled_attempts": 0, "fence_kills": 0, "watchdog_kills": 0,
                      "lease_lost": 0, "late_completions_dropped": 0, "limit_kills": 0}
        self.holding = Holding(config, self.pool, writer=writer, keeper=keeper, clock=clock,
                               side_by_side=self.side_by_side, start=self._start, flush=self._send_queued,
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
        the lease keeper is disconnected: their leases cannot be kept, nor when draining)."""
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
        Safe in a signal handler (no lock is taken)."""
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
        self.pool.maintain(self.clock(), draining=False)
        if self.pool.await_zygote(ZYGOTE_START_WAIT, stop=lambda: self._shutdown_req):
            self.pool.maintain(self.clock(), draining=False)
        self._publish_snapshot(self.clock())  # before maintenance's first registry row
        if running is not None:
            running.set()
        while True:
            self.turned_at = time.monotonic()  # /healthz: the loop turns
            try:
                now = self.clock()
                self._handle_requests(now)
                if self._drained(now):
                    break
                self._turn(now)
                self._tell_watchdog()
                self._wait(self._next_wake(self.clock()))
            except Exception:  # noqa: BLE001 - nothing a step does may end the supervisor
                log.exception("unexpected error in the process-control loop; carrying on")
                time.sleep(0.1)
        self._send_outcomes()

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
                self.cancel(att, "shutdown", now)

    def _turn(self, now: float) -> None:
        """One pass of the loop. Each phase runs on its own (:meth:`_phase`): one that fails
        (a descriptor limit hit while reading ``/proc``, say) is logged and the others
        still run, so the deadlines, fences and kills are enforced on every turn."""
        phase = self._phase
        phase("inbox", self._read_inbox)
        if self.held and self.pool.idle():
            phase("held steps", self.take_held)
        phase("children's messages", self._check_children_io)
        phase("watchdog", self.read_watchdog)
        phase("watchdog", self.watch_due.refresh)
        phase("children's starts", self._check_starts)
        now = self.clock()
        if now >= self._next_stray_check:
            self._next_stray_check = now + STRAY_CHECK_INTERVAL
            phase("stray processes", self._check_strays)
        phase("resource limits", lambda: self._enforce_limits(now))
        if now >= self._next_sample:
            self._next_sample = now + self.config.heartbeat_interval
            phase("sampling", self._sample_peaks)
        phase("held steps", lambda: self.holding.expire(self.clock(), draining=self.draining))
        phase("queued steps", lambda: self.endings.release_queued(self.clock()))
        phase("deadlines and kills", lambda: self._enforce(self.clock()))
        phase("outcomes", self._send_outcomes)
        now = self.clock()
        if self.db_ok and not self.draining and now >= self.next_poll:
            phase("claim", lambda: self._request_claim(now))
        if now >= self._next_snapshot:
            self._next_snapshot = now + self.config.registry_interval
            phase("snapshot", lambda: self._publish_snapshot(now))

    def _phase(self, name: str, fn: Callable[[], Any]) -> None:
        """Run one phase of a turn; an error is logged (at most once a minute per phase,
        with a count of the others) and the turn goes on."""
        try:
            fn()
        except Exception as exc:  # noqa: BLE001 - nothing may stop the loop's other phases
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

    def _enforce_limits(self, now: float) -> None:
        for att, kind in self.limit_watch.due(now):
            self._kill_for_limit(att, kind)

    def _sample_peaks(self) -> None:
        for att in self.attempts.values():  # a crashed child cannot be read afterwards
            if att.child.attempt is att:
                att.peak_rss_kb = peak_rss_kb(att.child.pid) or att.peak_rss_kb

    def _next_wake(self, now: float) -> float:
        times = [now + 1.0, self._next_stray_check, self._next_sample]
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
        flush_at = self._flush_at()
        if flush_at is not None:
            times.append(flush_at)
        refresh_at = self.watch_due.next_refresh()
        if refresh_at is not None:
            times.append(now + refresh_at - mono)
        return max(0.0, min(times) - now)

    def _wait(self, timeout: float) -> None:
        for key, _ in self.selector.select(timeout):
            kind, obj = key.data
            if kind == "child":  # read (or written) in _check_children_io on this turn
                self._io_ready.add(obj)
            elif kind == "zygote" and self.pool.zygote is not None:  # read in the pool's maintain on this turn
                self.pool.zygote.readable = True

    # -- messages from the other parts ------------------------------------------------------------

    def _read_inbox(self) -> None:
        for message in self.inbox.take():
            if isinstance(message, Renewed):
                self.on_renewed(message)
            elif isinstance(message, Claimed):
                self.on_claimed(message)
            elif isinstance(message, Written):
                self.batches_out = max(0, self.batches_out - message.batches)
                if self._claim_after_written and not self.batches_out:  # a claim waited for it
                    self._claim_after_written = False
                    self.next_poll = min(self.next_poll, self.clock())
            elif isinstance(message, LeaseLost):
                self.on_lease_lost(message)
            elif isinstance(message, Poll):
                self.next_poll = min(self.next_poll, self.clock())
            elif isinstance(message, Fleet):
                self.holding.fleet = max(1, message.live)
            elif isinstance(message, DatabaseState):
                self.db_ok = message.ok
                if message.ok:
                    self.next_poll = self.clock()

    def on_renewed(self, message: Renewed) -> None:
        """A renewal held: the lease lasts at least until ``sent + lease_ttl`` (the fence)."""
        att = self.attempts.get(message.key)
        if att is not None:
            att.lease_sent = max(att.lease_sent, message.sent)
            self.watch(att.child)
            return
        self.holding.renewed(message.key, message.sent)

    def on_lease_lost(self, message: LeaseLost) -> None:
        """A renewal matched nothing: cancel the attempt with the reason the row gives
        (SPEC 4); ``kill_grace`` later it is killed. A held step is simply dropped."""
        att = self.attempts.get(message.key)
        if message.reason == "cancelled":  # heard by the listener: the keeper renews it no more
            self._forget_cancelled(message.key, ours=att is not None or any(h.key == message.key for h in self.held))
        if att is None:
            self.holding.drop(message.key)
            return
        if att.ended:
            return
        reason = "lease_lost" if message.reason == "finished" else message.reason
        att.fenced = False  # the row says so: nothing to write for it
        if reason == "lease_lost":
            self.stats["lease_lost"] += 1
        self.cancel(att, reason, self.clock())

    def _forget_cancelled(self, key: LeaseKey, *, ours: bool) -> None:
        """A cancel of ``key`` was heard. Ours: its lease is renewed no more. Not (yet)
        ours: remembered for a lease's time, since the cancel may have crossed the claim
        that took it, whose rows are then dropped as they arrive (:meth:`on_claimed`)."""
        if ours:
            self.keeper(LeaseDone((key,)))
            return
        now = self.clock()
        cancelled = self._cancelled_unclaimed
        if len(cancelled) > 1024:
            for old in [k for k, at in cancelled.items() if now - at > self.config.lease_ttl]:
                del cancelled[old]
        cancelled[key] = now

    def on_claimed(self, message: Claimed) -> None:
        """Start claimed rows on idle children at once (however long they took to come
        back: their leases count from the claim's sending), hold the rest. The next poll
        comes after the poll interval's backoff, and no later than the claim's ``wait``
        (a rate-limited step's next free slot) when it has one."""
        self.claiming = max(0, self.claiming - message.limit)
        self._claim_after_written = False  # this claim's result says when to claim again
        now = self.clock()
        rows = list(message.rows)
        if self._cancelled_unclaimed:
            gone = [r for r in rows if self._cancelled_unclaimed.pop((r["id"], r["lease_generation"]), None)]
            if gone:  # cancelled as the claim came back: nothing to run, nothing to renew
                self.keeper(LeaseDone(tuple((r["id"], r["lease_generation"]) for r in gone)))
                rows = [r for r in rows if r not in gone]
        # a rate-limited step took its rate slot with this claim: it starts on an idle child
        # now, ahead of what is held, or is given back at once (never held or queued)
        rated = self.holding.add(rows, message.sent, now)
        if self.draining:
            self.holding.expire(now, draining=True)
        self.take_held()
        if rated:
            self.holding.give_back_rated()
        lo, hi = self.config.poll_interval
        if message.failed:
            self.poll_delay = min(hi, max(lo, self.poll_delay * 2))
            self.next_poll = now + self.poll_delay
        elif rows and len(rows) == message.limit:
            self.poll_delay = lo
            self.next_poll = now  # maybe more to take once a slot frees
        elif rows:
            self.poll_delay = lo
            self.next_poll = now + lo
        else:
            self.poll_delay = min(hi, max(lo, self.poll_delay * 2))
            self.next_poll = now + self.poll_delay
        if message.wait is not None:  # a rate limit held a step back: its slot frees then
            self.next_poll = min(self.next_poll, now + message.wait)

    def read_watchdog(self) -> None:
        for pid in self.watchdog.reports():
            self.watchdog_killed.add(pid)
            self.stats["watchdog_kills"] += 1
            self.observer.killed("watchdog")
            log.warning("the watchdog killed child %d (the supervisor was late: frozen or stalled)", pid)

    # -- claiming -----------------------------------------------------------------------------------

    def _claim_limit(self, *, standalone: bool) -> int:
        """Steps to claim now: free slots plus room to hold, minus what is held and what
        claims on their way will bring (0 when draining or disconnected). A claim rides
        with the outcomes that free its slots (:meth:`_send_outcomes`: one statement
        writes them and claims, so a supervisor never holds more rows than it has slots
        and room); one on its own waits until every outcome sent is written."""
        if self.draining or not self.db_ok or (standalone and not self.writer.idle):
            return 0
        return max(0, len(self.pool.idle()) + self.holding.side_by_side_room() + self.prefetch_room() - len(self.held)
                   - self.claiming)

    def _start_now(self, claim: int) -> int:
        """Of a claim of ``claim`` steps, how many idle children can start at once: the
        claim takes no more rate-limited steps (a rate limit counts handler starts)."""
        return max(0, min(claim, len(self.pool.idle()) - len(self.held)))

    def _request_claim(self, now: float) -> None:
        """A claim on its own (on the poll interval, or when woken), through the outcome
        writer, which makes every claim: the lease keeper only renews. With prefetch one
        statement is in flight at a time (see :meth:`_flush_at`): the claim waits for it
        (``Written``)."""
        if self.config.prefetch and self.batches_out:
            self._claim_after_written = True
            self.next_poll = now + self.poll_delay
            return
        limit = self._claim_limit(standalone=True)
        if limit <= 0:
            self.next_poll = now + self.poll_delay
            return
        if self.outcomes:  # what ended goes with it, in the same statement
            self._send_outcomes(force=True)
            return
        self.claiming += limit
        self.batches_out += 1
        self.writer.post_batch((), limit, self._start_now(limit))

    def _send_queued(self) -> None:
        self._tell_watchdog()  # the watchdog knows a task's due time before the child has the task
        for child in self.pool.children:
            if child.outbox:
                child.flush()
                self.pool.update_write_interest(child)

    # -- starting an attempt -----------------------------------------------------------------------

    def _start(self, item: Held, child: ChildProc) -> bool:
        """Start one claimed step on ``child``. Its timeout counts from the claim (its
        ``sent`` time), as it does in the database (SPEC 4). Its resource caps are set on
        the child's slot first; False (nothing started) when the child already
        holds more memory than the step's cap: the child is replaced, the step waits."""
        row = item.row
        limits = row_limits(row)
        slot = child.slot
        fits = True
        ceiling = child.open_files_ceiling
        if ceiling is not None and child.attempt is None and (limits.open_files is None or limits.open_files > ceiling):
            # its hard RLIMIT_NOFILE was lowered for a smaller max_open_files, and it cannot raise it back
            log.info("child %d cannot raise its RLIMIT_NOFILE back (lowered for max_open_files %d), which step %s "
                     "needs %s: replacing it", child.pid, ceiling, row["step_name"],
                     "without a cap" if limits.open_files is None else f"at {limits.open_files}")
            return self._replace(child)
        if slot is not None and (limits or slot.caps != (None, None)) and child.attempt is None:
            joining = slot.unjoined(limits) if limits else []
            if joining:  # its caps live in v1 cgroups the child is not in (a hybrid host)
                self.confinement.v1_at_birth = True  # from now on new children join those at birth
                # what a child holds stays charged where it was when it joins (v1): one that ran
                # steps, was spawned, or imported modules after its birth would take that past the cap
                if "memory" in joining and (child.steps_run or not child.forked or child.leftover):
                    log.info("child %d may hold memory charged outside its slot's memory cgroup, which would "
                             "escape memory_limit %s of step %s: replacing it", child.pid,
                             format_size(limits.memory), row["step_name"])
                    return self._replace(child)
                slot.join(joining)
            if limits.processes is not None and not child.userns and self.confinement.mechanism.userns_processes:
                # no pids cgroup: children hold max_processes with RLIMIT_NPROC in a user
                # namespace of their own, which only a child single-threaded at birth can make
                self.confinement.wants_userns()  # from now on new children are born in one
                log.info("child %d has no user namespace of its own to hold max_processes %d of step %s: "
                         "replacing it", child.pid, limits.processes, row["step_name"])
                return self._replace(child)
            fits = slot.configure(limits)
            if not fits and child.steps_run:
                log.info("child %d holds more than memory_limit %s of step %s: replacing it", child.pid,
                         format_size(limits.memory), row["step_name"])
                return self._replace(child)
        now = self.clock()
        step = self.mux.steps[row["step_name"]]
        timeout = row["timeout"]
        token = f"{child.pid}.{next(self._tokens)}"
        att = Attempt(
            key=item.key, run_id=row["run_id"], node=row["node"], step_name=row["step_name"],
            attempt=row["attempt"], timeout=timeout, token=token, child=child,
            workflow=row["run_kind"] != "step", started=now,  # (a workflow run, or a spawned one: "child")
            deadline=(item.sent + timeout) if timeout is not None else None, lease_sent=item.lease_sent,
            backoff_spec=row.get("backoff"), trace=row.get("trace"), limits=limits,
            claimed=(item.sent + item.arrived) / 2,
        )
        att.cpu_start = child.cpu_total
        self.attempts[att.key] = att
        if not fits:  # a fresh child alone is over the cap: no handler can run under it
            self.endings.end(att)
            self.endings.fail(att, decisions.MEMORY_LIMIT, self.limit_watch.below_a_fresh_child(child.pid, limits))
            return True
        side_by_side = row["step_name"] in self.side_by_side
        if side_by_side:  # an async attempt beside the others of its step in this child
            child.concurrent[token] = att
            att.started_wall = self.wall_clock()
            self.note_start(att)
        elif child.attempt is None:
            child.attempt = att
            att.started_wall = self.wall_clock()
            self.limit_watch.arm(att)
            self.note_start(att)
        else:  # pipelined: it starts when the child's current attempt ends, if by start_by
            att.start_by = time.monotonic() + hold_bound(self.config.lease_ttl, timeout, PREFETCH_MAX_WAIT)
            child.queued.append(att)
        self.deadlines.push(att)
        ref = step.ref
        task = {
            "t": "task", "task": token, "run_id": att.run_id, "step": att.step_name, "node": att.node,
            "attempt": att.attempt, "timeout": timeout, "start_by": att.start_by,
            "deadline": (self.wall_clock() + (att.deadline - now)) if att.deadline is not None else None,
            "input_json": row["input"], "upstream_json": row["upstream"],
            "ref": {"module": ref.module, "qualname": ref.qualname, "path": ref.path},
        }
        if row.get("spawned") is not None:  # it waited for the runs its upstream spawned: ctx.spawned
            task["spawned_json"] = row["spawned"]
        if row.get("maps"):  # upstream map nodes: their outputs in files (deleted when the attempt ends)
            task["maps"] = row["maps"]
            att.files = tuple(m["path"] for m in row["maps"].values())
        if self.config.max_child_rss is not None:  # the child says its RSS at the end of the task
            task["rss"] = True
        if self._hooks:  # mux.on_attempt_start / on_attempt_end, run by the child around the handler
            task["hooks"] = self._hooks
        if side_by_side:
            task["concurrent"] = True
        if limits:  # the child sets its rlimits for the task (inherited by what it starts)
            # where no cgroup holds the memory (or none counts the tree's CPU, or holds the
            # process cap), rlimits backstop and the child counts its tree as its handler ends
            pids_cgroup = slot is not None and slot.kernel_process_cap
            flags = (not (slot is not None and slot.kernel_memory_cap), not (slot is not None and slot.confined),
                     not pids_cgroup and child.userns, not pids_cgroup)
            if limits.processes is not None:
                att.processes_by = (self.confinement.mechanism.processes if pids_cgroup else
                                    PROCESSES_USERNS if child.userns else SAMPLING)
            cached = self._task_limits.get((limits, flags))
            if cached is None:
                if len(self._task_limits) > 256:
                    self._task_limits.clear()
                cached = self._task_limits[(limits, flags)] = {
                    **limits.as_json(), "rlimit_data": flags[0], "rlimit_cpu": flags[1], "rlimit_nproc": flags[2],
                    "count_tree": flags[3]}
            task["limits"] = cached
        child.queue(task)  # written by the caller, with the other tasks of this round
        self.watch(child)
        return True

    def note_start(self, att: Attempt) -> None:
        """An attempt whose handler started well after its claim (it waited for a child):
        its lease's next renewal records when (``started_at`` of a running step). And
        ``cyclone-mp workers`` shows the child busy within SNAPSHOT_AFTER_START, not idle
        until the next ``registry_interval``."""
        self._next_snapshot = min(self._next_snapshot, self.clock() + SNAPSHOT_AFTER_START)
        delay = att.start_delay()
        if delay is not None and delay > START_NOTED_AFTER:
            self.keeper(Started(att.key, delay))

    def _replace(self, child: ChildProc) -> bool:
        """Retire the idle ``child`` for a fresh one before a step with caps (which waits
        for it: False, nothing started)."""
        child.recycle_due = True
        self.pool.retire(child)
        self.pool.maintain(self.clock(), self.draining)
        return False

    # -- resource limits ----------------------------------------------------------------------------

    def _kill_for_limit(self, att: Attempt, kind: str) -> None:
        """Kill the tree of an attempt :class:`~cyclone_mp.limitwatch.LimitWatch` found over
        a cap (unless it ended meanwhile)."""
        child = att.child
        self.child_io(child)  # it may have ended just now
        if att.ended or child.attempt is not att:
            return
        att.killed_for = att.killed_by = kind
        self.stats["limit_kills"] += 1
        self.limit_watch.final_sample(att)  # the tree as it was, before the kill empties it
        for pid, _ in att.usage.left if att.usage is not None else ():  # out of the cgroups the kill goes through
            with contextlib.suppress(psutil.Error):
                child.descendants_seen.setdefault(pid, psutil.Process(pid))
        self.pool.kill(child, kind)
        self.endings.on_child_exit(child)

    # -- the children's messages ------------------------------------------------------------------

    def _check_children_io(self) -> None:
        """Read the children whose sockets the last wait reported (and, every
        ``IO_SWEEP_INTERVAL`` seconds, all of them), and write what is queued."""
        now = self.clock()
        if now >= self._next_io_sweep:
            self._next_io_sweep = now + IO_SWEEP_INTERVAL
            ready = list(self.pool.children)
        else:
            ready = [c for c in self.pool.children if c in self._io_ready or c.outbox]
        self._io_ready.clear()
        for child in ready:
            if child in self.pool.children:
                self.child_io(child)

    def child_io(self, child: ChildProc) -> None:
        """Write what is queued for ``child``, then read and handle all it has sent."""
        child.flush()
        try:
            messages, eof = child.receive()
        except protocol.ProtocolError as exc:
            log.error("child %d sent a bad message (%s); killing it", child.pid, exc)
            self.kill_for(child, "protocol_error")
            messages, eof = [], True
        for message in messages:
            self.endings.on_message(child, message)
        if eof:
            self.endings.on_child_exit(child)
        self.pool.update_write_interest(child)

    def kill_for(self, child: ChildProc, trigger: str) -> None:
        """Kill ``child`` for breaking the pipe protocol: its attempt fails as an error."""
        if child.attempt is not None:
            child.attempt.killed_by = trigger
        self.pool.kill(child, trigger)

    # -- deadlines, fences, cancels, kills ---------------------------------------------------------

    def cancel(self, att: Attempt, reason: str, now: float) -> None:
        if att.cancel_reason is not None or att.ended:
            return
        att.cancel_reason = reason
        att.killed_by = None
        if att.child.attempt is att or att.token in att.child.concurrent:  # a queued one is dropped, nothing to kill
            att.kill_at = now + self.config.kill_grace
            self.deadlines.push(att)
        att.child.cancel(att.token, reason)
        self.watch(att.child)

    def _enforce(self, now: float) -> None:
        """Carry out what :func:`~cyclone_mp.enforcement.due_actions` says is due for the
        attempts whose deadlines came (:class:`~cyclone_mp.enforcement.Deadlines`): cancel
        at the worker-clock deadline or when the lease cannot be kept; kill at ``kill_at``
        or at the fence, whichever comes first. A due kill is carried out whatever
        happened to the step's row since."""
        due = self.deadlines.take_due(now)
        if not due:
            return
        for action in due_actions(due, now, self.config.lease_ttl, self.config.kill_grace):
            att = action.att
            if isinstance(action, Cancel):
                if action.reason == LEASE_LOST:  # we could not renew in time: someone else may reclaim it soon
                    self.stats["lease_lost"] += 1
                    att.fenced = True
                    log.warning("lease of step %d not renewed in time; cancelling its attempt", att.step_id)
                self.cancel(att, action.reason, now)
                continue
            child = att.child
            self.child_io(child)  # it may have ended just now, and the child started the next
            if att.ended or not running(att):
                continue
            if att.cancel_reason is None:  # the fence came before any cancel could: cancel and kill now
                att.cancel_reason, att.fenced = LEASE_LOST, True
                child.cancel(att.token, LEASE_LOST)
            if action.trigger == LEASE_FENCE:
                self.stats["fence_kills"] += 1
            att.killed_by = action.trigger
            self.pool.kill(child, action.trigger)
            self.endings.on_child_exit(child)
        for att in due:
            self.deadlines.push(att)

    def watch(self, child: ChildProc) -> None:
        """``child``'s attempts changed: the watchdog hears its due time before this turn
        ends, and before the child is sent another task (:class:`~cyclone_mp.enforcement.WatchdogDue`)."""
        self.watch_due.mark(child)

    def _tell_watchdog(self) -> None:
        self.watch_due.tell(self.clock)

    # -- outcomes ----------------------------------------------------------------------------------

    def _flush_at(self) -> float | None:
        """When the gathered outcomes go to the writer (None: there are none). At once,
        except with prefetch while held steps keep every child busy: then they wait up to
        COALESCE_MAX (0.1 s) for COALESCE_PER_WORKER (4) outcomes per child, so steps of
        about 20 ms share statements (pgqueuer buffers its completions the same way). An
        outcome never waits into the last COALESCE_MAX before its attempt's deadline."""
        if not self.outcomes:
            return None
        since = self.outcomes_since if self.outcomes_since is not None else self.clock()
        due = [d - COALESCE_MAX for _, d in self.outcomes if d is not None]
        if self.config.prefetch and self.batches_out and not self.draining:
            # One statement in flight: these go in the next one, with all that ends meanwhile
            # and a claim for all the room there is (Written says when; the writer could not
            # start another statement before then anyway).
            return min([since + self.config.write_bound, *due])
        workers = self.config.workers
        if (not self.config.prefetch or self.draining or len(self.outcomes) >= COALESCE_PER_WORKER * workers
                or len(self.held) < workers):
            return since
        return min([since + COALESCE_MAX, *due])

    def _send_outcomes(self, force: bool = False) -> None:
        flush_at = self._flush_at()
        if flush_at is None or (not force and flush_at > self.clock()):
            return
        outcomes, self.outcomes, self.outcomes_since = self.outcomes, [], None
        claim = self._claim_limit(standalone=False)  # the freed slots' next steps ride along (one statement)
        self.claiming += claim
        self.batches_out += 1
        self.writer.post_batch(tuple(o for o, _ in outcomes), claim, self._start_now(claim))

    # -- the registry snapshot -----------------------------------------------------------------------

    def _publish_snapshot(self, now: float) -> None:
        """What ``cyclone-mp workers`` shows, as plain data for maintenance to write."""
        kids = []
        for child in self.pool.children:
            att = child.attempt or next(iter(child.concurrent.values()), None)
            info: dict[str, Any] = {"pid": child.pid, "steps_run": child.steps_run, "ready": child.ready}
            if child.concurrent:
                info["side_by_side"] = len(child.concurrent)  # async attempts it runs at once
            if child.proc is not None:
                try:
                    info["cpu_percent"] = child.proc.cpu_percent(None)
                    info["rss"] = child.proc.memory_info().rss
                except psutil.Error:
                    pass
            if att is not None:
                info.update({"run_id": att.run_id, "node": att.node, "step": att.step_name,
                             "attempt": att.attempt, "elapsed": round(now - att.started, 3)})
                if att.limits:
                    info["limits"] = att.limits.as_json()
            kids.append(info)
        self.snapshot = {
            "workers": self.config.workers, "queues": list(self.config.queues), "names": list(self.mux.step_names),
            "draining": self.draining, "children": kids, "prefetched": len(self.held),
            "prefetch": self.holding.prefetch_share(), "limits": self.confinement.mechanism.as_dict(),
        }

    # -- teardown -------------------------------------------------------------------------------------

    def close(self) -> None:
        """Stop every child and release this loop's descriptors."""
        self._send_outcomes(force=True)
        self.pool.teardown()
        try:
            self.selector.close()
        except Exception:  # noqa: BLE001
            pass
        self.inbox.close()
