"""Module-level handlers for tests/acceptance/test_one_live_execution.py: each appends a JSON line to
the file named in its input when it starts (pid, wall time, attempt), so the test can
tell which executions were alive at the same instant."""

from __future__ import annotations

import asyncio
import json
import os
import threading
import time
from typing import Any

import cyclone_mp as cy


def _no_backoff(attempt: int) -> float:
    return 0.0


def note(path: str, **record: Any) -> None:
    record = {"pid": os.getpid(), "t": time.time(), **record}
    with open(path, "a") as fh:
        fh.write(json.dumps(record) + "\n")


def records(path: str, event: str | None = None) -> list[dict[str, Any]]:
    try:
        with open(path) as fh:
            lines = fh.read().split("\n")[:-1]
    except FileNotFoundError:
        return []
    return [r for r in map(json.loads, filter(None, lines)) if event is None or r.get("event") == event]


@cy.step("live_wedge", timeout=2, max_attempts=2, backoff=_no_backoff)
def live_wedge(ctx: cy.Context, inp: dict) -> dict:
    """Wedged: never looks at its context (only a SIGKILL ends it)."""
    note(inp["log"], event="start", attempt=ctx.attempt, node=ctx.node, key=inp.get("key"))
    while True:
        sum(range(1000))


@cy.step("live_exclusive", timeout=2, max_attempts=1, concurrency=1)
def live_exclusive(ctx: cy.Context, inp: dict) -> dict:
    """A wedge whose group admits one attempt at a time."""
    note(inp["log"], event="start", attempt=ctx.attempt, key=inp.get("key"))
    if inp.get("wedge", True):
        while True:
            sum(range(1000))
    return {}


@cy.step("live_waits_for_cancel", max_attempts=1)
def live_waits_for_cancel(ctx: cy.Context, inp: dict) -> dict:
    """Waits on its cancellation handle and notes when it woke."""
    note(inp["log"], event="start")
    woke = ctx.cancellation.wait(inp.get("seconds", 60))
    note(inp["log"], event="woke", cancelled=woke, reason=ctx.cancel_reason)
    return {}


@cy.step("live_rated", rate_limit=(10, 1.0), max_attempts=1)
def live_rated(ctx: cy.Context, inp: dict) -> dict:
    """Notes the instant its handler starts (what a rate limit must bound)."""
    note(inp["log"], event="start")
    time.sleep(inp.get("seconds", 0.05))
    return {}


def _ticks(path: str, seconds: float) -> None:
    """A worker thread's body: notes a tick every 0.1 s for ``seconds``."""
    end = time.time() + seconds
    while time.time() < end:
        note(path, event="tick", thread=threading.get_ident())
        time.sleep(0.1)


@cy.step("live_async_thread", timeout=1, max_attempts=2, backoff=_no_backoff)
async def live_async_thread(ctx: cy.Context, inp: dict) -> dict:
    """An async handler that waits on a worker thread (asyncio.to_thread) past its
    timeout: the task is cancelled, the thread runs on."""
    note(inp["log"], event="start", attempt=ctx.attempt)
    await asyncio.to_thread(_ticks, inp["log"], inp.get("seconds", 15))
    return {}


@cy.step("live_fails_beside_a_thread", timeout=60, max_attempts=2, backoff=_no_backoff)
def live_fails_beside_a_thread(ctx: cy.Context, inp: dict) -> dict:
    """Hands work to a thread of its own, then fails (its first attempt): the thread
    ticks on for ``inp["seconds"]`` (attempt 1's only: the second returns at once)."""
    note(inp["log"], event="start", attempt=ctx.attempt)
    if ctx.attempt > 1:
        return {}
    threading.Thread(target=_ticks, args=(inp["log"], inp.get("seconds", 15)), daemon=inp.get("daemon", False)).start()
    time.sleep(0.2)
    raise RuntimeError("failed after handing work to a thread")


def _polite_ticks(ctx: cy.Context, path: str, seconds: float) -> None:
    """A worker thread that stops soon after its attempt is cancelled (0.3 s after)."""
    end = time.time() + seconds
    while time.time() < end and not ctx.cancellation.wait(0.1):
        note(path, event="tick", thread=threading.get_ident())
    time.sleep(0.3)


@cy.step("live_async_polite", timeout=1, max_attempts=2, backoff=_no_backoff)
async def live_async_polite(ctx: cy.Context, inp: dict) -> dict:
    """As live_async_thread, but its thread looks at the cancellation and stops."""
    note(inp["log"], event="start", attempt=ctx.attempt)
    await asyncio.to_thread(_polite_ticks, ctx, inp["log"], inp.get("seconds", 15))
    return {}


@cy.step("live_noted", max_attempts=1)
def live_noted(ctx: cy.Context, inp: dict) -> dict:
    """Notes when its handler starts (its run id with it) and sleeps a little."""
    note(inp["log"], event="start", run_id=ctx.run_id)
    time.sleep(inp.get("seconds", 0.05))
    return {}


@cy.step("live_async_noted", async_concurrency=4, max_attempts=1)
async def live_async_noted(ctx: cy.Context, inp: dict) -> dict:
    """As live_noted, for async attempts side by side in one child."""
    note(inp["log"], event="start", run_id=ctx.run_id)
    await asyncio.sleep(inp.get("seconds", 0.05))
    return {}


@cy.step("live_fails_once", max_attempts=2, backoff=_no_backoff)
def live_fails_once(ctx: cy.Context, inp: dict) -> dict:
    """Notes its start; its first attempt fails at once, the second sleeps ``inp["seconds"]``."""
    note(inp["log"], event="start", attempt=ctx.attempt)
    if ctx.attempt == 1:
        raise RuntimeError("the first attempt fails")
    time.sleep(inp.get("seconds", 0.05))
    return {}


@cy.step("live_snoozer", max_attempts=1, max_snoozes=5)
def live_snoozer(ctx: cy.Context, inp: dict) -> dict:
    """Snoozes ``inp["times"]`` times (counting its starts in the log), then succeeds."""
    note(inp["log"], event="start", attempt=ctx.attempt)
    starts = len(records(inp["log"], "start"))
    if starts <= inp["times"]:
        raise cy.Snooze(inp.get("seconds", 0.2))
    return {"starts": starts}


@cy.step("live_unique", unique=cy.Unique(by=("input",)), max_attempts=1)
def live_unique(ctx: cy.Context, inp: dict) -> dict:
    """One run per input at a time (while running, paused or completed)."""
    time.sleep(inp.get("seconds", 0.0))
    return {"input": inp}


@cy.step("live_hourly", unique=cy.Unique(by=(), period=3600, states=("running", "paused")), max_attempts=1)
def live_hourly(ctx: cy.Context, inp: dict) -> dict:
    """At most one live run per hour window, whatever its input."""
    return {}
