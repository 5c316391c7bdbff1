"""Operations on existing runs (:mod:`.core` explains operations): run ids and their
prefixes, the operator's actions (cancel, retry, pause, resume, signal, queue pauses),
the reads behind ``status`` and ``runs``, and pruning finished runs.
"""

from __future__ import annotations

import uuid
from typing import Any, Sequence

from psycopg.types.json import Jsonb

from ...errors import InvalidTransition, RunNotFound
from ...filters import RunFilter
from ...schedules import parse_idempotency_key
from .core import Steps, operation, q
from .enqueue import _locked_run, advance, advance_parent

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
