"""Which runs ``client.runs()`` lists and ``client.prune()`` deletes: one validated value.

A :class:`RunFilter` holds the filters an operator finds a run by: its states, the
step name, queue and concurrency key of one of its steps, the schedule that enqueued
it, and when it was created. Each filter left as None applies no condition. Times are
absolute (an aware :class:`~datetime.datetime`) or a duration before now on the
*database* clock (``since=600`` or ``since="10m"``: created in the last ten minutes),
so a worker's or a laptop's clock never moves the window.
"""

from __future__ import annotations

import dataclasses
import datetime as dt
from typing import Any, Iterable

from .durations import Duration, seconds
from .errors import ConfigurationError
from .protocol import check_text
from .status import TERMINAL_RUN_STATES

RUN_STATES = ("running", "paused", *TERMINAL_RUN_STATES)  #: every state a run can be in

#: A time bound: an aware datetime, or a duration before the database's ``now()``
#: (seconds, a timedelta, or text such as ``"10m"``).
When = dt.datetime | Duration | str


def _when(value: When | None, name: str) -> dt.datetime | float | None:
    if value is None or isinstance(value, dt.datetime):
        if isinstance(value, dt.datetime) and value.tzinfo is None:
            raise ConfigurationError(f"{name} must be an aware datetime (with a tzinfo), or a duration before now")
        return value
    return seconds(value, name, allow_zero=True, allow_text=True)


def _text(value: Any, name: str) -> str | None:
    if value is None:
        return None
    if not isinstance(value, str) or not value:
        raise ConfigurationError(f"{name} must be a non-empty string, got {value!r}")
    return check_text(value, name)  # a NUL or a lone surrogate: UnstorableText, as at enqueue


@dataclasses.dataclass(frozen=True)
class RunFilter:
    """Filters of runs (None: no condition).

    Attributes:
        states: the run is in one of these states.
        step: one of its steps runs this step name (a single-step run's name is its
            step's).
        queue: one of its steps is in this queue.
        key: one of its steps has this concurrency key.
            (``step``, ``queue`` and ``key`` together: one step matches all three.)
        schedule: the schedule (``mux.schedule(name=...)``) that enqueued it.
        since: it was created at or after this time, or this long before now.
        until: it was created before this time, or before this long before now.
    """

    states: tuple[str, ...] | None = None
    step: str | None = None
    queue: str | None = None
    key: str | None = None
    schedule: str | None = None
    since: dt.datetime | float | None = None
    until: dt.datetime | float | None = None

    @classmethod
    def of(cls, *, state: str | Iterable[str] | None = None, step: str | None = None, queue: str | None = None,
           key: str | None = None, schedule: str | None = None, since: When | None = None,
           until: When | None = None, allowed: tuple[str, ...] = RUN_STATES) -> "RunFilter":
        """The filter of the keyword arguments ``client.runs()`` and ``client.prune()`` take:
        ``state`` one state or several; ``allowed``, the states that may be asked for.

        Raises:
            ConfigurationError: an unknown state, an empty name, a naive datetime, a
                negative duration, or ``since`` after ``until``.
        """
        states = None
        if state is not None:
            states = (state,) if isinstance(state, str) else tuple(state)
            unknown = [s for s in states if s not in allowed]
            if unknown or not states:
                raise ConfigurationError(f"state must be one of {', '.join(allowed)}, got {unknown or 'none'}")
        found = cls(states=states, step=_text(step, "step"), queue=_text(queue, "queue"), key=_text(key, "key"),
                    schedule=_text(schedule, "schedule"), since=_when(since, "since"), until=_when(until, "until"))
        lo, hi = found.since, found.until
        if isinstance(lo, dt.datetime) and isinstance(hi, dt.datetime) and lo > hi or \
                isinstance(lo, float) and isinstance(hi, float) and lo < hi:
            raise ConfigurationError("since must not be later than until")
        return found

    @property
    def by_step(self) -> bool:
        """True when one of the step filters (step, queue, key) is set."""
        return any(v is not None for v in (self.step, self.queue, self.key))

    @property
    def narrows(self) -> bool:
        """True when a filter besides ``states`` is set (``prune`` then deletes archived runs
        row by row instead of dropping whole partitions)."""
        return self.by_step or any(v is not None for v in (self.schedule, self.since, self.until))

    def params(self) -> dict[str, Any]:
        """The filters as the named queries' parameters (``runs_filter_expr``,
        ``steps_filter_expr``): a time bound as an absolute ``*_at`` or microseconds
        before ``now()`` (``*_us``)."""
        out: dict[str, Any] = {"states": list(self.states) if self.states is not None else None, "step": self.step,
                               "queue": self.queue, "key": self.key, "schedule": self.schedule}
        for name in ("since", "until"):
            value = getattr(self, name)
            out[f"{name}_at"] = value if isinstance(value, dt.datetime) else None
            out[f"{name}_us"] = round(value * 1_000_000) if isinstance(value, float) else None
        return out
