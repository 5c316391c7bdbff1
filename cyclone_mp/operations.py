"""The client's database operations, written once for the sync and the async driver.

Each operation is a generator (a "sans-IO" procedure): it yields a :class:`Statement`
(a named query of ``sql/queries.sql`` and its parameters), receives its
:class:`Result` (rows and rowcount) and finally returns a value. It decides everything
else itself: which statement comes next, what a row means, which error to raise. It
never touches a connection: :class:`cyclone_mp.store.Store` drives it on a psycopg
connection, :class:`cyclone_mp.store.AsyncStore` on an async one, so ``Client`` and
``AsyncClient`` run the same SQL with the same parameters and the same row handling.

An :class:`Op` says whether its statements form one transaction. Operations compose
with ``yield from`` (:func:`advance` is part of every operation that moves a run on,
and of the supervisor's own writes).
"""

from __future__ import annotations

import dataclasses
import datetime as dt
import functools
import json
import uuid
from typing import Any, Callable, Generator, Sequence, TypeVar

from psycopg.types.json import Jsonb

from .errors import DatabaseError, InvalidTransition, RunNotFound, UnsupportedServer
from .filters import RunFilter
from .schedules import parse_idempotency_key
from .status import TERMINAL_RUN_STATES
from .limits import NO_LIMITS, Limits
from .store.queries import MIGRATION_LOCK, Q, NodeRow, _migrations, limit_params, nullable_jsonb, to_us

T = TypeVar("T")

#: The oldest PostgreSQL the statements run on (``server_version_num``): 14.0. Older
#: servers are refused by :func:`migrate`, which every supervisor runs before it starts.
MIN_SERVER_VERSION = 140000


@dataclasses.dataclass(frozen=True)
class Statement:
    """One statement to run: its SQL text and parameters (named, or a sequence).
    ``prepare``: psycopg's ``prepare`` argument (None: its default)."""

    sql: str
    params: Any = None
    prepare: bool | None = None


@dataclasses.dataclass(frozen=True)
class Result:
    """What a statement gave back: its rows (dicts; empty without a result set) and rowcount."""

    rows: list[dict[str, Any]]
    rowcount: int

    def one(self) -> dict[str, Any] | None:
        """The first row, or None."""
        return self.rows[0] if self.rows else None


Steps = Generator[Statement, Result, T]


class Op:
    """A planned operation: its steps (a generator) and whether they form one transaction.
    Iterating an ``Op`` gives its steps, so ``yield from op`` composes operations."""

    def __init__(self, steps: Steps[Any], *, transaction: bool, name: str = "") -> None:
        self.steps = steps
        self.transaction = transaction
        self.name = name

    def __iter__(self) -> Steps[Any]:
        return self.steps

    def __repr__(self) -> str:
        return f"Op({self.name}, transaction={self.transaction})"


def operation(*, transaction: bool) -> Callable[[Callable[..., Steps[T]]], Callable[..., Op]]:
    """Decorator: a generator function becomes a function returning an :class:`Op`."""

    def decorate(fn: Callable[..., Steps[T]]) -> Callable[..., Op]:
        @functools.wraps(fn)
        def make(*args: Any, **kwargs: Any) -> Op:
            return Op(fn(*args, **kwargs), transaction=transaction, name=fn.__name__)

        return make

    return decorate


def q(name: str, params: Any = None, *, prepare: bool | None = None) -> Statement:
    """The named query ``name`` of ``sql/queries.sql`` with ``params``."""
    return Statement(Q[name], params, prepare)


# -- schema ------------------------------------------------------------------------------------


@operation(transaction=True)
def migrate() -> Steps[list[str]]:
    """Apply pending numbered migrations under an advisory lock; returns their file names.

    Raises:
        UnsupportedServer: the server is older than :data:`MIN_SERVER_VERSION` (checked
            first, so nothing is applied and the error is one line).
    """
    version = (yield Statement("SELECT current_setting('server_version_num')::int AS num, "
                               "current_setting('server_version') AS name")).one()
    if version["num"] < MIN_SERVER_VERSION:
        raise UnsupportedServer(
            f"PostgreSQL {version['name']} (server_version_num {version['num']}) is not supported: "
            f"cyclone_mp needs PostgreSQL {MIN_SERVER_VERSION // 10000} or later "
            f"(tested on 14 to 18; docs/operating.md)")
    yield Statement("SELECT pg_advisory_xact_lock(%s)", (MIGRATION_LOCK,))
    yield Statement(
        "CREATE TABLE IF NOT EXISTS cyclone_migrations ("
        " version integer PRIMARY KEY, name text NOT NULL,"
        " applied_at timestamptz NOT NULL DEFAULT now())"
    )
    done = {row["version"] for row in (yield Statement("SELECT version FROM cyclone_migrations")).rows}
    applied: list[str] = []
    for version, name, text in _migrations():
        if version in done:
            continue
        yield Statement(text)
        yield Statement("INSERT INTO cyclone_migrations (version, name) VALUES (%s, %s)", (version, name))
        applied.append(name)
    return applied


# -- enqueue -----------------------------------------------------------------------------------


def enqueue_run(
    *, name: str, kind: str, input: Any, nodes: Sequence[NodeRow], delay: float,
    scheduled_at: dt.datetime | None = None, idempotency_key: str | None, trace: Any = None,
    input_json: str | None = None, unique: "UniquePlace | None" = None,
) -> Op:
    """Insert one run and its step rows, and NOTIFY; returns ``(run_id, created)``. With an
    ``idempotency_key`` already used, or a ``unique`` place held (:class:`UniquePlace`,
    ``cy.Unique``), returns the existing run's id and ``created=False``.

    A single-step run is one statement; a workflow's rows are a transaction (which, on a
    caller's connection, is the caller's). ``trace``: the enqueue's trace context (a dict
    of W3C headers, :mod:`cyclone_mp.tracing`), kept on the run, or None. ``input_json``:
    ``input`` as JSON text when the caller has it already (the client's payload check
    made it: it is not encoded twice).
    """
    run_id = str(uuid.uuid4())
    if kind == "step" and len(nodes) == 1:
        # a step with a key or a limit also marks its queue and makes its slots, a step with an
        # idempotency key is checked against the archive: one transaction
        make = _enqueue_step_tx if nodes[0].flow or idempotency_key is not None else _enqueue_step
        text = input_json if input_json is not None else json.dumps(input)
        return make(run_id, name, text, nodes[0], delay, scheduled_at, idempotency_key, trace, unique)
    return _enqueue_nodes(run_id, name, kind, input, nodes, delay, scheduled_at, idempotency_key, trace, unique)


@dataclasses.dataclass(frozen=True)
class UniquePlace:
    """A unique run's place (``cy.Unique``): ``key`` the client's digest of what makes
    two runs the same, ``period`` seconds of the database clock's window (None: none),
    ``states`` the run states (bits) in which a run holds it."""

    key: str
    period: float | None
    states: int

    def params(self) -> dict[str, Any]:
        return {"unique": self.key, "unique_period_us": to_us(self.period), "unique_states": self.states}


NO_UNIQUE = {"unique": None, "unique_period_us": None, "unique_states": None}
#: The parent columns of a run nobody spawned (cyclone_mp.spawning.Parent.params).
NO_PARENT = {"parent_id": None, "parent_node": None, "parent_key": None}


def _insert_step(run_id: str, name: str, input_json: str, node: NodeRow, delay: float,
                 scheduled_at: dt.datetime | None, idempotency_key: str | None, trace: Any,
                 unique: UniquePlace | None = None, parent: Any = None) -> Steps[tuple[str, bool]]:
    row = (yield q("enqueue_step", {
        **node.enqueue_params, "id": run_id, "name": name, "input": input_json, "idempotency_key": idempotency_key,
        "scheduled_at": scheduled_at, "delay_us": to_us(delay),
        "trace": nullable_jsonb(trace), **(unique.params() if unique else NO_UNIQUE),
        **(parent.params() if parent else NO_PARENT),
    })).one()
    if row is not None and row["id"] is not None:
        archived = yield from _archived_holder(idempotency_key, row["id"])
        if archived is not None:
            return archived, False
        if node.flow:
            yield from _flag_flow([(node.queue, node.limited, node.rate_limit is not None)])
            yield from _ensure_slots([(node.step_name, node.concurrency_key, node.concurrency, node.rate_limit)]
                                     if node.limited else [])
        return row["id"], True
    if parent is not None:  # spawned before (its id is derived from its parent, node and key)
        return run_id, False
    return (yield from _existing(idempotency_key, unique)), False


@operation(transaction=True)
def enqueue_unique_many(*, name: str, inputs_json: Sequence[str], nodes: Sequence[NodeRow], delay: float,
                        scheduled_at: dt.datetime | None, trace: Any,
                        places: Sequence[UniquePlace]) -> Steps[list[str]]:
    """``enqueue_many`` of a unique step (``cy.Unique``): each input its own run unless its
    place is held (then the holder's id), in one transaction; ids in input order."""
    ids = []
    for text, node, place in zip(inputs_json, nodes, places):
        run_id, _ = yield from _insert_step(str(uuid.uuid4()), name, text, node, delay, scheduled_at, None, trace,
                                            place)
        ids.append(run_id)
    return ids


_enqueue_step = operation(transaction=False)(_insert_step)  # one statement
# the step, then its queue's mark and its slots, or the archive's check of its idempotency key
_enqueue_step_tx = operation(transaction=True)(_insert_step)


def _archived_holder(idempotency_key: str | None, inserted: str) -> Steps[str | None]:
    """After a run with ``idempotency_key`` was inserted (uncommitted, id ``inserted``): the
    id of an archived run that holds the key already, or None. When there is
    one, the inserted run is deleted again (its steps go with it), so the enqueue returns
    the archived run, as the hot table's unique index makes it do for a hot one. Read in a
    statement after the insert: a holder archived before the insert committed first (the
    insert waited for it, or it saw the key free only because the holder had moved)."""
    if idempotency_key is None:
        return None
    row = (yield q("archived_run_by_key", {"key": idempotency_key})).one()
    if row is None:
        return None
    yield q("delete_runs", {"ids": [inserted]})
    return row["id"]


def _flag_flow(marks: Sequence[tuple[str, bool, bool]]) -> Steps[None]:
    """Mark the queues ``(queue, limited, rate_limited)`` that a step with a key or a limit
    enters: their claims are the fair or limited ones from then on (see
    :meth:`cyclone_mp.store.Store._claim_statement`)."""
    if marks:
        yield q("flag_flow_queues", {"queues": [m[0] for m in marks], "limits": [m[1] for m in marks],
                                     "rates": [m[2] for m in marks]})


def _ensure_slots(groups: Sequence[tuple[Any, str, int | None, tuple[int, float] | None]]) -> Steps[None]:
    """Make the slot rows of limited (step, key) groups (migration 0007); existing ones stay,
    held until the enqueue's transaction ends (so the cleanup leaves them)."""
    if groups:
        yield q("ensure_slots", {
            "step_names": [g[0] for g in groups], "keys": [g[1] for g in groups],
            "concurrencies": [g[2] or 0 for g in groups], "rate_counts": [g[3][0] if g[3] else 0 for g in groups],
            "periods_us": [to_us(g[3][1]) if g[3] else None for g in groups],
        })


@operation(transaction=False)
def delete_idle_slots(*, batch: int = 1000, budget: int = 1_000_000) -> Steps[int]:
    """Delete the slot rows of limited (step, key) groups none of whose steps waits or runs
    any more, ``batch`` per statement (each its own transaction) until none is left or
    ``budget`` rows are gone; returns how many went (a group enqueued again gets new ones)."""
    total = 0
    while total < budget:
        deleted = (yield q("delete_idle_slots", {"limit": batch})).rowcount
        total += deleted
        if deleted < batch:
            break
    return total


def _existing(idempotency_key: str | None, unique: UniquePlace | None = None) -> Steps[str]:
    """The run whose idempotency key, or unique place, made an insert do nothing."""
    existing = None
    if idempotency_key is not None:
        existing = (yield q("run_by_key", {"key": idempotency_key})).one()
    if existing is None and unique is not None:
        existing = (yield q("run_by_unique", unique.params())).one()
    if existing is None:  # the conflicting run was deleted (or finished) between the two statements
        raise DatabaseError("idempotency key or unique run conflict; try again")
    return existing["id"]


@operation(transaction=True)
def _enqueue_nodes(run_id: str, name: str, kind: str, input: Any, nodes: Sequence[NodeRow], delay: float,
                   scheduled_at: dt.datetime | None, idempotency_key: str | None, trace: Any,
                   unique: UniquePlace | None = None, parent: Any = None) -> Steps[tuple[str, bool]]:
    inserted = (yield q("insert_run", {
        "id": run_id, "name": name, "kind": kind, "input": Jsonb(input), "idempotency_key": idempotency_key,
        "trace": nullable_jsonb(trace), **(unique.params() if unique else NO_UNIQUE),
        **(parent.params() if parent else NO_PARENT),
    })).one()
    if inserted is None:
        if parent is not None:  # spawned before (its id is derived from its parent, node and key)
            return run_id, False
        return (yield from _existing(idempotency_key, unique)), False
    archived = yield from _archived_holder(idempotency_key, run_id)
    if archived is not None:
        return archived, False
    yield q("insert_steps", {
        "run_id": run_id,
        "delay_us": to_us(delay),
        "scheduled_at": scheduled_at,
        "nodes": [n.node for n in nodes],
        "step_names": [n.step_name for n in nodes],
        "kinds": [n.kind for n in nodes],
        "depends_on": [Jsonb(list(n.depends_on)) for n in nodes],
        "queues": [n.queue for n in nodes],
        "priorities": [n.priority for n in nodes],
        "states": [n.state for n in nodes],
        "max_attempts": [n.max_attempts for n in nodes],
        "max_reclaims": [n.max_reclaims for n in nodes],
        "timeouts_us": [to_us(n.timeout) for n in nodes],
        "timer_delays_us": [to_us(n.timer_delay) for n in nodes],
        "due_ats": [n.due_at for n in nodes],
        "backoffs": [nullable_jsonb(n.backoff) for n in nodes],
        "keys": [n.concurrency_key for n in nodes],
        "concurrencies": [n.concurrency for n in nodes],
        "rate_counts": [n.rate_limit[0] if n.rate_limit else None for n in nodes],
        "rate_periods_us": [to_us(n.rate_limit[1]) if n.rate_limit else None for n in nodes],
        "memory_limits": [n.limits.memory for n in nodes],
        "cpu_limits": [n.limits.cpu for n in nodes],
        "max_processes": [n.limits.processes for n in nodes],
        "max_open_files": [n.limits.open_files for n in nodes],
        "allow_failures": [n.allow_failures for n in nodes],
        "wait_spawned": [n.wait_spawned for n in nodes],
    })
    yield from _flag_flow([(n.queue, n.limited, n.rate_limit is not None) for n in nodes if n.flow])
    yield from _ensure_slots([(n.step_name, n.concurrency_key, n.concurrency, n.rate_limit) for n in nodes if n.limited])
    if kind == "workflow":
        yield from advance(run_id)  # roots leave pending; NOTIFY sent there
    else:
        for queue in sorted({n.queue for n in nodes if n.state == "available"}):
            yield q("notify", {"queue": queue})
    return run_id, True


@operation(transaction=True)
def enqueue_many(
    *, name: str, inputs_json: Sequence[str], queue: str, priority: int, max_attempts: int,
    max_reclaims: int | None, timeout: float | None, delay: float, scheduled_at: dt.datetime | None = None,
    backoff: Any = None, trace: Any = None, keys: Sequence[str] | None = None, concurrency: int | None = None,
    rate_limit: tuple[int, float] | None = None, limits: Limits = NO_LIMITS,
) -> Steps[list[str]]:
    """Insert many single-step runs in one statement; returns their ids in input order.

    ``inputs_json`` are the inputs as JSON texts (already checked by the client, so each
    is encoded once); ``trace`` the enqueue's trace context, kept on every run; ``keys``
    their concurrency keys (None: all ''), ``concurrency`` and ``rate_limit``
    (``(count, seconds)``) the step's limits, ``limits`` its resource caps.
    """
    ids = [uuid.uuid4() for _ in inputs_json]
    keys = list(keys) if keys is not None else [""] * len(ids)
    yield q("enqueue_many", {
        "ids": ids, "inputs": list(inputs_json), "name": name, "queue": queue,
        "priority": priority, "max_attempts": max_attempts, "max_reclaims": max_reclaims,
        "timeout_us": to_us(timeout), "delay_us": to_us(delay), "scheduled_at": scheduled_at,
        "backoff": nullable_jsonb(backoff), "trace": nullable_jsonb(trace), "keys": keys,
        "concurrency": concurrency, "rate_count": rate_limit[0] if rate_limit else None,
        "rate_period_us": to_us(rate_limit[1]) if rate_limit else None, **limit_params(limits),
    })
    limited = concurrency is not None or rate_limit is not None
    if limited or any(keys):
        yield from _flag_flow([(queue, limited, rate_limit is not None)])
    if limited:
        yield from _ensure_slots([(name, k, concurrency, rate_limit) for k in sorted(set(keys))])
    yield q("notify", {"queue": queue})
    return [str(i) for i in ids]


# -- moving a run on (shared with the supervisor's writes) ----------------------------------------


#: The most items one map node may have: its items are inserted in one statement, in the
#: transaction of a completion, within the outcome writer's statement_timeout (20,000 took
#: 0.15 s; a list past this fails its map with a clear error, never its writer's statements).
MAX_MAP_ITEMS = 1_000_000

def advance(run_id: str) -> Steps[None]:
    """Under the run lock: promote ready nodes, map the lists of map nodes whose node
    mapped over completed (``expand_maps``), fire signals and timers, end the map nodes
    whose items have all ended (``settle_maps``), refresh the run's state, NOTIFY the
    queues that have claimable steps now, and, for a spawned run that has ended, move its
    parent on (:func:`advance_parent`)."""
    yield q("hold_paused", {"run_id": run_id})
    for _ in range(10_000):
        promoted = (yield q("promote_ready", {"run_id": run_id})).rowcount
        mapped = (yield q("expand_maps", {"run_id": run_id, "max_items": MAX_MAP_ITEMS})).rowcount
        fired = (yield q("fire_nodes", {"run_id": run_id})).rowcount
        ended = (yield q("settle_maps", {"run_id": run_id})).rowcount
        if promoted == 0 and mapped == 0 and fired == 0 and ended == 0:
            break
    yield q("refresh_run_state", {"run_id": run_id})
    for row in (yield q("available_queues", {"run_id": run_id})).rows:
        yield q("notify", {"queue": row["queue"]})
    yield from advance_parent(run_id)


def advance_parent(run_id: str) -> Steps[None]:
    """When run ``run_id`` was spawned (``ctx.spawn``) and has ended: take its parent run's
    lock and move the parent on (a node of it may wait for the runs it spawned). Locks go
    from a child to its parent, never the other way, so two of them never wait on each other."""
    row = (yield q("parent_to_advance", {"run_id": run_id})).one()
    if row is not None:
        yield q("lock_run", {"run_id": row["parent_id"]})
        yield from advance(row["parent_id"])


def _locked_run(run_id: str, restore: Callable[[dict[str, Any]], bool] = lambda archived: False,
                ) -> Steps[dict[str, Any]]:
    """The run's row (``id``, ``kind``, ``state``), locked. A run that is not in the hot
    table may be archived: when ``restore(archived row)`` says so it is moved
    back first and locked there; otherwise the archived row is returned unlocked (a
    finished run: the action finds nothing to change and says why).

    Raises:
        RunNotFound: neither table holds it.
    """
    row = (yield q("lock_run", {"run_id": run_id})).one()
    if row is not None:
        return row
    archived = (yield q("archived_run", {"run_id": run_id})).one()
    if archived is None:
        raise RunNotFound(f"no run with id {run_id}")
    if not restore(archived):
        return archived
    yield q("restore_run", {"run_id": run_id})
    row = (yield q("lock_run", {"run_id": run_id})).one()
    if row is None:  # archived again, or deleted by retention, between the two statements
        raise RunNotFound(f"no run with id {run_id}")
    return row


# -- run ids -------------------------------------------------------------------------------------


def run_id_or_prefix(run_id: str) -> str | None:
    """``run_id`` as a canonical UUID string, or None when it is a prefix to look up.

    Raises:
        RunNotFound: neither a UUID nor a prefix of 8 to 32 hex digits.
    """
    text = str(run_id).strip()
    try:
        return str(uuid.UUID(text))
    except ValueError:
        pass
    digits = text.replace("-", "").lower()
    if len(digits) < 8 or len(digits) > 32 or any(c not in "0123456789abcdef" for c in digits):
        raise RunNotFound(f"no run with id {run_id!r} (not a UUID or a prefix of 8+ hex digits)")
    return None


def resolve(run_id: str) -> Steps[str]:
    """A full run id, or the one run whose id starts with ``run_id`` (at least 8 hex digits,
    as the CLI's tables show). Raises RunNotFound (none, or ambiguous)."""
    full = run_id_or_prefix(run_id)
    if full is not None:
        return full
    found = yield from _runs_by_prefix(str(run_id).strip())
    if not found:
        raise RunNotFound(f"no run with id starting {run_id!r}")
    if len(found) > 1:
        raise RunNotFound(f"{run_id!r} matches several runs; give more of the id")
    return found[0]


def _runs_by_prefix(prefix: str) -> Steps[list[str]]:
    digits = prefix.replace("-", "").lower()
    low = uuid.UUID(digits.ljust(32, "0"))
    high = uuid.UUID(digits.ljust(32, "f"))
    rows = (yield q("runs_by_prefix", {"low": str(low), "high": str(high)})).rows
    return [row["id"] for row in rows]


@operation(transaction=False)
def resolve_run(run_id: str) -> Steps[str]:
    """:func:`resolve` as an operation of its own."""
    return (yield from resolve(run_id))


@operation(transaction=False)
def runs_by_prefix(prefix: str) -> Steps[list[str]]:
    """Ids of at most two runs whose id starts with the hex ``prefix`` (index range scan)."""
    return (yield from _runs_by_prefix(prefix))


# -- operator actions ------------------------------------------------------------------------------


@operation(transaction=True)
def cancel_run(run_id: str) -> Steps[int]:
    """Cancel the run and every non-terminal step in one transaction; returns steps cancelled.

    Raises:
        RunNotFound, InvalidTransition: the run is already completed, discarded or cancelled.
    """
    rid = yield from resolve(run_id)
    run = yield from _locked_run(rid)
    row = (yield q("cancel_run", {"run_id": rid})).one()
    if row is None:
        raise InvalidTransition(f"run {rid} is {run['state']}; only running or paused runs can be cancelled")
    yield from advance_parent(rid)  # a spawned run: its parent may wait for it
    return int(row["steps"])


@operation(transaction=True)
def retry_run(run_id: str) -> Steps[int]:
    """Reopen the run's discarded steps (or a cancelled single step); returns how many.

    Raises:
        RunNotFound, InvalidTransition: nothing to retry.
    """
    rid = yield from resolve(run_id)
    # an archived run is moved back when it has something to retry
    run = yield from _locked_run(rid, lambda archived: archived["state"] == "discarded" or (
        archived["state"] == "cancelled" and archived["kind"] == "step"))
    count = 0
    if run["state"] in ("discarded", "running"):
        count = (yield q("retry_run", {"run_id": rid, "from_state": "discarded"})).rowcount
    elif run["state"] == "cancelled" and run["kind"] == "step":
        count = (yield q("retry_run", {"run_id": rid, "from_state": "cancelled"})).rowcount
    if count == 0:
        raise InvalidTransition(f"run {rid} is {run['state']} with no discarded step; nothing to retry")
    yield q("reopen_run", {"run_id": rid})
    yield from advance(rid)
    return count


@operation(transaction=False)
def pause_queue(queue: str, reason: str | None = None) -> Steps[bool]:
    """Stop every claim of ``queue``'s steps (running ones finish); True when it was not
    paused yet."""
    return bool((yield q("pause_queue", {"queue": queue, "reason": reason})).rows)


@operation(transaction=False)
def resume_queue(queue: str) -> Steps[bool]:
    """Let claims take ``queue``'s steps again (its supervisors are woken); True when it
    was paused."""
    return bool((yield q("resume_queue", {"queue": queue})).rows)


@operation(transaction=False)
def paused_queues() -> Steps[list[dict[str, Any]]]:
    """The paused queues: ``queue``, ``paused_at`` (DB clock), ``reason``."""
    return (yield q("paused_queues")).rows


@operation(transaction=True)
def pause_run(run_id: str) -> Steps[int]:
    """Pause a running run; returns how many steps were paused. Raises RunNotFound, InvalidTransition."""
    rid = yield from resolve(run_id)
    run = yield from _locked_run(rid)
    row = (yield q("pause_run", {"run_id": rid})).one()
    if row is None:
        raise InvalidTransition(f"run {rid} is {run['state']}; only a running run can be paused")
    return int(row["steps"])


@operation(transaction=True)
def resume_run(run_id: str) -> Steps[int]:
    """Resume a paused run; returns how many steps were restored. Raises RunNotFound, InvalidTransition."""
    rid = yield from resolve(run_id)
    run = yield from _locked_run(rid)
    row = (yield q("resume_run", {"run_id": rid})).one()
    if row is None:
        raise InvalidTransition(f"run {rid} is {run['state']}; only a paused run can be resumed")
    yield from advance(rid)
    return int(row["steps"])


@operation(transaction=True)
def signal(run_id: str, name: str, payload: Any) -> Steps[bool]:
    """Store the first signal ``name`` for the run; False when one was already kept.

    Raises:
        RunNotFound.
    """
    rid = yield from resolve(run_id)
    yield from _locked_run(rid, lambda archived: True)  # kept with the run, as for a finished hot run
    kept = (yield q("put_signal", {"run_id": rid, "name": name, "payload": Jsonb(payload)})).one() is not None
    yield from advance(rid)
    return kept


# -- reads ---------------------------------------------------------------------------------------


#: The most spawned runs ``client.status`` lists under a run (``RunStatus.children``).
CHILDREN_SHOWN = 1000


@operation(transaction=False)
def get_run(run_id: str) -> Steps[tuple[dict[str, Any], list[dict[str, Any]]]]:
    """The run row (with ``children``: the runs it spawned, at most :data:`CHILDREN_SHOWN`)
    and its step rows. Raises RunNotFound."""
    rid = yield from resolve(run_id)
    run = (yield q("get_run", {"run_id": rid})).one()
    if run is None:
        raise RunNotFound(f"no run with id {rid}")
    scheduled = parse_idempotency_key(run["idempotency_key"])
    if scheduled is not None:  # a schedule enqueued it: its slot, and the schedule's next one
        name, slot = scheduled
        row = (yield q("get_schedule", {"name": name})).one()
        run = {**run, "schedule": {"name": name, "slot": slot, "next_at": row["next_at"] if row else None}}
    children = (yield q("children_of_run", {"run_id": rid, "limit": CHILDREN_SHOWN})).rows
    return {**run, "children": children}, (yield q("get_steps", {"run_id": rid})).rows


@operation(transaction=False)
def map_items(run_id: str, node: str, *, states: Sequence[str] | None = None, after: int = -1,
              limit: int = 100) -> Steps[list[dict[str, Any]]]:
    """A page of the items of map node ``node``: those after item index ``after`` (-1:
    from the first), at most ``limit``, in item order, in one of ``states`` when given
    (rows as ``get_steps``', with ``item``). Raises RunNotFound."""
    rid = yield from resolve(run_id)
    return (yield q("map_items", {"run_id": rid, "node": node, "after": after, "limit": limit,
                                  "states": list(states) if states else None})).rows


@operation(transaction=False)
def finished_runs(run_ids: Sequence[str]) -> Steps[tuple[list[dict[str, Any]], list[dict[str, Any]]]]:
    """The run rows (as ``get_run``'s) of those of ``run_ids`` that are completed,
    discarded or cancelled, and their step rows (as ``get_steps``', with ``run_id``), in
    two statements: what a waiter reads when a notification names runs."""
    runs = (yield q("finished_runs", {"ids": list(run_ids)})).rows
    if not runs:
        return [], []
    steps = (yield q("steps_of_runs", {"ids": [r["id"] for r in runs]})).rows
    return runs, steps


@operation(transaction=False)
def list_runs(*, filters: RunFilter = RunFilter(), limit: int = 50, archived: bool = False
              ) -> Steps[list[dict[str, Any]]]:
    """Recent runs that match ``filters``, newest first; archived ones too with
    ``archived``. Planned with its parameters' values (unprepared), so the filters not
    asked for cost nothing."""
    params = {**filters.params(), "limit": limit, "archived": archived}
    return (yield q("list_runs", params, prepare=False)).rows


@operation(transaction=False)
def prune(*, older_than: float, batch: int = 1000, lock_timeout: float = 5.0,
          filters: RunFilter = RunFilter()) -> Steps[int]:
    """Delete finished runs (completed, discarded, cancelled) that finished more than
    ``older_than`` seconds ago and match ``filters``, hot or archived: ``batch`` per
    statement (each its own transaction). Archived runs go by whole archive partitions (one
    UTC day of one state, a DROP that waits at most ``lock_timeout`` seconds for its lock)
    when every run of theirs is that old and no filter but the states narrows the choice,
    else row by row. Returns how many runs were deleted.

    Raises:
        DatabaseBusy: a partition's lock could not be had in time (nothing of it was lost).
    """
    params = {**filters.params(), "older_us": to_us(older_than), "limit": batch}
    total = 0
    while True:
        deleted = (yield q("prune_runs", params, prepare=False)).rowcount
        total += deleted
        if deleted < batch:
            break
    states = [s for s in FINISHED_STATES if filters.states is None or s in filters.states]
    if filters.narrows:
        while True:
            row = (yield q("prune_archived", params, prepare=False)).one()
            total += row["runs"]
            if row["runs"] < batch:
                break
    else:
        now, partitions = yield from archive_partitions()
        cutoff = now - dt.timedelta(seconds=older_than)
        for state, day in sorted(partitions):
            if state in states and day_end(day) <= cutoff:
                total += yield from _drop_partition(state, day, lock_timeout)
        for state in states:
            while True:
                row = yield from _retain(state, older_than, batch)
                total += row["runs"]
                if row["runs"] < batch:
                    break
    yield from delete_idle_slots(batch=batch)  # the groups whose last steps went
    return total


# -- history: the archive and retention ------------------------------------------------------------

FINISHED_STATES = TERMINAL_RUN_STATES  # a finished run's (and its steps') states, the archive's partitions
HISTORY_LOCK = 0x63796869737479  # "cyhisty": pg_try_advisory_xact_lock key of history work


def day_end(day: dt.date) -> dt.datetime:
    """The end of a UTC day (the upper bound of its archive partitions)."""
    return dt.datetime.combine(day, dt.time(), dt.timezone.utc) + dt.timedelta(days=1)


def archive_partitions() -> Steps[tuple[dt.datetime, set[tuple[str, dt.date]]]]:
    """The database clock and the archive's partitions as ``(state, UTC day)``."""
    rows = (yield q("archive_partitions")).rows
    return rows[0]["now"], {(r["state"], r["day"]) for r in rows if r["state"] is not None}


@operation(transaction=False)
def xmin_horizon() -> Steps[dict[str, Any]]:
    """``{"xmin", "dead"}``: the oldest transaction id still running, and the hot tables'
    dead row versions (see :class:`cyclone_mp.history.VacuumWatch`)."""
    return (yield q("xmin_horizon")).one()


@operation(transaction=False)
def read_archive_partitions() -> Steps[tuple[dt.datetime, set[tuple[str, dt.date]]]]:
    """:func:`archive_partitions` as an operation of its own."""
    return (yield from archive_partitions())


def _history_lock() -> Steps[bool]:
    """Take the history lock for this transaction; False when another supervisor holds it."""
    return bool((yield q("history_lock", {"key": HISTORY_LOCK})).one()["got"])


@operation(transaction=True)
def archive_batch(params: dict[str, Any]) -> Steps[dict[str, Any] | None]:
    """One history batch (``archive_runs``, params from
    :meth:`cyclone_mp.history.Policy.params`); None when another supervisor holds the
    history lock.

    Raises:
        DatabaseError: its cause a ``CheckViolation`` when an archive partition it needs is
            missing (see :func:`archive_days`).
    """
    if not (yield from _history_lock()):
        return None
    return (yield q("archive_runs", params)).one()


@operation(transaction=False)
def archive_days(params: dict[str, Any]) -> Steps[set[tuple[str, dt.date]]]:
    """The ``(state, UTC day)`` partitions :func:`archive_batch` with ``params`` would need."""
    return {(r["state"], r["day"]) for r in (yield q("archive_days", params)).rows}


@operation(transaction=True)
def make_archive_partitions(days: Sequence[tuple[str, dt.date]], *, lock_timeout: float) -> Steps[int | None]:
    """Make the missing archive partitions of ``days`` (``(state, UTC day)``), in one
    transaction whose DDL waits at most ``lock_timeout`` seconds for each lock; returns
    how many were made, or None when another supervisor holds the history lock.

    Raises:
        DatabaseBusy: a lock could not be had in time (nothing was made).
    """
    if not (yield from _history_lock()):
        return None
    made = 0
    for state, day in sorted(days):
        made += bool((yield q("make_archive_partition", {"state": state, "day": day,
                                                          "lock_timeout": f"{int(lock_timeout * 1000)}ms"})).one()["made"])
    return made


@operation(transaction=True)
def drop_archive_partition(state: str, day: dt.date, *, lock_timeout: float) -> Steps[int | None]:
    """Drop the archive partitions of ``(state, day)``; returns how many runs they held, or
    None when another supervisor holds the history lock.

    Raises:
        DatabaseBusy: the lock could not be had within ``lock_timeout`` seconds.
    """
    if not (yield from _history_lock()):
        return None
    return (yield from _drop_partition(state, day, lock_timeout))


def _drop_partition(state: str, day: dt.date, lock_timeout: float) -> Steps[int]:
    """``DROP`` the archive partitions of ``(state, day)``; how many runs they held."""
    return (yield q("drop_archive_partition", {"state": state, "day": day,
                                               "lock_timeout": f"{int(lock_timeout * 1000)}ms"})).one()["runs"]


@operation(transaction=True)
def retain_archived(state: str, older_than: float, limit: int) -> Steps[dict[str, Any] | None]:
    """Delete up to ``limit`` archived runs of ``state`` finished more than ``older_than``
    seconds ago, with their steps; returns ``{"runs", "steps"}`` deleted, or None when
    another supervisor holds the history lock."""
    if not (yield from _history_lock()):
        return None
    return (yield from _retain(state, older_than, limit))


def _retain(state: str, older_than: float, limit: int) -> Steps[dict[str, Any]]:
    """Delete up to ``limit`` archived runs of ``state`` older than ``older_than`` seconds."""
    return (yield q("retain_archived", {"state": state, "drop_us": to_us(older_than), "limit": limit})).one()


@operation(transaction=False)
def list_workers(within: float = 15.0) -> Steps[list[dict[str, Any]]]:
    """Supervisors that refreshed their row within ``within`` seconds."""
    return (yield q("list_workers", {"within_us": to_us(within)})).rows


@operation(transaction=False)
def delete_runs(run_ids: Sequence[str]) -> Steps[int]:
    """Delete these runs, whatever their state, with their steps and signals; returns how
    many were deleted (the demo's clean-up: its runs ran in a queue of its own)."""
    return (yield q("delete_runs", {"ids": list(run_ids)})).rowcount
