"""Periodic steps (issue 21): ``mux.schedule(step, cron=...)`` and ``every=seconds``.

A :class:`Schedule` is pure: it names the slots of a cron expression (evaluated by
`cronsim <https://pypi.org/project/cronsim/>`_, which follows Debian's cron, in the
schedule's time zone) or of an interval (multiples of ``every`` since the Unix epoch), and
decides which due slots a tick enqueues (:func:`plan`). :func:`run_once` is the
maintenance pass (STYLE pattern 4): every supervisor whose mux defines schedules calls it
on its sweep tick. It compares slots with the database clock only, takes each due
schedule's row with ``FOR UPDATE SKIP LOCKED``, enqueues the slot's run (idempotency key
``cyclone-schedule:<name>:<slot>``) and advances the row in the same transaction: exactly
one run per (schedule, slot), however many supervisors tick and whatever their clocks say.

Time zones and daylight saving time (cron expressions only; intervals are UTC): a slot in
a local hour that a spring-forward transition skips runs right after the transition, once
(at 03:00 for ``30 2 * * *`` in Europe/Paris); in the hour that a fall-back transition
repeats, a job with a fixed hour runs once (the first 02:30), while a job that runs
several times an hour runs in both (``*/30 * * * *`` fires four times between 02:00 and
03:00). That is Debian's cron, which cronsim matches.

Missed slots (catch-up): a slot counts as missed when no supervisor enqueued it within
:data:`MISFIRE_GRACE` seconds of its time (all were down, or the database was). Slots
that are late by less than that are always enqueued, however the schedule is configured.
Of missed slots, ``catch_up="all"`` enqueues every one (at most :data:`MAX_SLOTS_PER_TICK`
per tick), ``"latest"`` (the default) only the most recent, and only when no slot was on
time in the same tick, and ``"none"`` none.
"""

from __future__ import annotations

import dataclasses
import datetime as dt
import zoneinfo
from typing import TYPE_CHECKING, Any, Iterator

from cronsim import CronSim, CronSimError

from .durations import seconds
from .errors import ConfigurationError, PayloadError
from .protocol import DEFAULT_MAX_PAYLOAD, check_value
from .steps import check_name

if TYPE_CHECKING:
    from .config import Config
    from .steps import Mux, Step
    from .store import Store
    from .workflow import Workflow

CATCH_UP = ("latest", "all", "none")
MISFIRE_GRACE = 60.0  # seconds late before a slot counts as missed (catch_up decides then)
ACTIVE_WITHIN = 60.0  # seconds: a schedule a supervisor ticked this recently is active (listed so; not deletable)
MAX_SLOTS_PER_TICK = 100  # per schedule; the rest are enqueued by the next ticks
IDEMPOTENCY_PREFIX = "cyclone-schedule:"
UTC = dt.timezone.utc
EPOCH = dt.datetime(1970, 1, 1, tzinfo=UTC)


@dataclasses.dataclass(frozen=True)
class Schedule:
    """One periodic schedule of a step or workflow (see the module docstring).

    Attributes:
        name: unique among schedules (default: the target's name).
        target: the step or workflow enqueued at each slot.
        cron: a cron expression (5 fields, or 6 with seconds first), or None.
        every: an interval in seconds (sub-minute allowed), or None.
        tz: the IANA zone a cron expression is read in (default ``"UTC"``).
        input: each run's input (a JSON value).
        catch_up: what to do with missed slots: ``"latest"``, ``"all"`` or ``"none"``.
    """

    name: str
    target: "Step | Workflow"
    cron: str | None = None
    every: float | None = None
    tz: str = "UTC"
    input: Any = None
    catch_up: str = "latest"

    def __post_init__(self) -> None:
        check_name(self.name, "schedule name")
        if (self.cron is None) == (self.every is None):
            raise ConfigurationError(f"schedule {self.name!r}: give exactly one of cron=... or every=seconds")
        if self.catch_up not in CATCH_UP:
            raise ConfigurationError(f"schedule {self.name!r}: catch_up must be one of {', '.join(CATCH_UP)}, got {self.catch_up!r}")
        try:
            zone = zoneinfo.ZoneInfo(self.tz)
        except (zoneinfo.ZoneInfoNotFoundError, ValueError, TypeError):
            raise ConfigurationError(f"schedule {self.name!r}: unknown time zone {self.tz!r}") from None
        object.__setattr__(self, "_zone", zone)
        if self.cron is not None:
            if not isinstance(self.cron, str):
                raise ConfigurationError(f"schedule {self.name!r}: cron must be a string, got {self.cron!r}")
            try:
                CronSim(self.cron, dt.datetime(2000, 1, 1, tzinfo=zone))
            except CronSimError as exc:
                raise ConfigurationError(f"schedule {self.name!r}: bad cron expression {self.cron!r}: {exc}") from None
        else:
            every = seconds(self.every, "every", allow_none=False)
            assert every is not None
            if every < 0.01:
                raise ConfigurationError(f"schedule {self.name!r}: every must be at least 0.01 seconds, got {self.every!r}")
            object.__setattr__(self, "every", every)
        try:  # checked as an enqueue checks it: a bad input would fail every tick of every schedule
            check_value(self.input, "input", DEFAULT_MAX_PAYLOAD)
        except PayloadError as exc:
            raise ConfigurationError(f"schedule {self.name!r}: {exc}") from None

    @property
    def spec(self) -> dict[str, Any]:
        """The definition as stored on the schedule's row (what ``cyclone-mp schedules`` shows)."""
        spec: dict[str, Any] = {"cron": self.cron, "tz": self.tz} if self.cron is not None else {"every": self.every}
        return {**spec, "catch_up": self.catch_up, "input": self.input}

    @property
    def period_text(self) -> str:
        """``cron "<expr>" <tz>`` or ``every <n>s``."""
        return f'cron "{self.cron}" {self.tz}' if self.cron is not None else f"every {self.every:g}s"

    def slots_after(self, after: dt.datetime) -> Iterator[dt.datetime]:
        """The slots strictly after ``after`` (aware), ascending, as UTC datetimes."""
        if self.every is not None:
            step_us = round(self.every * 1_000_000)
            since_us = (after - EPOCH) // dt.timedelta(microseconds=1)
            k = since_us // step_us + 1
            while True:
                yield EPOCH + dt.timedelta(microseconds=k * step_us)
                k += 1
        else:
            zone = getattr(self, "_zone")
            for local in CronSim(self.cron, after.astimezone(zone)):
                yield local.astimezone(UTC)

    def last_before(self, before: dt.datetime) -> dt.datetime | None:
        """The latest slot strictly before ``before`` (aware), as UTC, or None."""
        if self.every is not None:
            step_us = round(self.every * 1_000_000)
            until_us = (before - EPOCH) // dt.timedelta(microseconds=1)
            return EPOCH + dt.timedelta(microseconds=(until_us - 1) // step_us * step_us)
        zone = getattr(self, "_zone")
        found = next(iter(CronSim(self.cron, before.astimezone(zone), reverse=True)), None)
        return None if found is None else found.astimezone(UTC)

    def count_between(self, after: dt.datetime, until: dt.datetime, cap: int = 10_000) -> int:
        """How many slots lie in ``(after, until]`` (counted up to ``cap`` for cron expressions)."""
        if self.every is not None:
            step_us = round(self.every * 1_000_000)

            def index(t: dt.datetime) -> int:
                return ((t - EPOCH) // dt.timedelta(microseconds=1)) // step_us
            return max(0, index(until) - index(after))
        n = 0
        for slot in self.slots_after(after):
            if slot > until or n >= cap:
                break
            n += 1
        return n

    def next_after(self, after: dt.datetime) -> dt.datetime | None:
        """The first slot after ``after``, or None (an expression that never fires again)."""
        return next(self.slots_after(after), None)


@dataclasses.dataclass(frozen=True)
class Plan:
    """What one tick does with a schedule: ``enqueue`` these slots, ``skipped`` that many
    missed ones, and the row's new ``last_slot`` and ``next_at``."""

    enqueue: list[dt.datetime]
    skipped: int
    last_slot: dt.datetime | None
    next_at: dt.datetime | None


def plan(schedule: Schedule, *, last_slot: dt.datetime | None, now: dt.datetime) -> Plan:
    """Decide a tick (pure): the slots in ``(last_slot, now]`` and the catch-up policy.

    A schedule seen for the first time (``last_slot`` None) starts after ``now``: its
    first slot is the next one.
    """
    if last_slot is None:
        return Plan([], 0, now, schedule.next_after(now))
    cutoff = now - dt.timedelta(seconds=MISFIRE_GRACE)
    dropped, latest = 0, None
    if schedule.catch_up != "all":
        first = schedule.next_after(last_slot)
        if first is not None and first < cutoff:
            # missed slots are dropped (or, with "latest", all but the most recent) without
            # walking them one by one: a long outage of a sub-second schedule is millions
            latest = schedule.last_before(cutoff)
            assert latest is not None
            dropped = schedule.count_between(last_slot, latest)
            last_slot = latest
    due: list[dt.datetime] = []
    next_at: dt.datetime | None = None
    for slot in schedule.slots_after(last_slot):
        if slot > now or len(due) >= MAX_SLOTS_PER_TICK:
            next_at = slot
            break
        due.append(slot)
    if schedule.catch_up == "latest" and latest is not None and not due:
        return Plan([latest], dropped - 1, latest, next_at)
    return Plan(due, dropped, due[-1] if due else last_slot, next_at)


def idempotency_key(name: str, slot: dt.datetime) -> str:
    """The idempotency key of a schedule's run for ``slot``: one run per (schedule, slot)."""
    return f"{IDEMPOTENCY_PREFIX}{name}:{slot.astimezone(UTC).isoformat()}"


def parse_idempotency_key(key: str | None) -> tuple[str, dt.datetime] | None:
    """``(schedule name, slot)`` from a scheduled run's idempotency key, else None."""
    if not key or not key.startswith(IDEMPOTENCY_PREFIX):
        return None
    head, *clock = key[len(IDEMPOTENCY_PREFIX):].rsplit(":", 3)  # the slot's ISO text has three colons
    name, _, date_hour = head.rpartition(":")
    try:
        return name, dt.datetime.fromisoformat(":".join([date_hour, *clock]))
    except ValueError:
        return None


def run_once(store: "Store", mux: "Mux", config: "Config") -> dict[str, int]:
    """One scheduling pass: enqueue the due slots of every schedule ``mux`` defines.

    Refreshes the schedules' rows (definition, ``seen_at``) first, then, in one
    transaction, takes the due rows with ``FOR UPDATE SKIP LOCKED`` (a row another
    supervisor is deciding is left to it), enqueues their slots' runs and advances them.
    Returns counts: ``enqueued`` runs, ``skipped`` missed slots, ``schedules`` decided.

    Raises:
        DatabaseError: the database failed (the caller treats it as the sweep does).
    """
    from .planning import node_rows

    counts = {"enqueued": 0, "skipped": 0, "schedules": 0}
    schedules = mux.schedules
    if not schedules:
        return counts
    store.sync_schedules([(s.name, s.target.name, s.spec) for s in schedules.values()])

    def decide(row: dict[str, Any]) -> dict[str, Any]:
        schedule = schedules[row["name"]]
        last = row["last_slot"]
        if row["spec"] != schedule.spec or row["target"] != schedule.target.name:
            last = None  # a changed definition starts afresh: no slot of the old one is caught up
        decided = plan(schedule, last_slot=last, now=row["now"])
        run_id = None
        for slot in decided.enqueue:
            kind, nodes = node_rows(schedule.target, schedule.input, config.defaults)
            run_id, _ = store.enqueue_run(
                name=schedule.target.name, kind=kind, input=schedule.input, nodes=nodes, delay=0.0,
                idempotency_key=idempotency_key(schedule.name, slot), conn=store.conn,
            )
        counts["schedules"] += 1
        counts["enqueued"] += len(decided.enqueue)
        counts["skipped"] += decided.skipped
        return {"name": schedule.name, "target": schedule.target.name, "spec": schedule.spec,
                "last_slot": decided.last_slot, "next_at": decided.next_at, "n": len(decided.enqueue),
                "skipped": decided.skipped, "run_id": run_id}

    store.tick_schedules(sorted(schedules), decide)
    return counts
