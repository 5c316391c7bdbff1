"""Module-level steps and workflows for tests/acceptance/test_workflows.py (SPEC section 6).

Worker processes rebuild their mux by importing this module: a step is found as the
module attribute named like its handler, a workflow as a module-level ``cy.Workflow``
with its name. Every task node runs :func:`_record`, whose behaviour is driven by the
run's input (every node gets it):

- ``dir``: executions are logged to ``<dir>/<node>.log``, one ``start``/``end`` line
  each (``O_APPEND`` writes, so lines from several processes never interleave);
- ``hold``: ``{node: path}``: the node waits (cooperatively) until ``path`` exists;
- ``fail_until``: ``{node: path}``: the node raises until ``path`` exists;
- ``x``: echoed in every output, so a test can see that every node got the run input.
"""

from __future__ import annotations

import datetime as dt
import os
import time

import cyclone_mp as cy

HOLD_LIMIT = 60.0  # seconds a held node waits for its file before it gives up


def _no_backoff(attempt: int) -> float:
    return 0.0


def _log(inp: dict, node: str, line: str) -> None:
    folder = inp.get("dir")
    if not folder:
        return
    fd = os.open(os.path.join(folder, f"{node}.log"), os.O_WRONLY | os.O_CREAT | os.O_APPEND, 0o644)
    try:
        os.write(fd, f"{line}\n".encode())
    finally:
        os.close(fd)


def _record(ctx: cy.Context, inp: dict) -> dict:
    node = ctx.node
    _log(inp, node, f"start {ctx.attempt} {os.getpid()}")
    hold = (inp.get("hold") or {}).get(node)
    if hold:
        deadline = time.monotonic() + HOLD_LIMIT
        while not os.path.exists(hold):
            if ctx.cancellation.wait(0.02):
                _log(inp, node, f"cancelled {ctx.attempt} {os.getpid()} {ctx.cancel_reason}")
                ctx.check_cancellation()
            if time.monotonic() > deadline:
                raise RuntimeError(f"{node}: hold file {hold} never appeared")
    marker = (inp.get("fail_until") or {}).get(node)
    if marker and not os.path.exists(marker):
        _log(inp, node, f"fail {ctx.attempt} {os.getpid()}")
        raise RuntimeError(f"{node}: failing until {marker} exists (attempt {ctx.attempt})")
    _log(inp, node, f"end {ctx.attempt} {os.getpid()}")
    return {"node": node, "x": inp.get("x"), "attempt": ctx.attempt, "upstream": ctx.upstream}


# -- steps -------------------------------------------------------------------------------------


@cy.step("a")
def a(ctx: cy.Context, inp: dict) -> dict:
    return _record(ctx, inp)


@cy.step("b")
def b(ctx: cy.Context, inp: dict) -> dict:
    return _record(ctx, inp)


@cy.step("c")
def c(ctx: cy.Context, inp: dict) -> dict:
    return _record(ctx, inp)


@cy.step("d")
def d(ctx: cy.Context, inp: dict) -> dict:
    return _record(ctx, inp)


@cy.step("work", max_attempts=2, backoff=_no_backoff)
def work(ctx: cy.Context, inp: dict) -> dict:
    """The generic task node (named with ``name=``); two attempts, no backoff."""
    return _record(ctx, inp)


@cy.step("first", priority=-10)
def first(ctx: cy.Context, inp: dict) -> dict:
    """Claimed before any ``work`` node (lower priority runs first)."""
    return _record(ctx, inp)


# -- workflows ---------------------------------------------------------------------------------

# a -> b, a -> c, (b, c) -> d
diamond = cy.Workflow("diamond")
_a = diamond.add(a)
_b = diamond.add(b, after=[_a])
_c = diamond.add(c, after=["a"])
diamond.add(d, after=[_b, _c])

# prepare -> approve (signal) -> publish
approval = cy.Workflow("approval")
_prepare = approval.add(work, name="prepare")
_approve = approval.signal("approve", after=[_prepare])
approval.add(work, name="publish", after=[_approve])

# roots: slow (runs first), other (available), gate (signal), tick (timer, 4 s);
# after_slow waits for slow; final waits for everything.
pausable = cy.Workflow("pausable")
_slow = pausable.add(first, name="slow")
_other = pausable.add(work, name="other")
_gate = pausable.signal("gate")
_tick = pausable.timer("tick", seconds=4)
_after_slow = pausable.add(work, name="after_slow", after=[_slow])
pausable.add(work, name="final", after=[_after_slow, _other, _gate, _tick])

# start -> flaky (fails until a marker exists) and side; finish waits for both.
fragile = cy.Workflow("fragile")
_start = fragile.add(work, name="start")
_flaky = fragile.add(work, name="flaky", after=[_start])
_side = fragile.add(work, name="side", after=[_start])
fragile.add(work, name="finish", after=[_flaky, _side])


def timers_workflow(until: dt.datetime, seconds: float) -> cy.Workflow:
    """``at`` (until=), ``after`` (seconds=), then ``done`` (a task) after both.

    Built per test because ``until`` is an absolute instant a few seconds ahead; it is
    not registered in a worker's mux (a worker needs only the ``work`` step).
    """
    wf = cy.Workflow("timers")
    at = wf.timer("at", until=until)
    after = wf.timer("after", seconds=seconds)
    wf.add(work, name="done", after=[at, after])
    return wf


def instants_workflow(untils: dict[str, dt.datetime], day_after: str) -> cy.Workflow:
    """One root timer per ``untils`` entry, plus ``day`` (seconds=86400) after ``day_after``.

    Enqueued only to read back what is stored (no worker runs it).
    """
    wf = cy.Workflow("instants")
    for name, until in untils.items():
        wf.timer(name, until=until)
    wf.timer("day", seconds=86400, after=[day_after])
    return wf

