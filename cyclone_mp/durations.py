"""Durations: seconds as ``int``/``float`` or :class:`datetime.timedelta`, everywhere (SPEC 2)."""

from __future__ import annotations

import datetime as dt
import math
import re

from .errors import ConfigurationError

Duration = float | int | dt.timedelta
#: The longest duration accepted (a timeout, a delay, a lease, ...): 100 years of 365.25
#: days. Durations reach SQL as whole microseconds in a bigint and are added to
#: ``now()``; 1e300 seconds or ``timedelta.max`` overflowed both.
MAX_SECONDS = 100 * 365.25 * 86400
#: A duration written with a unit: ``2.5``, ``500ms``, ``30s``, ``5m``, ``1h``, ``7d``.
DURATION_RE = re.compile(r"^\s*(\d+(?:\.\d*)?|\.\d+)\s*(ms|s|m|h|d)?\s*$", re.I)
DURATION_UNITS = {None: 1.0, "ms": 0.001, "s": 1.0, "m": 60.0, "h": 3600.0, "d": 86400.0}


def parse_duration(text: str) -> float | None:
    """Seconds of a duration written as text (``"90"``, ``"500ms"``, ``"30s"``, ``"5m"``,
    ``"12h"``, ``"7d"``), or None when it is not one."""
    match = DURATION_RE.match(text)
    if not match:
        return None
    unit = match.group(2).lower() if match.group(2) else None
    return float(match.group(1)) * DURATION_UNITS[unit]


def seconds(value: Duration | str | None, name: str, *, allow_none: bool = True, allow_zero: bool = False,
            allow_text: bool = False) -> float | None:
    """Return ``value`` as float seconds; with ``allow_text`` also a duration written as
    text (``"7d"``, ``"12h"``, ``"30m"``: :func:`parse_duration`).

    Raises:
        ConfigurationError: ``value`` is negative, not finite, of the wrong type, or
            ``None`` where ``allow_none`` is false.
    """
    if value is None:
        if allow_none:
            return None
        raise ConfigurationError(f"{name} is required (seconds or timedelta)")
    if isinstance(value, str) and allow_text:
        parsed = parse_duration(value)
        if parsed is None:
            raise ConfigurationError(f"{name} must be seconds or a duration such as '7d', '12h', '30m', '45s', "
                                     f"got {value!r}")
        result = parsed
    elif isinstance(value, dt.timedelta):
        result = value.total_seconds()
    elif isinstance(value, (int, float)) and not isinstance(value, bool):
        result = float(value)
    else:
        raise ConfigurationError(f"{name} must be seconds (int/float) or a timedelta, not {type(value).__name__}")
    if not math.isfinite(result) or result < 0 or (result == 0 and not allow_zero):
        raise ConfigurationError(f"{name} must be a positive number of seconds, got {value!r}")
    if result > MAX_SECONDS:
        raise ConfigurationError(f"{name} must be at most 100 years ({MAX_SECONDS:.0f} seconds), got {value!r}")
    return result
