"""Every attempt's end, written under its CAS (SPEC 4): the settle statement of the hot
path (``sql/settle.sql``: a tick's completions and failures and the next claim, in one
statement), and the writes of one attempt alone (a failure under the run lock, a snooze,
a release at shutdown; ``sql/attempts.sql``). :func:`end_attempt` is a failed attempt's
end, which the recovery sweep (:mod:`.sweep`) writes too.
"""

from __future__ import annotations

import dataclasses
from typing import TYPE_CHECKING, Any, Callable, Sequence

import psycopg
from psycopg.rows import tuple_row
from psycopg.types.json import Jsonb

from .. import decisions
from ..backoff import delay_after
from ..errors import DatabaseBusy
from ..noderows import to_us
from . import operations
from .claims import Claims
from .queries import FORENSIC_KEYS, INLINE_MAX, FailedAttempt, Q, Settled, completion_arrays, nullable_jsonb
from .session import Session, drive, translate

if TYPE_CHECKING:
    from ..spawning import SpawnPlan


@dataclasses.dataclass(frozen=True)
class FailResult:
    """What :meth:`Outcomes.fail` did: ``status`` is ``"applied"``, ``"lost"`` (the row is
    no longer this attempt's) or ``"not_yet"`` (the DB deadline has not passed yet);
    ``ended`` the ``(step name, error kind)`` it stored (None unless applied);
    ``discarded`` whether the attempt discarded its step."""

    status: str
    ended: tuple[str | None, str] | None = None
    discarded: bool = False


def run_of(cur: psycopg.Cursor, id: int) -> str:
    """The id of the run of step ``id`` (text)."""
    cur.execute("SELECT run_id::text AS run_id FROM cyclone_steps WHERE id = %s", (id,))
    return cur.fetchone()["run_id"]


def advance(cur: psycopg.Cursor, run_id: str) -> None:
    """Under the run lock: :func:`cyclone_mp.store.operations.advance` on this cursor."""
    drive(cur, operations.advance(run_id))


def end_attempt(
    cur: psycopg.Cursor, id: int, row: dict[str, Any], kind: str, entry: dict[str, Any],
    backoff: Callable[[int], float], progress: Any = None, swept: bool = False,
) -> decisions.AttemptEnd:
    """Write a failed attempt's end (under the run lock and the step lock): ``row`` is the
    step as ``lock_attempt`` or ``sweep_recheck`` read it, ``kind`` a
    :data:`~cyclone_mp.decisions.FAILURE_KINDS` value, ``entry`` the error entry,
    ``backoff`` the step's delay (seconds) for an attempt number. ``swept``: the recovery
    sweep settles a running attempt whose process may still run: the step is not claimed
    again before that process is dead (``dead_by``, SPEC 9)."""
    delay = delay_after(row["attempt"], row.get("backoff"), backoff)
    end = decisions.end_attempt(
        attempt=row["attempt"], max_attempts=row["max_attempts"], kind=kind,
        timed_out=bool(row["timed_out"]), backoff=delay,
    )
    entry = {**entry, "attempt": row["attempt"], "kind": end.error_kind}
    if end.error_kind == decisions.TIMEOUT and kind != decisions.TIMEOUT:
        entry["reported_kind"] = kind
    quarantined = (decisions.discard_message(end.error_kind, entry, list(row.get("error_kinds") or []))
                   if end.state == "discarded" else None)
    cur.execute(Q["end_attempt"], {
        "id": id, "state": end.state, "attempt": end.attempt, "delay_us": to_us(end.delay),
        "error": quarantined or entry.get("message") or end.error_kind, "error_kind": end.error_kind,
        "entry": Jsonb(entry), "progress": nullable_jsonb(progress), "swept": swept,
    })
    advance(cur, run_of(cur, id))
    return end


class Outcomes:
    """Completions, failures, snoozes and releases on ``session``; the settle statements
    end with the claim ``claims`` picks."""

    def __init__(self, session: Session, claims: Claims) -> None:
        self.session = session
        self.claims = claims
        self._shapes: dict[str, tuple[list[str], tuple[int, ...]]] = {}  # statement -> (columns, positions)

    @translate
    def settle(
        self,
        *,
        owner: str,
        completions: Sequence[tuple[int, int, Any, Any]] = (),
        failures: Sequence[FailedAttempt] = (),
        queues: Sequence[str] = (),
        names: Sequence[str] = (),
        limit: int = 0,
        ttl: float = 0.0,
        kill_within: float = 0.0,
        start_now: int | None = None,
        workflows: bool = False,
        spawns: dict[tuple[int, int], Sequence["SpawnPlan"]] | None = None,
    ) -> Settled:
        """A tick's outcomes and the next claim in one statement (the hot path).

        ``completions`` are ``(id, generation, output, progress[, start delay])`` items (the
        delay: seconds from the claim to the handler's start, or None); ``failures`` are
        failed attempts. Each row gets its own CAS: still running under ``owner`` and
        its generation, a completion before its DB deadline, a failure with
        ``require_timed_out`` past it. A failed attempt's outcome is
        :func:`cyclone_mp.decisions.end_attempt`'s, in SQL; in a paused run a retried
        step is held paused. Rows whose CAS fails change nothing (late completions; for
        failures also timeouts not yet due on the DB clock, and without ``workflows``
        failures of workflow runs: write those with :meth:`fail`). Then up to ``limit``
        steps of ``queues``/``names`` are claimed with a ``ttl``-second lease (``kill_within``
        and ``start_now`` as for :meth:`Claims.claim`). With
        ``workflows`` (some outcome belongs to a workflow run) the workflow runs of the
        settled rows are advanced in the same transaction (a map's item only when it was
        the map's last to end, or was discarded: the others count down their map row in
        the statement, and leave the run as it is); otherwise it is one round
        trip and one commit. A tick without failures runs ``settle_completions``, the
        same statement without the failure CTEs (a smaller plan to start and run).
        ``spawns``: per completion's lease, the runs its handler spawned
        (:mod:`cyclone_mp.spawning`), inserted in the same transaction when its CAS held,
        before the runs move on; a spawned single-step run that ended moves its parent on.

        Raises:
            DatabaseUnavailable, QueryRejected: see :func:`translate`.
        """
        statement = self.claims.statement("settle" if failures else "settle_completions", queues, limit)
        with (self.session.tx() if workflows or spawns else self.session.conn.cursor()) as cur:
            cur.execute(Q[statement], {
                "owner": owner,
                **completion_arrays(completions),
                "fail_ids": [f.id for f in failures],
                "fail_generations": [f.generation for f in failures],
                "kinds": [f.kind for f in failures],
                "entries": [Jsonb(f.entry) for f in failures],
                "delays_us": [to_us(f.delay) for f in failures],
                "require_timed_out": [f.require_timed_out for f in failures],
                "fail_progress": [nullable_jsonb(f.progress) for f in failures],
                "names": list(names), "limit": max(0, limit), "ttl_us": to_us(ttl),
                "kill_within_us": to_us(kill_within), "inline_max": INLINE_MAX,
                "start_now": max(0, limit) if start_now is None else start_now, "in_tx": workflows,
                **self.claims.params(queues, statement),
            })
            # tuples, not a dict per row: only the claimed rows and the meta row become dicts
            cur.row_factory, row_factory = tuple_row, cur.row_factory
            rows = cur.fetchall()
            cur.row_factory = row_factory  # (a transaction's cursor goes on to advance runs)
            shape = self._shapes.get(statement)
            if shape is None:  # a statement's columns are its text's: read once (psycopg builds them per call)
                columns = [c.name for c in cur.description or ()]
                shape = (columns, tuple(columns.index(c) for c in ("id", "lease_generation", "run_id", "run_kind",
                                                                   "moves_run", "parent_id", "node", "step_name")))
                self._shapes[statement] = shape
            columns, (key, gen, run_id, run_kind, moves_run, parent_id, node, step_name) = shape
            ended = [r for r in rows if r[0] == "completed" or r[0] == "failed"]
            meta = next((dict(zip(columns, r)) for r in rows if r[0] == "meta"), None)
            wait = self.claims.keep_meta(meta, queues)
            completed = {(r[key], r[gen]) for r in ended if r[0] == "completed"}
            for lease, plans in (spawns or {}).items():  # before the run moves on: a node may wait for them
                if lease in completed:
                    drive(cur, operations.insert_spawned(plans))
            for run in sorted({r[run_id] for r in ended
                               if r[run_kind] == "workflow" and r[moves_run] is not False}):
                advance(cur, run)
            for run in sorted({r[run_id] for r in ended  # a spawned single-step run ended: its parent
                               if r[parent_id] is not None and r[run_kind] == "step"}):
                drive(cur, operations.advance_parent(run))
        failed = {(r[key], r[gen]): r[node] for r in ended if r[0] == "failed"}
        skipped = (meta or {}).get("input")  # "id:generation,..." (the meta row's input column)
        return Settled(
            completed=completed,
            failed=set(failed),
            claimed=[dict(zip(columns, r)) for r in rows if r[0] == "claimed"],
            wait=wait,
            failed_kinds=failed,
            discarded={(r[key], r[gen]) for r in ended if r[0] == "failed" and r[step_name] == "discarded"},
            skipped={(int(i), int(g)) for i, g in (k.split(":") for k in skipped.split(","))} if skipped else set(),
        )

    def complete(self, *, owner: str, items: Sequence[tuple[int, int, Any, Any]],
                 workflows: bool = True,
                 spawns: dict[tuple[int, int], Sequence["SpawnPlan"]] | None = None) -> set[tuple[int, int]]:
        """Success CASes for ``(id, generation, output, progress)`` items (:meth:`settle`
        without failures or claim, with its ``spawns``); returns the ``(id, generation)``
        leases whose CAS held."""
        if not items:
            return set()
        return _unless_skipped(self.settle(owner=owner, completions=items, workflows=workflows, spawns=spawns)).completed

    def fail_many(self, *, owner: str, items: Sequence[FailedAttempt],
                  workflows: bool = False) -> set[tuple[int, int]]:
        """Failed attempts (:meth:`settle` without completions or claim); returns the
        ``(id, generation)`` leases applied. Failures of workflow runs are applied only
        with ``workflows``."""
        if not items:
            return set()
        return _unless_skipped(self.settle(owner=owner, failures=items, workflows=workflows)).failed

    @translate
    def fail(
        self,
        *,
        owner: str,
        id: int,
        generation: int,
        kind: str,
        entry: dict[str, Any],
        backoff: Callable[[int], float],
        require_timed_out: bool = False,
        progress: Any = None,
    ) -> FailResult:
        """Record a failed attempt under the run lock and the CAS (``kind``, ``entry``,
        ``backoff``: see :func:`end_attempt`).

        Returns a :class:`FailResult`: ``"applied"``, ``"lost"`` (the row is no longer this
        attempt's; when the recovery sweep settled it first, what :meth:`annotate` adds is
        added to the sweep's entry) or ``"not_yet"`` (``require_timed_out`` and the DB
        deadline has not passed yet: the worker clock never shortens a durable timeout).
        Raises DatabaseError: DatabaseBusy at once when another session holds the run's
        row or the step's (NOWAIT: the outcome writer tries again later).
        """
        with self.session.tx() as cur:
            if self.session.one(cur, "lock_run_of_step_nowait", {"id": id}) is None:
                return FailResult("lost")
            row = self.session.one(cur, "lock_attempt", {"id": id, "owner": owner, "generation": generation})
            if row is None:
                # what the supervisor says it did ("child killed by the supervisor after ...")
                note = entry.get("message") if entry.get("killed_by_supervisor") else None
                self._annotate(cur, owner, id, generation, entry, note, progress)
                return FailResult("lost")
            if require_timed_out and not row["timed_out"]:
                return FailResult("not_yet")
            end = end_attempt(cur, id, row, kind, entry, backoff, progress)
        return FailResult("applied", (row["step_name"], end.error_kind), end.state == "discarded")

    @translate
    def annotate(self, *, owner: str, id: int, generation: int, entry: dict[str, Any], note: str | None,
                 progress: Any = None) -> None:
        """Complete the entry the recovery sweep wrote for this attempt's timeout with what
        its supervisor learnt after it (``annotate_attempt``): the forensics of ``entry``
        (:data:`FORENSIC_KEYS`), ``note`` added to its message, and, unless the step was
        claimed again since, ``progress`` and the handler's start delay (``entry["start_delay"]``,
        seconds). Once per attempt. Raises DatabaseError."""
        with self.session.tx() as cur:
            self._annotate(cur, owner, id, generation, entry, note, progress)

    @staticmethod
    def _annotate(cur: psycopg.Cursor, owner: str, id: int, generation: int, entry: dict[str, Any],
                  note: str | None, progress: Any) -> None:
        delay = entry.get("start_delay")
        cur.execute(Q["annotate_attempt"], {
            "id": id, "owner": owner, "generation": generation, "note": note,
            "forensics": Jsonb({k: v for k, v in entry.items() if k in FORENSIC_KEYS}),
            "progress": nullable_jsonb(progress),
            "start_delay_us": to_us(delay) if isinstance(delay, (int, float)) else None,
        })

    @translate
    def snooze(self, *, owner: str, id: int, generation: int, seconds: float, max_snoozes: int,
               entry: dict[str, Any], progress: Any = None) -> str | None:
        """A handler raised ``cy.Snooze(seconds)``: under the run lock and the attempt's
        CAS, the step is available again ``seconds`` later with no attempt spent, or
        discarded (``snooze_limit``) once it snoozed more than ``max_snoozes`` times.
        Returns the state written, or None when the row is no longer this attempt's."""
        with self.session.tx() as cur:
            run = self.session.one(cur, "lock_run_of_step_nowait", {"id": id})
            if run is None:
                return None
            row = self.session.one(cur, "snooze", {"id": id, "owner": owner, "generation": generation,
                                            "delay_us": to_us(seconds), "max_snoozes": max_snoozes,
                                            "entry": Jsonb(entry), "progress": nullable_jsonb(progress)})
            if row is None:
                return None
            if row["state"] == "discarded":
                advance(cur, row["run_id"])
            elif run["state"] == "paused":
                cur.execute(Q["hold_paused"], {"run_id": run["id"]})
            return row["state"]

    @translate
    def release(self, *, owner: str, id: int, generation: int) -> bool:
        """Give an unfinished step back at shutdown (available at once, nothing counted)."""
        with self.session.tx() as cur:
            run = self.session.one(cur, "lock_run_of_step_nowait", {"id": id})
            if run is None:
                return False
            cur.execute(Q["release"], {"id": id, "owner": owner, "generation": generation})
            released = cur.rowcount == 1
            if released and run["state"] == "paused":
                cur.execute(Q["hold_paused"], {"run_id": run["id"]})
            return released


def _unless_skipped(settled: Settled) -> Settled:
    """``settled``, unless a row's run was held locked by another session (its CAS not
    tried): then DatabaseBusy, as for a lock wait, so the caller writes it again later
    (the other items of a call of several may have been written: the writer passes one)."""
    if settled.skipped:
        raise DatabaseBusy("a run row is locked by another session", lock_wait=True)
    return settled
