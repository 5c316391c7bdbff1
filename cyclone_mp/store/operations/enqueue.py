"""Operations that make runs (:mod:`.core` explains operations): one run of a step or
workflow, many single-step runs in one statement, unique runs, the flow-control slots
their keys need; and :func:`advance`, which moves a run on as its steps end (shared with
the supervisor's own writes).
"""

from __future__ import annotations

import dataclasses
import datetime as dt
import json
import uuid
from typing import Any, Callable, Sequence

from psycopg.types.json import Jsonb

from ...errors import DatabaseError, RunNotFound
from ...limits.declared import NO_LIMITS, Limits
from ...noderows import NodeRow, limit_params, to_us
from ..queries import nullable_jsonb
from .core import Op, Steps, operation, q

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
        "scheduled_at": scheduled_at, "delay_us": to_us(delay), "backoff": nullable_jsonb(node.backoff),
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
    :meth:`cyclone_mp.store.Claims.statement`)."""
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


def insert_spawned(plans: Sequence[Any]) -> Steps[None]:
    """The statements that insert ``plans`` (:class:`cyclone_mp.spawning.SpawnPlan` each,
    for ``yield from``), each run with its parent; a run whose id exists already is left
    as it is."""
    for p in plans:
        if p.kind == "step":
            yield from _insert_step(p.run_id, p.name, p.input_json, p.nodes[0], 0.0, None, None, None,
                                    parent=p.parent)
        else:
            yield from _enqueue_nodes(p.run_id, p.name, p.kind, p.input, p.nodes, 0.0, None, None, None,
                                      parent=p.parent)

