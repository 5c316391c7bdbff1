"""Runs of several steps: a DAG of task, map, signal and timer nodes (SPEC sections 6, 10).

A :class:`Workflow` is a definition only; enqueueing it inserts one run row and one
step row per node (a map node's items are inserted when the node it maps over
completes). Validation happens at definition time: unique node names, known
dependencies (a dependency must be added first, so cycles cannot be built).
"""

from __future__ import annotations

import dataclasses
import datetime as dt
import sys
from typing import Any, Iterable, Union

from .durations import Duration
from .durations import seconds as to_seconds
from .errors import ConfigurationError
from .steps import STEP_ONLY_OPTIONS, Step, StepOptions, check_name

NodeRef = Union["Node", str]


@dataclasses.dataclass(frozen=True)
class Node:
    """One node of a workflow.

    Attributes:
        name: unique within the workflow; tools address a step as ``(run_id, name)``.
        kind: ``"task"``, ``"map"``, ``"signal"`` or ``"timer"``.
        step: the Step a task or map node runs (None otherwise).
        after: names of the nodes it depends on (a map node: the node it maps over).
        delay: timer nodes: seconds after the node is reached.
        until: timer nodes: an absolute UTC instant.
        allow_failures: map nodes: a discarded item does not discard the map.
        options: map nodes: options of its items, over the step's own.
        wait_for_spawned: task nodes: pending until the runs its dependencies spawned
            (``ctx.spawn``) have ended, too.
    """

    name: str
    kind: str
    after: tuple[str, ...]
    step: Step | None = None
    delay: float | None = None
    until: dt.datetime | None = None
    allow_failures: bool = False
    options: StepOptions = StepOptions()
    wait_for_spawned: bool = False


class Workflow:
    """A named DAG of nodes: ``wf.add(step, after=[...])``, ``wf.signal``, ``wf.timer``."""

    kind = "workflow"

    def __init__(self, name: str) -> None:
        check_name(name, "workflow name")
        self.name = name
        self._nodes: dict[str, Node] = {}
        # Where a worker process finds this definition again (a module-level attribute).
        self.module: str = sys._getframe(1).f_globals.get("__name__", "__main__")

    def _deps(self, after: Iterable[NodeRef] | None) -> tuple[str, ...]:
        names: list[str] = []
        for dep in after or ():
            dep_name = dep.name if isinstance(dep, Node) else dep
            if not isinstance(dep_name, str) or dep_name not in self._nodes:
                raise ConfigurationError(
                    f"workflow {self.name!r}: unknown dependency {dep_name!r} (add a node before the nodes that depend on it)"
                )
            if dep_name in names:
                raise ConfigurationError(f"workflow {self.name!r}: dependency {dep_name!r} listed twice")
            names.append(dep_name)
        return tuple(names)

    def _put(self, node: Node) -> Node:
        check_name(node.name, f"workflow {self.name!r}: node name")
        if node.name in self._nodes:
            raise ConfigurationError(f"workflow {self.name!r}: duplicate node name {node.name!r}")
        self._nodes[node.name] = node
        return node

    def add(self, step: Step, after: Iterable[NodeRef] | None = None, name: str | None = None, *,
            wait_for_spawned: bool = False) -> Node:
        """Add a task node running ``step``; returns the node (use it in ``after=``).

        With ``wait_for_spawned=True`` the node also waits until every run its
        dependencies spawned (``ctx.spawn``) has ended (completed, discarded or
        cancelled), and reads them as ``ctx.spawned``.

        Raises:
            ConfigurationError: not a Step, duplicate name, unknown dependency,
                ``wait_for_spawned`` without a dependency.
        """
        if not isinstance(step, Step):
            raise ConfigurationError(f"workflow {self.name!r}: add() takes a cy.step, not {type(step).__name__}")
        deps = self._deps(after)
        if wait_for_spawned and not deps:
            raise ConfigurationError(f"workflow {self.name!r}: wait_for_spawned needs after= (the nodes that spawn)")
        return self._put(Node(name=name or step.name, kind="task", after=deps, step=step,
                              wait_for_spawned=bool(wait_for_spawned)))

    def map(self, step: Step, over: NodeRef, name: str | None = None, allow_failures: bool = False,
            **options: Any) -> Node:
        """Add a mapped node: ``step`` runs once per item of the JSON list that ``over``
        completes with, each item its handler's input; returns the node. The node
        completes once every item has, and a node ``after=[it]`` gets the items' outputs
        in item order as ``ctx.upstream[name]``.

        A discarded item (its attempts spent) discards the map, and so the run, once no
        other item runs; with ``allow_failures=True`` the map completes anyway and the
        join sees ``cy.ItemFailed`` values in place of the discarded items' outputs.
        ``options`` (``timeout``, ``max_attempts``, ``queue``, ``priority``,
        ``concurrency``, ``rate_limit``...) apply to every item, over the step's own.

        Raises:
            ConfigurationError: not a Step, an unknown ``over``, a duplicate name, a bad
                option, or one only ``cy.step`` takes (``max_snoozes``, ``unique``,
                ``async_concurrency``).
        """
        if not isinstance(step, Step):
            raise ConfigurationError(f"workflow {self.name!r}: map() takes a cy.step, not {type(step).__name__}")
        if over is None:
            raise ConfigurationError(f"workflow {self.name!r}: map() needs over= (the node whose list it maps)")
        if not isinstance(allow_failures, bool):
            raise ConfigurationError(f"workflow {self.name!r}: allow_failures must be True or False")
        step_only = sorted(STEP_ONLY_OPTIONS & set(options))
        if step_only:  # read from the step by the supervisor that registers it, never from a row
            raise ConfigurationError(f"workflow {self.name!r}: map({step_only[0]}=...) is an option of cy.step, "
                                     f"not of a node")
        if callable(options.get("concurrency_key")):
            raise ConfigurationError(
                f"workflow {self.name!r}: map(concurrency_key=...) takes a string (a callable belongs to cy.step)")
        if callable(options.get("backoff")):
            raise ConfigurationError(
                f"workflow {self.name!r}: map(backoff=...) takes seconds or a list of seconds (stored on the row)")
        built = StepOptions.build(**options)
        return self._put(Node(name=name or step.name, kind="map", after=self._deps([over]), step=step,
                              allow_failures=allow_failures, options=built))

    def signal(self, name: str, after: Iterable[NodeRef] | None = None) -> Node:
        """Add a node that waits in ``waiting_signal`` until ``client.signal(run_id, name, payload)``."""
        return self._put(Node(name=name, kind="signal", after=self._deps(after)))

    def timer(
        self,
        name: str,
        seconds: Duration | None = None,
        after: Iterable[NodeRef] | None = None,
        until: dt.datetime | None = None,
    ) -> Node:
        """Add a node that waits in ``waiting_timer`` until due on the database clock.

        Give ``seconds`` (after the node is reached) or ``until`` (an aware UTC instant).

        Raises:
            ConfigurationError: both or neither given, or a naive ``until``.
        """
        if (seconds is None) == (until is None):
            raise ConfigurationError(f"timer {name!r}: give exactly one of seconds= or until=")
        if until is not None and (not isinstance(until, dt.datetime) or until.tzinfo is None
                                  or until.utcoffset() is None):
            raise ConfigurationError(f"timer {name!r}: until= must be timezone-aware (UTC)")
        delay = to_seconds(seconds, "seconds", allow_zero=True) if seconds is not None else None
        return self._put(Node(name=name, kind="timer", after=self._deps(after), delay=delay, until=until))

    @property
    def nodes(self) -> list[Node]:
        """Nodes in definition (topological) order."""
        return list(self._nodes.values())

    def task_nodes(self) -> list[Node]:
        """The nodes that run a step (task and map nodes)."""
        return [n for n in self._nodes.values() if n.kind in ("task", "map")]

    def __repr__(self) -> str:
        return f"Workflow({self.name!r}, nodes={list(self._nodes)})"

