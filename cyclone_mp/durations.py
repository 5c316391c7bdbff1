"""Durations: seconds as ``int``/``float`` or :class:`datetime.timedelta`, everywhere (SPEC 2)."""

from __future__ import annotations

import datetime as dt
import math

Duration = float | int | dt.timedelta
#: The longest duration accepted (a timeout, a delay, a lease, ...): 100 years of 365.25
#: days. Durations reach SQL as whole microseconds in a bigint and are added to
#: ``now()``; 1e300 seconds or ``timedelta.max`` overflowed both.
MAX_SECONDS = 100 * 365.25 * 86400


def seconds(value: Duration | None, name: str, *, allow_none: bool = True, allow_zero: bool = False) -> float | None:
    """Return ``value`` as float seconds.

    Raises:
        ConfigurationError: ``value`` is negative, not finite, of the wrong type, or
            ``None`` where ``allow_none`` is false.
    """
    from .errors import ConfigurationError

    if value is None:
        if allow_none:
            return None
        raise ConfigurationError(f"{name} is required (seconds or timedelta)")
    if isinstance(value, dt.timedelta):
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
