"""How the CLI shows things: rich tables and live displays, and JSON output.

Pure presentation: every function takes data the library returned (a
:class:`~cyclone_mp.RunStatus`, ``client.runs()`` / ``client.workers()`` rows, a
:class:`~cyclone_mp.demo.DemoReport`) and returns a rich renderable or prints it.
Times are shown in local time; durations in seconds; sizes in MiB.
"""

from __future__ import annotations

import datetime as dt
import decimal
import json
import sys
import uuid
from typing import Any, Iterable

from rich.console import Console, Group
from rich.progress_bar import ProgressBar
from rich.table import Table
from rich.text import Text

from cyclone_mp import RunStatus, StepStatus
from cyclone_mp.status import exit_text

STATE_STYLES = {
    "completed": "green", "discarded": "red", "cancelled": "yellow", "running": "cyan",
    "available": "blue", "pending": "dim", "paused": "magenta", "waiting_signal": "magenta",
    "waiting_timer": "magenta",
}
WIDE = 160  #: table width when the output is not a terminal (pipes, logs, tests)


def console(stderr: bool = False) -> Console:
    """A console on stdout (or stderr); wide when it is not a terminal so tables stay readable."""
    con = Console(stderr=stderr, highlight=False)
    if not con.is_terminal:
        con = Console(stderr=stderr, highlight=False, width=WIDE)
    return con


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


# -- small formatters -----------------------------------------------------------------------------


def when(value: dt.datetime | None) -> str:
    """Local time ``YYYY-MM-DD HH:MM:SS.mmm`` or ``-``."""
    if value is None:
        return "-"
    return value.astimezone().strftime("%Y-%m-%d %H:%M:%S.%f")[:-3]


def secs(value: float | None, digits: int = 2) -> str:
    """Seconds with a unit, or ``-``."""
    return "-" if value is None else f"{value:.{digits}f}s"


def mib(value: float | None, unit_kb: bool = False) -> str:
    """Bytes (or KiB when ``unit_kb``) as MiB, or ``-``."""
    if value is None:
        return "-"
    return f"{value / 1024 if unit_kb else value / 1024 / 1024:.1f} MiB"


def short(text: Any, limit: int = 80) -> str:
    """One line of at most ``limit`` characters."""
    if text is None:
        return ""
    flat = " ".join(str(text).split())
    return flat if len(flat) <= limit else flat[: limit - 1] + "…"


def state_text(state: str) -> Text:
    """The state, colored."""
    return Text(state, style=STATE_STYLES.get(state, ""))


def progress_cell(progress: Any, width: int = 16) -> Any:
    """A bar with ``done/total message`` for a ``{"done", "total", "message"}`` value."""
    if not isinstance(progress, dict):
        return ""
    done, total, message = progress.get("done"), progress.get("total"), progress.get("message")
    label = Text(f" {_num(done)}/{_num(total)}" if total else f" {_num(done)}" if done is not None else "")
    if message:
        label.append(f" {short(message, 32)}", style="dim")
    if isinstance(total, (int, float)) and total > 0 and isinstance(done, (int, float)):
        table = Table.grid()
        table.add_row(ProgressBar(total=float(total), completed=float(min(done, total)), width=width), label)
        return table
    return label


def _num(value: Any) -> str:
    if isinstance(value, float) and value.is_integer():
        return str(int(value))
    return "-" if value is None else str(value)


# -- status -----------------------------------------------------------------------------------------


def steps_table(status: RunStatus, *, live: bool = False) -> Table:
    """One row per step: node, state, attempt/max, reclaims, error kind, times, progress,
    last error. ``live`` (the ``enqueue --wait`` view) keeps only node, state, attempt,
    progress and, once a step failed, the last error."""
    steps = list(status.steps.values())
    errors = any(step.error for step in steps)
    table = Table()
    table.add_column("node", no_wrap=True)
    table.add_column("state", no_wrap=True)
    table.add_column("attempt", no_wrap=True)
    if not live:
        for name in ("reclaims", "error_kind", "started", "finished"):
            table.add_column(name, no_wrap=True)
    limits = any(step.concurrency_key or step.concurrency or step.rate_limit for step in steps)
    if limits:
        table.add_column("key / limit", no_wrap=True)
    table.add_column("progress", no_wrap=True)
    if errors or not live:
        table.add_column("last error")
    for step in steps:
        cells: list[Any] = [step.name, state_text(step.state), f"{step.attempt}/{step.max_attempts}"]
        if not live:
            cells += [str(step.reclaims) + (f"/{step.max_reclaims}" if step.max_reclaims is not None else ""),
                      step.error_kind or "", when(step.started_at), when(step.finished_at)]
        if limits:
            cells.append(limit_text(step))
        cells.append(progress_cell(step.progress))
        if errors or not live:
            cells.append(Text(short(step.error, 60), style="red"))
        table.add_row(*cells)
    return table


def limit_text(step: StepStatus) -> Text:
    """The step's key, its limits with what they count now, and the one it waits on."""
    parts = [f"key {step.concurrency_key}"] if step.concurrency_key else []
    if step.concurrency is not None:
        parts.append(f"{step.running_in_group or 0}/{step.concurrency} running")
    if step.rate_limit is not None:
        parts.append(f"{step.starts_in_period or 0}/{step.rate_limit[0]} starts per {step.rate_limit[1]:g}s")
    text = Text(", ".join(parts))
    if step.waiting_on:
        text.append(f"  waiting on {step.waiting_on.replace('_', ' ')}", style="yellow")
    return text


def attempts_table(steps: Iterable[StepStatus]) -> Table | None:
    """The forensics of every failed attempt: why it ended, and what the child used."""
    table = Table(title="failed attempts", title_justify="left")
    for name in ("node", "attempt", "kind", "exit", "killed by supervisor", "trigger", "cpu", "peak RSS",
                 "elapsed", "at", "message"):
        table.add_column(name, no_wrap=name != "message")
    rows = 0
    for step in steps:
        for entry in step.errors:
            killed = entry.get("killed_by_supervisor")
            table.add_row(
                step.name, str(entry.get("attempt", "-")), str(entry.get("kind") or "-"), exit_text(entry),
                "-" if killed is None else ("yes" if killed else "no"), str(entry.get("trigger") or "-"),
                secs(entry.get("cpu_seconds"), 3), mib(entry.get("peak_rss_kb"), unit_kb=True),
                secs(entry.get("elapsed")), when(_parse_time(entry.get("at"))),
                Text(short(entry.get("message"), 70), style="red"),
            )
            rows += 1
    return table if rows else None


def _parse_time(value: Any) -> dt.datetime | None:
    if isinstance(value, str):
        try:
            return dt.datetime.fromisoformat(value)
        except ValueError:
            return None
    return value if isinstance(value, dt.datetime) else None


def print_status(con: Console, status: RunStatus) -> None:
    """The full ``cyclone-mp status`` view of one run."""
    con.print(Text.assemble(
        ("run ", "bold"), (status.id, "bold"), f"  {status.kind} {status.name!r}  ", state_text(status.state),
        f"  created {when(status.created_at)}  finished {when(status.finished_at)}",
    ))
    con.print(f"input: {short(dumps(status.input, indent=None), 150)}")
    if status.schedule:
        con.print(f"schedule: {status.schedule['name']}  slot {when(status.schedule['slot'])}"
                  f"  next slot {when(status.schedule.get('next_at'))}")
    con.print(steps_table(status))
    for step in status.steps.values():
        if step.state == "completed" and step.output is not None:
            con.print(f"output[{step.name}]: {short(dumps(step.output, indent=None), 150)}")
    forensics = attempts_table(status.steps.values())
    if forensics is not None:
        con.print(forensics)


def wait_view(status: RunStatus, elapsed: float) -> Group:
    """What ``enqueue --wait`` shows while it waits."""
    head = Text.assemble(("run ", "bold"), status.id, "  ", state_text(status.state), f"  {elapsed:.1f}s")
    return Group(head, steps_table(status, live=True))


# -- runs, workers, db -------------------------------------------------------------------------------


def runs_table(rows: list[dict[str, Any]]) -> Table:
    """``client.runs()`` rows: id, name, kind, state, steps, created, finished; and, when
    any row has one, its key, the limit it waits on and its schedule (issue 21)."""
    table = Table()
    extra = [c for c in ("key", "waiting_on", "schedule") if any(row.get(c) for row in rows)]
    for name in ("id", "name", "kind", "state", "steps", "created", "finished", *extra):
        table.add_column(name.replace("_", " "), no_wrap=True)
    for row in rows:
        table.add_row(str(row["id"]), str(row["name"]), str(row["kind"]), state_text(str(row["state"])),
                      str(row.get("steps", "")), when(row.get("created_at")), when(row.get("finished_at")),
                      *(str(row.get(c) or "") for c in extra))
    return table


def schedule_period(spec: dict[str, Any]) -> str:
    """``cron "<expr>" <tz>`` or ``every <n>s``, from a schedule's stored spec."""
    if spec.get("cron") is not None:
        return f'cron "{spec["cron"]}" {spec.get("tz") or "UTC"}'
    return f"every {spec.get('every'):g}s"


def schedules_table(rows: list[dict[str, Any]]) -> Table:
    """``client.schedules()`` rows: name, target, period, catch-up, next and last slots, counts."""
    table = Table()
    for name in ("name", "target", "when", "catch up", "next", "last slot", "runs", "skipped", "active"):
        table.add_column(name, no_wrap=True)
    for row in rows:
        spec = row.get("spec") or {}
        table.add_row(str(row["name"]), str(row["target"]), schedule_period(spec), str(spec.get("catch_up", "")),
                      when(row.get("next_at")), when(row.get("last_slot")), str(row.get("runs", 0)),
                      str(row.get("skipped", 0)),
                      "yes" if row.get("active") else Text("no", style="yellow"))
    return table


def print_workers(con: Console, rows: list[dict[str, Any]]) -> None:
    """Each live supervisor, then a table of its children (pid, step, elapsed, CPU %, RSS)."""
    if not rows:
        con.print("no live supervisors")
        return
    for row in rows:
        info = row.get("info") or {}
        age = float(row.get("age") or 0.0)
        con.print(Text.assemble(
            ("supervisor ", "bold"), (str(row["id"]), "bold"),
            f"  host {row.get('hostname')} pid {row.get('pid')}  up since {when(row.get('started_at'))}",
            f"  seen {age:.1f}s ago  queues {','.join(info.get('queues') or [])}",
            ("  draining" if info.get("draining") else ""),
        ))
        table = Table()
        for name in ("pid", "step", "node", "run", "attempt", "elapsed", "CPU %", "RSS", "steps run"):
            table.add_column(name, no_wrap=True)
        for kid in info.get("children") or []:
            busy = kid.get("run_id") is not None
            elapsed = (float(kid.get("elapsed") or 0.0) + age) if busy else None
            cpu = kid.get("cpu_percent")
            table.add_row(
                str(kid.get("pid")), str(kid.get("step") or "idle"), str(kid.get("node") or ""),
                str(kid.get("run_id") or ""), str(kid.get("attempt") or ""), secs(elapsed, 1),
                "-" if cpu is None else f"{cpu:.0f}", mib(kid.get("rss")), str(kid.get("steps_run", 0)),
            )
        con.print(table)


def print_db_status(con: Console, info: dict[str, Any]) -> None:
    """``EmbeddedServer.status()`` as lines."""
    running = "[green]running[/]" if info.get("running") else "[yellow]not running[/]"
    con.print(f"embedded PostgreSQL {info.get('version')}: {running}" + (f" (pid {info['pid']})" if info.get("pid") else ""))
    con.print(f"data dir: {info.get('data_dir')}")
    if info.get("uri"):
        con.print(f"uri: {info['uri']}")


# -- demo ---------------------------------------------------------------------------------------------


def demo_table(report: Any) -> Table:
    """One row per demo run: step, final state, attempts, reclaims, error_kind, duration."""
    table = Table(title="cyclone-mp demo", title_justify="left")
    for name in ("#", "step", "run", "state", "attempts", "reclaims", "error_kind", "duration", "what happened",
                 "expected"):
        table.add_column(name, no_wrap=True, overflow="ellipsis")
    for i, row in enumerate(report.rows, 1):
        detail = ""
        if row.error:
            forensics = row.forensics or {}
            exit_ = exit_text(forensics)
            if forensics.get("killed_by_supervisor"):
                detail = f"child killed by supervisor after {forensics.get('trigger') or 'cancel'}, {exit_}"
            elif exit_ != "-":
                detail = f"child died on its own, {exit_}"
            else:
                detail = short(row.error, 60)
        table.add_row(
            str(i), row.step, row.run_id[:8], state_text(row.state), f"{row.attempt}/{row.max_attempts}",
            str(row.reclaims), row.error_kind or "", secs(row.duration), Text(detail, style="dim"),
            Text("ok" if row.ok else f"expected {row.expected}", style="green" if row.ok else "bold red"),
        )
    return table


def print_demo(con: Console, report: Any) -> None:
    """The demo's table, summary line and process check."""
    con.print(demo_table(report))
    throughput = f"{report.cpu_throughput:.2f} CPU steps/s" if report.cpu_throughput else "throughput n/a"
    con.print(
        f"[bold]{report.completed} completed, {report.discarded} discarded"
        + (f", {report.other} unfinished" if report.other else "") + "[/]"
        f" · {report.killed} children killed, {report.grandchildren_killed} grandchildren reaped"
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
    server = "started by the demo and stopped" if report.server_stopped else (
        "started by the demo" if report.server_started else "already running; left running")
    con.print(f"database: {report.database}" + (f" (embedded server {server})" if report.embedded else ""))
    failed = [name for name, ok in report.checks.items() if not ok]
    if failed:
        con.print(f"[bold red]FAILED checks: {', '.join(failed)}[/]")
    else:
        con.print("[bold green]all checks passed[/]")
