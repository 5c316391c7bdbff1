"""What ``client.status(run_id)`` returns: plain frozen dataclasses (SPEC section 2)."""

from __future__ import annotations

import dataclasses
import datetime as dt
from typing import Any

from .mapped import summary

STEP_STATES = ("pending", "available", "running", "waiting_signal", "waiting_timer", "paused", "completed",
               "discarded", "cancelled")
TERMINAL_STEP_STATES = ("completed", "discarded", "cancelled")
TERMINAL_RUN_STATES = ("completed", "discarded", "cancelled")


@dataclasses.dataclass(frozen=True)
class StepStatus:
    """One step (node) of a run, as the database has it.

    Attributes:
        name: the node name (the step name for a single-step run).
        state: one of ``pending, available, running, waiting_signal, waiting_timer,
            paused, completed, discarded, cancelled``.
        attempt: current attempt number (1-based); for a discarded step, the number of
            attempts consumed.
        max_attempts, reclaims, max_reclaims: the bounds stored at enqueue.
        error, error_kind: the last error (``timeout``, ``error``, ``permanent``,
            ``child_exited``, ``output_invalid``, ``not_importable``, ``memory_error``, ``exit``,
            ``reclaim_limit``; the causes of death ``memory_limit``, ``cpu_limit``,
            ``process_limit``, ``oom_killed``) or None.
        errors: history, one dict per failed attempt: ``attempt``, ``kind``, ``type``,
            ``message``, ``traceback``, ``exit_code``/``signal``, ``killed_by_supervisor``,
            ``trigger``, ``cpu_seconds``, ``peak_rss_kb``, ``elapsed`` (seconds), ``at``;
            for an attempt with resource limits or killed by a cause of death also
            ``limits``, ``tree`` (``peak_memory_kb``, ``cpu_seconds``, ``processes`` of the
            whole process tree), ``cause`` and ``enforced_by``;
            and one per claimed attempt cancelled (``kind="cancelled"``, with its
            ``started_at`` and ``elapsed`` if its handler had started, else the message
            "cancelled before it started (client.cancel)" once its supervisor says so;
            no attempt consumed, ``error`` unchanged).
        claimed_at: when the last attempt's row was claimed (the database's ``now()``:
            its timeout counts from it). started_at: when its handler started: the claim
            plus the delay its supervisor reports with the attempt's renewal, then with its
            outcome from the child's own clock (a row waits for a child when held ahead or
            queued behind a busy one); until reported, the claim. finished_at,
            scheduled_at, heartbeat_at, lease_expiry: DB-clock timestamps (aware
            datetimes) or None.
        lease_owner: the supervisor id holding (or that last held) the lease.
        output: the handler's JSON output once completed; progress: latest
            ``{"done", "total", "message"}`` or None.
        concurrency_key: the step's key (fairness and limit group), or None.
        concurrency, rate_limit: its limits per (step, key): an int, ``(count, seconds)``.
        waiting_on: ``"concurrency"`` or ``"rate_limit"`` while that limit holds the
            (due, available) step back, ``"previous_attempt"`` while the process of its
            last attempt (ended by a timeout or a cancel) may still run, else None;
            running_in_group and starts_in_period: what the limits count now.
        snoozes: how many times its handler raised ``cy.Snooze`` (no attempt spent).
        items: a map node (``kind="map"``) once its list was mapped: ``{"total": n}`` and
            how many of its items are in each state (``{"total": 3, "completed": 2,
            "running": 1}``); None otherwise. Its items are not in ``RunStatus.steps``
            (``client.map_items`` lists them).
        item: a map's item (``kind="item"``, from ``client.map_items``): its index in the
            list mapped; None otherwise.
        dead_by: after a timeout or a cancel settled while the attempt's process may still
            run, the DB-clock time by which it is dead at the latest (the step runs
            again, and its concurrency slot goes to another, only after that or once its
            supervisor reports it reaped); None otherwise (SPEC 9).
        memory_limit, cpu_limit, max_processes, max_open_files: the resource caps stored
            at enqueue (bytes, CPU seconds, processes, descriptors) or None.
    """

    name: str
    state: str
    attempt: int
    max_attempts: int
    reclaims: int
    error: str | None
    error_kind: str | None
    errors: list[dict[str, Any]]
    started_at: dt.datetime | None
    finished_at: dt.datetime | None
    lease_owner: str | None
    output: Any
    step_name: str | None = None
    kind: str = "task"
    max_reclaims: int | None = None
    timeout: float | None = None
    queue: str = "default"
    priority: int = 0
    depends_on: tuple[str, ...] = ()
    scheduled_at: dt.datetime | None = None
    heartbeat_at: dt.datetime | None = None
    lease_expiry: dt.datetime | None = None
    lease_generation: int = 0
    progress: Any = None
    paused_from: str | None = None
    due_at: dt.datetime | None = None
    id: int = 0
    concurrency_key: str | None = None
    concurrency: int | None = None
    rate_limit: tuple[int, float] | None = None
    waiting_on: str | None = None
    running_in_group: int | None = None
    starts_in_period: int | None = None
    memory_limit: int | None = None
    cpu_limit: float | None = None
    max_processes: int | None = None
    max_open_files: int | None = None
    dead_by: dt.datetime | None = None
    claimed_at: dt.datetime | None = None
    snoozes: int = 0
    items: dict[str, int] | None = None
    item: int | None = None

    @classmethod
    def from_row(cls, row: dict[str, Any]) -> "StepStatus":
        """Build from a ``get_steps`` row."""
        return cls(
            name=row["node"], state=row["state"], attempt=row["attempt"], max_attempts=row["max_attempts"],
            reclaims=row["reclaims"], error=row["error"], error_kind=row["error_kind"],
            errors=list(row["errors"] or []), started_at=row["started_at"], finished_at=row["finished_at"],
            lease_owner=row["lease_owner"], output=row["output"], step_name=row["step_name"], kind=row["kind"],
            max_reclaims=row["max_reclaims"], timeout=row["timeout"], queue=row["queue"],
            priority=row["priority"], depends_on=tuple(row["depends_on"] or ()),
            scheduled_at=row["scheduled_at"], heartbeat_at=row["heartbeat_at"],
            lease_expiry=row["lease_expiry"], lease_generation=row["lease_generation"],
            progress=row["progress"], paused_from=row["paused_from"], due_at=row["due_at"], id=row["id"],
            concurrency_key=row.get("concurrency_key") or None, concurrency=row.get("concurrency"),
            rate_limit=(row["rate_count"], row["rate_seconds"]) if row.get("rate_count") is not None else None,
            waiting_on=row.get("waiting_on"), running_in_group=row.get("running_in_group"),
            starts_in_period=row.get("starts_in_period"),
            memory_limit=row.get("memory_limit"), cpu_limit=row.get("cpu_limit"),
            max_processes=row.get("max_processes"), max_open_files=row.get("max_open_files"),
            dead_by=row.get("dead_by"), claimed_at=row.get("claimed_at", row["started_at"]),
            snoozes=row.get("snoozes") or 0,
            items=({"total": row["items_total"], **(row.get("items") or {})}
                   if row.get("items_total") is not None else None),
            item=row.get("item"),
        )

    @property
    def terminal(self) -> bool:
        """True for completed, discarded and cancelled."""
        return self.state in TERMINAL_STEP_STATES

    @property
    def items_summary(self) -> str | None:
        """A map node's items in one line (``10,000 items: 9,120 completed, 850 running,
        30 available``), or None for any other step."""
        if self.items is None:
            return None

        return summary(self.items)

    def to_dict(self) -> dict[str, Any]:
        """JSON-ready dict (datetimes as ISO 8601 strings)."""
        return _jsonable(dataclasses.asdict(self))


@dataclasses.dataclass(frozen=True)
class RunStatus:
    """A run and its steps: ``state`` is one of ``running, paused, completed, discarded,
    cancelled``; ``steps`` maps node name to :class:`StepStatus`."""

    id: str
    name: str
    kind: str
    state: str
    input: Any
    created_at: dt.datetime
    finished_at: dt.datetime | None
    steps: dict[str, StepStatus]
    idempotency_key: str | None = None
    #: For a run a schedule enqueued: ``{"name", "slot", "next_at"}`` (its slot, and the
    #: schedule's next one on the database clock), else None.
    schedule: dict[str, Any] | None = None
    #: True when the run was read from the archive tables (finished, moved out of the hot
    #: tables by the supervisors' maintenance after ``archive_after``).
    archived: bool = False
    #: For a run a handler spawned (``ctx.spawn``): the run, the node and the spawn's key
    #: it came from; None otherwise.
    parent_id: str | None = None
    parent_node: str | None = None
    parent_key: str | None = None
    #: The runs this run's handlers spawned, by node and key (at most 1,000): each
    #: ``{"id", "name", "state", "parent_node", "parent_key"}``.
    children: list[dict[str, Any]] = dataclasses.field(default_factory=list)

    @classmethod
    def from_rows(cls, run: dict[str, Any], steps: list[dict[str, Any]]) -> "RunStatus":
        """Build from a ``get_run`` row (with ``schedule`` when
        :func:`cyclone_mp.store.operations.get_run` found one) and its ``get_steps`` rows."""
        return cls(
            id=run["id"], name=run["name"], kind=run["kind"], state=run["state"], input=run["input"],
            created_at=run["created_at"], finished_at=run["finished_at"], idempotency_key=run["idempotency_key"],
            steps={row["node"]: StepStatus.from_row(row) for row in steps}, schedule=run.get("schedule"),
            archived=bool(run.get("archived", False)), parent_id=run.get("parent_id"),
            parent_node=run.get("parent_node"), parent_key=run.get("parent_key"),
            children=list(run.get("children") or ()),
        )

    @property
    def step(self) -> StepStatus:
        """The only step of a single-step run (the first node otherwise)."""
        return next(iter(self.steps.values()))

    @property
    def terminal(self) -> bool:
        """True once the run is completed, discarded or cancelled."""
        return self.state in TERMINAL_RUN_STATES

    @property
    def queued(self) -> bool:
        """True while the run is ``running`` and no supervisor has claimed any of its task
        steps yet: each is ``pending`` or ``available`` and was never started (its signal
        and timer nodes, which no supervisor runs, do not count)."""
        tasks = [s for s in self.steps.values() if s.kind in ("task", "map")]
        return self.state == "running" and bool(tasks) and all(
            s.state in ("pending", "available") and s.started_at is None for s in tasks)

    def to_dict(self) -> dict[str, Any]:
        """JSON-ready dict (datetimes as ISO 8601 strings)."""
        data = dataclasses.asdict(self)
        return _jsonable(data)


def exit_text(entry: dict[str, Any]) -> str:
    """``SIGKILL``, ``exit 3`` or ``-``: how the child of a failed attempt ended, from
    one entry of ``StepStatus.errors`` (SPEC 4 forensics)."""
    if entry.get("signal") is not None:
        return str(entry.get("signal_name") or f"signal {entry['signal']}")
    if entry.get("exit_code") is not None:
        return f"exit {entry['exit_code']}"
    return "-"


def _jsonable(value: Any) -> Any:
    if isinstance(value, dict):
        return {k: _jsonable(v) for k, v in value.items()}
    if isinstance(value, (list, tuple)):
        return [_jsonable(v) for v in value]
    if isinstance(value, dt.datetime):
        return value.isoformat()
    return value
