"""Handlers of the issue-17 tests: each execution leaves timestamps a test can compare.

Every line is ``<what> <run id> <pid> <time.time()>`` appended to ``inp["log"]``; a
handler that runs for a while writes a ``tick`` line every 50 ms, so its last tick is
(within 50 ms) when it died.
"""

from __future__ import annotations

import collections
import itertools
import os
import time

import cyclone_mp as cy


def note(inp: dict, what: str, ctx: cy.Context, at: float | None = None) -> None:
    with open(inp["log"], "a") as fh:
        fh.write(f"{what} {ctx.run_id} {os.getpid()} {time.time() if at is None else at:.6f}\n")


def note_start(inp: dict, ctx: cy.Context) -> None:
    """A ``start`` line, and a ``deadline`` line with the attempt's worker-clock deadline
    (epoch seconds), from which its cancel and kill are due: it counts from the claim, so
    it can come before a slow child's start plus the timeout (SPEC 4)."""
    note(inp, "start", ctx)
    if ctx.deadline is not None:
        note(inp, "deadline", ctx, at=ctx.deadline.timestamp())


@cy.step("wedge_native", timeout=1, max_attempts=3)
def wedge_native(ctx: cy.Context, inp: dict) -> dict:
    """Wedged in a C loop that holds the GIL and never returns (SPEC scenario SC-02)."""
    note_start(inp, ctx)
    collections.deque(itertools.repeat(None, 10**12), maxlen=0)
    return {}


@cy.step("progress_then_wedge", timeout=1, max_attempts=1)
def progress_then_wedge(ctx: cy.Context, inp: dict) -> dict:
    """Reports progress (``inp["message"]``), then wedges in a C loop holding the GIL."""
    ctx.set_progress(1, None, inp["message"])
    note_start(inp, ctx)
    collections.deque(itertools.repeat(None, 10**12), maxlen=0)
    return {}


@cy.step("progress_then_late", timeout=1, max_attempts=1)
def progress_then_late(ctx: cy.Context, inp: dict) -> dict:
    """Reports progress (``inp["message"]``), then sleeps ``inp["sleep"]`` seconds whatever
    ctx says and returns (after its deadline)."""
    ctx.set_progress(1, None, inp["message"])
    note_start(inp, ctx)
    end = time.monotonic() + inp["sleep"]
    while time.monotonic() < end:
        time.sleep(0.05)
    return {"late": True}


def _no_backoff(attempt: int) -> float:
    return 0.0


def _one_second(attempt: int) -> float:
    return 1.0


def _ten_seconds(attempt: int) -> float:
    return 10.0


def _ignoring(ctx: cy.Context, inp: dict) -> dict:
    note_start(inp, ctx)
    end = time.monotonic() + inp.get("seconds", 3600)
    while time.monotonic() < end:  # never looks at ctx: only a kill ends it
        time.sleep(0.05)
        note(inp, "tick", ctx)
    note(inp, "end", ctx)
    return {"pid": os.getpid()}


@cy.step("wedge_b0", timeout=1, max_attempts=3, backoff=_no_backoff)
def wedge_b0(ctx: cy.Context, inp: dict) -> dict:
    return _ignoring(ctx, inp)


@cy.step("wedge_b1", timeout=1, max_attempts=3, backoff=_one_second)
def wedge_b1(ctx: cy.Context, inp: dict) -> dict:
    return _ignoring(ctx, inp)


@cy.step("wedge_b10", timeout=1, max_attempts=3, backoff=_ten_seconds)
def wedge_b10(ctx: cy.Context, inp: dict) -> dict:
    return _ignoring(ctx, inp)


@cy.step("ignores_cancel", max_attempts=5)
def ignores_cancel(ctx: cy.Context, inp: dict) -> dict:
    """Runs ``inp["seconds"]`` whatever it is told, ticking."""
    return _ignoring(ctx, inp)


@cy.step("quick")
def quick(ctx: cy.Context, inp: dict) -> dict:
    note(inp, "start", ctx) if "log" in inp else None
    time.sleep(inp.get("seconds", 0.0))
    note(inp, "end", ctx) if "log" in inp else None
    return {"pid": os.getpid(), "attempt": ctx.attempt}
