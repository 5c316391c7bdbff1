"""The outcome writer: claims and every ended attempt's CAS write, on a connection of its own.

Process control hands it :class:`~cyclone_mp.messages.Batch` values (outcomes: a
success, a failed attempt, a release; and the claim for the slots they free) and goes
on; the writer puts whatever has gathered meanwhile, the claim included, in one
statement (:meth:`~cyclone_mp.store.Outcomes.settle`: each row with its own CAS,
SPEC 1), so outcomes share statements whenever they come faster than a round trip.
A row whose CAS did not hold is looked at alone: a success past its DB deadline still
counts once, as a timeout (SPEC 3), a failed attempt of a workflow run is written with
its run advanced, and a timeout not yet due on the database clock waits for it.

A write the database cannot take now (an outage, a lock wait past ``lock_timeout``) is
kept and written again; one it rejects (bad data) is never retried as is: a rejected
success becomes a failed attempt, a rejected error entry is written again with its plain
fields only. When a write is done (applied, or moot), the lease keeper stops renewing
that lease (:class:`~cyclone_mp.messages.LeaseDone`): until then the lease is kept, so a
brief outage does not turn a finished step into a reclaimed one.
"""

from __future__ import annotations

import dataclasses
import logging
import threading
import time
from typing import Any, Callable, Sequence

from . import decisions, unhealable
from .backoff import delay_after
from .config import Config
from .connections import stale_plan
from .dbloop import DatabaseThread
from .errors import ConfigurationError, DatabaseBusy, DatabaseError, DatabaseUnavailable, UnknownStep
from .messages import COMPLETE, FAIL, RELEASE, SNOOZE, Batch, Claimed, LeaseDone, Load, Outcome, Poll, Reaped, Track, Written
from .protocol import storable
from .steps import DEFAULT_MAX_SNOOZES
from .store import FORENSIC_KEYS, FailedAttempt
from .telemetry import NO_OBSERVER, Observer

log = logging.getLogger("cyclone_mp.supervisor")

RETRY_AFTER = 0.05  # seconds before a write that could not be made now is tried again
FINAL_FLUSH = 1.0  # seconds the writer may spend on what is left when the supervisor stops (while calls come back)


@dataclasses.dataclass
class PendingWrite:
    """An outcome written alone, again at ``retry_at`` (local monotonic seconds) if needed."""

    outcome: Outcome
    retry_at: float
    plain: bool = False  # the error entry was rejected once: write only its plain fields


class OutcomeWriter(DatabaseThread):
    """Writes the outcomes of one supervisor's attempts (see the module docstring).

    Args:
        dsn: PostgreSQL connection string.
        config: the supervisor's :class:`~cyclone_mp.config.Config`.
        owner: the supervisor's id (``lease_owner``).
        backoff_for: ``step name -> (attempt -> seconds)`` for rows storing no backoff.
        plan_spawns: a completion's spawned runs (``Outcome.spawns``) as the rows to insert
            with it (:func:`cyclone_mp.spawning.plan`); raises ConfigurationError (UnknownStep)
            for a spawn this supervisor cannot enqueue, which fails the attempt instead.
        tell_keeper: posts a message to the lease keeper.
        tell_control: posts a message to process control.
        load: posts a :class:`~cyclone_mp.messages.Load` to the payload loader.
        clock: local monotonic clock in seconds.
    """

    def __init__(self, dsn: str, config: Config, *, owner: str, names: list[str],
                 backoff_for: Callable[[str | None], Callable[[int], float]],
                 max_snoozes: Callable[[str | None], int] = lambda name: DEFAULT_MAX_SNOOZES,
                 plan_spawns: Callable[[Outcome], Any] = lambda outcome: [],
                 tell_keeper: Callable[[Any], None], tell_control: Callable[[Any], None],
                 load: Callable[[Any], None], observer: Observer = NO_OBSERVER,
                 clock: Callable[[], float] = time.monotonic) -> None:
        super().__init__("outcome writer", dsn, config, owner=owner, bound=config.write_bound, clock=clock)
        self.observer = observer
        self.config = config
        self.owner = owner
        self.names = names
        self.backoff_for = backoff_for
        self.max_snoozes = max_snoozes
        self.plan_spawns = plan_spawns
        self.tell_keeper = tell_keeper
        self.tell_control = tell_control
        self.load = load
        self.batch: list[Outcome] = []
        self.claim = 0  # the claim to make with the next batch
        self.start_now = 0  # of it, the steps idle children can start at once
        self.pending: list[PendingWrite] = []
        self.dead: list[Any] = []  # attempts reaped after a cancel or a timeout, to record (mark_dead)
        self.unstarted: set[Any] = set()  # of those, the ones whose handlers never started
        self._finished: list[Any] = []  # leases whose writes are over, for the keeper (LeaseDone)
        self._taken = 0  # counted Batch messages read since process control was last told (Written)
        self._lock = threading.Lock()
        self._outstanding = 0  # posted and not yet done (read by process control)

    # -- process control's side ------------------------------------------------------------------

    def post(self, outcome: Outcome) -> None:
        """Hand over one outcome outside process control's count of batches (a held step's
        release): no :class:`~cyclone_mp.messages.Written` answers it (never blocks)."""
        self.post_batch((outcome,), counted=False)

    def post_batch(self, outcomes: tuple[Outcome, ...], claim: int = 0, start_now: int | None = None, *,
                   counted: bool = True) -> None:
        """Hand over outcomes, and a claim of up to ``claim`` steps to make in the same
        statement (its rows go to process control as :class:`~cyclone_mp.messages.Claimed`),
        of which ``start_now`` (default all) can start on idle children at once.
        ``counted``: process control counts this batch as out until a
        :class:`~cyclone_mp.messages.Written` says the writer is done with it."""
        with self._lock:
            self._outstanding += len(outcomes)
        self.inbox.post(Batch(tuple(outcomes), claim, claim if start_now is None else min(claim, start_now),
                              counted))

    def post_dead(self, keys: tuple[Any, ...], *, started: bool = True) -> None:
        """Hand over attempts that ended after a cancel or a timeout and whose processes are
        dead (:class:`~cyclone_mp.messages.Reaped`); ``started`` False: their handlers never
        started. Recorded after the outcomes posted before them (never blocks)."""
        self.inbox.post(Reaped(tuple(keys), started))

    @property
    def idle(self) -> bool:
        """Every outcome posted so far is written (or moot)."""
        return self._outstanding == 0

    # -- the turn ------------------------------------------------------------------------------------

    def _read_inbox(self) -> None:
        for message in self.inbox.take():
            if isinstance(message, Reaped):
                self.dead.extend(message.keys)
                if not message.started:
                    self.unstarted.update(message.keys)
                continue
            self.batch.extend(message.outcomes)
            self.claim += message.claim
            self.start_now += message.start_now
            self._taken += message.counted

    def turn(self, now: float) -> float:
        self._read_inbox()
        if self.claim and not self.db_ok:  # no claim during an outage: say so, process control backs off
            claim, self.claim, self.start_now = self.claim, 0, 0
            self._claimed([], self.clock(), limit=claim, failed=True)
        if self.db_ok and (self.batch or self.claim):
            self._write_batch()
        if self.db_ok and self.pending:
            self._retry_pending(self.clock())
        if self.db_ok and self.dead:
            self._mark_dead()
        self._tell_finished()
        if self._taken:
            self.tell_control(Written(self._taken))
            self._taken = 0
        if self.pending or self.dead:
            return min([p.retry_at for p in self.pending] + ([self.clock() + RETRY_AFTER] if self.dead else []))
        return self.clock() + 1.0

    def _done(self, outcome: Outcome) -> None:
        self._done_many((outcome,))

    def _done_many(self, outcomes: Sequence[Outcome]) -> None:
        """These outcomes' writes are over: their leases are no longer renewed (the keeper
        hears of it at the end of this turn, with the others of the batch); one lock for all."""
        self._finished.extend(o.key for o in outcomes)
        with self._lock:
            self._outstanding -= len(outcomes)

    def _tell_finished(self) -> None:
        if self._finished:
            self.tell_keeper(LeaseDone(tuple(self._finished)))
            self._finished = []

    def _write_batch(self) -> None:
        batch, self.batch = self.batch, []
        claim, self.claim = self.claim, 0
        start_now, self.start_now = min(self.start_now, claim), 0
        # (written alone: rare) releases, snoozes, and completions that spawned runs
        releases = [o for o in batch if o.kind in (RELEASE, SNOOZE) or o.spawns]
        done = [o for o in batch if o.kind == COMPLETE and not o.spawns]
        failed = [o for o in batch if o.kind == FAIL]
        if claim and not (done or failed):
            self._claim_alone(claim, start_now)
        elif done or failed:
            try:
                self._settle(done, failed, claim, start_now)
            except Exception:  # noqa: BLE001 - never drop an outcome: keep it to write again
                log.exception("the batch statement failed unexpectedly; its outcomes will be written again")
                self._keep(done + failed)
                if claim:
                    self._claimed([], self.clock(), limit=claim, failed=True)
        for outcome in releases:
            self._write_alone(PendingWrite(outcome, self.clock()))

    def _mark_dead(self) -> None:
        """Record the reaped attempts (:meth:`~cyclone_mp.store.Leases.mark_dead`, one
        statement); kept for the next turn during an outage. Until recorded, their steps
        wait for ``dead_by`` on the database clock: never sooner than is safe."""
        dead, self.dead = self.dead, []
        unstarted = self.unstarted.intersection(dead)
        try:
            self.call(self.config.write_bound, lambda store: store.leases.mark_dead(dead, unstarted=unstarted))
        except (DatabaseUnavailable, DatabaseBusy):  # (an outage, a lock wait): kept for the next turn
            self.dead = dead + self.dead
            return
        except Exception as exc:  # noqa: BLE001 - nothing is lost: the steps wait for dead_by
            log.warning("could not record %d reaped attempt(s): %s", len(dead), exc)
        else:
            self.count("reaped_recorded", len(dead))
        self.unstarted -= unstarted

    def _claim_alone(self, limit: int, start_now: int) -> None:
        """A claim with no outcome to write (the poll, or a NOTIFY, found slots free)."""
        self.count("claim_statements")
        sent = self.clock()
        try:
            claimed = self.call(self.config.write_bound, lambda store: store.claims.claim(
                owner=self.owner, queues=self.config.queues, names=self.names, limit=limit,
                ttl=self.config.lease_ttl, kill_within=self.config.kill_within, start_now=start_now))
        except DatabaseError as exc:
            if not isinstance(exc, DatabaseUnavailable):
                log.error("claim rejected by the database: %s", exc)
            self._claimed([], sent, limit=limit, failed=True)
            return
        except Exception:  # noqa: BLE001 - process control still hears the claim is over (it counts claims in flight)
            log.exception("the claim failed unexpectedly")
            self._claimed([], sent, limit=limit, failed=True)
            return
        self._claimed(claimed.rows, sent, limit=limit, wait=claimed.wait)

    def _claimed(self, rows: list[dict[str, Any]], sent: float, *, limit: int, failed: bool = False,
                 wait: float | None = None) -> None:
        """Rows claimed with a batch: the keeper renews them from now on; process control starts
        them (and polls again within ``wait`` seconds when a rate limit held a step back)."""
        if rows:
            self.tell_keeper(Track(tuple((r["id"], r["lease_generation"]) for r in rows), sent))
            self.count("claimed", len(rows))
            self.observer.claimed(rows)
        big = tuple(r for r in rows if r.get("big"))
        if big:
            self.load(Load(big, sent))
        self.tell_control(Claimed(tuple(r for r in rows if not r.get("big")), sent, limit, failed=failed, wait=wait))

    def _settle(self, done: list[Outcome], failed: list[Outcome], claim: int, start_now: int) -> None:
        completions = [(o.step_id, o.generation, o.output, o.progress, o.start_delay) for o in done]
        failures = [
            FailedAttempt(id=o.step_id, generation=o.generation, kind=o.error_kind or decisions.ERROR,
                          entry=self._entry(o), require_timed_out=o.require_timed_out, progress=o.progress,
                          delay=delay_after(o.attempt, o.backoff_spec, self.backoff_for(o.step_name)))
            for o in failed
        ]
        workflows = any(o.workflow for o in done + failed)
        if done or failed:
            self.count("batches")
        sent = self.clock()
        try:
            settled = self.call(self.config.write_bound, lambda store: store.outcomes.settle(
                owner=self.owner, completions=completions, failures=failures, workflows=workflows,
                queues=self.config.queues, names=self.names, limit=claim, ttl=self.config.lease_ttl,
                kill_within=self.config.kill_within, start_now=start_now))
        except DatabaseUnavailable:
            self._keep(done + failed)
            if claim:
                self._claimed([], sent, limit=claim, failed=True)
            return
        except DatabaseError:  # one bad (or locked) row must not hold back the others: one by one
            if claim:
                self._claimed([], sent, limit=claim, failed=True)
            for outcome in done + failed:
                self._write_alone(PendingWrite(outcome, self.clock()))
            return
        if claim:
            self._claimed(settled.claimed, sent, limit=claim, wait=settled.wait)
        self.count("completed", len(settled.completed))
        self.count("failed", len(settled.failed))
        if settled.failed:
            self.tell_control(Poll())  # a retry without backoff is claimable at once
        written = [o for o in done if o.key in settled.completed]
        if written:
            self.observer.written_many([o.step_name for o in written], "completed")
        self._done_many(written)
        for outcome in done:
            if outcome.key not in settled.completed:
                self._late_success(outcome)
        # The rest (a lost lease, a timeout not yet due on the DB clock, a run neither
        # running nor paused, a workflow run's failure) go the one-by-one way.
        for outcome in failed:
            if outcome.key in settled.failed:
                kind = settled.failed_kinds.get(outcome.key) or decisions.ERROR
                self.observer.written(outcome.step_name, kind)
                if outcome.key in settled.discarded:
                    self._discarded(outcome, kind)
                self._done(outcome)
            else:
                self._write_alone(PendingWrite(outcome, self.clock()))

    def _discarded(self, outcome: Outcome, kind: str, error: str | None = None) -> None:
        """Tell the observers (``on_step_discarded`` hooks) that this write discarded its step."""
        self.observer.discarded({"run_id": outcome.run_id, "node": outcome.node, "step_name": outcome.step_name,
                                 "error_kind": kind, "error": error or (outcome.entry or {}).get("message")})

    def _keep(self, outcomes: list[Outcome]) -> None:
        now = self.clock()
        self.pending.extend(PendingWrite(o, now) for o in outcomes)

    def _late_success(self, outcome: Outcome) -> None:
        """A success whose CAS failed: a timed-out attempt still counts once, as a timeout.
        Anything else (cancelled, reclaimed, already written) drops it; a timeout the
        recovery sweep wrote first gets the late return's forensics, progress and start
        delay (:meth:`~cyclone_mp.store.Outcomes.annotate`)."""
        try:
            row = self.call(self.config.write_bound, lambda store: store.leases.state(outcome.step_id))
        except DatabaseUnavailable:
            self._keep([outcome])
            return
        except DatabaseError:
            row = None
        if (row and row["state"] == "running" and row["lease_owner"] == self.owner
                and row["lease_generation"] == outcome.generation and row["timed_out"]):
            entry = {k: v for k, v in (outcome.entry or {}).items()}
            entry["message"] = "returned after the database deadline"
            self._write_alone(PendingWrite(outcome._replace(
                kind=FAIL, error_kind=decisions.TIMEOUT, entry=entry, require_timed_out=True,
                output=None), self.clock()))
            return
        if (row and row["state"] != "running" and row["lease_generation"] == outcome.generation
                and row["last_error_kind"] == decisions.TIMEOUT
                and row["last_error_generation"] == outcome.generation):
            try:
                self.call(self.config.write_bound, lambda store: store.outcomes.annotate(
                    owner=self.owner, id=outcome.step_id, generation=outcome.generation,
                    entry={**self._entry(outcome), "returned_late": True},
                    note="the handler returned after the database deadline", progress=outcome.progress))
            except DatabaseError as exc:  # only the entry's details are lost: the attempt's end is written
                log.warning("could not add a late return's details to step %d: %s", outcome.step_id, exc)
        self.count("late_completions_dropped")
        self._done(outcome)

    def _entry(self, outcome: Outcome, plain: bool = False) -> dict[str, Any]:
        """An attempt's error entry as stored: who wrote it, under which lease. ``plain``:
        the forensics only, and the message :meth:`_rejected` wrote in place of the
        handler's (the entry was refused once)."""
        entry = dict(outcome.entry or {})
        if plain:
            entry = {k: v for k, v in entry.items() if k in FORENSIC_KEYS or k == "message"}
        if outcome.start_delay is not None:  # the handler started this long after its claim (written to start_delay)
            entry["start_delay"] = round(outcome.start_delay, 6)
        return {"worker": self.owner, "lease_generation": outcome.generation, **entry}

    def _retry_pending(self, now: float) -> None:
        due = [p for p in self.pending if p.retry_at <= now]
        if not due:
            return
        self.pending = [p for p in self.pending if p.retry_at > now]
        for write in due:
            if not self.db_ok:
                self.pending.append(write)
                continue
            self._write_alone(write)

    def _write_alone(self, write: PendingWrite) -> None:
        """Try one write now; keep it for later unless it is done (applied, moot, or replaced)."""
        if not self._apply(write):
            write.retry_at = max(write.retry_at, self.clock() + RETRY_AFTER)
            self.pending.append(write)

    def _apply(self, write: PendingWrite) -> bool:
        """One write alone; True when it is over (see the module docstring)."""
        outcome = write.outcome
        try:
            if outcome.kind == COMPLETE:
                try:
                    spawns = {outcome.key: self.plan_spawns(outcome)} if outcome.spawns else None
                except (ConfigurationError, UnknownStep) as exc:  # a spawn this worker cannot enqueue: the attempt fails
                    write.outcome = outcome._replace(kind=FAIL, error_kind=decisions.ERROR, output=None, spawns=(),
                                                     entry={**(outcome.entry or {}), "type": type(exc).__name__,
                                                            "message": str(exc)})
                    return self._apply(write)
                applied = self.call(self.config.write_bound, lambda store: store.outcomes.complete(
                    owner=self.owner, items=[(outcome.step_id, outcome.generation, outcome.output, outcome.progress,
                                              outcome.start_delay)],
                    workflows=outcome.workflow, spawns=spawns))
                if applied:
                    self.count("completed")
                    self.observer.written(outcome.step_name, "completed")
                    self._done(outcome)
                else:
                    self._late_success(outcome)
                return True
            if outcome.kind == SNOOZE:
                state = self.call(self.config.write_bound, lambda store: store.outcomes.snooze(
                    owner=self.owner, id=outcome.step_id, generation=outcome.generation, seconds=outcome.snooze,
                    max_snoozes=self.max_snoozes(outcome.step_name), progress=outcome.progress,
                    entry=self._entry(outcome)))
                if state is None:  # the row moved on (timed out, cancelled): a late end, as for a success
                    self.count("late_completions_dropped")
                else:
                    self.count("snoozed")
                    if state == "discarded":
                        self.observer.written(outcome.step_name, decisions.SNOOZE_LIMIT)
                        self._discarded(outcome, decisions.SNOOZE_LIMIT, "snoozed more than max_snoozes")
                self._done(outcome)
                return True
            if outcome.kind == RELEASE:
                released = self.call(self.config.write_bound, lambda store: store.outcomes.release(
                    owner=self.owner, id=outcome.step_id, generation=outcome.generation))
                if released:
                    self.count("prefetch_released" if outcome.held else "released")
                    self.tell_control(Poll())  # claimable at once, here too
                else:  # the row moved on (a cancel): nothing of a released attempt runs, so its step
                    self.dead.append(outcome.key)  # need not wait for dead_by (held: it never started)
                    self.unstarted.update((outcome.key,) if outcome.held else ())
                self._done(outcome)
                return True
            result = self.call(self.config.write_bound, lambda store: store.outcomes.fail(
                owner=self.owner, id=outcome.step_id, generation=outcome.generation,
                kind=outcome.error_kind or decisions.ERROR, entry=self._entry(outcome, write.plain),
                backoff=self.backoff_for(outcome.step_name), require_timed_out=outcome.require_timed_out,
                progress=None if write.plain else outcome.progress))
        except DatabaseUnavailable:
            return False
        except DatabaseBusy:
            return False  # a lock wait or a slow statement: nothing was done, try again
        except DatabaseError as exc:
            if stale_plan(exc.__cause__):  # a schema change, not the data: the connection re-prepares
                return False
            return self._rejected(write, exc)
        except Exception as exc:  # noqa: BLE001 - its values failed before the database: never retried as is
            # (an output too deep to encode, say: the child checks its handler's output,
            # so only a child that broke the protocol gets here)
            log.warning("a %s write for step %d failed before reaching the database: %s",
                        outcome.kind, outcome.step_id, unhealable.one_line(exc))
            return self._rejected(write, exc)
        if result.status == "not_yet":  # the DB deadline has not passed yet: the worker clock never shortens it
            return False
        if result.status == "applied":
            self.count("failed")
            kind = result.ended[1] if result.ended else outcome.error_kind or decisions.ERROR
            self.observer.written(outcome.step_name, kind)
            if result.discarded:
                self._discarded(outcome, kind)
            self.tell_control(Poll())
        self._done(outcome)
        return True

    def _rejected(self, write: PendingWrite, exc: Exception) -> bool:
        """The database refused this write for its data, or its values could not be sent:
        never retried as is."""
        outcome = write.outcome
        if outcome.kind == COMPLETE:  # output_invalid: discarded without retry, said once in the log
            message = storable(unhealable.rejected(exc) if isinstance(exc, DatabaseError)
                               else unhealable.unsendable(exc))[:2000]
            log.error("step %r (id %d) cannot succeed (output_invalid, discarded without retry): %s",
                      outcome.step_name, outcome.step_id, message)
            self._write_alone(PendingWrite(outcome._replace(
                kind=FAIL, error_kind=decisions.OUTPUT_INVALID, output=None, require_timed_out=False, entry={
                    "type": "cyclone_mp.errors.PayloadError", "message": message,
                }), self.clock()))
            return True
        if outcome.kind == FAIL and not write.plain:
            entry = {k: v for k, v in (outcome.entry or {}).items() if k in FORENSIC_KEYS}
            entry["message"] = storable(f"error entry rejected by the database: {exc}")[:2000]
            self._write_alone(PendingWrite(outcome._replace(entry=entry), self.clock(), plain=True))
            return True
        log.error("giving up on a %s write for step %d: %s", outcome.kind, outcome.step_id, exc)
        self._done(outcome)
        return True

    # -- stopping ----------------------------------------------------------------------------------

    def finish(self) -> None:
        """Write what is left, for at most :data:`FINAL_FLUSH` seconds and only while the
        database answers (SPEC 5: completed work is written before exit; an unfinished
        write leaves its lease to expire, and another supervisor reclaims the step)."""
        try:
            self._finish(self.clock() + FINAL_FLUSH)
        finally:
            self._tell_finished()

    def _finish(self, deadline: float) -> None:
        while self.clock() < deadline:
            self._read_inbox()
            self.claim = self.start_now = 0  # stopping: claim nothing more
            if self.dead and self.db_ok:
                self._mark_dead()
            if not (self.batch or self.pending) or not self.db_ok:
                return
            if self.batch:
                self._write_batch()
            for write in self.pending:
                write.retry_at = min(write.retry_at, self.clock())
            self._retry_pending(self.clock())
            if self.pending:
                time.sleep(RETRY_AFTER)
