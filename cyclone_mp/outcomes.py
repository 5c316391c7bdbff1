"""The outcome writer: claims and every ended attempt's CAS write, on a connection of its own.

Process control hands it :class:`~cyclone_mp.messages.Batch` values (outcomes: a
success, a failed attempt, a release; and the claim for the slots they free) and goes
on; the writer puts whatever has gathered meanwhile, the claim included, in one
statement (:meth:`~cyclone_mp.store.Outcomes.settle`: each row with its own CAS,
SPEC 1), so outcomes share statements whenever they come faster than a round trip. A
row whose run another session holds locked is not waited for: its outcome rides with
later statements until the lock goes, while the others flow. A row whose CAS did not
hold, and every write the statement could not make, is made alone
(:mod:`cyclone_mp.writealone`). When a write is done (applied, or moot), the lease
keeper stops renewing that lease (:class:`~cyclone_mp.messages.LeaseDone`): until then
the lease is kept, so a brief outage does not turn a finished step into a reclaimed one.
"""

from __future__ import annotations

import logging
import threading
import time
from typing import Any, Callable, Sequence

from . import decisions
from .backoff import delay_after
from .config import Config
from .dbloop import DatabaseThread
from .errors import DatabaseBusy, DatabaseError, DatabaseUnavailable
from .messages import COMPLETE, FAIL, RELEASE, SNOOZE, Batch, Claimed, LeaseDone, Load, Outcome, Poll, Reaped, Track, Written
from .steps import DEFAULT_MAX_SNOOZES
from .store import FORENSIC_KEYS, FailedAttempt
from .telemetry import NO_OBSERVER, Observer
from .writealone import RETRY_AFTER, AloneWrites, PendingWrite

log = logging.getLogger("cyclone_mp.supervisor")

DEFER_FIRST, DEFER_MAX = 0.005, 1.0  # seconds: a statement of their own for outcomes skipped for a locked run
FINAL_FLUSH = 1.0  # seconds the writer may spend on what is left when the supervisor stops (while calls come back)


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
        self.alone = AloneWrites(self)  # writes made one at a time, and those kept to make again
        self.deferred: list[Outcome] = []  # outcomes whose runs another session held locked (Settled.skipped)
        self.deferred_at = 0.0  # when they are tried again, if no statement takes them before
        self._deferrals: dict[Any, int] = {}  # times each deferred outcome was skipped in a row
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
        if self.db_ok and (self.batch or self.claim or (self.deferred and self.clock() >= self.deferred_at)):
            self._write_batch()
        if self.db_ok and self.alone.pending:
            self.alone.retry_due(self.clock())
        if self.db_ok and self.dead:
            self._mark_dead()
        self._tell_finished()
        if self._taken:
            self.tell_control(Written(self._taken))
            self._taken = 0
        if self.alone.pending or self.dead or self.deferred:
            return min([p.retry_at for p in self.alone.pending] + ([self.clock() + RETRY_AFTER] if self.dead else [])
                       + ([self.deferred_at] if self.deferred else []))
        return self.clock() + 1.0

    def done(self, outcome: Outcome) -> None:
        self.done_many((outcome,))

    def done_many(self, outcomes: Sequence[Outcome]) -> None:
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
        batch, self.batch, self.deferred = self.deferred + self.batch, [], []  # the deferred ones ride along
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
                over = set(self._finished).union(o.key for o in self.deferred)  # (written, or kept already)
                self.alone.keep([o for o in done + failed if o.key not in over])
                if claim:
                    self._claimed([], self.clock(), limit=claim, failed=True)
        for outcome in releases:
            self.alone.write(PendingWrite(outcome, self.clock()))

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
                          entry=self.entry_of(o), require_timed_out=o.require_timed_out, progress=o.progress,
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
            self.alone.keep(done + failed)
            if claim:
                self._claimed([], sent, limit=claim, failed=True)
            return
        except DatabaseError:  # one bad (or locked) row must not hold back the others: one by one
            if claim:
                self._claimed([], sent, limit=claim, failed=True)
            for outcome in done + failed:
                self.alone.write(PendingWrite(outcome, self.clock()))
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
        self.done_many(written)
        late = [o for o in done if o.key not in settled.completed]
        self._defer([o for o in late + failed if o.key in settled.skipped])
        for outcome in late:
            if outcome.key not in settled.skipped:
                self.alone.late_success(outcome)
        # The rest (a lost lease, a timeout not yet due on the DB clock, a run neither
        # running nor paused, a workflow run's failure) go the one-by-one way.
        for outcome in failed:
            if outcome.key in settled.failed:
                kind = settled.failed_kinds.get(outcome.key) or decisions.ERROR
                self.observer.written(outcome.step_name, kind)
                if outcome.key in settled.discarded:
                    self.discarded(outcome, kind)
                self.done(outcome)
            elif outcome.key not in settled.skipped:
                self.alone.write(PendingWrite(outcome, self.clock()))

    def _defer(self, outcomes: list[Outcome]) -> None:
        """Outcomes whose runs another session held locked (their CAS not tried, no lock
        waited for): they ride with each later statement, and when none comes, go in a
        statement of their own after a backoff (DEFER_FIRST, doubling for the outcome
        skipped the fewest times in a row, to DEFER_MAX); the rest flows meanwhile."""
        self._deferrals = {o.key: self._deferrals.get(o.key, 0) + 1 for o in outcomes}
        if not outcomes:
            return
        self.deferred.extend(outcomes)
        self.deferred_at = self.clock() + min(DEFER_MAX, DEFER_FIRST * 2 ** (min(self._deferrals.values()) - 1))
        self.count("skipped_for_locks", len(outcomes))  # (each time an outcome is skipped)

    def discarded(self, outcome: Outcome, kind: str, error: str | None = None) -> None:
        """Tell the observers (``on_step_discarded`` hooks) that this write discarded its step."""
        self.observer.discarded({"run_id": outcome.run_id, "node": outcome.node, "step_name": outcome.step_name,
                                 "error_kind": kind, "error": error or (outcome.entry or {}).get("message")})

    def entry_of(self, outcome: Outcome, plain: bool = False) -> dict[str, Any]:
        """An attempt's error entry as stored: who wrote it, under which lease. ``plain``:
        the forensics only, and the message :meth:`_rejected` wrote in place of the
        handler's (the entry was refused once)."""
        entry = dict(outcome.entry or {})
        if plain:
            entry = {k: v for k, v in entry.items() if k in FORENSIC_KEYS or k == "message"}
        if outcome.start_delay is not None:  # the handler started this long after its claim (written to start_delay)
            entry["start_delay"] = round(outcome.start_delay, 6)
        return {"worker": self.owner, "lease_generation": outcome.generation, **entry}

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
            self.batch, self.deferred = self.deferred + self.batch, []
            if self.dead and self.db_ok:
                self._mark_dead()
            if not (self.batch or self.alone.pending) or not self.db_ok:
                return
            if self.batch:
                self._write_batch()
            for write in self.alone.pending:
                write.retry_at = min(write.retry_at, self.clock())
            self.alone.retry_due(self.clock())
            if self.alone.pending or self.deferred:
                time.sleep(RETRY_AFTER)
