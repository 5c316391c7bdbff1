"""Click parameter types for the CLI: JSON values, durations, byte sizes, poll intervals, rate limits,
backoffs, the history settings (a duration or never), and points in time (a duration before now, or a date).

Each converts one option value and fails with ``click.BadParameter`` (exit code 2, one
line naming the option) on malformed input.
"""

from __future__ import annotations

import datetime as dt
import pathlib
import re
import sys
from typing import Any

import click

from cyclone_mp.durations import parse_duration
from cyclone_mp.errors import PayloadError
from cyclone_mp.protocol import load_value

_SIZE_RE = re.compile(r"^\s*(\d+(?:\.\d*)?)\s*([kmgt]?)(i?b)?\s*$", re.I)
_SIZE_UNITS = {"": 1, "k": 1024, "m": 1024**2, "g": 1024**3, "t": 1024**4}


class JsonValue(click.ParamType):
    """A JSON value given inline (``'{"a": 1}'``), from a file (``@input.json``) or from
    standard input (``@-``). Converts to the decoded Python value."""

    name = "JSON"

    def convert(self, value: Any, param: click.Parameter | None, ctx: click.Context | None) -> Any:
        if not isinstance(value, str):
            return value
        text: str | bytes = value
        source = "value"
        if value.startswith("@"):
            where = value[1:]
            try:
                text = sys.stdin.buffer.read() if where == "-" else pathlib.Path(where).expanduser().read_bytes()
            except OSError as exc:
                self.fail(f"cannot read {where!r}: {exc.strerror or exc}", param, ctx)
            source = "standard input" if where == "-" else f"file {where!r}"
        try:
            return load_value(text, f"the {source}")
        except PayloadError as exc:  # not UTF-8, not JSON, too deep, an integer over 4,300 digits
            self.fail(str(exc), param, ctx)


class Seconds(click.ParamType):
    """A duration: seconds as a number (``2.5``) or with a unit (``500ms``, ``30s``,
    ``5m``, ``1h``, ``7d``). Converts to float seconds (>= 0, and <= ``most`` when given)."""

    name = "SECONDS"

    def __init__(self, most: float | None = None) -> None:
        self.most = most

    def convert(self, value: Any, param: click.Parameter | None, ctx: click.Context | None) -> float:
        if isinstance(value, (int, float)) and not isinstance(value, bool):
            parsed: float | None = float(value)
        else:
            parsed = parse_duration(str(value))
        if parsed is None:
            self.fail(f"{value!r} is not a duration (seconds, e.g. 2.5, 500ms, 30s, 5m, 1h, 7d)", param, ctx)
        if self.most is not None and parsed > self.most:
            self.fail(f"at most {self.most:g} seconds, got {parsed:g}", param, ctx)
        return parsed


class When(click.ParamType):
    """A point in time: a duration before now (``10m``, ``2h``, ``7d``: on the database's
    clock) or a date and time (``2026-12-04``, ``2026-12-04T10:30``, ``2026-12-04
    10:30:00+01:00``; without an offset, local time). Converts to float seconds or an
    aware datetime."""

    name = "WHEN"

    def convert(self, value: Any, param: click.Parameter | None, ctx: click.Context | None) -> float | dt.datetime:
        if isinstance(value, (float, dt.datetime)):
            return value
        text = str(value).strip()
        ago = parse_duration(text)
        if ago is not None:
            return ago
        try:
            when = dt.datetime.fromisoformat(text)
        except ValueError:
            self.fail(f"{value!r} is neither a duration before now (10m, 2h, 7d) nor a date and time "
                      "(2026-12-04T10:30)", param, ctx)
        return when if when.tzinfo is not None else when.astimezone()


class DurationOrNever(click.ParamType):
    """A duration as :class:`Seconds` takes it (``7d``, ``12h``, ``30m``), or ``never``
    (also ``forever``, ``off``): None. The history settings."""

    name = "DURATION|never"
    NEVER = ("never", "forever", "off", "none")

    def convert(self, value: Any, param: click.Parameter | None, ctx: click.Context | None) -> float | None:
        if value is None or isinstance(value, (int, float)) and not isinstance(value, bool):
            return value
        if str(value).strip().lower() in self.NEVER:
            return None
        parsed = parse_duration(str(value))
        if parsed is None:
            self.fail(f"{value!r} is not a duration (e.g. 7d, 12h, 30m, 90s) or 'never'", param, ctx)
        return parsed


class ByteSize(click.ParamType):
    """A size in bytes: ``1048576``, ``512K``, ``500M``, ``2G`` (powers of 1024). Converts to int."""

    name = "BYTES"

    def convert(self, value: Any, param: click.Parameter | None, ctx: click.Context | None) -> int:
        if isinstance(value, int) and not isinstance(value, bool):
            return value
        match = _SIZE_RE.match(str(value))
        if not match:
            self.fail(f"{value!r} is not a size (bytes, e.g. 1048576, 512K, 500M, 2G)", param, ctx)
        size = int(float(match.group(1)) * _SIZE_UNITS[match.group(2).lower()])
        if size < 1:
            self.fail(f"{value!r} must be at least 1 byte", param, ctx)
        return size


class PollInterval(click.ParamType):
    """Seconds between claims when idle: one value (``0.5``) or a ``MIN,MAX`` range
    (``0.1,1.0``; the poll backs off from MIN to MAX). Converts to ``(min, max)``."""

    name = "MIN[,MAX]"

    def convert(self, value: Any, param: click.Parameter | None, ctx: click.Context | None) -> tuple[float, float]:
        if isinstance(value, tuple):
            return value
        parts = [p for p in re.split(r"[,:]", str(value))]
        if len(parts) not in (1, 2):
            self.fail(f"{value!r} is not SECONDS or MIN,MAX", param, ctx)
        lo, hi = (Seconds().convert(p, param, ctx) for p in (parts[0], parts[-1]))
        if lo <= 0 or hi < lo:
            self.fail(f"{value!r}: need 0 < MIN <= MAX", param, ctx)
        return lo, hi


class RateLimit(click.ParamType):
    """A rate limit, ``COUNT/SECONDS``: at most COUNT starts per SECONDS (``10/1s``,
    ``100/1m``, ``5/2.5``). Converts to ``(count, seconds)``; the library checks the
    ranges."""

    name = "COUNT/SECONDS"

    def convert(self, value: Any, param: click.Parameter | None, ctx: click.Context | None) -> tuple[int, float]:
        if isinstance(value, tuple):
            return value
        count, sep, period = str(value).partition("/")
        if not sep or not count.strip().isdigit():
            self.fail(f"{value!r} is not COUNT/SECONDS (e.g. 10/1s: at most 10 starts per second)", param, ctx)
        seconds = Seconds().convert(period, param, ctx)
        if seconds <= 0:
            self.fail(f"{value!r}: the period must be more than 0 seconds", param, ctx)
        return int(count), seconds


class BackoffSeconds(click.ParamType):
    """A retry backoff: one duration for every failed attempt (``30s``), or a comma list,
    one per failed attempt, the last repeated (``1s,10s,1m``). Converts to float seconds or
    a list of them; the library checks the ranges."""

    name = "SECONDS[,SECONDS...]"

    def convert(self, value: Any, param: click.Parameter | None, ctx: click.Context | None) -> float | list[float]:
        if isinstance(value, (int, float, list)) and not isinstance(value, bool):
            return value
        parts = [part.strip() for part in str(value).split(",")]
        if not all(parts):
            self.fail(f"{value!r} is not SECONDS or a comma list of them (e.g. 30s, or 1s,10s,1m)", param, ctx)
        seconds = [Seconds().convert(part, param, ctx) for part in parts]
        return seconds[0] if len(seconds) == 1 else seconds


JSON = JsonValue()
SECONDS = Seconds()
BYTES = ByteSize()
POLL = PollInterval()
RATE = RateLimit()
BACKOFF = BackoffSeconds()
DURATION_OR_NEVER = DurationOrNever()
WHEN = When()
