"""Named SQL and the typed methods that run it (with :mod:`cyclone_mp.connections`, the
only modules that talk to psycopg).

Every query lives in ``sql/queries.sql`` under a ``-- name:`` header (STYLE pattern 1);
migrations are the numbered files in ``sql/migrations`` applied under an advisory lock.
psycopg errors become :class:`~cyclone_mp.errors.DatabaseError` with the cause kept
(STYLE pattern 2). The store never decides a transition itself: it reads rows under
their locks and asks :mod:`cyclone_mp.decisions`.
"""

from __future__ import annotations

import contextlib
import dataclasses
import datetime as dt
import functools
import importlib.resources
import json
import logging
import re
from typing import Any, Callable, Iterator, Sequence

import psycopg
import psycopg.sql
from psycopg.rows import dict_row
from psycopg.types.json import Jsonb

from . import decisions
from .backoff import delay_after
from .connections import (  # the connections and their errors; the rest of the names are re-exported
    STALE_PLAN_LOG, PooledAsyncConnection, PooledConnection, PooledCursor, check_pooled, classify, client_sessions,
    configure_session, connect, create_database, database_dsn, drop_database, list_databases, redact, server_spoke,
    session_settings, stale_plan, tcp_bounds, translate, vacuum_hot_tables,
)
from .errors import DatabaseError, DatabaseUnavailable, QueryRejected
from .limits import NO_LIMITS, Limits

log = logging.getLogger("cyclone_mp.store")

#: Keys of an error entry that describe how the child ended (SPEC 4, "Every attempt that ends").
FORENSIC_KEYS = frozenset({
    "pid", "exit_code", "signal", "signal_name", "killed_by_supervisor", "trigger",
    "cpu_seconds", "peak_rss_kb", "elapsed", "worker", "tree", "limits", "cause", "enforced_by",
})
#: Stored bytes (``pg_column_size``) up to which a claimed row's input and upstream
#: outputs come with its claim; a bigger row comes without them ("big") and the
#: supervisor loads them alone (:meth:`Store.load_payload`), so one huge row never slows
#: a claim past its bound nor holds back its neighbours (issue 18).
INLINE_MAX = 512 * 1024
MIGRATION_LOCK = 0x6379636C6F6E65  # "cyclone": pg_advisory_xact_lock key for migrate()
NOTIFY_CHANNEL = "cyclone_mp"


def _code(line: str) -> str:
    """A line of SQL without its trailing ``--`` comment (none of ours is inside a string
    literal): shorter texts keep the hot statements under psycopg's 4,096-character
    limit for caching a query's parsed form (above it, each call re-parsed ~6,700
    characters: about 75 us)."""
    at = line.find("--")
    while at >= 0:
        if line.count("'", 0, at) % 2 == 0:
            return line[:at].rstrip()
        at = line.find("--", at + 2)
    return line


def _load_queries() -> dict[str, str]:
    text = importlib.resources.files("cyclone_mp.sql").joinpath("queries.sql").read_text()
    queries: dict[str, str] = {}
    for block in re.split(r"^-- name: ", text, flags=re.M)[1:]:
        name, _, body = block.partition("\n")
        # without comments and indentation (none of our literals spans lines)
        body = "\n".join(code.strip() for code in map(_code, body.strip().splitlines()) if code.strip())
        if name.strip() in queries:  # a second block of one name would silently replace the first
            raise RuntimeError(f"queries.sql: two blocks named {name.strip()!r}")
        queries[name.strip()] = body.strip().rstrip(";")
    # Fragments (names ending in _ctes or _expr) are spliced into the queries that cite
    # them, and into the fragments that cite them, until none is left.
    fragments = {name: sql for name, sql in queries.items() if name.endswith(("_ctes", "_expr"))}

    def splice(body: str) -> str:
        for _ in range(10):
            spliced = re.sub(r"\{(\w+_(?:ctes|expr))\}", lambda m: fragments.get(m[1], m[0]), body)
            if spliced == body:
                break
            body = spliced
        if left := re.findall(r"\{\w+_(?:ctes|expr)\}", body):
            raise RuntimeError(f"queries.sql: unknown or circular fragments {left}")
        return body
    return {name: splice(body) for name, body in queries.items()}


Q = _load_queries()

#: psycopg keeps the parsed form of a query only up to this many characters (its
#: ``MAX_CACHED_STATEMENT_LENGTH``, 4,096); longer ones are parsed again at every call.
#: The claim and settle statements grew past it with the fair, limited claim (issue 21):
#: parsing settle_completions (10,600 characters) took 35 us a call, against 0.07 us
#: cached. The limit is a module constant read at each call; it is raised to fit them.
PARSE_CACHE_LENGTH = 16_384


def _fit_parse_cache() -> None:
    from psycopg import _queries

    if getattr(_queries, "MAX_CACHED_STATEMENT_LENGTH", PARSE_CACHE_LENGTH) < PARSE_CACHE_LENGTH:
        _queries.MAX_CACHED_STATEMENT_LENGTH = PARSE_CACHE_LENGTH


with contextlib.suppress(ImportError):  # a psycopg without it: the statements are parsed at each call
    _fit_parse_cache()


def _migrations() -> list[tuple[int, str, str]]:
    folder = importlib.resources.files("cyclone_mp.sql.migrations")
    found = []
    for entry in folder.iterdir():
        match = re.match(r"^(\d+)_.*\.sql$", entry.name)
        if match:
            found.append((int(match.group(1)), entry.name, entry.read_text()))
    return sorted(found)




def nullable_jsonb(value: Any) -> Jsonb | None:
    """``value`` as a jsonb parameter, or SQL NULL (not JSON ``null``) for None."""
    return None if value is None else Jsonb(value)


def node_params(node: "NodeRow") -> dict[str, Any]:
    """A step row's key, flow limits (issue 21) and resource limits (issue 20) as query parameters."""
    return {
        "key": node.concurrency_key, "concurrency": node.concurrency,
        "rate_count": node.rate_limit[0] if node.rate_limit else None,
        "rate_period_us": to_us(node.rate_limit[1]) if node.rate_limit else None,
        **limit_params(node.limits),
    }


def limit_params(limits: Limits) -> dict[str, Any]:
    """A step row's resource-limit columns as query parameters (issue 20)."""
    return {"memory_limit": limits.memory, "cpu_limit": limits.cpu, "max_processes": limits.processes,
            "max_open_files": limits.open_files}


def to_us(seconds: float | None) -> int | None:
    """Seconds to whole microseconds (how durations reach SQL)."""
    return None if seconds is None else int(round(seconds * 1_000_000))




@dataclasses.dataclass(frozen=True)
class NodeRow:
    """One step row to insert at enqueue (a node of the run)."""

    node: str
    step_name: str | None
    kind: str
    depends_on: Sequence[str]
    queue: str
    priority: int
    state: str
    max_attempts: int
    max_reclaims: int | None
    timeout: float | None
    timer_delay: float | None = None
    due_at: dt.datetime | None = None
    backoff: Any = None  # a stored backoff spec (seconds or a list of seconds), or None
    limits: Limits = NO_LIMITS  # resource caps of each attempt (issue 20)
    concurrency_key: str = ""  # its fairness and limit group ('' for none)
    concurrency: int | None = None  # at most this many running per (step, key)
    rate_limit: tuple[int, float] | None = None  # at most count starts per seconds per (step, key)

    @functools.cached_property
    def enqueue_params(self) -> dict[str, Any]:
        """The parameters of ``enqueue_step`` that come from this row alone (its queue,
        priority, attempts, timeout, backoff, key, flow and resource limits), computed once
        per row: a client reuses a step's row for every enqueue without per-enqueue
        options (issue 23). Callers copy it, never change it."""
        return {"queue": self.queue, "priority": self.priority, "max_attempts": self.max_attempts,
                "max_reclaims": self.max_reclaims, "timeout_us": to_us(self.timeout),
                "backoff": nullable_jsonb(self.backoff), **node_params(self)}

    @property
    def flow(self) -> bool:
        """True when the step has a key or a limit: its queue needs the fair, limited claim."""
        return bool(self.concurrency_key) or self.limited

    @property
    def limited(self) -> bool:
        """True when a limit needs slots (see :meth:`Store.ensure_slots`)."""
        return self.concurrency is not None or self.rate_limit is not None


class Store:
    """Typed access to the cyclone tables over one autocommit connection.

    Methods that change several rows run in one transaction. All methods raise
    :class:`DatabaseError` when the database fails.
    """

    def __init__(self, conn: psycopg.Connection) -> None:
        self.conn = conn
        self.commits = 0  # transactions this Store committed
        #: Per queue, the concurrency key the last claim's walk ended at: the next claim
        #: serves the keys after it first (round-robin, issue 21).
        self.fair_cursors: dict[str, str] = {}
        #: After a claim: seconds until a step that a rate limit held back may start
        #: (the supervisor's next poll need not come sooner), or None.
        self.claim_wait: float | None = None
        #: The marks of the queues the last claim statement asked for (see
        #: :meth:`_claim_statement`), as its meta row said: queue -> "keys", "limits" or
        #: "rates" (a queue without a mark is plain); None until a claim said.
        self.flow_marks: dict[str, str] | None = None
        self._marks_for: frozenset[str] = frozenset()  # the queues flow_marks covers
        #: ``(step name, error kind)`` of the attempt the last :meth:`fail` or :meth:`expire`
        #: ended (what it stored), or None: the supervisor's metrics count it (issue 24).
        self.last_ended: tuple[str | None, str] | None = None
        self.failed_before_commit = False  # the last transaction failed in its body: nothing of it committed

    @classmethod
    def open(cls, dsn: str, *, generic_plans: bool = False, idle_in_transaction: float | None = None,
             lock_timeout: float | None = None, statement_timeout: float | None = None,
             dead_after: float = 30.0, connect_timeout: float = 10.0, application_name: str | None = None,
             pgbouncer: bool = False, prepare: bool = True) -> "Store":
        """Connect to ``dsn``; raises DatabaseError.

        ``generic_plans`` makes PostgreSQL reuse one plan per prepared statement
        (``plan_cache_mode = force_generic_plan``) instead of re-planning the many-CTE
        hot-path statements with each call's values: planning them cost more than running
        them (about 0.7 of 1.4 ms per claim-and-complete, measured for issue 8). Only for
        the supervisor's connection, whose statements all read by index whatever the values.
        ``idle_in_transaction``, ``lock_timeout``, ``statement_timeout`` (seconds): see
        :func:`configure_session`; ``dead_after``, ``connect_timeout``, ``application_name``,
        ``pgbouncer``, ``prepare``: see :func:`connect` (without prepared statements,
        ``generic_plans`` has nothing to act on).
        """
        conn = connect(dsn, timeout=connect_timeout, dead_after=dead_after, application_name=application_name,
                       pgbouncer=pgbouncer, prepare=prepare)
        generic_plans = generic_plans and prepare
        if generic_plans:
            # Prepared (and planned) at the first call, not the fifth: the first calls
            # of a start planned each many-CTE statement again, about 2 ms each.
            conn.prepare_threshold = 0
        try:
            configure_session(conn, generic_plans=generic_plans, idle_in_transaction=idle_in_transaction,
                              lock_timeout=lock_timeout, statement_timeout=statement_timeout)
        except psycopg.Error as exc:
            conn.close()
            raise DatabaseUnavailable(f"cannot configure the connection: {redact(str(exc))}") from exc
        return cls(conn)

    def forget_prepared(self, error: DatabaseError) -> None:
        """After ``error`` (a :func:`stale_plan` one): drop this connection's prepared
        statements (``DEALLOCATE ALL``, which psycopg sees and clears its own cache for);
        a no-op inside a transaction, whose ROLLBACK does the same."""
        log.warning(STALE_PLAN_LOG, error)
        with contextlib.suppress(psycopg.Error):
            if self.conn.info.transaction_status == psycopg.pq.TransactionStatus.IDLE:
                self.conn.execute("DEALLOCATE ALL", prepare=False)

    def close(self) -> None:
        """Close the connection (idempotent)."""
        with contextlib.suppress(Exception):
            self.conn.close()

    @property
    def broken(self) -> bool:
        """True when the connection is closed or lost."""
        return self.conn.closed or self.conn.broken

    @contextlib.contextmanager
    def _tx(self) -> Iterator[psycopg.Cursor]:
        """One transaction. Records whether it failed in its body (before COMMIT: then
        nothing of it was committed, even if the connection died) and counts commits, so
        a caller knows when running it again is safe (:meth:`Client._call`)."""
        self.failed_before_commit = False
        with self.conn.transaction(), self.conn.cursor() as cur:
            try:
                yield cur
            except BaseException:
                self.failed_before_commit = True
                raise
        self.commits += 1

    def _one(self, cur: psycopg.Cursor, name: str, params: dict[str, Any]) -> dict[str, Any] | None:
        cur.execute(Q[name], params)
        return cur.fetchone() if cur.description else None

    # -- the client's operations (cyclone_mp.operations, shared with AsyncStore) ------------

    def run(self, op: "operations.Op", *, caller_tx: bool = False) -> Any:
        """Run a planned operation (:mod:`cyclone_mp.operations`) on this store's
        connection: in a transaction of its own when the operation needs one, unless
        ``caller_tx`` (the connection is the caller's, inside the caller's open
        transaction: the operation's rows exist only if it commits).

        Raises:
            DatabaseError: see :func:`translate`; what the operation itself raises
                (RunNotFound, InvalidTransition, ...).
        """
        try:
            if caller_tx or not op.transaction:
                with self.conn.cursor(row_factory=dict_row) as cur:
                    return drive(cur, op)
            with self._tx() as cur:
                return drive(cur, op)
        except psycopg.Error as exc:
            raise self._translated(exc) from exc
        except UnicodeEncodeError as exc:  # a value psycopg cannot send (a lone surrogate)
            raise QueryRejected(f"value rejected: {exc}") from exc

    def _translated(self, exc: psycopg.Error) -> DatabaseError:
        error = classify(exc, broken=self.broken)
        if not isinstance(error, DatabaseUnavailable) and stale_plan(exc):
            self.forget_prepared(error)
        return error

    def migrate(self) -> list[str]:
        """Apply pending numbered migrations under an advisory lock; returns their names.

        Idempotent and safe to run from many processes at once.
        """
        return self.run(operations.migrate())

    def enqueue_run(
        self,
        *,
        name: str,
        kind: str,
        input: Any,
        nodes: Sequence[NodeRow],
        delay: float,
        scheduled_at: dt.datetime | None = None,
        idempotency_key: str | None,
        conn: psycopg.Connection | None = None,
    ) -> tuple[str, bool]:
        """Insert one run and its step rows, and NOTIFY; returns ``(run_id, created)``
        (:func:`cyclone_mp.operations.enqueue_run`).

        With ``conn`` the rows are written in the caller's open transaction (they exist
        only if it commits). With an ``idempotency_key`` already used, returns the
        existing run id and ``created=False``.
        """
        op = operations.enqueue_run(name=name, kind=kind, input=input, nodes=nodes, delay=delay,
                                    scheduled_at=scheduled_at, idempotency_key=idempotency_key)
        if conn is not None:
            return Store(conn).run(op, caller_tx=True)
        return self.run(op)

    def enqueue_many(self, **kwargs: Any) -> list[str]:
        """Insert many single-step runs in one statement (:func:`cyclone_mp.operations.enqueue_many`)."""
        return self.run(operations.enqueue_many(**kwargs))

    # -- the supervisor's hot path ------------------------------------------------------

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
    def claim(self, *, owner: str, queues: Sequence[str], names: Sequence[str], limit: int, ttl: float) -> list[dict[str, Any]]:
        """Claim up to ``limit`` available steps (SKIP LOCKED), one statement.

        Fair by key (round-robin within each queue) and within the steps' concurrency
        and rate limits (issue 21); afterwards :attr:`claim_wait` is the seconds until a
        rate-limited step held back by this claim may start, or None. When the marks
        that came back call for a claim that takes more kinds of steps than the one just
        made (a queue's first keyed or limited step), and it took fewer than ``limit``,
        the rest is claimed at once with that one (a second statement, once per change of
        a queue's marks).
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
                    "inline_max": INLINE_MAX, **self._claim_params(queues, statement),
                })
                rows = cur.fetchall()
            self._claim_meta(next((r for r in rows if r["id"] is None), None), queues)
            claimed += [r for r in rows if r["id"] is not None]
            if len(claimed) >= limit or self._rank(self._claim_statement("claim", queues, 1)) <= self._rank(statement):
                return claimed

    @translate
    def heartbeat(self, *, id: int, owner: str, generation: int, ttl: float, progress: Any = None) -> bool:
        """Renew one lease (the seed's WHERE clause); False when it matched no row."""
        with self.conn.cursor() as cur:
            cur.execute(Q["heartbeat"], {
                "id": id, "owner": owner, "generation": generation, "ttl_us": to_us(ttl),
                "progress": nullable_jsonb(progress),
            })
            return cur.rowcount == 1

    @translate
    def renew_many(self, *, owner: str, items: Sequence[tuple[int, int, Any]], ttl: float) -> list[bool]:
        """Renew several leases, ``(id, generation, progress or None)`` items, in one round
        trip: still one renewal per step, addressed by id, with the seed's WHERE clause
        (:meth:`heartbeat`), sent together (psycopg's pipelined ``executemany``). They share
        one implicit transaction: a renewal that fails (a lock wait past ``lock_timeout``)
        fails them all, and the caller renews one by one. Returns, per item, whether it
        matched its row."""
        if not items:
            return []
        with self.conn.cursor() as cur:
            cur.executemany(Q["heartbeat"], [
                {"id": id, "owner": owner, "generation": generation, "ttl_us": to_us(ttl),
                 "progress": nullable_jsonb(progress)}
                for id, generation, progress in items
            ], returning=True)
            matched = []
            while True:
                matched.append(cur.rowcount == 1)
                if not cur.nextset():
                    break
            return matched

    @translate
    def load_payload(self, id: int) -> dict[str, Any] | None:
        """A claimed step's ``input`` and ``upstream`` as JSON text (None when the step is gone)."""
        with self.conn.cursor() as cur:
            return self._one(cur, "load_payload", {"id": id})

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
        workflows: bool = False,
    ) -> "Settled":
        """A tick's outcomes and the next claim in one statement (issue 8: the hot path).

        ``completions`` are ``(id, generation, output, progress)`` items; ``failures`` are
        failed attempts. Each row gets its own CAS: still running under ``owner`` and
        its generation, a completion before its DB deadline, a failure with
        ``require_timed_out`` past it. A failed attempt's outcome is
        :func:`cyclone_mp.decisions.end_attempt`'s, in SQL; in a paused run a retried
        step is held paused. Rows whose CAS fails change nothing (late completions; for
        failures also timeouts not yet due on the DB clock, and without ``workflows``
        failures of workflow runs: write those with :meth:`fail`). Then up to ``limit``
        steps of ``queues``/``names`` are claimed with a ``ttl``-second lease. With
        ``workflows`` (some outcome belongs to a workflow run) the workflow runs of the
        settled rows are advanced in the same transaction; otherwise it is one round
        trip and one commit. A tick without failures runs ``settle_completions``, the
        same statement without the failure CTEs (a smaller plan to start and run).

        Raises:
            DatabaseUnavailable, QueryRejected: see :func:`translate`.
        """
        statement = self._claim_statement("settle" if failures else "settle_completions", queues, limit)
        with (self._tx() if workflows else self.conn.cursor()) as cur:
            cur.execute(Q[statement], {
                "owner": owner,
                "ids": [i[0] for i in completions],
                "leases": [f"{i[0]}:{i[1]}" for i in completions],
                "outputs": [Jsonb(i[2]) for i in completions],
                "progress": [nullable_jsonb(i[3]) for i in completions],
                "fail_ids": [f.id for f in failures],
                "fail_generations": [f.generation for f in failures],
                "kinds": [f.kind for f in failures],
                "entries": [Jsonb(f.entry) for f in failures],
                "delays_us": [to_us(f.delay) for f in failures],
                "require_timed_out": [f.require_timed_out for f in failures],
                "fail_progress": [nullable_jsonb(f.progress) for f in failures],
                "names": list(names), "limit": max(0, limit), "ttl_us": to_us(ttl),
                "inline_max": INLINE_MAX, "in_tx": workflows, **self._claim_params(queues, statement),
            })
            rows = cur.fetchall()
            self._claim_meta(next((r for r in rows if r["what"] == "meta"), None), queues)
            for run_id in sorted({r["run_id"] for r in rows if r["what"] != "claimed" and r["run_kind"] == "workflow"}):
                self._advance(cur, run_id)
        failed = {(r["id"], r["lease_generation"]): r["node"] for r in rows if r["what"] == "failed"}
        return Settled(
            completed={(r["id"], r["lease_generation"]) for r in rows if r["what"] == "completed"},
            failed=set(failed),
            claimed=[r for r in rows if r["what"] == "claimed"],
            wait=self.claim_wait,
            failed_kinds=failed,
        )

    def complete(self, *, owner: str, items: Sequence[tuple[int, int, Any, Any]],
                 workflows: bool = True) -> set[tuple[int, int]]:
        """Success CASes for ``(id, generation, output, progress)`` items (:meth:`settle`
        without failures or claim); returns the ``(id, generation)`` leases whose CAS held."""
        if not items:
            return set()
        return self.settle(owner=owner, completions=items, workflows=workflows).completed

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
        self.last_ended = None
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
        return "applied"

    def _end_attempt(
        self, cur: psycopg.Cursor, id: int, row: dict[str, Any], kind: str, entry: dict[str, Any],
        backoff: Callable[[int], float], progress: Any = None,
    ) -> decisions.AttemptEnd:
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
            "entry": Jsonb(entry), "progress": nullable_jsonb(progress),
        })
        self._advance(cur, self._run_of(cur, id))
        return end

    @staticmethod
    def _run_of(cur: psycopg.Cursor, id: int) -> str:
        cur.execute("SELECT run_id::text AS run_id FROM cyclone_steps WHERE id = %s", (id,))
        return cur.fetchone()["run_id"]

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

    # -- recovery sweep -----------------------------------------------------------------

    @translate
    def sweep_turn(self, owner: str, every: float, task: str = "sweep") -> tuple[bool, float]:
        """Take the recovery sweep's turn (or another maintenance ``task``'s: ``"history"``)
        for all supervisors when the last one is at least ``every`` seconds old (one
        statement, a row lock for its length; migration 0018).

        Returns ``(mine, wait)``: True when ``owner`` took it (it sweeps now; the next
        turn is ``every`` seconds away), else False and the seconds until the turn it
        saw ends (0 or more)."""
        with self.conn.cursor() as cur:
            cur.execute(Q["sweep_turn"], {"owner": owner, "every_us": to_us(every), "task": task})
            row = cur.fetchone()
        if row["mine"]:
            return True, every
        return False, max(0.0, float(row["due_in"] if row["due_in"] is not None else every))

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
        self.last_ended = None
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
                ended = self._end_attempt(cur, id, row, decisions.TIMEOUT, {
                    **entry, "message": "timed out (database clock); settled by the recovery sweep",
                    "lease_owner": row["lease_owner"], "lease_generation": row["lease_generation"],
                }, backoff_for(row["step_name"])).error_kind
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
        if action in ("timeout", "reclaim_limit"):
            self.last_ended = (row["step_name"], ended)
        return action

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

    def _advance(self, cur: psycopg.Cursor, run_id: str) -> None:
        """Under the run lock: :func:`cyclone_mp.operations.advance` on this cursor."""
        drive(cur, operations.advance(run_id))

    # -- schedules (issue 21; the logic is cyclone_mp.schedules) ---------------------------

    @translate
    def sync_schedules(self, items: Sequence[tuple[str, str, dict[str, Any]]]) -> None:
        """Create or refresh the rows of ``(name, target, spec)`` schedules: a new or changed
        one is due at once (its first tick computes its next slot); ``seen_at`` is kept fresh."""
        items = sorted(items)
        with self.conn.cursor() as cur:
            cur.execute(Q["sync_schedules"], {
                "names": [i[0] for i in items], "targets": [i[1] for i in items],
                "specs": [Jsonb(i[2]) for i in items],
            })

    @translate
    def tick_schedules(self, names: Sequence[str], decide: Callable[[dict[str, Any]], dict[str, Any]]) -> int:
        """In one transaction: lock the due rows among ``names`` (SKIP LOCKED), call
        ``decide(row)`` for each (it may enqueue runs on this connection, inside the
        transaction) and write the row it returns. Returns how many rows were decided."""
        with self._tx() as cur:
            cur.execute(Q["due_schedules"], {"names": list(names)})
            rows = cur.fetchall()
            for row in rows:
                new = decide(row)
                cur.execute(Q["advance_schedule"], {**new, "spec": Jsonb(new["spec"])})
            return len(rows)

    @translate
    def get_schedule(self, name: str) -> dict[str, Any] | None:
        """One schedule row, or None."""
        with self.conn.cursor() as cur:
            return self._one(cur, "get_schedule", {"name": name})

    @translate
    def list_schedules(self) -> list[dict[str, Any]]:
        """Every schedule row with the database clock (``now``) and ``age``: seconds since
        a supervisor that defines it last ticked."""
        with self.conn.cursor() as cur:
            cur.execute(Q["list_schedules"])
            return cur.fetchall()

    @translate
    def delete_schedule(self, name: str, active_s: float) -> dict[str, Any] | None:
        """Delete the schedule row ``name`` unless a supervisor ticked it within ``active_s``
        seconds: ``{"age", "deleted"}``, or None when there is no such row."""
        with self._tx() as cur:
            cur.execute(Q["delete_schedule"], {"name": name, "active_s": active_s})
            return cur.fetchone()

    # -- operator actions (cyclone_mp.operations) -----------------------------------------

    def cancel_run(self, run_id: str) -> int:
        """:func:`cyclone_mp.operations.cancel_run`."""
        return self.run(operations.cancel_run(run_id))

    def retry_run(self, run_id: str) -> int:
        """:func:`cyclone_mp.operations.retry_run`."""
        return self.run(operations.retry_run(run_id))

    def pause_run(self, run_id: str) -> int:
        """:func:`cyclone_mp.operations.pause_run`."""
        return self.run(operations.pause_run(run_id))

    def resume_run(self, run_id: str) -> int:
        """:func:`cyclone_mp.operations.resume_run`."""
        return self.run(operations.resume_run(run_id))

    def signal(self, run_id: str, name: str, payload: Any) -> bool:
        """:func:`cyclone_mp.operations.signal`."""
        return self.run(operations.signal(run_id, name, payload))

    # -- reads ----------------------------------------------------------------------------

    def get_run(self, run_id: str) -> tuple[dict[str, Any], list[dict[str, Any]]]:
        """The run row and its step rows. Raises RunNotFound."""
        return self.run(operations.get_run(run_id))

    def runs_by_prefix(self, prefix: str) -> list[str]:
        """Ids of at most two runs whose id starts with the hex ``prefix`` (index range scan)."""
        return self.run(operations.runs_by_prefix(prefix))

    def list_runs(self, *, state: str | None = None, limit: int = 50) -> list[dict[str, Any]]:
        """Recent runs, newest first."""
        return self.run(operations.list_runs(state=state, limit=limit))

    def prune(self, *, older_than: float, batch: int = 1000) -> int:
        """:func:`cyclone_mp.operations.prune`."""
        return self.run(operations.prune(older_than=older_than, batch=batch))

    def delete_runs(self, run_ids: Sequence[str]) -> int:
        """:func:`cyclone_mp.operations.delete_runs`."""
        return self.run(operations.delete_runs(run_ids))

    @translate
    def register_worker(self, *, id: str, hostname: str, pid: int, info: dict[str, Any]) -> None:
        """Announce or refresh this supervisor's registry row (informational)."""
        with self.conn.cursor() as cur:
            cur.execute(Q["register_worker"], {"id": id, "hostname": hostname, "pid": pid, "info": Jsonb(info)})

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


def drive(cur: psycopg.Cursor, op: Any) -> Any:
    """Run the steps of ``op`` (a :class:`cyclone_mp.operations.Op`, or its generator) on
    a sync cursor: each yielded statement is executed and its result sent back; returns
    what the operation returns."""
    steps = iter(op)
    try:
        statement = next(steps)
        while True:
            cur.execute(statement.sql, statement.params, prepare=statement.prepare)
            result = operations.Result(cur.fetchall() if cur.description else [], cur.rowcount)
            statement = steps.send(result)
    except StopIteration as stop:
        return stop.value


async def adrive(cur: psycopg.AsyncCursor[Any], op: Any) -> Any:
    """:func:`drive` on an async cursor."""
    steps = iter(op)
    try:
        statement = next(steps)
        while True:
            await cur.execute(statement.sql, statement.params, prepare=statement.prepare)
            result = operations.Result(await cur.fetchall() if cur.description else [], cur.rowcount)
            statement = steps.send(result)
    except StopIteration as stop:
        return stop.value


class AsyncStore:
    """The client's operations (:mod:`cyclone_mp.operations`) over one async psycopg
    connection: :class:`Store`'s sync driver, awaited. Errors are translated the same way.

    Attributes:
        commits, failed_before_commit: as :class:`Store`'s (the client retries a call
            that surely did nothing).
    """

    def __init__(self, conn: psycopg.AsyncConnection[Any]) -> None:
        self.conn = conn
        self.commits = 0
        self.failed_before_commit = False

    @property
    def broken(self) -> bool:
        """True when the connection is closed or lost."""
        return self.conn.closed or self.conn.broken

    async def run(self, op: Any, *, caller_tx: bool = False) -> Any:
        """:meth:`Store.run`, awaited."""
        try:
            if caller_tx or not op.transaction:
                async with self.conn.cursor(row_factory=dict_row) as cur:
                    return await adrive(cur, op)
            self.failed_before_commit = False
            async with self.conn.transaction():
                async with self.conn.cursor(row_factory=dict_row) as cur:
                    try:
                        value = await adrive(cur, op)
                    except BaseException:
                        self.failed_before_commit = True
                        raise
            self.commits += 1
            return value
        except psycopg.Error as exc:
            error = classify(exc, broken=self.broken)
            if not isinstance(error, DatabaseUnavailable) and stale_plan(exc):
                log.warning(STALE_PLAN_LOG, error)
                with contextlib.suppress(psycopg.Error):
                    if self.conn.info.transaction_status == psycopg.pq.TransactionStatus.IDLE:
                        await self.conn.execute("DEALLOCATE ALL", prepare=False)
            raise error from exc
        except UnicodeEncodeError as exc:
            raise QueryRejected(f"value rejected: {exc}") from exc


@dataclasses.dataclass(frozen=True)
class FailedAttempt:
    """One failed attempt for :meth:`Store.settle`: ``kind`` is a
    :data:`~cyclone_mp.decisions.FAILURE_KINDS` value, ``entry`` the error entry (JSON),
    ``delay`` the backoff in seconds if the step is retried."""

    id: int
    generation: int
    kind: str
    entry: dict[str, Any]
    delay: float
    require_timed_out: bool
    progress: Any = None


@dataclasses.dataclass(frozen=True)
class Settled:
    """What :meth:`Store.settle` did: the ``(id, lease generation)`` leases whose
    completion and whose failure CAS held (with the error kind each failure stored), and
    the claimed rows."""

    completed: set[tuple[int, int]]
    failed: set[tuple[int, int]]
    claimed: list[dict[str, Any]]
    wait: float | None = None  # the claim's rate-limit wait (see Store.claim_wait)
    failed_kinds: dict[tuple[int, int], str] = dataclasses.field(default_factory=dict)  # the error kind stored


# The client's operations are planned in cyclone_mp.operations, which reads this module's
# named SQL; imported last so that either module may be imported first.
from . import operations  # noqa: E402
