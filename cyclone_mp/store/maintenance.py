"""What keeps the tables right beside the hot path: the recovery sweep and its turns,
workflow timers, schedules and the supervisors' registry."""

from __future__ import annotations

from typing import Any, Callable, Mapping, NamedTuple, Sequence

from psycopg.types.json import Jsonb

from .. import decisions
from .base import translate
from . import operations
from .queries import Q, to_us


class Turn(NamedTuple):
    """What :meth:`MaintenanceQueries.sweep_turn` found: whether the caller took the turn,
    the seconds until the turn it saw ends, and the seconds since the task last succeeded
    (None: never)."""

    mine: bool
    wait: float
    since_success: float | None


class MaintenanceQueries:
    """The sweep, timers, schedules and the registry (a part of
    :class:`~cyclone_mp.store.Store`)."""

    # -- recovery sweep -----------------------------------------------------------------

    @translate
    def sweep_turn(self, owner: str, every: float, task: str = "sweep") -> "Turn":
        """Take the recovery sweep's turn (or another maintenance ``task``'s: ``"history"``)
        for all supervisors when the last one is at least ``every`` seconds old (one
        statement, a row lock for its length).

        Returns a :class:`Turn`: ``mine`` is True when ``owner`` took it (it does the
        task now; the next turn is ``every`` seconds away), else ``wait`` is the seconds
        until the turn it saw ends (0 or more); ``since_success`` the seconds since a pass
        of the task last succeeded on any supervisor (:meth:`maintenance_succeeded`), or
        None when none did."""
        with self.conn.cursor() as cur:
            cur.execute(Q["sweep_turn"], {"owner": owner, "every_us": to_us(every), "task": task})
            row = cur.fetchone()
        since = row["since_success"]
        if row["mine"]:
            return Turn(True, every, since)
        return Turn(False, max(0.0, float(row["due_in"] if row["due_in"] is not None else every)), since)

    @translate
    def maintenance_succeeded(self, task: str = "sweep") -> None:
        """Record that a pass of the maintenance ``task`` ended without an error now (the
        database clock): every supervisor reads it with its turn (:meth:`sweep_turn`)."""
        with self.conn.cursor() as cur:
            cur.execute(Q["maintenance_succeeded"], {"task": task})

    @translate
    def sweep_candidates(self, limit: int = 100) -> list[dict[str, Any]]:
        """Running rows whose lease expired or whose DB deadline passed (one page)."""
        with self.conn.cursor() as cur:
            cur.execute(Q["sweep_candidates"], {"limit": limit})
            return cur.fetchall()

    @translate
    def expire(self, id: int, backoff_for: Callable[[str | None], Callable[[int], float]], entry: dict[str, Any]) -> str:
        """Settle one sweep candidate under the run lock then the step lock.

        Returns the action taken: ``"timeout"``, ``"reclaim"``, ``"reclaim_limit"`` or
        ``"none"`` (renewed, finished or gone meanwhile). An attempt it ends (timeout,
        reclaim_limit) is in :attr:`last_ended` afterwards.
        """
        self.last_ended, self.last_discarded = None, None
        with self._tx() as cur:
            if self._one(cur, "lock_run_of_step", {"id": id}) is None:
                return "none"
            row = self._one(cur, "sweep_recheck", {"id": id})
            if row is None:
                return "none"
            action = decisions.expiry(
                timed_out=bool(row["timed_out"]), lease_expired=bool(row["lease_expired"]),
                reclaims=row["reclaims"], max_reclaims=row["max_reclaims"],
            ).action
            if action == "timeout":
                end = self._end_attempt(cur, id, row, decisions.TIMEOUT, {
                    **entry, "message": "timed out (database clock); settled by the recovery sweep",
                    "lease_owner": row["lease_owner"], "lease_generation": row["lease_generation"],
                }, backoff_for(row["step_name"]), swept=True)
                ended = end.error_kind
                if end.state == "discarded":
                    self.last_discarded = {"run_id": row["run_id"], "node": row["node"], "step_name": row["step_name"],
                                           "error_kind": ended, "error": "timed out (database clock)"}
            elif action == "reclaim":
                cur.execute(Q["reclaim"], {"id": id})
                cur.execute(Q["hold_paused"], {"run_id": self._run_of(cur, id)})
                cur.execute(Q["notify"], {"queue": row["queue"]})  # claimable at once, anywhere
            elif action == "reclaim_limit":
                n = row["reclaims"]
                message = f"lease expired after {n} reclaim{'' if n == 1 else 's'} (max_reclaims={row['max_reclaims']})"
                cur.execute(Q["discard_reclaim_limit"], {"id": id, "error": message, "entry": Jsonb({
                    **entry, "attempt": row["attempt"], "kind": decisions.RECLAIM_LIMIT, "message": message,
                    "lease_owner": row["lease_owner"], "lease_generation": row["lease_generation"],
                })})
                self._advance(cur, self._run_of(cur, id))
                ended = decisions.RECLAIM_LIMIT
                self.last_discarded = {"run_id": row["run_id"], "node": row["node"], "step_name": row["step_name"],
                                       "error_kind": ended, "error": message}
        if action in ("timeout", "reclaim_limit"):
            self.last_ended = (row["step_name"], ended)
        return action

    @translate
    def mark_dead(self, keys: Sequence[tuple[int, int]]) -> int:
        """Record that the processes of these ``(step id, lease generation)`` attempts,
        ended after a cancel or a timeout, are dead and reaped: their steps may run again
        (and their concurrency slots go to others) at once, without waiting for
        ``dead_by``. Wakes the supervisors of the queues concerned; returns how many
        queues it woke."""
        if not keys:
            return 0
        with self.conn.cursor() as cur:
            cur.execute(Q["mark_dead"], {"ids": [k[0] for k in keys], "generations": [k[1] for k in keys]})
            return int(cur.fetchone()["woken"])

    @translate
    def fire_due_timers(self, limit: int = 100) -> int:
        """Complete timer nodes due on the database clock; returns how many runs moved."""
        with self.conn.cursor() as cur:
            cur.execute(Q["due_timer_runs"], {"limit": limit})
            run_ids = [r["run_id"] for r in cur.fetchall()]
        for run_id in run_ids:
            with self._tx() as cur:
                if self._one(cur, "lock_run", {"run_id": run_id}) is not None:
                    self._advance(cur, run_id)
        return len(run_ids)

    # -- schedules (the logic is cyclone_mp.schedules) --------------------------------------

    @translate
    def sync_schedules(self, items: Sequence[tuple[str, str, str, dict[str, Any]]], active_s: float) -> None:
        """Create or refresh the rows of ``(name, fingerprint, target, spec)`` schedules and
        of their definitions (a new definition is in force from now on: see due_schedules),
        then drop the definitions of those schedules that no supervisor declared within
        ``active_s`` seconds. Three statements, each its own transaction, each locking
        rows of one table in name order."""
        items = sorted(items)
        names = [i[0] for i in items]
        targets, specs = [i[2] for i in items], [Jsonb(i[3]) for i in items]
        with self.conn.cursor() as cur:
            cur.execute(Q["sync_schedules"], {"names": names, "targets": targets, "specs": specs})
            cur.execute(Q["sync_schedule_definitions"], {
                "names": names, "fingerprints": [i[1] for i in items], "targets": targets, "specs": specs,
                "active_us": to_us(active_s),
            })
            cur.execute(Q["forget_schedule_definitions"], {"names": names, "active_us": to_us(active_s)})

    @translate
    def tick_schedules(self, mine: Mapping[str, str], active_s: float,
                       decide: Callable[[dict[str, Any]], dict[str, Any]]) -> int:
        """In one transaction: lock the due rows of the schedules ``mine`` names (name ->
        the caller's definition's fingerprint) whose definition in force is the caller's
        (SKIP LOCKED), read which definition is in force again now that they are held, and
        for each still the caller's call ``decide(row)`` (the row with ``since``: when
        that definition came into force; it may enqueue runs on this connection, inside
        the transaction) and write the row it returns. Returns how many rows were decided."""
        names = sorted(mine)
        with self._tx() as cur:
            cur.execute(Q["due_schedules"], {"names": names, "fingerprints": [mine[n] for n in names],
                                             "active_us": to_us(active_s)})
            rows = cur.fetchall()
            if not rows:
                return 0
            cur.execute(Q["schedules_in_force"], {"names": [r["name"] for r in rows], "active_us": to_us(active_s)})
            in_force = {r["name"]: r for r in cur.fetchall()}
            decided = 0
            for row in rows:
                now_in_force = in_force.get(row["name"])
                if now_in_force is None or now_in_force["fingerprint"] != mine[row["name"]]:
                    continue  # another definition was declared meanwhile: its supervisors decide
                new = decide({**row, "since": now_in_force["first_seen_at"]})
                cur.execute(Q["advance_schedule"], {**new, "spec": Jsonb(new["spec"])})
                decided += 1
            return decided

    @translate
    def get_schedule(self, name: str) -> dict[str, Any] | None:
        """One schedule row, or None."""
        with self.conn.cursor() as cur:
            return self._one(cur, "get_schedule", {"name": name})

    @translate
    def list_schedules(self, active_s: float = 60.0) -> list[dict[str, Any]]:
        """Every schedule row with the database clock (``now``), ``age`` (seconds since a
        supervisor that defines it last ticked) and ``definitions``: those a supervisor
        declared within ``active_s`` seconds (``fingerprint``, ``target``, ``spec``,
        ``first_seen_at``, ``seen_at``, ``in_force``), the one in force first."""
        with self.conn.cursor() as cur:
            cur.execute(Q["list_schedules"])
            rows = cur.fetchall()
            cur.execute(Q["list_schedule_definitions"], {"active_us": to_us(active_s)})
            definitions: dict[str, list[dict[str, Any]]] = {}
            for d in cur.fetchall():
                listed = definitions.setdefault(d.pop("name"), [])
                listed.append({**d, "in_force": not listed})
        return [{**row, "definitions": definitions.get(row["name"], [])} for row in rows]

    @translate
    def delete_schedule(self, name: str, active_s: float) -> dict[str, Any] | None:
        """Delete the schedule row ``name`` unless a supervisor ticked it within ``active_s``
        seconds: ``{"age", "deleted"}``, or None when there is no such row."""
        with self._tx() as cur:
            cur.execute(Q["delete_schedule"], {"name": name, "active_s": active_s})
            return cur.fetchone()

    # -- the registry of supervisors ---------------------------------------------------------

    @translate
    def register_worker(self, *, id: str, hostname: str, pid: int, info: dict[str, Any], live: float = 15.0,
                        queues: Sequence[str] = ()) -> tuple[int, list[str]]:
        """Announce or refresh this supervisor's registry row; returns how many supervisors
        are live (this one and those whose row was refreshed within ``live`` seconds) and
        which of ``queues`` are paused."""
        with self.conn.cursor() as cur:
            cur.execute(Q["register_worker"], {"id": id, "hostname": hostname, "pid": pid, "info": Jsonb(info),
                                               "live_us": to_us(live), "queues": list(queues)})
            row = cur.fetchone()
            return int(row["live"]), list(row["paused"] or [])

    @translate
    def queue_depths(self, queues: Sequence[str], cap: int = 100_000) -> list[dict[str, Any]]:
        """Per queue: ``queue``, ``depth`` (claimable steps, at most ``cap``) and ``oldest``
        (seconds the oldest of them has been claimable, or None)."""
        with self.conn.cursor() as cur:
            cur.execute(Q["queue_depths"], {"queues": list(queues), "cap": cap})
            return cur.fetchall()

    @translate
    def unregister_worker(self, id: str) -> None:
        """Remove this supervisor's registry row."""
        with self.conn.cursor() as cur:
            cur.execute(Q["unregister_worker"], {"id": id})

    def list_workers(self, within: float = 15.0) -> list[dict[str, Any]]:
        """Supervisors that refreshed their row within ``within`` seconds."""
        return self.run(operations.list_workers(within))


