"""The outcome writer's writes made one at a time (:class:`AloneWrites`): releases,
snoozes, completions that spawn runs, and each outcome its batch statement could not
take (its CAS did not hold, its values were refused, the statement failed). A write the
database cannot take now (an outage, a lock wait past ``lock_timeout``) is kept and made
again, later each time after a lock wait; one it refuses for its data is never made
again as is: a refused success becomes a failed attempt (``output_invalid``), a refused
error entry is written again with its plain fields only. See :mod:`cyclone_mp.outcomes`.
"""

from __future__ import annotations

import dataclasses
import logging
from typing import TYPE_CHECKING

from . import decisions, unhealable
from .connections import stale_plan
from .errors import ConfigurationError, DatabaseBusy, DatabaseError, DatabaseUnavailable, UnknownStep
from .messages import COMPLETE, FAIL, RELEASE, SNOOZE, Outcome, Poll
from .protocol import storable
from .store import FORENSIC_KEYS

if TYPE_CHECKING:
    from .outcomes import OutcomeWriter

log = logging.getLogger("cyclone_mp.supervisor")

RETRY_AFTER = 0.05  # seconds before a write that could not be made now is tried again
BUSY_RETRY_MAX = 5.0  # seconds: a write that waited past lock_timeout is tried again ever later, up to this


@dataclasses.dataclass
class PendingWrite:
    """An outcome written alone, again at ``retry_at`` (local monotonic seconds) if needed."""

    outcome: Outcome
    retry_at: float
    plain: bool = False  # the error entry was rejected once: write only its plain fields
    busy: int = 0  # lock waits or statement timeouts so far (each doubles the wait before the next try)


class AloneWrites:
    """The writes alone of ``writer`` (an :class:`~cyclone_mp.outcomes.OutcomeWriter`),
    on its thread, and those kept to make again (``pending``)."""

    def __init__(self, writer: OutcomeWriter) -> None:
        self.writer = writer
        self.pending: list[PendingWrite] = []

    def keep(self, outcomes: list[Outcome]) -> None:
        """Outcomes to write alone later (their statement failed, or the database is away)."""
        now = self.writer.clock()
        self.pending.extend(PendingWrite(o, now) for o in outcomes)

    def late_success(self, outcome: Outcome) -> None:
        """A success whose CAS failed: a timed-out attempt still counts once, as a timeout.
        Anything else (cancelled, reclaimed, already written) drops it; a timeout the
        recovery sweep wrote first gets the late return's forensics, progress and start
        delay (:meth:`~cyclone_mp.store.Outcomes.annotate`)."""
        w = self.writer
        try:
            row = w.call(w.config.write_bound, lambda store: store.leases.state(outcome.step_id))
        except DatabaseUnavailable:
            self.keep([outcome])
            return
        except DatabaseError:
            row = None
        if (row and row["state"] == "running" and row["lease_owner"] == w.owner
                and row["lease_generation"] == outcome.generation and row["timed_out"]):
            entry = {k: v for k, v in (outcome.entry or {}).items()}
            entry["message"] = "returned after the database deadline"
            self.write(PendingWrite(outcome._replace(
                kind=FAIL, error_kind=decisions.TIMEOUT, entry=entry, require_timed_out=True,
                output=None), w.clock()))
            return
        if (row and row["state"] != "running" and row["lease_generation"] == outcome.generation
                and row["last_error_kind"] == decisions.TIMEOUT
                and row["last_error_generation"] == outcome.generation):
            try:
                w.call(w.config.write_bound, lambda store: store.outcomes.annotate(
                    owner=w.owner, id=outcome.step_id, generation=outcome.generation,
                    entry={**w.entry_of(outcome), "returned_late": True},
                    note="the handler returned after the database deadline", progress=outcome.progress))
            except DatabaseError as exc:  # only the entry's details are lost: the attempt's end is written
                log.warning("could not add a late return's details to step %d: %s", outcome.step_id, exc)
        w.count("late_completions_dropped")
        w.done(outcome)

    def retry_due(self, now: float) -> None:
        w = self.writer
        due = [p for p in self.pending if p.retry_at <= now]
        if not due:
            return
        self.pending = [p for p in self.pending if p.retry_at > now]
        for write in due:
            if not w.db_ok:
                self.pending.append(write)
                continue
            self.write(write)

    def write(self, item: PendingWrite) -> None:
        """Try one write now; keep it for later unless it is done (applied, moot, or replaced)."""
        w = self.writer
        if not self._apply(item):
            item.retry_at = max(item.retry_at, w.clock() + RETRY_AFTER)
            self.pending.append(item)

    def _apply(self, write: PendingWrite) -> bool:
        """One write alone; True when it is over (see the module docstring)."""
        w = self.writer
        outcome = write.outcome
        try:
            if outcome.kind == COMPLETE:
                try:
                    spawns = {outcome.key: w.plan_spawns(outcome)} if outcome.spawns else None
                except (ConfigurationError, UnknownStep) as exc:  # a spawn this worker cannot enqueue: the attempt fails
                    write.outcome = outcome._replace(kind=FAIL, error_kind=decisions.ERROR, output=None, spawns=(),
                                                     entry={**(outcome.entry or {}), "type": type(exc).__name__,
                                                            "message": str(exc)})
                    return self._apply(write)
                applied = w.call(w.config.write_bound, lambda store: store.outcomes.complete(
                    owner=w.owner, items=[(outcome.step_id, outcome.generation, outcome.output, outcome.progress,
                                              outcome.start_delay)],
                    workflows=outcome.workflow, spawns=spawns))
                if applied:
                    w.count("completed")
                    w.observer.written(outcome.step_name, "completed")
                    w.done(outcome)
                else:
                    self.late_success(outcome)
                return True
            if outcome.kind == SNOOZE:
                state = w.call(w.config.write_bound, lambda store: store.outcomes.snooze(
                    owner=w.owner, id=outcome.step_id, generation=outcome.generation, seconds=outcome.snooze,
                    max_snoozes=w.max_snoozes(outcome.step_name), progress=outcome.progress,
                    entry=w.entry_of(outcome)))
                if state is None:  # the row moved on (timed out, cancelled): a late end, as for a success
                    w.count("late_completions_dropped")
                else:
                    w.count("snoozed")
                    if state == "discarded":
                        w.observer.written(outcome.step_name, decisions.SNOOZE_LIMIT)
                        w.discarded(outcome, decisions.SNOOZE_LIMIT, "snoozed more than max_snoozes")
                w.done(outcome)
                return True
            if outcome.kind == RELEASE:
                released = w.call(w.config.write_bound, lambda store: store.outcomes.release(
                    owner=w.owner, id=outcome.step_id, generation=outcome.generation))
                if released:
                    w.count("prefetch_released" if outcome.held else "released")
                    w.tell_control(Poll())  # claimable at once, here too
                else:  # the row moved on (a cancel): nothing of a released attempt runs, so its step
                    w.dead.append(outcome.key)  # need not wait for dead_by (held: it never started)
                    w.unstarted.update((outcome.key,) if outcome.held else ())
                w.done(outcome)
                return True
            result = w.call(w.config.write_bound, lambda store: store.outcomes.fail(
                owner=w.owner, id=outcome.step_id, generation=outcome.generation,
                kind=outcome.error_kind or decisions.ERROR, entry=w.entry_of(outcome, write.plain),
                backoff=w.backoff_for(outcome.step_name), require_timed_out=outcome.require_timed_out,
                progress=None if write.plain else outcome.progress))
        except DatabaseUnavailable:
            return False
        except DatabaseBusy:  # a lock wait or a slow statement: nothing was done, try again, later each time
            write.busy += 1
            write.retry_at = w.clock() + min(BUSY_RETRY_MAX, RETRY_AFTER * 2 ** write.busy)
            return False
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
            w.count("failed")
            kind = result.ended[1] if result.ended else outcome.error_kind or decisions.ERROR
            w.observer.written(outcome.step_name, kind)
            if result.discarded:
                w.discarded(outcome, kind)
            w.tell_control(Poll())
        w.done(outcome)
        return True

    def _rejected(self, write: PendingWrite, exc: Exception) -> bool:
        """The database refused this write for its data, or its values could not be sent:
        never retried as is."""
        w = self.writer
        outcome = write.outcome
        if outcome.kind == COMPLETE:  # output_invalid: discarded without retry, said once in the log
            message = storable(unhealable.rejected(exc) if isinstance(exc, DatabaseError)
                               else unhealable.unsendable(exc))[:2000]
            log.error("step %r (id %d) cannot succeed (output_invalid, discarded without retry): %s",
                      outcome.step_name, outcome.step_id, message)
            self.write(PendingWrite(outcome._replace(
                kind=FAIL, error_kind=decisions.OUTPUT_INVALID, output=None, require_timed_out=False, entry={
                    "type": "cyclone_mp.errors.PayloadError", "message": message,
                }), w.clock()))
            return True
        if outcome.kind == FAIL and not write.plain:
            entry = {k: v for k, v in (outcome.entry or {}).items() if k in FORENSIC_KEYS}
            entry["message"] = storable(f"error entry rejected by the database: {exc}")[:2000]
            self.write(PendingWrite(outcome._replace(entry=entry), w.clock(), plain=True))
            return True
        log.error("giving up on a %s write for step %d: %s", outcome.kind, outcome.step_id, exc)
        w.done(outcome)
        return True
