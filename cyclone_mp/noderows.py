"""The step rows of one run: :func:`node_rows` turns a step or workflow, its input and the
enqueue's options into a :class:`NodeRow` per node (the enqueue's options over the step's
over the client's defaults, SPEC 2), and the query parameters each row gives.

Pure and at the bottom of the import graph: the clients' planning, schedules, spawned
runs and the store all read these rows.
"""

from __future__ import annotations

import dataclasses
import datetime as dt
import functools
from typing import Any, Sequence

from .backoff import storable_backoff
from .limits.declared import NO_LIMITS, Limits
from .steps import Step, StepOptions
from .workflow import Workflow


@dataclasses.dataclass(frozen=True)
class NodeRow:
    """One step row to insert at enqueue (a node of the run)."""

    node: str
    step_name: str | None
    kind: str
    depends_on: Sequence[str]
    queue: str
    priority: int
    state: str
    max_attempts: int
    max_reclaims: int | None
    timeout: float | None
    timer_delay: float | None = None
    due_at: dt.datetime | None = None
    backoff: Any = None  # a stored backoff spec (seconds or a list of seconds), or None
    limits: Limits = NO_LIMITS  # resource caps of each attempt
    concurrency_key: str = ""  # its fairness and limit group ('' for none)
    concurrency: int | None = None  # at most this many running per (step, key)
    rate_limit: tuple[int, float] | None = None  # at most count starts per seconds per (step, key)
    allow_failures: bool | None = None  # map nodes: discarded items do not discard the map
    wait_spawned: bool | None = None  # pending until the runs its dependencies spawned have ended

    @functools.cached_property
    def enqueue_params(self) -> dict[str, Any]:
        """The parameters of ``enqueue_step`` that come from this row alone (its queue,
        priority, attempts, timeout, key, flow and resource limits; the backoff is a JSON
        parameter the store wraps), computed once
        per row: a client reuses a step's row for every enqueue without per-enqueue
        options. Callers copy it, never change it."""
        return {"queue": self.queue, "priority": self.priority, "max_attempts": self.max_attempts,
                "max_reclaims": self.max_reclaims, "timeout_us": to_us(self.timeout), **node_params(self)}

    @property
    def flow(self) -> bool:
        """True when the step has a key or a limit: its queue needs the fair, limited claim."""
        return bool(self.concurrency_key) or self.limited

    @property
    def limited(self) -> bool:
        """True when a limit needs slots (made at enqueue: ``operations._ensure_slots``)."""
        return self.concurrency is not None or self.rate_limit is not None


def to_us(seconds: float | None) -> int | None:
    """Seconds to whole microseconds (how durations reach SQL)."""
    return None if seconds is None else int(round(seconds * 1_000_000))


def limit_params(limits: Limits) -> dict[str, Any]:
    """A step row's resource-limit columns as query parameters."""
    return {"memory_limit": limits.memory, "cpu_limit": limits.cpu, "max_processes": limits.processes,
            "max_open_files": limits.open_files}


def node_params(node: NodeRow) -> dict[str, Any]:
    """A step row's key, flow limits and resource limits as query parameters."""
    return {
        "key": node.concurrency_key, "concurrency": node.concurrency,
        "rate_count": node.rate_limit[0] if node.rate_limit else None,
        "rate_period_us": to_us(node.rate_limit[1]) if node.rate_limit else None,
        **limit_params(node.limits),
    }


def task_row(node: str, step: Step, opts: StepOptions, input: Any, after: Sequence[str], state: str) -> NodeRow:
    return NodeRow(
        node=node, step_name=step.name, kind="task", depends_on=tuple(after), queue=opts.queue or "default",
        priority=opts.priority or 0, state=state, max_attempts=opts.max_attempts or 25,
        max_reclaims=opts.max_reclaims, timeout=opts.timeout, backoff=storable_backoff(opts.backoff),
        concurrency_key=opts.key_for(input), concurrency=opts.concurrency, rate_limit=opts.rate_limit,
        limits=opts.limits,
    )


def node_rows(definition: Step | Workflow, input: Any, defaults: StepOptions,
              overrides: StepOptions = StepOptions()) -> tuple[str, list[NodeRow]]:
    """The run kind and the step rows of one run of ``definition`` with ``input``: per
    node, the enqueue's ``overrides`` over the step's options over ``defaults`` (SPEC 2);
    a map node's row (the options of its items) has ``map()``'s options between the
    enqueue's and the step's. Every node's concurrency key comes from the run's input.

    Raises:
        ConfigurationError: a concurrency key callable failed.
    """
    if isinstance(definition, Workflow):
        nodes = []
        for node in definition.nodes:
            if node.kind == "task":
                opts = overrides.over(node.step.options).over(defaults)
                row = task_row(node.name, node.step, opts, input, node.after, "pending")
                nodes.append(dataclasses.replace(row, wait_spawned=True) if node.wait_for_spawned else row)
            elif node.kind == "map":  # the row its items are made from: map()'s options over the step's
                opts = overrides.over(node.options).over(node.step.options).over(defaults)
                row = task_row(node.name, node.step, opts, input, node.after, "pending")
                nodes.append(dataclasses.replace(row, kind="map", allow_failures=node.allow_failures))
            else:
                nodes.append(NodeRow(
                    node=node.name, step_name=None, kind=node.kind, depends_on=node.after,
                    queue=overrides.queue or defaults.queue or "default", priority=0, state="pending",
                    max_attempts=1, max_reclaims=None, timeout=None, timer_delay=node.delay, due_at=node.until,
                ))
        return "workflow", nodes
    opts = overrides.over(definition.options).over(defaults)
    return "step", [task_row(definition.name, definition, opts, input, (), "available")]
