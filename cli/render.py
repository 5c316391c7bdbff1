"""How the CLI shows things: rich tables and live displays, and JSON output.

Pure presentation: every function takes data the library returned (a
:class:`~cyclone_mp.RunStatus`, ``client.runs()`` / ``client.workers()`` rows, a
:class:`~cyclone_mp.demo.DemoReport`) and returns a rich renderable or prints it.
Times are shown in local time; durations in seconds; sizes in MiB.

Tables fit the terminal (issue 19): below :data:`NARROW` columns they are *compact*:
low-value columns are dropped or folded into one wrapping "detail" column, while state,
attempts and run ids always show in full; ``wide=True`` (the CLI's ``--wide``) shows
every column whatever the width. Data is printed as text, never as rich markup (a node
named ``[x]`` or an input holding ``[true]`` shows as is).
"""

from __future__ import annotations

import datetime as dt
import decimal
import json
import os
import sys
import uuid
from typing import Any, Iterable

from rich.console import Console, Group
from rich.measure import Measurement
from rich.progress_bar import ProgressBar
from rich.table import Table
from rich.text import Text

from cyclone_mp import RunStatus, StepStatus
from cyclone_mp.limits import format_size
from cyclone_mp.status import exit_text

STATE_STYLES = {
    "completed": "green", "discarded": "red", "cancelled": "yellow", "running": "cyan",
    "available": "blue", "pending": "dim", "paused": "magenta", "waiting_signal": "magenta",
    "waiting_timer": "magenta",
}
WIDE = 160  #: table width when the output is not a terminal (pipes, logs, tests) and COLUMNS is unset
NARROW = 100  #: below this many columns tables are compact (issue 19)
MAX_WIDE = 400  #: the widest a --wide table is drawn


def console(stderr: bool = False) -> Console:
    """A console on stdout (or stderr): the terminal's width; when the output is not a
    terminal, ``$COLUMNS`` if set, else :data:`WIDE` so tables stay readable in logs."""
    con = Console(stderr=stderr, highlight=False)
    if not con.is_terminal and not os.environ.get("COLUMNS", "").strip().isdigit():
        con = Console(stderr=stderr, highlight=False, width=WIDE)
    return con


def compact(con: Console, wide: bool = False) -> bool:
    """True when tables printed on ``con`` should be compact (narrower than NARROW, and
    ``wide`` not asked for)."""
    return not wide and con.width < NARROW


def put(con: Console, renderable: Any, wide: bool = False) -> None:
    """Print a table; with ``wide``, as wide as its columns need (at least WIDE, at most
    MAX_WIDE) and uncropped: every column whole (the terminal wraps the lines, or
    ``less -S`` scrolls). A new user saw --wide squeeze the error column to nothing."""
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


def run_state_text(status: RunStatus) -> Text:
    """The run's state, colored; a ``running`` run none of whose steps has started yet
    says so (``running (queued: no step started yet)``), as the run row's state is
    ``running`` from its enqueue on."""
    text = state_text(status.state)
    if status.queued:
        text.append(" (queued: no step started yet)", style="dim")
    return text


def age(value: dt.datetime | None, now: dt.datetime | None = None) -> str:
    """How long ago, compact: ``12s``, ``5m``, ``3h``, ``2d`` (or ``-``)."""
    if value is None:
        return "-"
    seconds = max(0.0, ((now or dt.datetime.now(dt.timezone.utc)) - value).total_seconds())
    for unit, size in (("d", 86400), ("h", 3600), ("m", 60)):
        if seconds >= size:
            return f"{int(seconds // size)}{unit}"
    return f"{int(seconds)}s"


def attempt_text(step: StepStatus) -> str:
    """``attempt/max_attempts``; ``0/max`` for a step that never started (a first
    attempt not begun is no attempt: issue 19)."""
    started = step.started_at is not None or bool(step.errors)
    return f"{step.attempt if started else 0}/{step.max_attempts}"


def type_name(name: Any) -> str | None:
    """An exception type as stored (``builtins.ValueError``, ``app.errors.Bad``), without
    the ``builtins.`` of the built-in ones."""
    if not name:
        return None
    return str(name).removeprefix("builtins.")


def last_error(step: StepStatus) -> str:
    """The step's last error as ``Type: message`` (the exception type from its last error
    entry, so an empty message still names what was raised), or ``""``."""
    if not step.error and not step.error_kind:
        return ""
    entry = next((e for e in reversed(step.errors) if e.get("kind") != "cancelled"), {})  # what set ``error``
    kind = type_name(entry.get("type"))
    message = step.error or ""
    if message == step.error_kind and kind:  # no message: the store keeps the kind in its place
        message = ""
    if kind and not message.startswith(f"{kind}:"):
        return f"{kind}: {message}" if message else str(kind)
    return message or str(step.error_kind or "")


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


def count(n: int, one: str, many: str | None = None) -> str:
    """``1 child``, ``2 children``: ``n`` and the noun agreeing with it."""
    return f"{n} {one if n == 1 else (many or one + 's')}"


def _num(value: Any) -> str:
    if isinstance(value, float) and value.is_integer():
        return str(int(value))
    return "-" if value is None else str(value)


# -- status -----------------------------------------------------------------------------------------


def _step_detail(step: StepStatus) -> Text:
    """The compact table's last column: the error (kind, type, message) of a failed
    step, else its progress or how long it took."""
    if step.error or step.error_kind:
        text = Text(f"{step.error_kind}: " if step.error_kind else "", style="bold red")
        text.append(short(last_error(step), 160), style="red")
        return text
    if isinstance(step.progress, dict) and step.state == "running":
        done, total, message = (step.progress.get(k) for k in ("done", "total", "message"))
        head = f"{_num(done)}/{_num(total)}" if total else _num(done)
        return Text(head + (f" {short(message, 60)}" if message else ""))
    if step.started_at is not None and step.finished_at is not None and step.state == "completed":
        return Text(f"took {secs((step.finished_at - step.started_at).total_seconds())}", style="dim")
    return Text("")


def steps_table(status: RunStatus, *, live: bool = False, compact: bool = False) -> Table:
    """One row per step: node, state, attempt/max, reclaims, error kind, times, progress,
    last error (``Type: message``). ``live`` (the ``enqueue --wait`` view) keeps only
    node, state, attempt, progress and, once a step failed, the last error. ``compact``
    (narrow terminals): node, state, attempt and one wrapping detail column (the error,
    the progress or the time taken); state and attempt never shrink."""
    steps = list(status.steps.values())
    errors = any(step.error or step.error_kind for step in steps)
    table = Table()
    table.add_column("node", overflow="fold")
    table.add_column("state", no_wrap=True, min_width=max([len("state")] + [len(s.state) for s in steps]))
    table.add_column("attempt", no_wrap=True)
    if compact:
        table.add_column("detail", overflow="fold", ratio=1)
        for step in steps:
            table.add_row(Text(step.name), state_text(step.state), attempt_text(step), _step_detail(step))
        return table
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
        cells: list[Any] = [Text(step.name), state_text(step.state), attempt_text(step)]
        if not live:
            cells += [str(step.reclaims) + (f"/{step.max_reclaims}" if step.max_reclaims is not None else ""),
                      step.error_kind or "", when(step.started_at), when(step.finished_at)]
        if limits:
            cells.append(limit_text(step))
        cells.append(progress_cell(step.progress))
        if errors or not live:
            cells.append(Text(short(last_error(step), 90), style="red"))
        table.add_row(*cells)
    return table


def limit_text(step: StepStatus) -> Text:
    """The step's key, its limits with what they count now, and the one it waits on."""
    parts = [f"key {step.concurrency_key}"] if step.concurrency_key else []
    if step.concurrency is not None:
        parts.append(f"{step.running_in_group or 0}/{step.concurrency} running")
    if step.rate_limit is not None:
        parts.append(f"{step.starts_in_period or 0}/{step.rate_limit[0]} starts per {step.rate_limit[1]:g}s")
    text = Text(", ".join(parts))  # a Text: a key is user data, never markup
    if step.waiting_on:
        text.append(f"  waiting on {step.waiting_on.replace('_', ' ')}", style="yellow")
    return text


def _forensics_text(entry: dict[str, Any]) -> str:
    """How an attempt's child ended, in words (the compact attempts table)."""
    parts = []
    killed = entry.get("killed_by_supervisor")
    if killed and "killed by the supervisor" in str(entry.get("message") or ""):
        pass  # the message says it already
    elif killed:
        parts.append(f"killed by supervisor after {entry.get('trigger') or 'cancel'}")
    elif killed is False:
        parts.append("child died on its own")
    usage = [f"cpu {secs(entry.get('cpu_seconds'), 2)}" if entry.get("cpu_seconds") is not None else "",
             f"peak {mib(entry.get('peak_rss_kb'), unit_kb=True)}" if entry.get("peak_rss_kb") is not None else "",
             f"after {secs(entry.get('elapsed'))}" if entry.get("elapsed") is not None else ""]
    tree = tree_text(entry)
    if tree:
        usage.append(f"tree {tree}")
    return "; ".join(parts + [", ".join(u for u in usage if u)] if any(usage) else parts)


def tree_text(entry: dict[str, Any]) -> str:
    """The whole process tree's numbers of an attempt with limits (issue 20): ``peak 257
    MiB · 2.04 CPU s · 3 procs``, or ``""``."""
    tree = entry.get("tree") or {}
    if not isinstance(tree, dict) or not tree:
        return ""
    parts = []
    if tree.get("peak_memory_kb") is not None:
        parts.append(f"peak {format_size(tree['peak_memory_kb'] * 1024)}")
    if tree.get("cpu_seconds") is not None:
        parts.append(f"{tree['cpu_seconds']:.2f} CPU s")
    if tree.get("processes") is not None:
        parts.append(count(int(tree["processes"]), "proc"))
    return " · ".join(parts)


def limits_text(value: Any) -> str:
    """Resource caps (``{"memory_limit": ..., ...}`` or a StepStatus) in words, or ``""``."""
    if isinstance(value, StepStatus):
        value = {"memory_limit": value.memory_limit, "cpu_limit": value.cpu_limit,
                 "max_processes": value.max_processes, "max_open_files": value.max_open_files}
    if not isinstance(value, dict):
        return ""
    parts = []
    if value.get("memory_limit") is not None:
        parts.append(f"memory {format_size(value['memory_limit'])}")
    if value.get("cpu_limit") is not None:
        parts.append(f"cpu {value['cpu_limit']:g} s")
    if value.get("max_processes") is not None:
        parts.append(f"{value['max_processes']} procs")
    if value.get("max_open_files") is not None:
        parts.append(f"{value['max_open_files']} files")
    return ", ".join(parts)


def attempts_table(steps: Iterable[StepStatus], *, compact: bool = False) -> Table | None:
    """The forensics of every failed (or cancelled) attempt: why it ended, the exception
    type and message, and what the child used. ``compact``: node, attempt, kind, exit and
    one wrapping column with the rest."""
    table = Table(title="failed and cancelled attempts", title_justify="left")
    steps = list(steps)
    trees = any(tree_text(entry) for step in steps for entry in step.errors)
    names = (("node", "attempt", "kind", "exit", "what happened") if compact else
             ("node", "attempt", "kind", "exit", "killed by supervisor", "trigger", "cpu", "peak RSS",
              *(("tree",) if trees else ()), "elapsed", "at", "error"))
    for name in names:
        table.add_column(name, no_wrap=name not in ("node", "what happened", "error"),
                         overflow="fold", ratio=1 if name in ("what happened", "error") else None)
    rows = 0
    for step in steps:
        for entry in step.errors:
            message, kind = entry.get("message") or "", type_name(entry.get("type"))
            error = f"{kind}: {message}" if kind and message else (kind or message)
            head = [Text(step.name), str(entry.get("attempt", "-")), str(entry.get("kind") or "-"), exit_text(entry)]
            if compact:
                detail = Text(short(error, 160), style="red")
                how = _forensics_text(entry)
                if how:
                    detail.append(("; " if error else "") + how, style="dim")
                table.add_row(*head, detail)
            else:
                killed = entry.get("killed_by_supervisor")
                table.add_row(
                    *head, "-" if killed is None else ("yes" if killed else "no"), str(entry.get("trigger") or "-"),
                    secs(entry.get("cpu_seconds"), 3), mib(entry.get("peak_rss_kb"), unit_kb=True),
                    *((tree_text(entry) or "-",) if trees else ()),
                    secs(entry.get("elapsed")), when(_parse_time(entry.get("at"))),
                    Text(short(error, 120), style="red"),
                )
            rows += 1
    return table if rows else None


def error_text(type_name: Any, message: Any) -> str:
    """``ValueError: bad value``: the exception's short type name beside its message
    (once: a message that already starts with it, such as ``SystemExit: exit code 0``,
    is shown as it is)."""
    text = "" if message is None else str(message)
    short_type = str(type_name).rsplit(".", 1)[-1] if type_name else ""
    if not short_type or text.startswith(short_type):
        return text
    return f"{short_type}: {text}" if text else short_type


def _parse_time(value: Any) -> dt.datetime | None:
    if isinstance(value, str):
        try:
            return dt.datetime.fromisoformat(value)
        except ValueError:
            return None
    return value if isinstance(value, dt.datetime) else None


def last_traceback(status: RunStatus) -> tuple[str, dict[str, Any]] | None:
    """``(node, error entry)`` of the most recent error entry that carries a traceback,
    or None (``status --traceback``)."""
    found = [(str(entry.get("at") or ""), step.name, entry) for step in status.steps.values()
             for entry in step.errors if entry.get("traceback")]
    if not found:
        return None
    _, node, entry = max(found, key=lambda item: item[0])
    return node, entry


def print_status(con: Console, status: RunStatus, *, wide: bool = False, traceback: bool = False) -> None:
    """The full ``cyclone-mp status`` view of one run: the run, a table of its steps (node
    name, state, attempt, last error as ``Type: message``), the whole error of each
    discarded step, each output under its node's name, the failed attempts' forensics
    and, with ``traceback``, the last traceback."""
    narrow = compact(con, wide)
    con.print(Text.assemble(
        ("run ", "bold"), (status.id, "bold"), f"  {status.kind} {status.name!r}  ", run_state_text(status),
        f"  created {when(status.created_at)}  finished {when(status.finished_at)}",
        ("  (archived)", "dim") if status.archived else "",
    ))
    con.print(Text(f"input: {short(dumps(status.input, indent=None), 150)}"))
    if status.schedule:
        con.print(Text(f"schedule: {status.schedule['name']}  slot {when(status.schedule['slot'])}"
                       f"  next slot {when(status.schedule.get('next_at'))}"))
    put(con, steps_table(status, compact=narrow), wide)
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
    forensics = attempts_table(status.steps.values(), compact=narrow)
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


def wait_view(status: RunStatus, elapsed: float, *, compact: bool = False) -> Group:
    """What ``enqueue --wait`` shows while it waits."""
    head = Text.assemble(("run ", "bold"), status.id, "  ", run_state_text(status), f"  {elapsed:.1f}s")
    return Group(head, steps_table(status, live=True, compact=compact))


# -- runs, workers, db -------------------------------------------------------------------------------


def runs_table(rows: list[dict[str, Any]], *, compact: bool = False) -> Table:
    """``client.runs()`` rows: id, name, kind, state, steps, created, finished; and, when
    any row has one, its key, the limit it waits on and its schedule (issue 21).
    ``compact``: id (in full), state, name (wrapping) and age."""
    table = Table()
    if compact:
        table.add_column("id", no_wrap=True, min_width=36)
        table.add_column("state", no_wrap=True, min_width=9)
        table.add_column("name", overflow="fold", ratio=1)
        table.add_column("age", no_wrap=True, justify="right")
        for row in rows:
            table.add_row(str(row["id"]), state_text(str(row["state"])), Text(str(row["name"])),
                          age(row.get("created_at")))
        return table
    extra = [c for c in ("key", "waiting_on", "schedule") if any(row.get(c) for row in rows)]
    for name in ("id", "name", "kind", "state", "steps", "created", "finished", *extra):
        table.add_column(name.replace("_", " "), no_wrap=True)
    for row in rows:
        table.add_row(str(row["id"]), Text(str(row["name"])), str(row["kind"]), state_text(str(row["state"])),
                      str(row.get("steps", "")), when(row.get("created_at")), when(row.get("finished_at")),
                      *(Text(str(row.get(c) or "")) for c in extra))
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
        table.add_row(Text(str(row["name"])), Text(str(row["target"])), Text(schedule_period(spec)),
                      str(spec.get("catch_up", "")),
                      when(row.get("next_at")), when(row.get("last_slot")), str(row.get("runs", 0)),
                      str(row.get("skipped", 0)), _active(row))
    return table


def _active(row: dict[str, Any]) -> Text | str:
    """``yes``, ``yes, 2 definitions`` (two live supervisors declare it differently: the one
    declared last is in force), or ``no`` in yellow."""
    if not row.get("active"):
        return Text("no", style="yellow")
    n = len(row.get("definitions") or ())
    return f"yes, {n} definitions" if n > 1 else "yes"


def _sweep_age(age: float | None, row_age: float) -> Text | str:
    """``  last sweep 1.2s ago`` (the fleet's last successful recovery sweep, brought up to
    now from the registry row's age), in red when older than a minute; '' when unknown."""
    if age is None:
        return ""
    total = float(age) + row_age
    return Text(f"  last sweep {total:.0f}s ago", style="bold red" if total > 60 else "")


def print_workers(con: Console, rows: list[dict[str, Any]], *, wide: bool = False) -> None:
    """Each live supervisor, then a table of its children (pid, step, elapsed, CPU %, RSS).
    Compact (narrow terminals): pid, run id (in full), attempt, and the step with its
    elapsed time, CPU % and RSS on a second line."""
    if not rows:
        con.print("no live supervisors")
        return
    narrow = compact(con, wide)
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
        table = Table()
        names = (("pid", "run", "attempt", "step") if narrow else
                 ("pid", "step", "node", "run", "attempt", "elapsed", "CPU %", "RSS", "steps run"))
        for name in names:
            if name == "step" and narrow:
                table.add_column(name, overflow="fold", ratio=1)
            else:
                table.add_column(name, no_wrap=True, min_width=36 if name == "run" and narrow else None)
        for kid in info.get("children") or []:
            busy = kid.get("run_id") is not None
            elapsed = (float(kid.get("elapsed") or 0.0) + age_s) if busy else None
            cpu = kid.get("cpu_percent")
            cpu_text = "-" if cpu is None else f"{cpu:.0f}"
            caps = limits_text(kid.get("limits"))
            if narrow:
                step = Text(str(kid.get("step") or "idle"))
                if kid.get("node") and kid.get("node") != kid.get("step"):
                    step.append(f" ({kid['node']})")
                if caps:
                    step.append(f" [{caps}]", style="dim")
                usage = [secs(elapsed, 1)] if busy else []
                usage += [f"CPU {cpu_text}%", mib(kid.get("rss")).replace(" ", "\u00a0")]  # "14.6 MiB" stays whole
                step.append("\n" + " · ".join(usage), style="dim")
                table.add_row(str(kid.get("pid")), str(kid.get("run_id") or ""), str(kid.get("attempt") or ""), step)
                continue
            step_cell = Text(str(kid.get("step") or "idle"))
            if caps:
                step_cell.append(f" [{caps}]", style="dim")
            table.add_row(
                str(kid.get("pid")), step_cell, Text(str(kid.get("node") or "")),
                str(kid.get("run_id") or ""), str(kid.get("attempt") or ""), secs(elapsed, 1),
                cpu_text, mib(kid.get("rss")), str(kid.get("steps_run", 0)),
            )
        put(con, table, wide)


def print_db_status(con: Console, info: dict[str, Any]) -> None:
    """``EmbeddedServer.status()`` as lines."""
    running = "[green]running[/]" if info.get("running") else "[yellow]not running[/]"
    con.print(f"embedded PostgreSQL {info.get('version')}: {running}" + (f" (pid {info['pid']})" if info.get("pid") else ""))
    con.print(f"data dir: {info.get('data_dir')}")
    if info.get("uri"):
        con.print(f"uri: {info['uri']}")
    if info.get("sessions") is not None:
        con.print(f"sessions: {info['sessions']} connected (`cyclone-mp db stop` would end them)")


# -- demo ---------------------------------------------------------------------------------------------


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


def demo_table(report: Any, *, compact: bool = False) -> Table:
    """One row per demo run: step, final state, attempts, reclaims, error_kind, duration.
    ``compact``: step, run, state, attempts, what happened (error kind, duration and the
    child's end, wrapping) and the check."""
    table = Table(title="cyclone-mp demo", title_justify="left")
    if compact:
        for name in ("step", "run", "state", "attempts", "what happened", "ok"):
            wraps = name == "what happened"
            table.add_column(name, no_wrap=not wraps, overflow="fold" if wraps else "ellipsis",
                             ratio=1 if wraps else None, min_width=9 if name == "state" else None)
        for row in report.rows:
            what = Text(f"{row.error_kind} after {secs(row.duration)}" if row.error_kind else secs(row.duration))
            detail = _demo_detail(row)
            if detail:
                what.append(f": {detail}", style="dim")
            if not row.ok:
                what.append(f" (expected {row.expected})", style="bold red")
            table.add_row(Text(row.step), row.run_id[:8], state_text(row.state), f"{row.attempt}/{row.max_attempts}",
                          what, Text("ok" if row.ok else "✗", style="green" if row.ok else "bold red"))
        return table
    for name in ("#", "step", "run", "state", "attempts", "reclaims", "error_kind", "duration", "what happened",
                 "expected"):
        table.add_column(name, no_wrap=True, overflow="ellipsis")
    for i, row in enumerate(report.rows, 1):
        table.add_row(
            str(i), Text(row.step), row.run_id[:8], state_text(row.state), f"{row.attempt}/{row.max_attempts}",
            str(row.reclaims), row.error_kind or "", secs(row.duration), Text(_demo_detail(row), style="dim"),
            Text("ok" if row.ok else f"expected {row.expected}", style="green" if row.ok else "bold red"),
        )
    return table


def print_demo(con: Console, report: Any, *, wide: bool = False) -> None:
    """The demo's table, summary line and process check."""
    put(con, demo_table(report, compact=compact(con, wide)), wide)
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
