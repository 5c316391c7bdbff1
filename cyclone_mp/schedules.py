"""Periodic steps: ``mux.schedule(step, cron=...)`` and ``every=seconds``.

A :class:`Schedule` is pure: it names the slots of a cron expression (evaluated by
`cronsim`, which follows Debian's cron, daylight saving time included, in the schedule's
time zone) or of an interval (multiples of ``every`` since the Unix epoch), and decides
which due slots a tick enqueues (:func:`plan`). :func:`run_once` is the maintenance pass:
it compares slots with the database clock only, takes each due schedule's row with
``FOR NO KEY UPDATE SKIP LOCKED``, enqueues the slot's run (idempotency key
``cyclone-schedule:<name>:<slot>``) and advances the row in the same transaction: exactly
one run per (schedule, slot), however many supervisors tick.

Of two definitions of one schedule (a rolling deploy), the one declared most recently by a
live supervisor is in force (:func:`take_over`). docs/schedules-and-flow-control.md explains
misfires and ``catch_up``.
"""

from __future__ import annotations

import collections
import dataclasses
import datetime as dt
import functools
import hashlib
import json
import zoneinfo
from typing import TYPE_CHECKING, Any, Iterator

from cronsim import CronSim, CronSimError

from .durations import seconds
from .errors import ConfigurationError, PayloadError, UnknownStep
from .noderows import node_rows
from .protocol import DEFAULT_MAX_PAYLOAD, check_value
from .steps import StepOptions, check_name

if TYPE_CHECKING:
    from .config import Config
    from .mux import Mux
    from .steps import Step
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

    @functools.cached_property
    def fingerprint(self) -> str:
        """A digest of the target's name and :attr:`spec`: equal for equal definitions,
        in every process and Python version (canonical JSON)."""
        text = json.dumps([self.target.name, self.spec], sort_keys=True, separators=(",", ":"))
        return hashlib.sha256(text.encode()).hexdigest()[:32]

    @classmethod
    def from_spec(cls, name: str, target: "Step | Workflow", spec: dict[str, Any]) -> "Schedule | None":
        """The definition a schedule row's stored ``spec`` describes (enqueuing ``target``),
        or None when it cannot be read (a spec this version does not know)."""
        try:
            return cls(name=name, target=target, cron=spec.get("cron"), every=spec.get("every"),
                       tz=spec.get("tz") or "UTC", input=spec.get("input"), catch_up=spec.get("catch_up", "latest"))
        except (ConfigurationError, AttributeError, TypeError, ValueError):
            return None

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
    missed ones, and the row's new ``last_slot`` and ``next_at``. ``inherited``: at a
    handover, the previous definition's slots enqueued with its input (:func:`take_over`)."""

    enqueue: list[dt.datetime]
    skipped: int
    last_slot: dt.datetime | None
    next_at: dt.datetime | None
    inherited: tuple[dt.datetime, ...] = ()


def define(target: "Step | Workflow", *, name: str | None, cron: str | None, every: Any, tz: str, input: Any,
           catch_up: str) -> Schedule:
    """The :class:`Schedule` of ``mux.schedule(target, ...)`` (named ``name``, default the
    target's name), checked now: its expression, zone, interval and policy, and that the
    target's concurrency key callable takes ``input``.

    Raises:
        ConfigurationError: any of those is bad.
    """
    node_rows(target, input, StepOptions())
    return Schedule(name=name if name is not None else target.name, target=target, cron=cron, every=every, tz=tz,
                    input=input, catch_up=catch_up)


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


def take_over(schedule: Schedule, previous: Schedule | None, *, last_slot: dt.datetime | None,
              since: dt.datetime, now: dt.datetime) -> Plan:
    """Decide the first tick of ``schedule`` on a row another definition decided last (pure).

    ``previous`` is that definition, read back from the row (None: unreadable), and
    ``since`` the time ``schedule`` came into force (when it was first declared). Slots
    up to ``since`` are the previous definition's: those after the row's ``last_slot``
    that it had not enqueued are ``inherited`` (to be enqueued with its input) when late
    by less than :data:`MISFIRE_GRACE`, the most recent :data:`MAX_SLOTS_PER_TICK` of
    them, and counted as skipped otherwise. ``schedule``'s own slots start after
    ``since`` (or after ``last_slot``, when later), under its catch-up policy. A new row
    (``last_slot`` None) starts after ``since``.
    """
    since = min(since, now)
    if last_slot is None:
        return plan(schedule, last_slot=since, now=now)
    inherited: collections.deque[dt.datetime] = collections.deque(maxlen=MAX_SLOTS_PER_TICK)
    skipped = 0
    if previous is not None and since > last_slot:
        cutoff = now - dt.timedelta(seconds=MISFIRE_GRACE)
        for slot in previous.slots_after(max(last_slot, cutoff - dt.timedelta(microseconds=1))):
            if slot > since:
                break
            inherited.append(slot)
        skipped = max(0, previous.count_between(last_slot, since) - len(inherited))
    own = plan(schedule, last_slot=max(last_slot, since), now=now)
    return dataclasses.replace(own, skipped=own.skipped + skipped, inherited=tuple(inherited))


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

    Refreshes the schedules' rows and this mux's definitions of them (``seen_at``) first,
    then, in one transaction, takes the due rows whose definition in force is this mux's
    with ``FOR NO KEY UPDATE SKIP LOCKED`` (a row another supervisor is deciding is left to it),
    enqueues their slots' runs and advances them. Returns counts: ``enqueued`` runs,
    ``skipped`` slots dropped (catch-up, handover), ``schedules`` decided.

    Raises:
        DatabaseError: the database failed (the caller treats it as the sweep does).
    """
    counts = {"enqueued": 0, "skipped": 0, "schedules": 0}
    schedules = mux.schedules
    if not schedules:
        return counts
    store.schedules.sync([(s.name, s.fingerprint, s.target.name, s.spec) for s in schedules.values()], ACTIVE_WITHIN)

    def enqueue(schedule: Schedule, slot: dt.datetime) -> str:
        kind, nodes = node_rows(schedule.target, schedule.input, config.defaults)
        run_id, _ = store.runs.enqueue(
            name=schedule.target.name, kind=kind, input=schedule.input, nodes=nodes, delay=0.0,
            idempotency_key=idempotency_key(schedule.name, slot), conn=store.conn,
        )
        return run_id

    def decide(row: dict[str, Any]) -> dict[str, Any]:
        schedule = schedules[row["name"]]
        # the same definition decided it last (a row from before fingerprints were kept has none)
        if row["fingerprint"] == schedule.fingerprint or (row["target"], row["spec"]) == (
                schedule.target.name, schedule.spec):
            decided = plan(schedule, last_slot=row["last_slot"], now=row["now"])
            previous = None
        else:  # a handover: the row was decided by another definition, or is new
            target = _lookup(mux, row["target"])
            previous = Schedule.from_spec(schedule.name, target or schedule.target, row["spec"])
            decided = take_over(schedule, previous, last_slot=row["last_slot"], since=row["since"], now=row["now"])
            if decided.inherited and not _can_enqueue(target, previous, config):
                decided = dataclasses.replace(decided, skipped=decided.skipped + len(decided.inherited), inherited=())
        run_id = None
        for slot in decided.inherited:
            assert previous is not None
            run_id = enqueue(previous, slot)
        for slot in decided.enqueue:
            run_id = enqueue(schedule, slot)
        n = len(decided.inherited) + len(decided.enqueue)
        counts["schedules"] += 1
        counts["enqueued"] += n
        counts["skipped"] += decided.skipped
        return {"name": schedule.name, "target": schedule.target.name, "spec": schedule.spec,
                "fingerprint": schedule.fingerprint, "last_slot": decided.last_slot, "next_at": decided.next_at,
                "n": n, "skipped": decided.skipped, "run_id": run_id}

    store.schedules.tick({s.name: s.fingerprint for s in schedules.values()}, ACTIVE_WITHIN, decide)
    return counts


def _can_enqueue(target: "Step | Workflow | None", previous: Schedule | None, config: "Config") -> bool:
    """Whether this supervisor can enqueue the previous definition's runs: its code
    registers the target and the target accepts the input (a concurrency key callable of
    the new code may not), so a handover never fails a tick over an old definition."""
    if target is None or previous is None:
        return False
    try:
        node_rows(target, previous.input, config.defaults)
    except ConfigurationError:
        return False
    return True


def _lookup(mux: "Mux", name: str) -> "Step | Workflow | None":
    """The step or workflow ``mux`` registers under ``name``, or None."""
    try:
        return mux.lookup(name)
    except UnknownStep:
        return None
