"""Small formatters of the CLI's output: times, durations, sizes, states, errors,
progress, limits. Each takes a value the library returned and gives a string or a rich
:class:`~rich.text.Text` (data as text, never as markup)."""

from __future__ import annotations

import datetime as dt
from typing import Any

from rich.progress_bar import ProgressBar
from rich.table import Table
from rich.text import Text

from cyclone_mp import RunStatus, StepStatus
from cyclone_mp.limits.declared import format_size

STATE_STYLES = {
    "completed": "green", "discarded": "red", "cancelled": "yellow", "running": "cyan",
    "available": "blue", "pending": "dim", "paused": "magenta", "waiting_signal": "magenta",
    "waiting_timer": "magenta",
}


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


def attempt_text(step: StepStatus) -> str:
    """``attempt/max_attempts``; ``0/max`` for a step that never started (a first
    attempt not begun is no attempt)."""
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
    label = Text(f" {num(done)}/{num(total)}" if total else f" {num(done)}" if done is not None else "")
    if message:
        label.append(f" {short(message, 32)}", style="dim")
    if isinstance(total, (int, float)) and total > 0 and isinstance(done, (int, float)):
        table = Table.grid()
        table.add_row(ProgressBar(total=float(total), completed=float(min(done, total)), width=width), label)
        return table
    return label


def progress_text(progress: Any) -> Text:
    """A ``{"done", "total", "message"}`` progress value in words (``3/10 resizing``), or ``""``."""
    if not isinstance(progress, dict):
        return Text("")
    done, total, message = (progress.get(k) for k in ("done", "total", "message"))
    head = f"{num(done)}/{num(total)}" if total else num(done) if done is not None else ""
    return Text(" ".join(p for p in (head, short(message, 60) if message else "") if p))


def count(n: int, one: str, many: str | None = None) -> str:
    """``1 child``, ``2 children``: ``n`` and the noun agreeing with it."""
    return f"{n} {one if n == 1 else (many or one + 's')}"


def num(value: Any) -> str:
    if isinstance(value, float) and value.is_integer():
        return str(int(value))
    return "-" if value is None else str(value)


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


def tree_text(entry: dict[str, Any]) -> str:
    """The whole process tree's numbers of an attempt with limits: ``peak 257
    MiB · 2.04 CPU s · 3 procs`` (and ``· 503 files``, the most one process held, with
    ``max_open_files``), or ``""``."""
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
    if tree.get("open_files") is not None:
        parts.append(count(int(tree["open_files"]), "file"))
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


def error_text(type_name: Any, message: Any) -> str:
    """``ValueError: bad value``: the exception's short type name beside its message
    (once: a message that already starts with it, such as ``SystemExit: exit code 0``,
    is shown as it is)."""
    text = "" if message is None else str(message)
    short_type = str(type_name).rsplit(".", 1)[-1] if type_name else ""
    if not short_type or text.startswith(short_type):
        return text
    return f"{short_type}: {text}" if text else short_type


def parse_time(value: Any) -> dt.datetime | None:
    if isinstance(value, str):
        try:
            return dt.datetime.fromisoformat(value)
        except ValueError:
            return None
    return value if isinstance(value, dt.datetime) else None


def schedule_period(spec: dict[str, Any]) -> str:
    """``cron "<expr>" <tz>`` or ``every <n>s``, from a schedule's stored spec."""
    if spec.get("cron") is not None:
        return f'cron "{spec["cron"]}" {spec.get("tz") or "UTC"}'
    return f"every {spec.get('every'):g}s"
