"""The supervisor's hot path: claims, lease renewals and every attempt's CAS write
(SPEC 1 and 4; the completion CAS is :meth:`LeaseQueries.settle`)."""

from __future__ import annotations

import json
from typing import TYPE_CHECKING, Any, Callable, Sequence

from psycopg.types.json import Jsonb

from .base import translate
from ..protocol import DEFAULT_MAX_PAYLOAD, upstream_limit
from .base import drive
from . import operations
from .queries import FORENSIC_KEYS, INLINE_MAX, Q, FailedAttempt, Settled, nullable_jsonb, to_us

if TYPE_CHECKING:
    from ..spawning import SpawnPlan


class LeaseQueries:
    """Claims, renewals, completions, failures and releases (a part of
    :class:`~cyclone_mp.store.Store`)."""

    #: The claim statements, from the least work to the most: each takes every step the
    #: ones before it take, and more.
    CLAIMS = ("_plain", "_fair", "_concurrency", "")
    _FOR_MARK = {None: "_plain", "keys": "_fair", "limits": "_concurrency", "rates": ""}

    def _claim_statement(self, name: str, queues: Sequence[str], limit: int) -> str:
        """Which claim a statement of ``name`` uses, from the least to the most work:

        - ``name_plain``, the claim of before: no requested queue was ever entered by a
          step with a key or a limit (it takes no such step);
        - ``name_fair``: keyed steps did, no limited one (no slots; it takes no limited step);
        - ``name_concurrency``: a step with a concurrency limit did, none with a rate limit
          (concurrency slots only; it takes no rate-limited step);
        - ``name``, the full limited claim: a rate-limited step did, or the marks of these
          queues are not known yet (it takes every kind of step).

        The marks (cyclone_flow_queues, written at enqueue, never cleared) come back in
        every claim statement's meta row (:meth:`_claim_meta`), so they cost no round trip
        of their own (under 250 ms of latency, a read of its own per claim pushed claims
        past their bound). A claim chosen from older marks never passes a limit (each
        claim leaves alone what it is not made for); :meth:`claim` claims again at once
        when the marks it got back call for a claim that takes more."""
        if limit <= 0:
            return name + "_plain"
        if self.flow_marks is None or not set(queues) <= self._marks_for:
            return name
        rank = max((self.CLAIMS.index(self._FOR_MARK[self.flow_marks.get(q)]) for q in queues), default=0)
        return name + self.CLAIMS[rank]

    @classmethod
    def _rank(cls, statement: str) -> int:
        """The place of a claim statement in :data:`CLAIMS` (more: it takes more kinds of steps)."""
        return next((i for i, suffix in enumerate(cls.CLAIMS[:-1]) if statement.endswith(suffix)), len(cls.CLAIMS) - 1)

    def _claim_params(self, queues: Sequence[str], statement: str) -> dict[str, Any]:
        """The fairness cursors of a claim (per queue, the key its last walk ended at) and
        which limited steps it may take: ``limits``, any (the limited claims); ``rates``,
        rate-limited ones too (the full claim only)."""
        return {"queues": list(queues), "cursors": [self.fair_cursors.get(q) for q in queues],
                "limits": not statement.endswith(("_fair", "_plain")),
                "rates": not statement.endswith(("_fair", "_plain", "_concurrency"))}

    def _claim_meta(self, meta: dict[str, Any] | None, queues: Sequence[str]) -> None:
        """Keep what a claim's meta row says: the queues' marks, where each queue's walk
        ended, and the rate-limit wait (:attr:`claim_wait`)."""
        self.claim_wait = None
        if meta is None:
            return
        if meta.get("step_name") is not None:
            self.flow_marks = json.loads(meta["step_name"])
            self._marks_for = frozenset(queues)
        if meta.get("node"):
            self.fair_cursors.update(json.loads(meta["node"]))
        wait = meta.get("timeout")
        self.claim_wait = None if wait is None else float(wait)

    @translate
    def claim(self, *, owner: str, queues: Sequence[str], names: Sequence[str], limit: int, ttl: float,
              kill_within: float = 0.0, start_now: int | None = None) -> list[dict[str, Any]]:
        """Claim up to ``limit`` available steps (SKIP LOCKED), one statement.

        Fair by key (round-robin within each queue) and within the steps' concurrency
        and rate limits; afterwards :attr:`claim_wait` is the seconds until a
        rate-limited step held back by this claim may start, or None. When the marks
        that came back call for a claim that takes more kinds of steps than the one just
        made (a queue's first keyed or limited step), and it took fewer than ``limit``,
        the rest is claimed at once with that one (a second statement, once per change of
        a queue's marks). ``kill_within`` (seconds) is stored on each claimed row: how long
        after a cancel the claimer's handler may live (:attr:`Config.kill_within`).
        ``start_now``: how many of the steps claimed can start at once (idle children;
        default ``limit``): no more rate-limited steps are claimed, since a rate limit
        counts handler starts (each claimed rate-limited row has ``rated`` true).
        """
        if limit <= 0 or not names:
            self.claim_wait = None
            return []
        claimed: list[dict[str, Any]] = []
        while True:
            statement = self._claim_statement("claim", queues, limit - len(claimed))
            with self.conn.cursor() as cur:
                cur.execute(Q[statement], {
                    "owner": owner, "names": list(names), "limit": limit - len(claimed), "ttl_us": to_us(ttl),
                    "kill_within_us": to_us(kill_within), "inline_max": INLINE_MAX,
                    "start_now": limit if start_now is None else max(0, start_now - len(claimed)), **self._claim_params(queues, statement),
                })
                rows = cur.fetchall()
            self._claim_meta(next((r for r in rows if r["id"] is None), None), queues)
            claimed += [r for r in rows if r["id"] is not None]
            if len(claimed) >= limit or self._rank(self._claim_statement("claim", queues, 1)) <= self._rank(statement):
                return claimed

    @translate
    def heartbeat(self, *, id: int, owner: str, generation: int, ttl: float, progress: Any = None,
                  start_delay: float | None = None) -> bool:
        """Renew one lease (the seed's WHERE clause); False when it matched no row. With it
        go the latest ``progress`` and the handler's ``start_delay`` (seconds after the
        claim), when given."""
        with self.conn.cursor() as cur:
            cur.execute(Q["heartbeat"], {
                "id": id, "owner": owner, "generation": generation, "ttl_us": to_us(ttl),
                "progress": nullable_jsonb(progress), "start_delay_us": to_us(start_delay),
            })
            return cur.rowcount == 1

    @translate
    def renew_many(self, *, owner: str, items: Sequence[tuple[int, int, Any]], ttl: float) -> list[bool]:
        """Renew several leases, ``(id, generation, progress or None[, start delay or None])``
        items, in one round
        trip: still one renewal per step, addressed by id, with the seed's WHERE clause
        (:meth:`heartbeat`), sent together (psycopg's pipelined ``executemany``). They share
        one implicit transaction: a renewal that fails (a lock wait past ``lock_timeout``)
        fails them all, and the caller renews one by one. Returns, per item, whether it
        matched its row."""
        if not items:
            return []
        with self.conn.cursor() as cur:
            cur.executemany(Q["heartbeat"], [
                {"id": item[0], "owner": owner, "generation": item[1], "ttl_us": to_us(ttl),
                 "progress": nullable_jsonb(item[2]), "start_delay_us": to_us(item[3] if len(item) > 3 else None)}
                for item in items
            ], returning=True)
            matched = []
            while True:
                matched.append(cur.rowcount == 1)
                if not cur.nextset():
                    break
            return matched

    @translate
    def load_payload(self, id: int, *, statement_timeout: float | None = None,
                     max_upstream: int = upstream_limit(DEFAULT_MAX_PAYLOAD)) -> dict[str, Any] | None:
        """A claimed step's ``input`` and ``upstream`` as JSON text, and ``upstream_bytes``
        and ``upstream_outputs`` (the size of its upstream object and how many outputs it
        holds); ``upstream`` is None when the step has no upstream node or when the object
        would be over ``max_upstream`` bytes (:func:`~cyclone_mp.protocol.upstream_limit`);
        ``maps``: its upstream map nodes, ``[[node, items], ...]`` or None (their outputs are
        read in pages: :meth:`map_outputs_page`); ``spawned``: for a step that waited for
        the runs its upstream spawned, those runs as JSON text (``ctx.spawned``), else None.
        None when the step is gone. ``statement_timeout`` (seconds): the statement's own,
        in place of the session's (a write's bound: building a fan-in of hundreds of
        megabytes takes longer)."""
        with self._tx() as cur:
            if statement_timeout is not None:
                cur.execute(Q["local_statement_timeout"], {"timeout": f"{max(1, int(statement_timeout * 1000))}ms"})
            return self._one(cur, "load_payload", {"id": id, "max_upstream": max_upstream})

    @translate
    def lease_state(self, id: int) -> dict[str, Any] | None:
        """The row's state, owner, generation and whether its DB deadline passed."""
        with self.conn.cursor() as cur:
            return self._one(cur, "lease_state", {"id": id})

    @translate
    def settle(
        self,
        *,
        owner: str,
        completions: Sequence[tuple[int, int, Any, Any]] = (),
        failures: Sequence["FailedAttempt"] = (),
        queues: Sequence[str] = (),
        names: Sequence[str] = (),
        limit: int = 0,
        ttl: float = 0.0,
        kill_within: float = 0.0,
        start_now: int | None = None,
        workflows: bool = False,
        spawns: dict[tuple[int, int], Sequence["SpawnPlan"]] | None = None,
    ) -> "Settled":
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
        and ``start_now`` as for :meth:`claim`). With
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
        statement = self._claim_statement("settle" if failures else "settle_completions", queues, limit)
        with (self._tx() if workflows or spawns else self.conn.cursor()) as cur:
            cur.execute(Q[statement], {
                "owner": owner,
                "ids": [i[0] for i in completions],
                "leases": [f"{i[0]}:{i[1]}" for i in completions],
                "outputs": [Jsonb(i[2]) for i in completions],
                "progress": [nullable_jsonb(i[3]) for i in completions],
                "start_delays_us": [to_us(i[4]) if len(i) > 4 else None for i in completions],
                "fail_ids": [f.id for f in failures],
                "fail_generations": [f.generation for f in failures],
                "kinds": [f.kind for f in failures],
                "entries": [Jsonb(f.entry) for f in failures],
                "delays_us": [to_us(f.delay) for f in failures],
                "require_timed_out": [f.require_timed_out for f in failures],
                "fail_progress": [nullable_jsonb(f.progress) for f in failures],
                "names": list(names), "limit": max(0, limit), "ttl_us": to_us(ttl),
                "kill_within_us": to_us(kill_within), "inline_max": INLINE_MAX,
                "start_now": max(0, limit) if start_now is None else start_now, "in_tx": workflows, **self._claim_params(queues, statement),
            })
            rows = cur.fetchall()
            self._claim_meta(next((r for r in rows if r["what"] == "meta"), None), queues)
            completed = {(r["id"], r["lease_generation"]) for r in rows if r["what"] == "completed"}
            for lease, plans in (spawns or {}).items():  # before the run moves on: a node may wait for them
                if lease in completed:
                    drive(cur, operations.insert_spawned(plans))
            for run_id in sorted({r["run_id"] for r in rows
                                  if r["what"] in ("completed", "failed") and r["run_kind"] == "workflow"
                                  and r["moves_run"] is not False}):
                self._advance(cur, run_id)
            for run_id in sorted({r["run_id"] for r in rows  # a spawned single-step run ended: its parent
                                  if r["what"] in ("completed", "failed") and r["parent_id"] is not None
                                  and r["run_kind"] == "step"}):
                drive(cur, operations.advance_parent(run_id))
        failed = {(r["id"], r["lease_generation"]): r["node"] for r in rows if r["what"] == "failed"}
        return Settled(
            completed={(r["id"], r["lease_generation"]) for r in rows if r["what"] == "completed"},
            failed=set(failed),
            claimed=[r for r in rows if r["what"] == "claimed"],
            wait=self.claim_wait,
            failed_kinds=failed,
            discarded={(r["id"], r["lease_generation"]) for r in rows
                       if r["what"] == "failed" and r["step_name"] == "discarded"},
        )

    def complete(self, *, owner: str, items: Sequence[tuple[int, int, Any, Any]],
                 workflows: bool = True,
                 spawns: dict[tuple[int, int], Sequence["SpawnPlan"]] | None = None) -> set[tuple[int, int]]:
        """Success CASes for ``(id, generation, output, progress)`` items (:meth:`settle`
        without failures or claim, with its ``spawns``); returns the ``(id, generation)``
        leases whose CAS held."""
        if not items:
            return set()
        return self.settle(owner=owner, completions=items, workflows=workflows, spawns=spawns).completed

    def fail_many(self, *, owner: str, items: Sequence["FailedAttempt"],
                  workflows: bool = False) -> set[tuple[int, int]]:
        """Failed attempts (:meth:`settle` without completions or claim); returns the
        ``(id, generation)`` leases applied. Failures of workflow runs are applied only
        with ``workflows``."""
        if not items:
            return set()
        return self.settle(owner=owner, failures=items, workflows=workflows).failed

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
    ) -> str:
        """Record a failed attempt under the run lock and the CAS.

        Returns ``"applied"``, ``"lost"`` (the row is no longer this attempt's) or
        ``"not_yet"`` (``require_timed_out`` and the DB deadline has not passed yet:
        the worker clock never shortens a durable timeout).
        """
        self.last_ended, self.last_discarded = None, False
        with self._tx() as cur:
            if self._one(cur, "lock_run_of_step", {"id": id}) is None:
                return "lost"
            row = self._one(cur, "lock_attempt", {"id": id, "owner": owner, "generation": generation})
            if row is None:
                forensics = {k: v for k, v in entry.items() if k in FORENSIC_KEYS}
                if forensics:
                    cur.execute(Q["annotate_attempt"], {
                        "id": id, "owner": owner, "generation": generation, "forensics": Jsonb(forensics),
                        # what the supervisor says it did ("child killed by the supervisor after ...")
                        "note": entry.get("message") if forensics.get("killed_by_supervisor") else None,
                    })
                return "lost"
            if require_timed_out and not row["timed_out"]:
                return "not_yet"
            end = self._end_attempt(cur, id, row, kind, entry, backoff, progress)
        self.last_ended = (row["step_name"], end.error_kind)
        self.last_discarded = end.state == "discarded"
        return "applied"

    @translate
    def snooze(self, *, owner: str, id: int, generation: int, seconds: float, max_snoozes: int,
               entry: dict[str, Any], progress: Any = None) -> str | None:
        """A handler raised ``cy.Snooze(seconds)``: under the run lock and the attempt's
        CAS, the step is available again ``seconds`` later with no attempt spent, or
        discarded (``snooze_limit``) once it snoozed more than ``max_snoozes`` times.
        Returns the state written, or None when the row is no longer this attempt's."""
        with self._tx() as cur:
            run = self._one(cur, "lock_run_of_step", {"id": id})
            if run is None:
                return None
            row = self._one(cur, "snooze", {"id": id, "owner": owner, "generation": generation,
                                            "delay_us": to_us(seconds), "max_snoozes": max_snoozes,
                                            "entry": Jsonb(entry), "progress": nullable_jsonb(progress)})
            if row is None:
                return None
            if row["state"] == "discarded":
                self._advance(cur, row["run_id"])
            elif run["state"] == "paused":
                cur.execute(Q["hold_paused"], {"run_id": run["id"]})
            return row["state"]

    @translate
    def release(self, *, owner: str, id: int, generation: int) -> bool:
        """Give an unfinished step back at shutdown (available at once, nothing counted)."""
        with self._tx() as cur:
            run = self._one(cur, "lock_run_of_step", {"id": id})
            if run is None:
                return False
            cur.execute(Q["release"], {"id": id, "owner": owner, "generation": generation})
            released = cur.rowcount == 1
            if released and run["state"] == "paused":
                cur.execute(Q["hold_paused"], {"run_id": run["id"]})
            return released
