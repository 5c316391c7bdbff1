"""The CLI's tables: which columns each has, how long each stays in its own place as
the terminal narrows (see :mod:`folding`), and the cells made from what the library
returned (``client.status()``, ``client.runs()``, ``client.workers()``,
``client.schedules()``, the demo's report)."""

from __future__ import annotations

import dataclasses
from typing import Any, Iterable

from rich.text import Text

from cyclone_mp import RunStatus, StepStatus
from cyclone_mp.status import exit_text

from .folding import Cell, Column, FoldingTable
from .formats import (
    attempt_text, last_error, limit_text, limits_text, mib, parse_time, progress_cell, progress_text, schedule_period,
    secs, short, state_text, tree_text, type_name, when,
)


def _took(step: StepStatus) -> str:
    if step.started_at is None or step.finished_at is None:
        return ""
    return secs((step.finished_at - step.started_at).total_seconds())


#: The columns of :func:`steps_table`; the last error holds what folds.
STEP_COLUMNS = (
    Column("node", keep=90, min_width=8, comfort=12, label=""),
    Column("state", keep=100, whole=True),
    Column("attempt", keep=95, whole=True),
    Column("reclaims", keep=15, whole=True, quiet=("0", "-")),
    Column("error_kind", keep=45, whole=True, label=""),
    Column("took", keep=40, whole=True),
    Column("started", keep=20, whole=True),
    Column("finished", keep=10, whole=True),
    Column("key / limit", keep=70, min_width=12, label=""),
    Column("progress", keep=60, min_width=12, comfort=24),
    Column("last error", keep=80, min_width=12, comfort=30, host_name="detail", always=True),
)


def steps_table(status: RunStatus, *, live: bool = False) -> FoldingTable:
    """One row per step: node, state, attempt/max, reclaims, error kind, times, the key
    and limits (what they count, what the step waits on), progress, last error (``Type:
    message``). ``live`` (the ``enqueue --wait`` view) keeps node, state, attempt, the
    key and limits, progress and, once a step failed, the last error. As the terminal
    narrows, the other columns fold into the last one; state and attempt stay whole."""
    steps = list(status.steps.values())
    errors = any(step.error or step.error_kind for step in steps)
    rows = []
    for step in steps:
        # a map node's progress is its items' (how many of them completed)
        progress = step.progress if step.items is None else {
            "done": step.items.get("completed", 0), "total": step.items["total"], "message": "items"}
        row: dict[str, Any] = {
            "node": Text(step.name), "state": state_text(step.state), "attempt": attempt_text(step),
            "key / limit": limit_text(step),
            "progress": Cell(progress_cell(progress), progress_text(progress)),
            "last error": Text(short(last_error(step), 160), style="red"),
        }
        if not live:
            row.update({"reclaims": str(step.reclaims) + (f"/{step.max_reclaims}" if step.max_reclaims is not None
                                                          else ""),
                        "error_kind": Text(step.error_kind or "", style="bold red"), "took": _took(step),
                        "started": when(step.started_at), "finished": when(step.finished_at)})
        rows.append(row)
    names = ("node", "state", "attempt", "key / limit", "progress", *(("last error",) if errors else ())) if live \
        else tuple(c.name for c in STEP_COLUMNS)
    columns = [c for c in STEP_COLUMNS if c.name in names]
    if live and not errors:
        columns = [dataclasses.replace(c, always=True) if c.name == "progress" else c for c in columns]
    return FoldingTable(columns, rows, host="last error" if errors or not live else "progress")


#: The columns of :func:`attempts_table`; the error holds what folds.
ATTEMPT_COLUMNS = (
    Column("node", keep=90, min_width=8, comfort=12, label=""),
    Column("attempt", keep=100, whole=True),
    Column("kind", keep=95, whole=True),
    Column("exit", keep=60, whole=True, label=""),
    Column("killed by supervisor", keep=50, whole=True),
    Column("trigger", keep=45, whole=True),
    Column("cpu", keep=30, whole=True),
    Column("peak RSS", keep=25, whole=True, label="peak"),
    Column("tree", keep=35, min_width=12),
    Column("elapsed", keep=40, whole=True, label="after"),
    Column("at", keep=20, whole=True),
    Column("error", keep=80, min_width=12, comfort=30, host_name="error, forensics", always=True),
)


def attempts_table(steps: Iterable[StepStatus]) -> FoldingTable | None:
    """The forensics of every failed (or cancelled) attempt: why it ended, the exception
    type and message, how the child ended and what it (and its tree) used; None when
    no attempt failed. As the terminal narrows, the forensics fold into the error."""
    rows = []
    for step in steps:
        for entry in step.errors:
            message, kind = entry.get("message") or "", type_name(entry.get("type"))
            error = f"{kind}: {message}" if kind and message else (kind or message)
            killed = entry.get("killed_by_supervisor")
            rows.append({
                "node": Text(step.name), "attempt": str(entry.get("attempt", "-")),
                "kind": str(entry.get("kind") or "-"), "exit": exit_text(entry),
                "killed by supervisor": "-" if killed is None else ("yes" if killed else "no"),
                "trigger": str(entry.get("trigger") or "-"), "cpu": secs(entry.get("cpu_seconds"), 3),
                "peak RSS": mib(entry.get("peak_rss_kb"), unit_kb=True), "tree": tree_text(entry),
                "elapsed": secs(entry.get("elapsed")), "at": when(parse_time(entry.get("at"))),
                "error": Text(short(error, 160), style="red"),
            })
    if not rows:
        return None
    return FoldingTable(ATTEMPT_COLUMNS, rows, host="error", title="failed and cancelled attempts")


#: The columns of :func:`runs_table`; the name holds what folds, and folds under the id.
RUN_COLUMNS = (
    Column("id", keep=100, whole=True),
    Column("name", keep=70, min_width=10, comfort=16, into=("id",), label=""),
    Column("kind", keep=10, whole=True, label=""),
    Column("state", keep=95, whole=True),
    Column("steps", keep=20, whole=True),
    Column("created", keep=50, whole=True),
    Column("finished", keep=30, whole=True),
    Column("key", keep=60, min_width=8),
    Column("waiting on", keep=65, min_width=8),
    Column("schedule", keep=40, min_width=8),
    Column("parent", keep=35, whole=True),
)


def runs_table(rows: list[dict[str, Any]]) -> FoldingTable:
    """``client.runs()`` rows: id, name, kind, state, steps, created, finished; and, when
    any row has one, its key, the limit it waits on, its schedule and the run that spawned
    it (its first 8 digits: ``status`` takes a prefix). The id and the
    state always show whole; as the terminal narrows, the rest folds under the name,
    and the name under the id."""
    return FoldingTable(RUN_COLUMNS, [{
        "id": str(row["id"]), "name": Text(str(row["name"])), "kind": str(row["kind"]),
        "state": state_text(str(row["state"])), "steps": str(row.get("steps", "")),
        "created": when(row.get("created_at")), "finished": when(row.get("finished_at")),
        "key": Text(str(row.get("key") or "")),
        "waiting on": Text(str(row.get("waiting_on") or "").replace("_", " "), style="yellow"),
        "schedule": Text(str(row.get("schedule") or "")),
        "parent": str(row.get("parent_id") or "")[:8],  # the run that spawned it (ctx.spawn)
    } for row in rows], host="name")


#: The columns of :func:`schedules_table`; the period holds what folds.
SCHEDULE_COLUMNS = (
    Column("name", keep=100, min_width=10, comfort=16, label=""),
    Column("target", keep=60, min_width=8),
    Column("when", keep=90, min_width=12, comfort=20, label=""),
    Column("catch up", keep=20, whole=True),
    Column("next", keep=80, whole=True),
    Column("last slot", keep=40, whole=True),
    Column("runs", keep=30, whole=True),
    Column("skipped", keep=25, whole=True, quiet=("0",)),
    Column("active", keep=70, min_width=3, comfort=8),
)


def schedules_table(rows: list[dict[str, Any]]) -> FoldingTable:
    """``client.schedules()`` rows: name, target, period, catch-up, next and last slots,
    counts, and whether a live supervisor defines it."""
    return FoldingTable(SCHEDULE_COLUMNS, [{
        "name": Text(str(row["name"])), "target": Text(str(row["target"])),
        "when": Text(schedule_period(row.get("spec") or {})),
        "catch up": str((row.get("spec") or {}).get("catch_up", "")), "next": when(row.get("next_at")),
        "last slot": when(row.get("last_slot")), "runs": str(row.get("runs", 0)), "skipped": str(row.get("skipped", 0)),
        "active": _active(row),
    } for row in rows], host="when")


def _active(row: dict[str, Any]) -> Text:
    """``yes``, ``yes, 2 definitions`` (two live supervisors declare it differently: the one
    declared last is in force), or ``no`` in yellow."""
    if not row.get("active"):
        return Text("no", style="yellow")
    n = len(row.get("definitions") or ())
    return Text(f"yes, {n} definitions" if n > 1 else "yes")


#: The columns of the children's table of :func:`print_workers`; the step holds what folds.
CHILD_COLUMNS = (
    Column("pid", keep=80, whole=True),
    Column("step", keep=85, min_width=10, comfort=16, label=""),
    Column("node", keep=35, min_width=8),
    Column("run", keep=90, whole=True),
    Column("attempt", keep=70, whole=True, into=("run",)),
    Column("elapsed", keep=60, whole=True, label=""),
    Column("CPU %", keep=50, whole=True, label="CPU"),
    Column("RSS", keep=45, whole=True, label=""),
    Column("steps run", keep=20, whole=True),
)


def children_table(info: dict[str, Any], row_age: float) -> FoldingTable:
    """A supervisor's children (its registry row's ``info``, ``row_age`` seconds old): pid,
    step (``idle``; ``starting`` for one not yet ready) with its caps, node, run, attempt,
    elapsed, CPU %, RSS, steps run."""
    rows = []
    for kid in info.get("children") or []:
        busy = kid.get("run_id") is not None
        elapsed = (float(kid.get("elapsed") or 0.0) + row_age) if busy else None
        cpu = kid.get("cpu_percent")
        step = Text(str(kid.get("step") or ("idle" if kid.get("ready", True) else "starting")))
        caps = limits_text(kid.get("limits"))
        if caps:
            step.append(f" [{caps}]", style="dim")
        rows.append({
            "pid": str(kid.get("pid")), "step": step,
            "node": Text(str(kid.get("node") or "") if kid.get("node") != kid.get("step") else ""),
            "run": str(kid.get("run_id") or ""), "attempt": str(kid.get("attempt") or ""),
            "elapsed": secs(elapsed, 1) if busy else "", "CPU %": "-" if cpu is None else f"{cpu:.0f}",
            "RSS": mib(kid.get("rss")), "steps run": str(kid.get("steps_run", 0)),
        })
    return FoldingTable(CHILD_COLUMNS, rows, host="step")


def _demo_detail(row: Any) -> str:
    """What happened to one demo run, in words."""
    if not row.error:
        return ""
    forensics = row.forensics or {}
    exit_ = exit_text(forensics)
    if forensics.get("killed_by_supervisor"):
        return f"child killed by supervisor after {forensics.get('trigger') or 'cancel'}, {exit_}"
    if exit_ != "-":
        return f"child died on its own, {exit_}"
    return short(row.error, 60)


#: The columns of :func:`demo_table`; what happened holds what folds.
DEMO_COLUMNS = (
    Column("#", keep=10, whole=True),
    Column("step", keep=90, min_width=8, comfort=14, label=""),
    Column("run", keep=50, whole=True),
    Column("state", keep=100, whole=True),
    Column("attempts", keep=95, whole=True),
    Column("reclaims", keep=20, whole=True, quiet=("0",)),
    Column("error_kind", keep=60, whole=True, label=""),
    Column("duration", keep=55, whole=True, label="after"),
    Column("what happened", keep=80, min_width=12, comfort=30, always=True),
    Column("expected", keep=85, min_width=6, comfort=12, label=""),
)


def demo_table(report: Any) -> FoldingTable:
    """One row per demo run: step, run id (its first 8 characters: ``status`` takes it),
    final state, attempts, reclaims, error_kind, duration, what happened to its child,
    and whether that is what was expected."""
    return FoldingTable(DEMO_COLUMNS, [{
        "#": str(i), "step": Text(row.step), "run": row.run_id[:8], "state": state_text(row.state),
        "attempts": f"{row.attempt}/{row.max_attempts}", "reclaims": str(row.reclaims),
        "error_kind": Text(row.error_kind or "", style="bold red"), "duration": secs(row.duration),
        "what happened": Text(_demo_detail(row), style="dim"),
        "expected": Text("ok" if row.ok else f"expected {row.expected}", style="green" if row.ok else "bold red"),
    } for i, row in enumerate(report.rows, 1)], host="what happened", title="cyclone-mp demo")
