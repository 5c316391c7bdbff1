"""What the dashboard shows: JSON-ready dicts built from the store's reads.

:class:`Dashboard` is the only part of the dashboard that reads the database (through
the :class:`~cyclone_mp.Client`'s connection pool and its read-only queries, :mod:`cyclone_mp.dashboard_queries`);
the pages and the JSON API render the same dicts, so they always show the same
numbers. The helpers below it are pure functions of rows (tested without a database).

Every time comes from the database: rows carry DB-clock timestamps, and ages and
elapsed times are computed against the database's ``now()`` of the same read.
"""

from __future__ import annotations

import datetime as dt
import json
from typing import Any, Callable, Iterable, Sequence

from ..errors import PayloadError
from ..schedules import ACTIVE_WITHIN
from ..status import TERMINAL_RUN_STATES, StepStatus, exit_text
from ..dashboard_queries import DashboardReads
from ..store import Store
from .charts import iso, kills_by_trigger, pickup, throughput
from .params import RUN_STATES, STEP_STATES, BadRequest, RunQuery, encode_cursor

COUNT_CAP = 10_000  #: the runs list counts matching runs up to this many
WORKERS_WITHIN = 15.0  #: seconds: a supervisor whose registry row is older is not shown
KILLS_SHOWN = 20
HOUR = 60  #: minutes of the latency, kills and durations charts
DURATIONS_SHOWN = 50  #: steps in the durations table
NAMES_SHOWN = 200
FORENSICS = ("pid", "exit_code", "signal", "signal_name", "killed_by_supervisor", "trigger", "cpu_seconds",
             "peak_rss_kb", "elapsed", "worker", "cancel_reason")


class Dashboard:
    """Reads for the pages and the API, over ``client``'s pool (one connection per read).

    Args:
        client: a :class:`~cyclone_mp.Client` (its mux is not needed).
    """

    def __init__(self, client: Any) -> None:
        self.client = client

    def _read(self, fn: Callable[[Store, DashboardReads], Any]) -> Any:
        # The Client owns the pool and translates database errors; every dashboard read
        # goes through this one call so a page's queries share one pooled connection.
        return self.client._call(lambda store: fn(store, DashboardReads(store)))

    # -- overview ----------------------------------------------------------------------------

    def overview(self, minutes: int = 30) -> dict[str, Any]:
        """Counts by state, name and queue (the hot tables: live work and recent history;
        archived runs by state, exact up to 10,000 per state, estimated past that; ``exact``
        says which); throughput; live supervisors;
        recent kills; schedules and their next slots; pickup latency, kills by trigger and
        run times over the last hour."""
        now, runs, archived, steps, per_minute, kills, workers, schedules, hour = self._read(lambda s, d: (
            d.now(), d.run_counts(), d.archived_counts(), d.step_counts(), d.throughput(minutes),
            d.recent_kills(KILLS_SHOWN), s.registry.workers(WORKERS_WITHIN), s.schedules.list_all(),
            (d.pickup(HOUR), d.kills_by_trigger(HOUR), d.durations(HOUR, DURATIONS_SHOWN)),
        ))
        return {
            "now": iso(now),
            "runs": {"by_state": {state: runs.get(state, 0) for state in RUN_STATES}, "total": sum(runs.values())},
            "archived": {"by_state": {state: archived[0].get(state, 0) for state in TERMINAL_RUN_STATES},
                         "total": sum(archived[0].values()), "exact": archived[1]},
            "steps": step_counts(steps),
            "throughput": throughput(per_minute, minutes),
            "workers": [worker_view(row) for row in workers],
            "kills": [kill_view(row) for row in kills],
            "schedules": [schedule_view(row) for row in schedules],
            "pickup": pickup(hour[0]),
            "kill_triggers": kills_by_trigger(hour[1]),
            "durations": [durations_row(row) for row in hour[2]],
        }

    # -- runs --------------------------------------------------------------------------------

    def runs(self, query: RunQuery) -> dict[str, Any]:
        """One page of runs with the filters of ``query``, the capped match count and names."""
        filters = {"state": query.state, "name": query.name, "since": query.since, "until": query.until}
        now, rows, total, names = self._read(lambda s, d: (
            d.now(),
            d.runs(**filters, after=query.after, limit=query.limit + 1, offset=query.offset),
            d.count_runs(**filters, cap=COUNT_CAP),
            d.run_names(NAMES_SHOWN),
        ))
        more = len(rows) > query.limit
        rows = rows[: query.limit]
        last = rows[-1] if rows else None
        return {
            "now": iso(now),
            "filters": {"state": query.state, "name": query.name, "since": iso(query.since),
                        "until": iso(query.until)},
            "limit": query.limit,
            "offset": query.offset,
            "cursor": query.cursor,
            "total": total,
            "total_capped": total >= COUNT_CAP,
            "next_cursor": encode_cursor(last["created_at"], last["id"]) if more and last else None,
            "runs": [run_row(row) for row in rows],
            "names": names,
        }

    # -- one run -----------------------------------------------------------------------------

    def run(self, run_id: str) -> dict[str, Any]:
        """Everything about one run. Raises RunNotFound."""
        now, (run, rows), signals = self._read(lambda s, d: (
            d.now(), s.runs.get(run_id), d.run_signals(run_id),
        ))
        steps = [StepStatus.from_row(row) for row in rows]
        received = {row["name"] for row in signals}
        views = [step_view(step, now) for step in steps]
        return {
            "now": iso(now),
            "id": run["id"], "name": run["name"], "kind": run["kind"], "state": run["state"],
            "input": run["input"], "idempotency_key": run["idempotency_key"],
            "created_at": iso(run["created_at"]), "updated_at": iso(run["updated_at"]),
            "finished_at": iso(run["finished_at"]),
            # spawned runs (ctx.spawn): the run that spawned this one, and those it spawned
            "parent": ({"id": run["parent_id"], "node": run["parent_node"], "key": run["parent_key"]}
                       if run.get("parent_id") else None),
            "children": list(run.get("children") or ()),
            "steps": views,
            "attempts": attempts(steps, now),
            **outputs(steps, run["state"]),
            "graph": graph_layout(views),
            "signals": [{"name": r["name"], "payload": r["payload"], "created_at": iso(r["created_at"])}
                        for r in signals],
            "signal_names": [s.name for s in steps if s.kind == "signal" and s.name not in received],
            "actions": actions_for(run["state"], run["kind"], [s.state for s in steps]),
        }

    # -- actions -----------------------------------------------------------------------------

    def act(self, run_id: str, action: str, name: str | None = None, payload: Any = None) -> dict[str, Any]:
        """Apply an operator action through the Client; returns ``{action, run_id, message, ...}``.

        Raises RunNotFound, InvalidTransition, PayloadError, BadRequest (a signal without a
        name), DatabaseError.
        """
        client = self.client
        if action == "signal":
            name = (name or "").strip()
            if not name:
                raise BadRequest("a signal needs a name")
            if len(name) > 200 or "\x00" in name:
                raise BadRequest("a signal name is at most 200 characters, without NUL")
            kept = client.signal(run_id, name, payload)
            message = (f"Signal {name!r} sent to run {run_id}." if kept
                       else f"Run {run_id} already received signal {name!r}; the first one is kept.")
            return {"action": action, "run_id": run_id, "name": name, "kept": kept, "message": message}
        count = getattr(client, action)(run_id)
        message = {
            "cancel": f"Cancelled run {run_id}: {count} step(s) cancelled. A running handler is told at its "
                      "next heartbeat and killed after kill_grace.",
            "retry": f"Retrying run {run_id}: {count} step(s) reopened.",
            "pause": f"Paused run {run_id}: {count} step(s) paused; running steps finish.",
            "resume": f"Resumed run {run_id}: {count} step(s) restored.",
        }[action]
        return {"action": action, "run_id": run_id, "count": count, "message": message}


# -- pure helpers ------------------------------------------------------------------------------


def step_counts(rows: Iterable[dict[str, Any]]) -> dict[str, Any]:
    """``dash_step_counts`` rows -> totals by state, and one row per (name, queue)."""
    by_state = {state: 0 for state in STEP_STATES}
    groups: dict[tuple[str, str], dict[str, int]] = {}
    for row in rows:
        n = int(row["n"])
        by_state[row["state"]] = by_state.get(row["state"], 0) + n
        group = groups.setdefault((row["name"], row["queue"]), {state: 0 for state in STEP_STATES})
        group[row["state"]] = group.get(row["state"], 0) + n
    return {
        "by_state": by_state,
        "total": sum(by_state.values()),
        "by_name": [{"name": name, "queue": queue, "by_state": counts, "total": sum(counts.values())}
                    for (name, queue), counts in sorted(groups.items())],
    }


def durations_row(row: dict[str, Any]) -> dict[str, Any]:
    """A ``dash_durations`` row -> one line of the per-step duration percentiles."""
    return {"step": row["step"], "n": int(row["n"]), **{k: row[k] for k in ("p50", "p95", "p99", "max")}}


def forensics(entry: dict[str, Any]) -> dict[str, Any]:
    """The fields of an error entry that say how the attempt ended (SPEC 4)."""
    out = {key: entry.get(key) for key in FORENSICS}
    out["exit"] = exit_text(entry)
    return out


def kill_view(row: dict[str, Any]) -> dict[str, Any]:
    """A ``dash_recent_kills`` row -> one line of "recent kills"."""
    entry = row["entry"] or {}
    return {
        "run_id": row["run_id"], "node": row["node"], "step_name": row["step_name"], "queue": row["queue"],
        "state": row["state"], "attempt": entry.get("attempt", row["attempt"]), "kind": entry.get("kind"),
        "at": entry.get("at"), "message": entry.get("message"), **forensics(entry),
    }


def worker_view(row: dict[str, Any]) -> dict[str, Any]:
    """A ``list_workers`` row -> a supervisor and its children (elapsed times brought up to
    the read: the registry row is ``age`` seconds old)."""
    info = row.get("info") or {}
    age = float(row.get("age") or 0.0)
    children = []
    for kid in info.get("children") or []:
        busy = kid.get("run_id") is not None
        children.append({
            "pid": kid.get("pid"), "busy": busy, "run_id": kid.get("run_id"), "node": kid.get("node"),
            "step": kid.get("step"), "attempt": kid.get("attempt"),
            "elapsed": round(float(kid.get("elapsed") or 0.0) + age, 1) if busy else None,
            "cpu_percent": kid.get("cpu_percent"), "rss": kid.get("rss"), "steps_run": kid.get("steps_run", 0),
        })
    return {
        "id": row["id"], "hostname": row["hostname"], "pid": row["pid"], "started_at": iso(row["started_at"]),
        "heartbeat_at": iso(row["heartbeat_at"]), "age": round(age, 1), "workers": info.get("workers"),
        "queues": info.get("queues") or [], "draining": bool(info.get("draining")),
        "paused_queues": info.get("paused_queues") or [],
        "stats": info.get("stats") or {}, "children": children, "failing": failing_tasks(info),
        "last_sweep_age": (info.get("maintenance") or {}).get("last_sweep_age"),
    }


def failing_tasks(info: dict[str, Any]) -> list[dict[str, Any]]:
    """The maintenance tasks a supervisor reports failing (registry ``info["maintenance"]``,
    :mod:`cyclone_mp.health`): ``[{"task", "failures", "error", "for"}]``, by task name."""
    failing = (info.get("maintenance") or {}).get("failing") or {}
    return [{"task": task, "failures": h.get("failures"), "error": h.get("error") or "", "for": h.get("for")}
            for task, h in sorted(failing.items())]


def run_row(row: dict[str, Any]) -> dict[str, Any]:
    """A ``dash_runs`` row -> one line of the runs list."""
    steps = {k: int(v) for k, v in (row.get("steps") or {}).items()}
    return {
        "id": row["id"], "name": row["name"], "kind": row["kind"], "state": row["state"],
        "created_at": iso(row["created_at"]), "updated_at": iso(row["updated_at"]),
        "finished_at": iso(row["finished_at"]), "steps": steps, "steps_total": sum(steps.values()),
        "parent_id": row.get("parent_id"),  # the run that spawned it (ctx.spawn), or None
    }


def step_view(step: StepStatus, now: dt.datetime) -> dict[str, Any]:
    """One node of a run, with its elapsed time (DB clock) while it runs."""
    elapsed = None
    if step.started_at is not None and step.state == "running":
        elapsed = round((now - step.started_at).total_seconds(), 3)
    elif step.started_at is not None and step.finished_at is not None and step.finished_at >= step.started_at:
        elapsed = round((step.finished_at - step.started_at).total_seconds(), 3)
    return {
        "name": step.name, "step_name": step.step_name, "kind": step.kind, "state": step.state,
        "paused_from": step.paused_from, "queue": step.queue, "priority": step.priority,
        "depends_on": list(step.depends_on), "attempt": step.attempt, "max_attempts": step.max_attempts,
        "reclaims": step.reclaims, "max_reclaims": step.max_reclaims, "timeout": step.timeout,
        "scheduled_at": iso(step.scheduled_at), "claimed_at": iso(step.claimed_at), "started_at": iso(step.started_at),
        "finished_at": iso(step.finished_at), "heartbeat_at": iso(step.heartbeat_at),
        "lease_owner": step.lease_owner, "lease_expiry": iso(step.lease_expiry),
        "lease_generation": step.lease_generation, "due_at": iso(step.due_at), "error": step.error,
        "error_kind": step.error_kind, "output": step.output,
        # a map node: its items by state in one line, and as its progress how many completed
        "items": step.items, "items_summary": step.items_summary,
        "progress": step.progress if step.items is None else {
            "done": step.items.get("completed", 0), "total": step.items["total"], "message": "items"},
        "failures": len(step.errors), "elapsed": elapsed,
        # the attempt shown: 0 until a first attempt began ("1/3" would read as "ran once")
        "attempt_shown": step.attempt if step.started_at is not None or step.errors else 0,
        "concurrency_key": step.concurrency_key, "waiting_on": step.waiting_on, "limits": limits_text(step),
    }


def limits_text(step: StepStatus) -> str:
    """A step's key and limits with what they count now, or ''."""
    parts = [f"key {step.concurrency_key}"] if step.concurrency_key else []
    if step.concurrency is not None:
        parts.append(f"{step.running_in_group or 0}/{step.concurrency} running")
    if step.rate_limit is not None:
        parts.append(f"{step.starts_in_period or 0}/{step.rate_limit[0]} starts per {step.rate_limit[1]:g}s")
    if step.waiting_on:
        parts.append(f"waiting on {step.waiting_on.replace('_', ' ')}")
    return ", ".join(parts)


def schedule_view(row: dict[str, Any]) -> dict[str, Any]:
    """A ``client.schedules()`` row for the overview: when it fires and what it did."""
    spec = row.get("spec") or {}
    period = f'cron "{spec["cron"]}" {spec.get("tz") or "UTC"}' if spec.get("cron") else f"every {spec.get('every'):g}s"
    return {
        "name": row["name"], "target": row["target"], "period": period, "catch_up": spec.get("catch_up"),
        "next_at": iso(row.get("next_at")), "last_slot": iso(row.get("last_slot")),
        "last_run_id": row.get("last_run_id"), "runs": row.get("runs", 0), "skipped": row.get("skipped", 0),
        "active": row["age"] is not None and row["age"] < ACTIVE_WITHIN,
    }


def outputs(steps: Sequence[StepStatus], run_state: str) -> dict[str, Any]:
    """The run page's outputs: ``{"outputs": [{"node", "state", "output", "note"}],
    "outputs_note": str | None}``. One entry per finished task node: a completed one with
    its output (``note`` says when the handler returned null), a discarded or cancelled
    one with why it has none; ``outputs_note`` when there is no entry ("no output yet"
    only while the run can still produce one)."""
    out = []
    for step in steps:
        if step.kind not in ("task", "map") or not step.terminal:
            continue
        if step.kind == "map":  # its items' outputs are rows of their own (cyclone-mp status RUN --items)
            note = f"the outputs of its items: {step.items_summary}" if step.items is not None else None
            out.append({"node": step.name, "state": "", "output": None, "note": note or f"no output: {step.state}"})
            continue
        if step.state == "completed":
            note = "the handler returned null" if step.output is None else None
        else:
            note = f"no output: {step.state}" + (f" ({step.error_kind})" if step.error_kind else "")
        out.append({"node": step.name, "state": step.state, "output": step.output, "note": note})
    note = None
    if not out:
        note = "no output yet" if run_state in ("running", "paused") else f"no output: the run ended {run_state}"
    return {"outputs": out, "outputs_note": note}


def attempts(steps: Sequence[StepStatus], now: dt.datetime) -> list[dict[str, Any]]:
    """Every attempt of every task node: one per error entry (with its forensics and
    traceback), plus the current one when it runs, completed, was cancelled or waits."""
    out: list[dict[str, Any]] = []
    for step in steps:
        if step.kind != "task":
            continue
        failed = set()
        for entry in step.errors:
            failed.add(entry.get("attempt"))
            out.append({
                "node": step.name, "attempt": entry.get("attempt"), "outcome": entry.get("kind") or "error",
                "at": entry.get("at"), "type": entry.get("type"), "message": entry.get("message"),
                "traceback": entry.get("traceback"), "started_at": None, "finished_at": None,
                **forensics(entry),
            })
        current = None
        if step.state == "running":
            current = "running"
        elif step.state == "completed":
            current = "completed"
        elif step.state == "cancelled" and step.started_at is not None and step.attempt not in failed:
            current = "cancelled"
        elif step.state == "available" and step.errors and step.attempt not in failed:
            current = "scheduled"
        if current is not None:
            elapsed = None
            if step.started_at is not None and current in ("running", "completed", "cancelled"):
                end = now if current == "running" else (step.finished_at or now)
                elapsed = round((end - step.started_at).total_seconds(), 3)
            out.append({
                "node": step.name, "attempt": step.attempt, "outcome": current,
                "at": iso(step.scheduled_at) if current == "scheduled" else None,
                "type": None, "message": None, "traceback": None,
                "started_at": iso(step.started_at) if current != "scheduled" else None,
                "finished_at": iso(step.finished_at) if current in ("completed", "cancelled") else None,
                **{key: None for key in FORENSICS}, "exit": "-", "elapsed": elapsed,
                "progress": step.progress,
            })
    return out


def actions_for(run_state: str, run_kind: str, step_states: Sequence[str]) -> dict[str, bool]:
    """Which operator actions make sense for a run now (the server checks again on POST)."""
    live = run_state in ("running", "paused")
    return {
        "cancel": live,
        "retry": (run_state in ("discarded", "running") and "discarded" in step_states)
                 or (run_state == "cancelled" and run_kind == "step"),
        "pause": run_state == "running",
        "resume": run_state == "paused",
        "signal": live,
    }


NODE_W, NODE_H, GAP_X, GAP_Y, PAD = 168, 44, 48, 14, 6


def graph_layout(steps: Sequence[dict[str, Any]]) -> dict[str, Any]:
    """Place a run's nodes in columns by dependency depth (roots left); edges as curves.

    ``steps`` are :func:`step_view` dicts (``name``, ``kind``, ``state``, ``depends_on``).
    """
    names = [s["name"] for s in steps]
    known = set(names)
    deps = {s["name"]: [d for d in s["depends_on"] if d in known] for s in steps}
    depth: dict[str, int] = {}

    def level(name: str, path: frozenset[str]) -> int:
        if name in depth:
            return depth[name]
        parents = [d for d in deps[name] if d not in path]  # a cycle cannot be stored; never loop
        depth[name] = 1 + max((level(d, path | {name}) for d in parents), default=-1)
        return depth[name]

    for name in names:
        level(name, frozenset())
    columns: dict[int, list[str]] = {}
    for name in names:
        columns.setdefault(depth[name], []).append(name)
    pos: dict[str, tuple[float, float]] = {}
    for col, members in columns.items():
        for row, name in enumerate(members):
            pos[name] = (PAD + col * (NODE_W + GAP_X), PAD + row * (NODE_H + GAP_Y))
    nodes = [{
        "name": s["name"], "kind": s["kind"], "state": s["state"], "x": pos[s["name"]][0], "y": pos[s["name"]][1],
        "w": NODE_W, "h": NODE_H, "label": s["name"] if len(s["name"]) <= 20 else s["name"][:19] + "…",
    } for s in steps]
    edges = []
    for s in steps:
        x2, y2 = pos[s["name"]]
        for d in deps[s["name"]]:
            x1, y1 = pos[d]
            sx, sy, ex, ey = x1 + NODE_W, y1 + NODE_H / 2, x2, y2 + NODE_H / 2
            mid = (sx + ex) / 2
            edges.append({"from": d, "to": s["name"], "path": f"M{sx:g},{sy:g} C{mid:g},{sy:g} {mid:g},{ey:g} {ex:g},{ey:g}"})
    cols = max(columns, default=0) + 1
    rows = max((len(m) for m in columns.values()), default=1)
    return {"width": PAD * 2 + cols * NODE_W + (cols - 1) * GAP_X,
            "height": PAD * 2 + rows * NODE_H + (rows - 1) * GAP_Y, "nodes": nodes, "edges": edges}


def parse_payload(text: str | None) -> Any:
    """The JSON payload of a signal form (empty means null). Raises PayloadError."""
    if text is None or not text.strip():
        return None
    try:
        return json.loads(text)
    except ValueError as exc:
        raise PayloadError(f"the payload is not valid JSON: {exc}") from None
