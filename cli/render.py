"""How the CLI shows things: rich tables and live displays, and JSON output.

Pure presentation: every function takes data the library returned (a
:class:`~cyclone_mp.RunStatus`, ``client.runs()`` / ``client.workers()`` rows, a
:class:`~cyclone_mp.demo.DemoReport`) and returns a rich renderable or prints it.
Times are shown in local time; durations in seconds; sizes in MiB.

The tables themselves are :mod:`tables`; they fit the terminal at any width (their
least important columns fold into the cells of the others as it narrows, see
:mod:`folding`: states, attempts and run ids always show whole); ``wide=True`` (the
CLI's ``--wide``) prints every column in its own place whatever the width. The small
formatters are :mod:`formats`. Data is printed as
text, never as rich markup (a node named ``[x]`` or an input holding ``[true]`` shows as
is).
"""

from __future__ import annotations

import dataclasses
import datetime as dt
import decimal
import json
import os
import sys
import uuid
from typing import Any

from rich.console import Console, Group
from rich.measure import Measurement
from rich.text import Text

from cyclone_mp import RunStatus, StepStatus

from .formats import (  # noqa: F401 - the formatters the commands use, by render's name
    attempt_text, count, error_text, last_error, limits_text, run_state_text, secs, short, when,
)
from .tables import attempts_table, children_table, demo_table, runs_table, schedules_table, steps_table  # noqa: F401

WIDE = 160  #: table width when the output is not a terminal (pipes, logs, tests) and COLUMNS is unset
MAX_WIDE = 400  #: the widest a --wide table is drawn
SPAWNED_LISTED = 20  #: the spawned runs `status` lists one per line (--json has them all)


def console(stderr: bool = False) -> Console:
    """A console on stdout (or stderr): the terminal's width; when the output is not a
    terminal, ``$COLUMNS`` if set, else :data:`WIDE` so tables stay readable in logs."""
    con = Console(stderr=stderr, highlight=False)
    if not con.is_terminal and not os.environ.get("COLUMNS", "").strip().isdigit():
        con = Console(stderr=stderr, highlight=False, width=WIDE)
    return con


def put(con: Console, renderable: Any, wide: bool = False) -> None:
    """Print a table; with ``wide``, as wide as its columns need (at least WIDE, at most
    MAX_WIDE) and uncropped: every column whole and in its own place (the terminal wraps
    the lines, or ``less -S`` scrolls)."""
    need = WIDE
    if wide:
        need = max(WIDE, min(MAX_WIDE, Measurement.get(con, con.options.update_width(MAX_WIDE), renderable).maximum))
    if wide and con.width < need:
        narrow, con.width = con.width, need  # print(width=...) cannot exceed the console's width
        try:
            con.print(renderable, crop=False)
        finally:
            con.width = narrow
    else:
        con.print(renderable)


# -- JSON ---------------------------------------------------------------------------------------


def _default(value: Any) -> Any:
    if isinstance(value, (dt.datetime, dt.date)):
        return value.isoformat()
    if isinstance(value, dt.timedelta):
        return value.total_seconds()
    if isinstance(value, (uuid.UUID, decimal.Decimal)):
        return str(value)
    if isinstance(value, (set, frozenset, tuple)):
        return list(value)
    raise TypeError(f"not JSON serializable: {type(value).__name__}")


def dumps(value: Any, indent: int | None = 2) -> str:
    """JSON text of ``value`` (datetimes as ISO 8601 strings)."""
    return json.dumps(value, default=_default, indent=indent, ensure_ascii=False)


def print_json(value: Any) -> None:
    """Print ``value`` as JSON on stdout (plain, never colored: scripts parse it)."""
    sys.stdout.write(dumps(value) + "\n")
    sys.stdout.flush()


# -- status, runs, workers, db, demo --------------------------------------------------------------


def last_traceback(status: RunStatus) -> tuple[str, dict[str, Any]] | None:
    """``(node, error entry)`` of the most recent error entry that carries a traceback,
    or None (``status --traceback``)."""
    found = [(str(entry.get("at") or ""), step.name, entry) for step in status.steps.values()
             for entry in step.errors if entry.get("traceback")]
    if not found:
        return None
    _, node, entry = max(found, key=lambda item: item[0])
    return node, entry


def print_status(con: Console, status: RunStatus, *, wide: bool = False, traceback: bool = False,
                 items: dict[str, list[StepStatus]] | None = None) -> None:
    """The full ``cyclone-mp status`` view of one run: the run, a table of its steps (node
    name, state, attempt, last error as ``Type: message``), each map node's items by state
    (and with ``items``, ``{map node: its items}``, a table of them), the whole error of
    each discarded step, each output under its node's name, the failed attempts'
    forensics and, with ``traceback``, the last traceback."""
    con.print(Text.assemble(
        ("run ", "bold"), (status.id, "bold"), f"  {status.kind} {status.name!r}  ", run_state_text(status),
        f"  created {when(status.created_at)}  finished {when(status.finished_at)}",
        ("  (archived)", "dim") if status.archived else "",
    ))
    con.print(Text(f"input: {short(dumps(status.input, indent=None), 150)}"))
    if status.schedule:
        con.print(Text(f"schedule: {status.schedule['name']}  slot {when(status.schedule['slot'])}"
                       f"  next slot {when(status.schedule.get('next_at'))}"))
    if status.parent_id:  # a handler of another run spawned it (ctx.spawn)
        con.print(Text(f"parent: {status.parent_id}  node {status.parent_node}  key {status.parent_key}"))
    if status.children:
        states: dict[str, int] = {}
        for kid in status.children:
            states[kid["state"]] = states.get(kid["state"], 0) + 1
        con.print(Text(f"spawned: {count(len(status.children), 'run')} ("
                       + ", ".join(f"{n} {s}" for s, n in sorted(states.items())) + ")"))
        for kid in status.children[:SPAWNED_LISTED]:
            con.print(Text(f"  {kid['id']}  {kid['name']}  {kid['state']}  node {kid['parent_node']}"
                           f"  key {kid['parent_key']}"))
        if len(status.children) > SPAWNED_LISTED:
            con.print(Text(f"  ... {len(status.children) - SPAWNED_LISTED} more (--json lists them)", style="dim"))
    put(con, steps_table(status), wide)
    for step in status.steps.values():
        if step.items is not None:  # a map node: its items by state (--items lists them)
            con.print(Text.assemble((f"{step.name}: ", "bold"), step.items_summary or ""))
    for name, items in (items or {}).items():
        con.print(Text(f"items of {name}:", style="bold"))
        put(con, steps_table(dataclasses.replace(status, steps={i.name: i for i in items})), wide)
    for step in status.steps.values():
        if step.state == "discarded" and (step.error or step.error_kind):  # why, in full: it may say what to fix
            con.print(Text.assemble((f"{step.name} discarded ({step.error_kind}): ", "bold"),
                                    (last_error(step), "red")))
    for step in status.steps.values():
        if step.state == "completed" and step.output is not None:
            con.print(Text.assemble((f"output of {step.name}: ", "bold"), short(dumps(step.output, indent=None), 300)))
    for step in status.steps.values():
        caps = limits_text(step)
        if caps:
            con.print(Text.assemble((f"limits of {step.name}: ", "bold"), caps))
    forensics = attempts_table(status.steps.values())
    if forensics is not None:
        put(con, forensics, wide)
    if traceback:
        last = last_traceback(status)
        if last is None:
            con.print(Text("no traceback recorded (no attempt raised an exception)", style="dim"))
        else:
            node, entry = last
            con.print(Text(f"last traceback: {node}, attempt {entry.get('attempt', '-')}", style="bold"))
            con.print(Text(str(entry["traceback"]).rstrip("\n")), soft_wrap=True)
    elif any(entry.get("traceback") for step in status.steps.values() for entry in step.errors):
        con.print(Text(f"(cyclone-mp status {status.id} --traceback shows the last traceback)", style="dim"))


def wait_view(status: RunStatus, elapsed: float) -> Group:
    """What ``enqueue --wait`` shows while it waits."""
    head = Text.assemble(("run ", "bold"), status.id, "  ", run_state_text(status), f"  {elapsed:.1f}s")
    return Group(head, steps_table(status, live=True))


def _sweep_age(age: float | None, row_age: float) -> Text | str:
    """``  last sweep 1.2s ago`` (the fleet's last successful recovery sweep, brought up to
    now from the registry row's age), in red when older than a minute; '' when unknown."""
    if age is None:
        return ""
    total = float(age) + row_age
    return Text(f"  last sweep {total:.0f}s ago", style="bold red" if total > 60 else "")


def print_workers(con: Console, rows: list[dict[str, Any]], *, wide: bool = False) -> None:
    """Each live supervisor, then a table of its children (pid, step, elapsed, CPU %, RSS)."""
    if not rows:
        con.print("no live supervisors")
        return
    for row in rows:
        info = row.get("info") or {}
        age_s = float(row.get("age") or 0.0)
        con.print(Text.assemble(
            ("supervisor ", "bold"), (str(row["id"]), "bold"),
            f"  host {row.get('hostname')} pid {row.get('pid')}  up since {when(row.get('started_at'))}",
            f"  seen {age_s:.1f}s ago  queues "
            + ",".join(q + (" (paused)" if q in (info.get("paused_queues") or ()) else "") for q in info.get("queues") or []),
            _sweep_age((info.get("maintenance") or {}).get("last_sweep_age"), age_s),
            ("  draining" if info.get("draining") else ""),
        ))
        for task, health in sorted(((info.get("maintenance") or {}).get("failing") or {}).items()):
            con.print(Text(f"  FAILING: maintenance task {task} failed {health.get('failures')} times in a row "
                           f"(for {secs(health.get('for'), 0)}): {health.get('error')}", style="bold red"))
        mech = info.get("limits")
        if isinstance(mech, dict):
            con.print(Text(
                f"  limits: memory {mech.get('memory')} · processes {mech.get('processes')} · "
                f"cpu {mech.get('cpu')} · open files {mech.get('open_files')} · tree kill {mech.get('kill')}"
                + (f" · OOM evidence {mech['oom']}" if mech.get("oom") else ""),
                style="dim"))
        if info.get("children"):
            put(con, children_table(info, age_s), wide)


def print_db_status(con: Console, info: dict[str, Any]) -> None:
    """``EmbeddedServer.status()`` as lines."""
    running = "[green]running[/]" if info.get("running") else "[yellow]not running[/]"
    con.print(f"embedded PostgreSQL {info.get('version')}: {running}" + (f" (pid {info['pid']})" if info.get("pid") else ""))
    con.print(f"data dir: {info.get('data_dir')}")
    if info.get("uri"):
        con.print(f"uri: {info['uri']}")
    if info.get("sessions") is not None:
        con.print(f"sessions: {info['sessions']} connected (`cyclone-mp db stop` would end them)")


def print_demo(con: Console, report: Any, *, wide: bool = False) -> None:
    """The demo's table, summary line and process check."""
    put(con, demo_table(report), wide)
    throughput = f"{report.cpu_throughput:.2f} CPU steps/s" if report.cpu_throughput else "throughput n/a"
    con.print(
        f"[bold]{report.completed} completed, {report.discarded} discarded"
        + (f", {report.other} unfinished" if report.other else "") + "[/]"
        f" · {count(report.killed, 'child', 'children')} killed, "
        f"{count(report.grandchildren_killed, 'grandchild', 'grandchildren')} reaped"
        f" · {throughput} · wall {report.wall_seconds:.1f}s (runs {report.run_seconds:.1f}s)"
    )
    if not report.grandchildren:
        con.print("[bold red]grandchildren: pids not recorded[/] (the grandchild step's progress message, which "
                  "carries them, never reached the database), so they cannot be checked")
    elif report.grandchildren_alive:
        con.print(f"[bold red]grandchildren {report.grandchildren}: ALIVE {report.grandchildren_alive}[/]")
    else:
        con.print(f"grandchildren {report.grandchildren}: gone")
    left = "no handler process left" if not report.leftover_pids else f"LEFT BEHIND: pids {report.leftover_pids}"
    mark = "[green]✓[/]" if not report.leftover_pids else "[bold red]✗[/]"
    con.print(f"{mark} check: {left} (supervisor {report.supervisor_id}: no process carries its marker, "
              f"no child of this process alive)")
    if report.own_database:
        data = "its own database, kept" if report.kept else "its own database, dropped at the end; --keep keeps it"
    else:
        data = "its runs kept" if report.kept else "its runs deleted at the end; --keep keeps them"
    con.print(f"database: {report.database} ({data})", soft_wrap=True)  # whole, to copy
    if report.kept:
        con.print(f"look at its runs: cyclone-mp --dsn '{report.database}' runs", soft_wrap=True)
    if report.embedded:
        server = "started by this demo" if report.server_started else "already running"
        con.print(f"embedded server: {server}; left running for other commands and users "
                  "(`cyclone-mp db stop` stops it)")
    failed = [name for name, ok in report.checks.items() if not ok]
    if failed:
        con.print(f"[bold red]FAILED checks: {', '.join(failed)}[/]")
    else:
        con.print("[bold green]all checks passed[/]")
