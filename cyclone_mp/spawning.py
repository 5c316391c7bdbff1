"""Runs spawned by a handler (``ctx.spawn``, SPEC section 10): planned by the supervisor,
written with the spawning attempt's completion.

The child process only lists what its handler spawned (step name, input, key and the
run id derived from them: :meth:`cyclone_mp.Context.spawn`) and sends it with its
successful result. The supervisor plans each run here (:func:`plan`: its rows, from the
step's options in the supervisor's mux, as an enqueue would make them), and the outcome
writer inserts them (:func:`cyclone_mp.store.operations.insert_spawned`) in the
transaction of the completion, after its CAS held and before the parent run moves on:
an attempt whose result loses its CAS spawns nothing, and a spawn whose run exists
already (its id is derived from the parent's run, node and key) is not made twice.
"""

from __future__ import annotations

import dataclasses
import json
from typing import Any, Sequence

from .errors import UnknownStep
from .mux import Mux
from .noderows import NodeRow, node_rows
from .steps import StepOptions


@dataclasses.dataclass(frozen=True)
class Parent:
    """Where a spawned run comes from: the run, the node of the attempt that spawned it,
    and the spawn's key."""

    run_id: str
    node: str
    key: str

    def params(self) -> dict[str, Any]:
        return {"parent_id": self.run_id, "parent_node": self.node, "parent_key": self.key}


@dataclasses.dataclass(frozen=True)
class SpawnPlan:
    """One run to spawn: its id, the step or workflow ``name`` and ``kind`` (``step`` or
    ``workflow``), its input (as a value and as JSON text), its step rows and its parent."""

    run_id: str
    name: str
    kind: str
    input: Any
    input_json: str
    nodes: tuple[NodeRow, ...]
    parent: Parent


def plan(mux: Mux, defaults: StepOptions, run_id: str, node: str, spawns: Sequence[dict[str, Any]]) -> list[SpawnPlan]:
    """The runs a completed attempt of ``node`` in run ``run_id`` spawned, planned with the
    step's (or workflow's) options over ``defaults``, as :func:`cyclone_mp.noderows.node_rows`
    makes an enqueue's rows.

    Raises:
        UnknownStep: a spawned name that ``mux`` does not register (the supervisor that
            runs the spawning step enqueues its children, so it must know them).
        ConfigurationError: a concurrency key callable failed on the input.
    """
    plans = []
    for spawn in spawns:
        try:
            target = mux.lookup(spawn["step"])
        except UnknownStep:
            raise UnknownStep(f"ctx.spawn({spawn['step']!r}): this worker's mux does not register it (the "
                              f"worker that runs the spawning step enqueues the runs it spawns)") from None
        kind, nodes = node_rows(target, spawn["input"], defaults)
        plans.append(SpawnPlan(run_id=spawn["run_id"], name=target.name, kind=kind, input=spawn["input"],
                               input_json=json.dumps(spawn["input"]), nodes=tuple(nodes),
                               parent=Parent(run_id, node, spawn["key"])))
    return plans
