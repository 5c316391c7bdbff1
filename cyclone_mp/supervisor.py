"""The supervisor (parent process): holds every lease, owns every child (SPEC sections 1, 4, 5).

One thread runs one loop. Each turn it reads what children sent, renews the leases
that are due (one renewal per step, addressed by id, with the seed's WHERE clause),
cancels attempts whose worker-clock deadline passed or whose renewal matched nothing,
SIGKILLs the process tree of a child still running ``kill_grace`` seconds after its
cancel, applies outcomes with the CAS guard, claims as many steps as it has idle
children, and ticks the recovery sweep. The database decides every durable
transition; the local clock only schedules work.

Which file owns what: "a step's lease was lost" is decided here (:meth:`Supervisor._renew`);
the SQL of it lives in ``sql/queries.sql``; what a failure does to the row is
:mod:`cyclone_mp.decisions`; killing a process tree is :mod:`cyclone_mp.procs`.
"""

from __future__ import annotations

import collections
import contextlib
import dataclasses
import itertools
import logging
import os
import random
import selectors
import socket
import threading
import time
import uuid
from typing import Any, Callable

import psutil

from . import decisions, procs, protocol, schedules
from .batch import BatchWriter
from .backoff import compute_backoff, delay_after
from .config import (
    COALESCE_MAX, COALESCE_PER_WORKER, PIPELINE_DEPTH, PIPELINE_MAX_STEP, PIPELINE_ONE_MAX_STEP, PREFETCH_MAX_WAIT,
    PRELOAD_TIMEOUT, SWEEP_LIMIT, Config,
)
from .errors import ConfigurationError, DatabaseError, DatabaseUnavailable
from .pool import ChildProc
from .protocol import storable
from .steps import Mux
from .store import FORENSIC_KEYS, NOTIFY_CHANNEL, FailedAttempt, Settled, Store, connect, stale_plan

RELEASED = "released"  # the cancel reason that takes back a step queued in a child (pipelining)
log = logging.getLogger("cyclone_mp.supervisor")

RECONNECT_BACKOFF = (0.1, 2.0)  # seconds, doubling
RESPAWN_BACKOFF = (0.05, 5.0)  # seconds between starts of children that die before they are ready
STRAY_CHECK_INTERVAL = 0.25  # seconds between looks for handler processes reparented to us
IO_SWEEP_INTERVAL = 1.0  # seconds between reads of every child socket, readiness or not (a safety net)


@dataclasses.dataclass
class Attempt:
    """The parent's view of one running attempt."""

    step_id: int
    run_id: str
    node: str
    step_name: str
    attempt: int
    generation: int
    timeout: float | None
    token: str
    child: ChildProc
    workflow: bool  # the run has several nodes (its completion advances the run)
    started: float  # local monotonic
    deadline: float | None  # local monotonic worker-clock deadline
    next_beat: float
    lease_ok_until: float  # local estimate of lease_expiry: last good renewal + ttl
    progress: Any = None
    progress_dirty: bool = False
    cancel_reason: str | None = None
    kill_at: float | None = None
    killed_by: str | None = None
    settled: bool = False  # the outcome was handed to the writer
    cpu_start: float = 0.0  # the child's CPU seconds when the attempt began (children are reused)
    forensics: dict[str, Any] = dataclasses.field(default_factory=dict)  # how the attempt ended
    peak_rss_kb: int | None = None  # sampled with each heartbeat (a crashed child cannot be read)
    backoff_spec: Any = None  # the row's stored backoff (seconds or a list), if any
    start_by: float | None = None  # queued in a child (pipelining): released if not started by then (time.monotonic(), the child's clock too)


@dataclasses.dataclass
class Prefetched:
    """A claimed step no child has taken yet (``Config.prefetch``)."""

    row: dict[str, Any]
    claimed: float  # local monotonic time of the claim: its lease and timeout count from it
    release_at: float  # released (available at once, no attempt used) if still here then


@dataclasses.dataclass
class PendingWrite:
    """An outcome that could not be written yet (database down, or DB deadline not reached)."""

    kind: str  # "complete" | "fail" | "release"
    attempt: Attempt
    payload: dict[str, Any]
    retry_at: float


class Supervisor:
    """The multiprocess supervisor; see the module docstring.

    Args:
        dsn: PostgreSQL connection string.
        mux: the steps this supervisor may claim (by name).
        config: a :class:`~cyclone_mp.config.Config`.
        clock: local monotonic clock in seconds (injectable; only schedules work).
        wall_clock: local wall clock in epoch seconds, for ``ctx.deadline`` only.

    Raises:
        ConfigurationError: a registered handler cannot be imported by a child, or this
            process is itself a handler's child (a module-level ``client.start()``).
    """

    def __init__(
        self,
        dsn: str,
        mux: Mux,
        config: Config,
        *,
        clock: Callable[[], float] = time.monotonic,
        wall_clock: Callable[[], float] = time.time,
    ) -> None:
        if os.environ.get(procs.MARKER_ENV):
            # We are a handler's child (or its descendant): a supervisor here would spawn
            # children that import the same module and start supervisors again, without end.
            raise ConfigurationError(
                "a supervisor cannot start inside a handler's child process: this usually means a "
                "script starts its Client at module level; put that code under "
                "`if __name__ == \"__main__\":` (children import the module to find its steps)"
            )
        for step in mux.steps.values():
            if not step.ref.importable():
                raise ConfigurationError(
                    f"step {step.name!r}: handler {step.ref.qualname} is not importable by module path "
                    f"(define it at module level in {step.ref.module}); children import handlers by name"
                )
        self.dsn = dsn
        self.mux = mux
        # every child imports the handlers' modules before it is ready (issue 8)
        self._preload = sorted({(s.ref.module, s.ref.path) for s in mux.steps.values()}, key=str)
        self.config = config
        self.clock = clock
        self.wall_clock = wall_clock
        self.id = f"{socket.gethostname()}:{os.getpid()}:{uuid.uuid4().hex[:8]}"
        self.children: list[ChildProc] = []
        self.attempts: dict[int, Attempt] = {}
        self.pending: list[PendingWrite] = []
        self.completions: list[tuple[Attempt, Any, Any]] = []
        self.failures: list[tuple[Attempt, str, dict[str, Any], bool]] = []  # this tick's
        self._outcomes_since: float | None = None  # when the oldest of them came in
        self.store: Store | None = None
        self.listen_conn: Any = None
        self._listen_fd: int | None = None
        self.selector = selectors.DefaultSelector()
        self._wake_r, self._wake_w = os.pipe()
        os.set_blocking(self._wake_r, False)
        os.set_blocking(self._wake_w, False)
        self.selector.register(self._wake_r, selectors.EVENT_READ, ("wake", None))
        self.batch = BatchWriter(dsn, self._wake, config.idle_in_transaction_limit)  # a tick's outcomes + next claim, off the loop
        self._io_ready: set[ChildProc] = set()  # children whose sockets the last wait reported
        self._next_io_sweep = clock()
        self.draining = False
        self.drain_deadline: float | None = None
        self.hard_stop = False
        self._shutdown_req = threading.Event()
        self._stop_req = threading.Event()
        self.running = threading.Event()
        self.stopped = threading.Event()
        self.db_ok = False
        start = clock()  # every local timer is relative to the injected clock, whatever its origin
        self.reconnect_at = start
        self.reconnect_delay = RECONNECT_BACKOFF[0]
        self.next_poll = start
        self.poll_delay = config.poll_interval[0]
        self.next_sweep = start
        self.next_registry = start
        self.stats = {"claimed": 0, "completed": 0, "failed": 0, "killed": 0, "grandchildren_killed": 0,
                      "released": 0, "lease_lost": 0, "reclaimed": 0, "swept_timeouts": 0,
                      "reclaim_limits": 0, "children_spawned": 0, "late_completions_dropped": 0,
                      "cancelled_attempts": 0, "prefetch_released": 0, "batches": 0, "pipelined": 0}
        self.descended: set[int] = set()
        self.prefetched: collections.deque[Prefetched] = collections.deque()
        self.step_seconds: float | None = None  # moving average of attempt durations
        self.ready_seconds: float | None = None  # moving average of a new child's spawn to ready
        self._prefetch_hold = False  # a prefetched step waited too long: none until the next result
        self._claim_hold = PREFETCH_MAX_WAIT  # the shortest hold bound among the last claim's rows
        self._next_stray_check = start
        self._foreign: set[int] = set()  # children of this process that are no handler's
        self._tokens = itertools.count(1)
        self.respawn_at = start
        self.respawn_delay = RESPAWN_BACKOFF[0]

    # -- control from other threads / signal handlers -----------------------------------

    def request_shutdown(self) -> None:
        """Soft stop: claim nothing more; in-flight handlers get ``shutdown_grace`` (SPEC 5)."""
        self._shutdown_req.set()
        self._wake()

    def request_stop(self) -> None:
        """Hard stop: cancel every in-flight handler now, kill after ``kill_grace``."""
        self._shutdown_req.set()
        self._stop_req.set()
        self._wake()

    def _wake(self) -> None:
        try:
            os.write(self._wake_w, b"x")
        except (BlockingIOError, OSError):
            pass

    # -- the loop ---------------------------------------------------------------------------

    def run(self) -> None:
        """Run until shut down. Children are created from this thread (PDEATHSIG is per thread)."""
        self._was_subreaper = procs.set_subreaper(True)
        self._watchdog, self._watchdog_fd = procs.spawn_watchdog(self.id)
        try:
            self._connect()
        except DatabaseError as exc:
            log.warning("database unavailable at start (%s); retrying", exc)
        try:
            self._maintain_pool(self.clock())
            with contextlib.suppress(DatabaseError):  # while the children start, not at the first result
                self.batch.open()
            self.running.set()
            while True:
                try:
                    now = self.clock()
                    self._handle_requests(now)
                    if (self.draining and not self.attempts and not self.completions and not self.failures
                            and not self.prefetched and not self.batch.busy and not self._pending_live()):
                        break
                    self._tick(now)
                    self._wait(self._next_wake(self.clock()))
                except Exception:  # noqa: BLE001 - nothing a step does may end the supervisor
                    log.exception("unexpected error in the supervisor loop; carrying on")
                    time.sleep(0.1)
        finally:
            self._teardown()
            self.stopped.set()

    def _pending_live(self) -> bool:
        """Writes still worth waiting for before exit: completed work is written first
        (SPEC 5), unless the database stays away past the lease (then the lease expires
        and another supervisor reclaims the step) or a hard stop was asked for twice."""
        if not self.pending or self.hard_stop and not self.db_ok:
            return False
        now = self.clock()
        return self.db_ok or any(now < p.attempt.lease_ok_until for p in self.pending)

    def _handle_requests(self, now: float) -> None:
        if self._shutdown_req.is_set() and not self.draining:
            self.draining = True
            self.drain_deadline = now + self.config.shutdown_grace
            log.info("shutdown: draining %d in-flight step(s) for up to %.1fs", len(self.attempts), self.config.shutdown_grace)
        if self._stop_req.is_set() and not self.hard_stop:
            self.hard_stop = True
            self.drain_deadline = now
        if self.draining and self.drain_deadline is not None and now >= self.drain_deadline:
            for att in self.attempts.values():
                self._cancel(att, "shutdown", now)

    def _tick(self, now: float) -> None:
        self._check_children_io()
        self._check_preloads(self.clock())
        self._maintain_pool(self.clock())
        now = self.clock()
        if not self.db_ok and now >= self.reconnect_at:
            try:
                self._connect()
            except DatabaseError as exc:
                log.info("reconnect failed (next try in %.1fs): %s", self.reconnect_delay, exc)
                self._db_down(exc)
        if now >= self._next_stray_check:
            self._next_stray_check = now + STRAY_CHECK_INTERVAL
            self._reap_orphans()
        self._renew_due(now)
        self._expire_prefetched(self.clock())
        self._release_queued(self.clock())
        self._enforce_deadlines(self.clock())
        self._collect_batch()
        self._flush_outcomes()
        self._retry_pending(self.clock())
        now = self.clock()
        if self.db_ok and not self.draining and now >= self.next_poll and not self.batch.busy:
            self._claim(now)  # (a batch in flight claims too; its rows decide the next poll)
        if self.db_ok and now >= self.next_sweep:
            self.sweep_once()
            lo, hi = self.config.poll_interval
            self.next_sweep = now + random.uniform(lo, hi)
        if now >= self.next_registry:
            self._registry(now)

    def _next_wake(self, now: float) -> float:
        times = [now + 1.0]
        for att in self.attempts.values():
            times.append(att.next_beat)
            if att.kill_at is not None:
                times.append(att.kill_at)
            elif att.deadline is not None:
                times.append(att.deadline)
            times.append(att.lease_ok_until)
        if self.pending:
            times.append(min(p.retry_at for p in self.pending))
        if self.db_ok and not self.draining and not self.batch.busy and (self._idle_children() or self.prefetch_room()):
            times.append(self.next_poll)
        if self.prefetched:
            times.append(min(p.release_at for p in self.prefetched))
        mono = time.monotonic()
        for child in self.children:
            times.extend(now + a.start_by - mono for a in child.queued if a.start_by is not None)
        times.append(self.next_sweep)
        if not self.db_ok:
            times.append(self.reconnect_at)
        if self.draining and self.drain_deadline is not None:
            times.append(self.drain_deadline)
        flush_at = self._flush_at()
        if flush_at is not None:
            times.append(flush_at)
        if self.batch.done:
            times.append(now)
        return max(0.0, min(times) - now)

    def _wait(self, timeout: float) -> None:
        for key, _ in self.selector.select(timeout):
            kind, obj = key.data
            if kind == "wake":
                try:
                    while os.read(self._wake_r, 4096):
                        pass
                except (BlockingIOError, OSError):
                    pass
            elif kind == "listen":
                self._drain_notifies()
            else:  # a child's socket: read (or written) in _check_children_io on this tick
                self._io_ready.add(obj)

    # -- children ---------------------------------------------------------------------------

    def _spawn(self) -> ChildProc | None:
        try:
            child = ChildProc(self.id, self.config.max_payload, self._preload)
        except OSError as exc:
            log.error("cannot start a child process: %s", exc)
            return None
        self.children.append(child)
        self.stats["children_spawned"] += 1
        self.selector.register(child.sock, selectors.EVENT_READ, ("child", child))
        child.events = selectors.EVENT_READ
        return child

    def _idle_children(self) -> list[ChildProc]:
        return [c for c in self.children if c.ready and c.attempt is None and c.returncode is None and not c.recycle_due]

    def _check_children_io(self) -> None:
        """Read the children whose sockets the last wait reported (and, every
        ``IO_SWEEP_INTERVAL`` seconds, all of them), and write what is queued."""
        now = self.clock()
        if now >= self._next_io_sweep:
            self._next_io_sweep = now + IO_SWEEP_INTERVAL
            ready = list(self.children)
        else:
            ready = [c for c in self.children if c in self._io_ready or c.outbox]
        self._io_ready.clear()
        for child in ready:
            if child in self.children:
                self._child_io(child)

    def _child_io(self, child: ChildProc) -> None:
        """Write what is queued for ``child``, then read and handle all it has sent."""
        child.flush()
        try:
            messages, eof = child.receive()
        except protocol.ProtocolError as exc:
            log.error("child %d sent a bad message (%s); killing it", child.pid, exc)
            if child.attempt is not None:
                child.attempt.killed_by = "protocol_error"  # the attempt fails as an error
            messages, eof = [], True
            self._kill_child(child, "protocol_error")
        for message in messages:
            self._on_message(child, message)
        if eof:
            self._on_child_exit(child)
        self._update_write_interest(child)

    def _update_write_interest(self, child: ChildProc) -> None:
        if child.returncode is not None:
            return
        events = selectors.EVENT_READ | (selectors.EVENT_WRITE if child.outbox else 0)
        if events == child.events:
            return
        child.events = events
        try:
            self.selector.modify(child.sock, events, ("child", child))
        except (KeyError, ValueError, OSError):
            pass

    def _on_message(self, child: ChildProc, message: dict[str, Any]) -> None:
        kind = message.get("t")
        if kind == "preloading":
            child.preloading, child.preloading_since = (message.get("module"), message.get("path")), self.clock()
            return
        if kind == "ready":
            child.preloading = None
            child.ready = True
            child.ready_after = self.clock() - child.spawned
            prev = self.ready_seconds
            self.ready_seconds = child.ready_after if prev is None else 0.8 * prev + 0.2 * child.ready_after
            child.cpu_total = child.cpu_at_ready = float(message.get("cpu_total") or 0.0)
            self._take_prefetched()
            return
        att = child.attempt
        if att is None or message.get("task") != att.token:
            if kind == "result" and message.get("dropped"):  # a step queued behind ``att``, taken back
                for queued in child.queued:
                    if queued.token == message.get("task"):
                        child.queued.remove(queued)
                        self._settle_dropped(queued, message)
                        break
            return
        if kind == "progress":
            att.progress = {k: message.get(k) for k in ("done", "total", "message")}
            att.progress_dirty = True
        elif kind == "result":
            self._on_result(att, message)

    def _on_result(self, att: Attempt, result: dict[str, Any]) -> None:
        child = att.child
        child.attempt = None
        dropped = bool(result.get("dropped"))  # a queued step the child never started
        child.steps_run += not dropped
        child.cpu_total = float(result.get("cpu_total") or child.cpu_total)
        self.attempts.pop(att.step_id, None)
        att.settled = True
        if not dropped:
            self._note_duration(self.clock() - att.started)
        self._prefetch_hold = False
        if child.queued:  # the child starts its queued step now, in the order it was sent
            nxt = child.attempt = child.queued.popleft()
            nxt.started, nxt.start_by = self.clock(), None
            if nxt.cancel_reason == RELEASED:  # too late to take back: it runs (if the child dropped it, its result says so)
                nxt.cancel_reason = None
            elif nxt.cancel_reason is not None:  # a cancel the child may have seen too late to drop it
                nxt.kill_at = nxt.started + self.config.kill_grace
        try:
            self._settle_result(att, result)
        finally:
            self._take_prefetched()  # the freed child starts its next step now, not after a round trip

    def _settle_result(self, att: Attempt, result: dict[str, Any]) -> None:
        child = att.child
        if result.get("dropped"):
            self._settle_dropped(att, result)
            self._maybe_recycle(child)  # due for recycling, it takes nothing more (its next step was this one)
            return
        if result.get("progress"):
            att.progress = {k: result["progress"].get(k) for k in ("done", "total", "message")}
        if result.get("children", True) and child.returncode is None:  # it left processes behind (if dead: swept with it)
            self._count_grandchildren(child, child.kill_descendants())
            child.queue({"t": "go"})  # swept: the child may start its next step
            child.flush()
            self._update_write_interest(child)
        self._maybe_recycle(child)
        entry = {
            "pid": child.pid, "cpu_seconds": result.get("cpu"), "peak_rss_kb": result.get("maxrss_kb"),
            "elapsed": round(self.clock() - att.started, 3),
        }
        att.forensics = entry
        reason = att.cancel_reason
        if result.get("ok"):
            if reason in ("cancelled", "lease_lost"):
                self.stats["late_completions_dropped"] += 1
                return
            self.completions.append((att, result.get("output"), att.progress))
            self._outcome_added()
            return
        entry.update({k: result.get(k) for k in ("type", "message", "traceback")})
        if reason is not None:
            entry["cancel_reason"] = reason
            self._settle_cancelled(att, entry)
            return
        kind = decisions.PERMANENT if result.get("kind") == "permanent" else decisions.ERROR
        self._write_fail(att, kind, entry, require_timed_out=False)

    def _settle_cancelled(self, att: Attempt, entry: dict[str, Any]) -> None:
        """An attempt that ended after a cancel: its reason decides what is written."""
        reason = att.cancel_reason
        if reason == "timeout":
            entry.setdefault("message", "timed out")
            self._write_fail(att, decisions.TIMEOUT, entry, require_timed_out=True)
        elif reason == "shutdown":
            self._write("release", att, {})
        elif reason in ("cancelled", "lease_lost"):  # an operator's cancel, or someone else's lease
            self.stats["cancelled_attempts"] += 1  # the row already says what happened: write nothing
        else:  # killed for breaking the pipe protocol: a failed attempt like any error
            self._write_fail(att, decisions.ERROR, entry, require_timed_out=False)

    def _settle_dropped(self, att: Attempt, result: dict[str, Any]) -> None:
        """The child gave back a queued step unstarted: our cancel reason, else its own."""
        att.cancel_reason = att.cancel_reason or result.get("cancel_reason")
        self._settle_unstarted(att)

    def _settle_unstarted(self, att: Attempt) -> None:
        """A step queued in a child that never started it (the child died, or dropped it
        after a cancel): nothing ran. It is released (available at once, no attempt or
        reclaim counted) unless a cancel already decided it (a timeout is written as
        one; an operator's cancel or a lost lease needs nothing)."""
        att.settled = True
        self.attempts.pop(att.step_id, None)
        if att.cancel_reason in (None, "shutdown", RELEASED):
            self._write("release", att, {"prefetch": att.cancel_reason == RELEASED})
        else:
            self._settle_cancelled(att, {"pid": att.child.pid, "message": "cancelled before it started",
                                         "cancel_reason": att.cancel_reason})

    def _on_child_exit(self, child: ChildProc) -> None:
        with_suppress_unregister(self.selector, child.sock)
        unread, child.unread = child.unread, []
        for message in unread:  # sent before it died: e.g. the result of the attempt we killed it for
            self._on_message(child, message)
        att = child.attempt  # then maybe the queued step it had started since
        hit: list[int] = []
        if child.returncode is None and (att is None or not att.killed_by):
            # It ended on its own (or closed its socket): its group and descendants go with
            # it. Done before reaping it, while its pid cannot be reused by a stranger.
            child.note_descendants()
            hit = procs.kill_tree(child.pid, child.pid, list(child.descendants_seen.values()))
        code = child.wait(timeout=5.0)
        if code is None:  # still alive after SIGKILL (uninterruptible sleep): kill and wait again
            self._kill_child(child, "protocol_error")
            code = child.returncode
        if child in self.children:
            self.children.remove(child)
        child.attempt = None
        if hit:
            procs.reap([p for p in hit if p != child.pid], timeout=1.0)
            self._count_grandchildren(child, hit)
        self._reap_strays(child)
        if att is not None and not att.settled:
            att.settled = True
            self.attempts.pop(att.step_id, None)
            self._note_duration(self.clock() - att.started)
            entry = {"pid": child.pid, **procs.exit_description(code), **child.usage(since=att.cpu_start),
                     "elapsed": round(self.clock() - att.started, 3)}
            if child.peak_rss_kb is None and att.peak_rss_kb is not None:
                entry["peak_rss_kb"] = att.peak_rss_kb  # wait4's maxrss would include the pre-exec parent
            if att.killed_by:
                entry["killed_by_supervisor"] = True
                entry["trigger"] = att.killed_by
                entry.setdefault("message", f"child killed by the supervisor after {att.killed_by}")
                self._settle_cancelled(att, entry)
            elif child.killed and att.cancel_reason is None:  # started as the attempt in front, being killed, ended
                entry.update(killed_by_supervisor=True, trigger="previous_attempt", message=(
                    "child killed by the supervisor to end the attempt before this one, "
                    "which ended as this one started"))
                self._write_fail(att, decisions.CHILD_EXITED, entry, require_timed_out=False)
            else:
                entry["killed_by_supervisor"] = False
                desc = procs.exit_description(code)
                what = f"signal {desc.get('signal_name', desc.get('signal'))}" if "signal" in desc else f"exit code {code}"
                entry["message"] = f"child process exited unexpectedly ({what})"
                if att.cancel_reason is not None:
                    entry["cancel_reason"] = att.cancel_reason
                    self._settle_cancelled(att, entry)
                else:
                    self._write_fail(att, decisions.CHILD_EXITED, entry, require_timed_out=False)
        queued, child.queued = list(child.queued), collections.deque()
        for unstarted in queued:
            self._settle_unstarted(unstarted)
        if not child.ready and child.preloading in self._preload:
            # Importing that module killed or wedged the child: later children leave it to
            # its steps' first attempt (where it fails them, not every child), as before.
            self._preload.remove(child.preloading)
            log.error("a child %s while importing %s (code %s); its steps import it at their first attempt",
                      "hung" if child.killed else "died", child.preloading[0], code)
            self.respawn_delay = RESPAWN_BACKOFF[0]
        elif not child.ready and not child.killed:
            self.respawn_delay = min(RESPAWN_BACKOFF[1], self.respawn_delay * 2)
            self.respawn_at = self.clock() + self.respawn_delay
            log.error("a child exited before it was ready (code %s); next start in %.1fs", code, self.respawn_delay)
        else:
            self.respawn_delay = RESPAWN_BACKOFF[0]
        self._maintain_pool(self.clock())

    def _check_preloads(self, now: float) -> None:
        """Kill a new child stuck importing one handler module for PRELOAD_TIMEOUT (30 s)."""
        for child in list(self.children):
            if not child.ready and child.preloading is not None and now - child.preloading_since > PRELOAD_TIMEOUT:
                self._kill_child(child, "preload_timeout")
                self._on_child_exit(child)

    def _maintain_pool(self, now: float) -> None:
        """Keep ``workers`` children alive (a killed or recycled one is replaced at once)."""
        if self.draining or now < self.respawn_at:
            return
        while len(self.children) < self.config.workers:
            if self._spawn() is None:
                self.respawn_at = now + self.respawn_delay
                return

    def _reap_strays(self, child: ChildProc) -> None:
        if len(self.descended) > 10_000:
            self.descended = {pid for pid in self.descended if psutil.pid_exists(pid)}
        self.descended.update(child.descendants_seen)
        known = {c.pid for c in self.children} | {self._watchdog.pid}
        n = procs.reap_strays(self.id, known, self.descended)
        if n:
            self.stats["grandchildren_killed"] += n

    def _reap_orphans(self) -> None:
        """Kill handler processes that were reparented to us (we are a subreaper) while
        their child lives on: a daemonised leftover (``sh -c 'cmd &'``) whose parent
        exited during the handler. The child's own leftover check cannot see those."""
        pids = protocol.child_pids()
        known = {c.pid for c in self.children} | {self._watchdog.pid}
        if pids is not None and not pids - known - self._foreign:
            return
        n = procs.reap_strays(self.id, known, self.descended)
        if n:
            self.stats["grandchildren_killed"] += n
            log.info("killed %d handler process(es) reparented to the supervisor", n)
        left = protocol.child_pids()
        self._foreign = (left or set()) - known  # not ours (the embedding program's): not looked at again

    def _count_grandchildren(self, child: ChildProc, hit: list[int]) -> None:
        others = [p for p in hit if p != child.pid]
        self.stats["grandchildren_killed"] += len(others)

    def _kill_child(self, child: ChildProc, trigger: str) -> None:
        child.note_descendants()
        with_suppress_unregister(self.selector, child.sock)
        hit = child.kill()
        self.stats["killed"] += 1
        self._count_grandchildren(child, hit)
        log.warning("killed child %d (%s) and %d descendant(s)", child.pid, trigger, len([p for p in hit if p != child.pid]))

    def _maybe_recycle(self, child: ChildProc) -> None:
        cfg = self.config
        if child.returncode is not None:
            return  # dead already (a result read after its kill): its exit is being handled
        if not child.recycle_due:
            too_many = cfg.max_steps_per_child is not None and child.steps_run >= cfg.max_steps_per_child
            rss = child.rss() if cfg.max_child_rss is not None else None
            too_big = rss is not None and cfg.max_child_rss is not None and rss > cfg.max_child_rss
            child.recycle_due = too_many or too_big  # then nothing more is queued in it
        if not child.recycle_due:
            return
        if child.attempt is not None:  # it finishes the step it runs; the ones queued are taken back
            for att in child.queued:
                self._cancel(att, RELEASED, self.clock())
            return
        with_suppress_unregister(self.selector, child.sock)
        child.retire()
        if child.wait(timeout=2.0) is None:
            child.kill()
        self.children.remove(child)
        self._maintain_pool(self.clock())

    # -- claiming ---------------------------------------------------------------------------

    def prefetch_room(self) -> int:
        """How many steps to claim beyond the idle children now (``Config.prefetch``).

        Zero unless ``prefetch`` is set, and zero until attempt durations are known. The
        expected wait of a prefetched step, ``len(prefetched) / workers`` attempts, is
        kept under half the time a held step may wait (:meth:`_hold_bound`: 0.5 s,
        ``lease_ttl / 4``, and ``timeout / 10`` of the last claim's rows). An attempt
        counts with its share of a new child's start-up when ``max_steps_per_child``
        recycles children (a slot is free again only once the new one is ready): long steps,
        or steps with short timeouts, get little or no prefetch, so nothing claimed sits
        waiting behind them until it is released. A prefetched step released
        for waiting too long stops prefetching until the next attempt ends (no claim and
        release churn behind a long step). The buffer is refilled once it is half empty,
        so refills ride on few statements.
        """
        want = self.config.prefetch
        if not want or self.draining or self.step_seconds is None or self._prefetch_hold:
            return 0
        wait = min(self._prefetch_wait(), self._claim_hold) / 2
        cycle = max(self.step_seconds, 1e-4)
        if self.config.max_steps_per_child is not None and self.ready_seconds is not None:
            cycle += self.ready_seconds / self.config.max_steps_per_child  # a recycled slot's restart, shared
        cap = min(want, int(self.config.workers * wait / cycle))
        if len(self.prefetched) > cap // 2:
            return 0
        return cap - len(self.prefetched)

    def _prefetch_wait(self) -> float:
        """Seconds a prefetched step may wait for a child: min(0.5 s, lease_ttl / 4)."""
        return min(PREFETCH_MAX_WAIT, self.config.lease_ttl / 4)

    def _hold_bound(self, timeout: float | None) -> float:
        """Seconds a claimed step may wait for its start (held, or queued in a child)
        before it is released: min(0.5 s, lease_ttl / 4, timeout / 10)."""
        wait = self._prefetch_wait()
        return wait if timeout is None else min(wait, timeout / 10)

    def _release_queued(self, now: float) -> None:
        """Take back steps queued in children that waited too long behind a longer
        attempt, as a held step would be: released, no attempt used.

        A child never starts a queued task after its ``start_by`` (the same monotonic
        clock in both processes), and it sends the result of the attempt in front before
        it looks. So once ``start_by`` has passed, a step still queued after this reads
        the child's socket never runs there: it is released here, without waiting for
        the child to say so. That holds while the handler in front holds the GIL (the
        child's cancel watcher cannot run then), so the step goes to a free child, never
        times out unstarted. When draining, queued steps are cancelled over the pipe at
        once; one the child already started runs."""
        mono = time.monotonic()

        def past_start_by(att: Attempt) -> bool:
            return att.start_by is not None and mono >= att.start_by

        for child in list(self.children):
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

    def _note_duration(self, seconds: float) -> None:
        prev = self.step_seconds
        self.step_seconds = seconds if prev is None else 0.9 * prev + 0.1 * seconds

    def _claim(self, now: float) -> None:
        idle = self._idle_children()
        room = self.prefetch_room()
        if not (idle or room) or self.store is None:
            self.next_poll = now + self.poll_delay
            return
        if self.config.prefetch:
            self._claim_in_batch(now, len(idle) + room)
            return
        sent = self.clock()
        try:
            rows = self.store.claim(limit=len(idle) + room, **self._claim_args())
        except DatabaseError as exc:
            if self._db_down(exc):
                return
            rows = []  # rejected (not an outage): back off as after an empty claim, not retry each tick
        self._dispatch(rows, len(idle) + room, sent)

    def _claim_in_batch(self, now: float, limit: int) -> None:
        """With prefetch, a claim goes to the batch writer like a tick's outcomes, and
        this loop keeps serving the children meanwhile: run here, it blocked the loop
        about 10 ms per claim while 20 ms steps ended (B2, 23 claims per 400 steps), and
        a child whose queued step had started ran dry. The rows are handed out when the
        statement is back (:meth:`_collect_batch`)."""
        args = self._claim_args()

        def statement(store: Store) -> Settled:
            return Settled(set(), set(), store.claim(limit=limit, **args))

        self.next_poll = now + self.poll_delay  # set again when the rows are back
        try:
            self.batch.submit(([], [], limit, self.clock()), statement)
        except DatabaseError as exc:
            if not self._db_down(exc):
                self._dispatch([], limit)

    def _claim_args(self) -> dict[str, Any]:
        """What every claim of this supervisor passes: its lease owner, queues, step names, ttl."""
        return {"owner": self.id, "queues": self.config.queues, "names": self.mux.step_names,
                "ttl": self.config.lease_ttl}

    def _dispatch(self, rows: list[dict[str, Any]], limit: int, sent: float | None = None) -> None:
        """Hand claimed rows to idle children (the rest wait in ``prefetched``) and
        schedule the next poll. ``sent``: when the claim was sent (local monotonic). The
        rows' leases and timeouts count from then, never from their arrival: the
        database's ``now()`` is no earlier, so the local lease and deadline are never
        later than the database's, even when the process was frozen while the claim was
        in flight (a supervisor resumed after a SIGSTOP had started steps it no longer
        held)."""
        now = self.clock()
        at = now if sent is None else min(sent, now)
        for row in rows:
            self.prefetched.append(Prefetched(row, at, at + self._hold_bound(row["timeout"])))
        if rows:
            self._claim_hold = min(self._hold_bound(row["timeout"]) for row in rows)
        self._take_prefetched()
        self.stats["claimed"] += len(rows)
        lo, hi = self.config.poll_interval
        if rows and len(rows) == limit:
            self.poll_delay = lo
            self.next_poll = now  # maybe more to take once a slot frees
        elif rows:
            self.poll_delay = lo
            self.next_poll = now + lo
        else:
            self.poll_delay = min(hi, max(lo, self.poll_delay * 2))
            self.next_poll = now + self.poll_delay

    def _take_prefetched(self) -> None:
        """Start claimed steps on idle children, oldest claim first (none during an
        outage: held steps are released once the database is back)."""
        if not self.prefetched or self.draining or not self.db_ok:
            return
        now = self.clock()
        if now >= self.prefetched[0].release_at:  # held too long (the process was frozen?): release, never start
            self._expire_prefetched(now)
            if not self.db_ok:  # the release met an outage: nothing starts until the database is back
                return
        for child in self._idle_children():
            if not self.prefetched:
                break
            item = self.prefetched.popleft()
            self._start(item.row, child, item.claimed)
        self._send_queued()  # an idle child starts now, before the others' queues are filled
        try:
            self._pipeline()
        finally:
            self._send_queued()  # each child's new tasks in one write

    def _send_queued(self) -> None:
        for child in self.children:
            if child.outbox:
                child.flush()
                self._update_write_interest(child)

    def _pipeline(self) -> None:
        """Pipelining: while attempts are short, a busy child also gets the next held
        steps, so it starts each the moment the one before ends instead of waiting for
        this loop. Attempts under PIPELINE_MAX_STEP (10 ms) queue up to PIPELINE_DEPTH
        (on 2 cores that wait and its context switches were a third of B1's CPU); under
        PIPELINE_ONE_MAX_STEP (0.1 s) one, which hides the loop's turn between two steps
        (with 20 ms steps a core was idle about 1 % of the time); longer ones none (a
        queued step could not move to a child that frees up first), and nothing is queued
        behind an attempt that has run that long. A queued step that has not started
        within the time a held step may wait is released (:meth:`_release_queued`)."""
        if self.step_seconds is None or self.step_seconds >= PIPELINE_ONE_MAX_STEP:
            return
        depth = PIPELINE_DEPTH if self.step_seconds < PIPELINE_MAX_STEP else 1
        # A child's queue is topped up once it is half empty (its new tasks then go in one
        # write, read by one recv), one step per child in turn, so the queues stay even.
        cap = self.config.max_steps_per_child
        # Nothing is queued behind an attempt already running for PIPELINE_ONE_MAX_STEP:
        # an outlier (a long handler among short ones) would only hold it until released.
        young = self.clock() - PIPELINE_ONE_MAX_STEP
        low = [c for c in self.children
               if c.attempt is not None and len(c.queued) <= depth // 2 and c.attempt.started > young]
        took = True
        while took:
            took = False
            for child in low:
                if not self.prefetched:
                    return
                if (child.attempt is not None and len(child.queued) < depth and child.returncode is None
                        and child.attempt.cancel_reason is None and not child.recycle_due
                        and (cap is None or child.steps_run + 2 + len(child.queued) <= cap)):
                    item = self.prefetched.popleft()
                    self._start(item.row, child, item.claimed)
                    self.stats["pipelined"] += 1
                    took = True

    def _expire_prefetched(self, now: float) -> None:
        """Release prefetched steps nobody took in time, and all of them when draining
        (available at once, no attempt or reclaim counted, as a shutdown release)."""
        if not self.prefetched:
            return
        if not self.db_ok or self.store is None:
            # Keep them to release once the database is back, while the lease is still
            # ours; give up on those whose lease ran out (the sweep reclaims them) or on
            # all of them when a hard stop finds no database.
            ttl = self.config.lease_ttl
            self.prefetched = collections.deque(
                p for p in self.prefetched if now < p.claimed + ttl and not self.hard_stop)
            return
        if self.draining:
            due, self.prefetched = list(self.prefetched), collections.deque()
        else:
            due = [p for p in self.prefetched if now >= p.release_at]
            if not due:
                return
            self._prefetch_hold = True
            self.prefetched = collections.deque(p for p in self.prefetched if now < p.release_at)
        for item in due:
            row = item.row
            try:
                if self.store.release(owner=self.id, id=row["id"], generation=row["lease_generation"]):
                    self.stats["prefetch_released"] += 1
            except DatabaseError as exc:
                self._db_down(exc)

    def _start(self, row: dict[str, Any], child: ChildProc, claimed: float) -> None:
        """Start one claimed step on ``child``. Its lease and its timeout count from the
        claim (``claimed``, local monotonic), as they do in the database (SPEC 4)."""
        now = self.clock()
        step = self.mux.steps.get(row["step_name"])
        interval = self.config.heartbeat_interval
        timeout = row["timeout"]
        token = f"{child.pid}.{next(self._tokens)}"
        att = Attempt(
            step_id=row["id"], run_id=row["run_id"], node=row["node"], step_name=row["step_name"],
            attempt=row["attempt"], generation=row["lease_generation"], timeout=timeout, token=token,
            workflow=row["run_kind"] == "workflow",
            child=child, started=now, deadline=(claimed + timeout) if timeout is not None else None,
            next_beat=claimed + random.uniform(0, interval),  # the claim was the first heartbeat
            lease_ok_until=claimed + self.config.lease_ttl, backoff_spec=row.get("backoff"),
        )
        att.cpu_start = child.cpu_total
        self.attempts[att.step_id] = att
        if child.attempt is None:
            child.attempt = att
        else:  # pipelined: it starts when the child's current attempt ends, if by start_by
            att.start_by = time.monotonic() + self._hold_bound(timeout)
            child.queued.append(att)
        assert step is not None
        ref = step.ref
        child.queue({
            "t": "task", "task": token, "run_id": att.run_id, "step": att.step_name, "node": att.node,
            "attempt": att.attempt, "timeout": timeout, "start_by": att.start_by,
            "deadline": (self.wall_clock() + (att.deadline - now)) if att.deadline is not None else None,
            "input": row["input"], "upstream": row["upstream"] or {},
            "ref": {"module": ref.module, "qualname": ref.qualname, "path": ref.path},
        })  # written by the caller (_take_prefetched), with the other tasks of this round

    # -- heartbeats, deadlines, kills --------------------------------------------------------

    def _renew_due(self, now: float) -> None:
        interval = self.config.heartbeat_interval
        for att in list(self.attempts.values()):
            if now < att.next_beat or att.settled:
                continue
            att.next_beat = now + interval * random.uniform(0.9, 1.1)
            att.peak_rss_kb = protocol.peak_rss_kb(att.child.pid) or att.peak_rss_kb
            if att.cancel_reason in ("cancelled", "lease_lost"):
                continue
            if not self.db_ok or self.store is None:
                continue
            self._renew(att)

    def _renew(self, att: Attempt) -> None:
        """Renew one lease; on zero rows learn why and cancel the attempt (seed: Heartbeats)."""
        assert self.store is not None
        progress = att.progress if att.progress_dirty else None
        try:
            renewed = self.store.heartbeat(
                id=att.step_id, owner=self.id, generation=att.generation, ttl=self.config.lease_ttl, progress=progress,
            )
            if renewed:
                att.lease_ok_until = self.clock() + self.config.lease_ttl
                att.progress_dirty = False
                return
            row = self.store.lease_state(att.step_id)
        except DatabaseError as exc:
            self._db_down(exc)
            return
        if row is None:
            reason = "cancelled"
        elif row["state"] == "cancelled":
            reason = "cancelled"
        elif row["state"] == "running" and row["lease_owner"] == self.id and row["lease_generation"] == att.generation:
            reason = "timeout" if row["timed_out"] else "lease_lost"
        elif row["last_error_kind"] == decisions.TIMEOUT and row["last_error_generation"] == att.generation:
            reason = "timeout"  # the sweep settled this attempt's timeout first; our kill adds forensics
        else:
            reason = "lease_lost"
        if reason == "lease_lost":
            self.stats["lease_lost"] += 1
        log.info("renewal of step %d matched nothing (%s); cancelling its attempt", att.step_id, reason)
        self._cancel(att, reason, self.clock())

    def _cancel(self, att: Attempt, reason: str, now: float) -> None:
        if att.cancel_reason is not None:
            return
        att.cancel_reason = reason
        att.killed_by = None
        if att.child.attempt is att:  # a queued one is dropped by the child, nothing to kill
            att.kill_at = now + self.config.kill_grace
        att.child.cancel(att.token, reason)

    def _enforce_deadlines(self, now: float) -> None:
        for att in list(self.attempts.values()):
            if att.settled:
                continue
            if att.cancel_reason is None and att.deadline is not None and now >= att.deadline:
                self._cancel(att, "timeout", now)
            if att.cancel_reason is None and now >= att.lease_ok_until:
                # We could not renew before the lease ran out: someone else may reclaim it.
                self.stats["lease_lost"] += 1
                self._cancel(att, "lease_lost", now)
            if att.kill_at is not None and now >= att.kill_at and not att.settled:
                child = att.child
                self._child_io(child)  # it may have ended just now, and the child started the next
                if att.settled or child.attempt is not att:
                    continue  # ended (a result or its exit): nothing to kill
                att.killed_by = att.cancel_reason
                self._kill_child(child, att.cancel_reason or "kill")
                self._on_child_exit(child)

    # -- writing outcomes ---------------------------------------------------------------------

    def _flush_outcomes(self) -> None:
        """Send this tick's successes and failed attempts as one statement, with the next claim when there is room, to the batch writer (one
        statement in flight; later outcomes wait for it). Issue 8."""
        flush_at = self._flush_at()
        if flush_at is None or flush_at > self.clock():
            return
        done, self.completions = self.completions, []
        failed, self.failures = self.failures, []
        self._outcomes_since = None
        if not self.db_ok or self.store is None:
            self._defer(done, failed)
            return
        completions = [(a.step_id, a.generation, out, prog) for a, out, prog in done]
        failures = [
            FailedAttempt(id=att.step_id, generation=att.generation, kind=kind, entry=self._entry(att, entry),
                          require_timed_out=rto, progress=att.progress,
                          delay=delay_after(att.attempt, att.backoff_spec, self._backoff_for(att.step_name)))
            for att, kind, entry, rto in failed
        ]
        limit = len(self._idle_children()) + self.prefetch_room() if not self.draining else 0
        workflows = any(a.workflow for a, _, _ in done) or any(a.workflow for a, _, _, _ in failed)
        args = self._claim_args()

        def statement(store: Store) -> Settled:
            return store.settle(completions=completions, failures=failures, limit=limit, workflows=workflows, **args)
        self.stats["batches"] += 1
        try:
            # Without prefetch nothing can start before the claim returns: run it here.
            # (the send time goes along: the claimed rows' leases count from it)
            self.batch.submit((done, failed, limit, self.clock()), statement, inline=not self.config.prefetch)
        except DatabaseError as exc:
            self._db_down(exc)
            self._defer(done, failed)
            return
        self._collect_batch()

    def _collect_batch(self) -> None:
        """Apply the outcome of the batch statement once it is back."""
        taken = self.batch.take()
        if taken is None:
            return
        (done, failed, limit, sent), future = taken
        try:
            settled: Settled = future.result()
        except DatabaseError as exc:
            if self._db_down(exc):
                self._defer(done, failed)
            else:  # one bad row must not hold back the others: write them one by one
                for att, output, progress in done:
                    self._write("complete", att, {"output": output, "progress": progress})
                for att, kind, entry, rto in failed:
                    self._write("fail", att, fail_payload(kind, entry, rto))
                if limit:  # the claim was rejected too: back off as after an empty claim
                    self._dispatch([], limit)
            return
        except Exception:  # noqa: BLE001 - never drop an outcome: keep it to write again
            log.exception("the batch statement failed unexpectedly; its outcomes will be written again")
            self._defer(done, failed)
            return
        if limit:
            self._dispatch(settled.claimed, limit, sent)
        self.stats["completed"] += len(settled.completed)
        self.stats["failed"] += len(settled.failed)
        if settled.failed:
            self.next_poll = self.clock()  # a retry without backoff is claimable at once
        for att, _, _ in done:
            if att.step_id not in settled.completed:
                self._late_success(att)
        # The rest (a lost lease, a timeout not yet due on the DB clock, a run neither
        # running nor paused) go the one-by-one way, which knows each case.
        for att, kind, entry, rto in failed:
            if att.step_id not in settled.failed:
                self._write("fail", att, fail_payload(kind, entry, rto))

    def _defer(self, done: list[tuple[Attempt, Any, Any]], failed: list[tuple[Attempt, str, dict[str, Any], bool]]) -> None:
        """Keep a tick's outcomes to write again (one by one) once the database answers."""
        now = self.clock()
        for att, output, progress in done:
            self.pending.append(PendingWrite("complete", att, {"output": output, "progress": progress}, now))
        for att, kind, entry, rto in failed:
            self.pending.append(PendingWrite("fail", att, fail_payload(kind, entry, rto), now))

    def _late_success(self, att: Attempt) -> None:
        """A success whose CAS failed: a timed-out attempt still counts once, as a timeout.

        Without a database the sweep settles a timed-out row later; nothing is lost.
        """
        if self.store is None:
            return
        try:
            row = self.store.lease_state(att.step_id)
        except DatabaseError as exc:
            self._db_down(exc)
            return
        if row and row["state"] == "running" and row["lease_owner"] == self.id and row["lease_generation"] == att.generation and row["timed_out"]:
            self._write_fail(att, decisions.TIMEOUT, {
                **att.forensics, "message": "returned after the database deadline",
            }, require_timed_out=True)
        else:
            self.stats["late_completions_dropped"] += 1

    def _write_fail(self, att: Attempt, kind: str, entry: dict[str, Any], *, require_timed_out: bool) -> None:
        self.failures.append((att, kind, entry, require_timed_out))
        self._outcome_added()

    def _outcome_added(self) -> None:
        if self._outcomes_since is None:
            self._outcomes_since = self.clock()

    def _flush_at(self) -> float | None:
        """When this tick's outcomes go to the database (None: there are none, or a
        statement is in flight). At once, except with prefetch while held steps keep
        every child busy: then they wait up to COALESCE_MAX (0.1 s) for
        COALESCE_PER_WORKER (4) outcomes per child, so steps of about 20 ms share
        statements instead of paying one each (the completion is visible that much
        later; the claim rides along when held steps run low). pgqueuer buffers its
        completions the same way (10 of them or 0.1 s by default). An outcome never waits
        past COALESCE_MAX before its attempt's deadline: written after it, a success
        would count as a timeout."""
        if not (self.completions or self.failures) or self.batch.busy:
            return None
        since = self._outcomes_since if self._outcomes_since is not None else self.clock()
        workers = self.config.workers
        if (not self.config.prefetch or self.draining or not self.db_ok
                or len(self.completions) + len(self.failures) >= COALESCE_PER_WORKER * workers
                or len(self.prefetched) < workers):
            return since
        due = [a.deadline for a, *_ in self.completions + self.failures if a.deadline is not None]
        return min([since + COALESCE_MAX] + [d - COALESCE_MAX for d in due])

    def _entry(self, att: Attempt, entry: dict[str, Any]) -> dict[str, Any]:
        """An attempt's error entry as stored: who wrote it, under which lease."""
        return {"worker": self.id, "lease_generation": att.generation, **entry}

    def _write(self, kind: str, att: Attempt, payload: dict[str, Any]) -> None:
        write = PendingWrite(kind, att, payload, self.clock())
        if not self._apply(write):
            self.pending.append(write)

    def _apply(self, write: PendingWrite) -> bool:
        """Try one write; True when it is done (applied, definitively lost, or replaced).

        A write the database rejects (bad data, not an outage) is never retried as is:
        a rejected success becomes a failed attempt, a rejected failure entry is written
        again with only its plain fields, a rejected release is left to the lease expiry.
        A prepared statement a schema change invalidated is not the data's fault: that
        write is tried again (the connection has dropped its prepared statements).
        """
        if not self.db_ok or self.store is None:
            return False
        att = write.attempt
        try:
            if write.kind == "complete":
                applied = self.store.complete(
                    owner=self.id, items=[(att.step_id, att.generation, write.payload["output"], write.payload["progress"])],
                    workflows=att.workflow,
                )
                if applied:
                    self.stats["completed"] += 1
                else:
                    self._late_success(att)
                return True
            if write.kind == "release":
                if self.store.release(owner=self.id, id=att.step_id, generation=att.generation):
                    self.stats["prefetch_released" if write.payload.get("prefetch") else "released"] += 1
                return True
            entry = self._entry(att, write.payload["entry"])
            result = self.store.fail(
                owner=self.id, id=att.step_id, generation=att.generation, kind=write.payload["kind"], entry=entry,
                backoff=self._backoff_for(att.step_name),
                require_timed_out=write.payload["require_timed_out"],
                progress=None if write.payload.get("plain") else att.progress,
            )
        except DatabaseError as exc:
            if self._db_down(exc):
                return False
            if stale_plan(exc.__cause__):  # a schema change, not the data: the connection re-prepares
                write.retry_at = self.clock() + 0.05
                return False
            return self._rejected(write, exc)
        if result == "not_yet":
            write.retry_at = self.clock() + 0.05
            return False
        if result == "applied":
            self.stats["failed"] += 1
        return True

    def _rejected(self, write: PendingWrite, exc: Exception) -> bool:
        att = write.attempt
        if write.kind == "complete":
            self._write_fail(att, decisions.ERROR, {
                "type": "cyclone_mp.errors.PayloadError",
                "message": storable(f"the database rejected the handler's output: {exc}")[:2000],
            }, require_timed_out=False)
        elif write.kind == "fail" and not write.payload.get("plain"):
            plain = {k: v for k, v in write.payload["entry"].items() if k in FORENSIC_KEYS}
            plain["message"] = storable(f"error entry rejected by the database: {exc}")[:2000]
            self._write("fail", att, {**write.payload, "entry": plain, "plain": True})
        else:
            log.error("giving up on a %s write for step %d: %s", write.kind, att.step_id, exc)
        return True

    def _retry_pending(self, now: float) -> None:
        if not self.pending or not self.db_ok:
            return
        due = [p for p in self.pending if p.retry_at <= now]
        self.pending = [p for p in self.pending if p.retry_at > now]
        for write in due:
            if not self._apply(write):
                if write not in self.pending:
                    write.retry_at = max(write.retry_at, now + 0.05)
                    self.pending.append(write)

    # -- the recovery sweep ---------------------------------------------------------------------

    def sweep_once(self) -> dict[str, int]:
        """One pass of the recovery sweep (STYLE pattern 4): at most 100 candidates.

        Returns counts by action (``timeout``, ``reclaim``, ``reclaim_limit``, ``none``).
        """
        counts = {"timeout": 0, "reclaim": 0, "reclaim_limit": 0, "none": 0, "timers": 0}
        if self.store is None:
            return counts
        try:
            for row in self.store.sweep_candidates(SWEEP_LIMIT):
                action = self.store.expire(row["id"], self._backoff_for, {"swept_by": self.id})
                counts[action] += 1
            counts["timers"] = self.store.fire_due_timers(SWEEP_LIMIT)
            counts["scheduled"] = schedules.run_once(self.store, self.mux, self.config)["enqueued"]  # issue 21
        except DatabaseError as exc:
            self._db_down(exc)
        if counts["reclaim"] or counts["timeout"] or counts["timers"]:
            self.next_poll = self.clock()  # something may be claimable now: do not wait a poll
        self.stats["reclaimed"] += counts["reclaim"]
        self.stats["swept_timeouts"] += counts["timeout"]
        self.stats["reclaim_limits"] += counts["reclaim_limit"]
        return counts

    def _backoff_for(self, step_name: str | None) -> Callable[[int], float]:
        """The callable backoff for a row that stores none: the step's, else the client's,
        else the default (a stored spec on the row wins over all of these)."""
        step = self.mux.steps.get(step_name or "")
        own = step.options.backoff if step else None
        fn = own if callable(own) else self.config.defaults.backoff
        return lambda n: compute_backoff(fn if callable(fn) else None, n)

    # -- database connection ----------------------------------------------------------------------

    def _connect(self) -> None:
        self._close_db()
        self.batch.ensure_idle()
        self.store = Store.open(self.dsn, generic_plans=True, idle_in_transaction=self.config.idle_in_transaction_limit)
        try:
            conn = connect(self.dsn)
            conn.execute(f"LISTEN {NOTIFY_CHANNEL}")
            self.listen_conn = conn
            self._listen_fd = conn.pgconn.socket
            self.selector.register(self._listen_fd, selectors.EVENT_READ, ("listen", None))
        except (DatabaseError, Exception) as exc:  # noqa: BLE001 - polling still works without LISTEN
            log.warning("LISTEN unavailable (%s); polling only", exc)
            self.listen_conn = None
        self.db_ok = True
        self.reconnect_delay = RECONNECT_BACKOFF[0]
        self.next_poll = self.clock()
        log.info("connected; supervisor %s", self.id)

    def _close_db(self) -> None:
        if self._listen_fd is not None:
            try:
                self.selector.unregister(self._listen_fd)
            except (KeyError, ValueError, OSError):
                pass
            self._listen_fd = None
        if self.listen_conn is not None:
            try:
                self.listen_conn.close()
            except Exception:  # noqa: BLE001
                pass
            self.listen_conn = None
        if self.store is not None:
            self.store.close()
            self.store = None
        self.batch.close_connection()

    def _db_down(self, exc: Exception) -> bool:
        """React to a failed query; True when the database is down (we then reconnect).

        A query the database rejected on a healthy connection (bad data) is not an
        outage: it is logged and False is returned so the caller handles that one write.
        """
        if not isinstance(exc, DatabaseUnavailable) and self.store is not None and not self.store.broken:
            log.error("query rejected by the database: %s", exc)
            return False
        if self.db_ok:
            log.warning("database lost (%s); stop claiming, reconnecting", exc)
        self.db_ok = False
        self._close_db()
        self.reconnect_at = self.clock() + self.reconnect_delay
        self.reconnect_delay = min(RECONNECT_BACKOFF[1], self.reconnect_delay * 2)
        return True

    def _drain_notifies(self) -> None:
        conn = self.listen_conn
        if conn is None:
            return
        try:
            conn.pgconn.consume_input()
            got = False
            while conn.pgconn.notifies() is not None:
                got = True
            if got:
                self.next_poll = self.clock()
        except Exception as exc:  # noqa: BLE001 - a lost LISTEN connection is re-established
            self._db_down(DatabaseUnavailable(f"the LISTEN connection was lost: {exc}"))

    # -- registry (informational) -------------------------------------------------------------------

    def _registry(self, now: float) -> None:
        self.next_registry = now + self.config.registry_interval
        if not self.db_ok or self.store is None:
            return
        kids = []
        for child in self.children:
            att = child.attempt
            info: dict[str, Any] = {"pid": child.pid, "steps_run": child.steps_run}
            if child.proc is not None:
                try:
                    info["cpu_percent"] = child.proc.cpu_percent(None)
                    info["rss"] = child.proc.memory_info().rss
                except psutil.Error:
                    pass
            if att is not None:
                info.update({"run_id": att.run_id, "node": att.node, "step": att.step_name,
                             "attempt": att.attempt, "elapsed": round(now - att.started, 3)})
            kids.append(info)
        try:
            self.store.register_worker(id=self.id, hostname=socket.gethostname(), pid=os.getpid(), info={
                "workers": self.config.workers, "queues": list(self.config.queues),
                "draining": self.draining, "children": kids, "stats": self.stats,
                "prefetched": len(self.prefetched),
            })
        except DatabaseError as exc:
            self._db_down(exc)

    # -- teardown ---------------------------------------------------------------------------------

    def _teardown(self) -> None:
        for child in list(self.children):
            with_suppress_unregister(self.selector, child.sock)
            if child.attempt is None:
                child.retire()
        deadline = time.monotonic() + 2.0
        for child in list(self.children):
            if child.attempt is not None or child.wait(timeout=max(0.0, deadline - time.monotonic())) is None:
                child.kill()
        self.children.clear()
        procs.reap_strays(self.id, {self._watchdog.pid}, self.descended)
        if self._was_subreaper is False:
            procs.set_subreaper(False)
        os.close(self._watchdog_fd)  # EOF: the watchdog sweeps anything marked, then exits
        try:
            self._watchdog.wait(timeout=10)
        except Exception:  # noqa: BLE001
            self._watchdog.kill()
            self._watchdog.wait()
        self.batch.wait(timeout=self.config.lease_ttl)
        self._collect_batch()
        self.batch.shutdown()
        self._defer(self.completions, self.failures)
        self.completions, self.failures = [], []
        if self.db_ok and self.store is not None:
            for write in list(self.pending):
                self._apply(write)
            try:
                self.store.unregister_worker(self.id)
            except DatabaseError:
                pass
        self._close_db()
        try:
            self.selector.close()
        except Exception:  # noqa: BLE001
            pass
        for fd in (self._wake_r, self._wake_w):
            try:
                os.close(fd)
            except OSError:
                pass


def fail_payload(kind: str, entry: dict[str, Any], require_timed_out: bool) -> dict[str, Any]:
    """The payload of a pending "fail" write (see :meth:`Supervisor._apply`)."""
    return {"kind": kind, "entry": entry, "require_timed_out": require_timed_out}


def with_suppress_unregister(selector: selectors.BaseSelector, sock: socket.socket) -> None:
    """Unregister a socket from the selector if it is registered."""
    try:
        selector.unregister(sock)
    except (KeyError, ValueError, OSError):
        pass
