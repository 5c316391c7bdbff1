"""Module-level ``async def`` handlers for tests/acceptance/test_async.py (issue 24): children import them by name."""

from __future__ import annotations

import asyncio
import collections
import itertools
import os
from pathlib import Path

import cyclone_mp as cy


def _note(inp: dict, text: str) -> None:
    if inp.get("marker"):
        with open(inp["marker"], "a") as fh:
            fh.write(text + "\n")


@cy.step("async_echo")
async def echo(ctx: cy.Context, inp: dict) -> dict:
    await asyncio.sleep(0)
    loop = asyncio.get_running_loop()
    return {"echo": inp, "attempt": ctx.attempt, "pid": os.getpid(), "loop": id(loop), "run_id": ctx.run_id}


@cy.step("sync_echo")
def sync_echo(ctx: cy.Context, inp: dict) -> dict:
    return {"echo": inp, "pid": os.getpid()}


@cy.step("async_sleeps", timeout=1, max_attempts=1)
async def sleeps(ctx: cy.Context, inp: dict) -> dict:
    """Awaits an hour; a cancel must reach it as CancelledError at once."""
    _note(inp, "started")
    try:
        await asyncio.sleep(3600)
    except asyncio.CancelledError:
        _note(inp, f"CancelledError {ctx.cancel_reason}")
        raise
    return {}


@cy.step("async_wedge", timeout=1, max_attempts=1)
async def wedge(ctx: cy.Context, inp: dict) -> dict:
    """Blocks the loop in C (holding the GIL): no cancel can reach it, only the kill."""
    _note(inp, "started")
    collections.deque(itertools.repeat(None, 10**12), maxlen=0)
    return {}


@cy.step("async_watcher", max_attempts=1)
async def watcher(ctx: cy.Context, inp: dict) -> dict:
    """A second task awaits ctx.cancellation while the handler's own task sleeps."""

    async def watch() -> None:
        reason = await ctx.cancellation
        _note(inp, f"watcher woke: {reason}")

    asyncio.get_running_loop().create_task(watch())
    _note(inp, "started")
    try:
        await asyncio.sleep(3600)
    except asyncio.CancelledError:
        await asyncio.sleep(0.05)  # let the watcher run (cleanup may await)
        _note(inp, f"CancelledError {ctx.cancel_reason}")
        raise
    return {}


@cy.step("async_fails", max_attempts=1)
async def fails(ctx: cy.Context, inp: dict) -> dict:
    await asyncio.sleep(0)
    raise ValueError("async failure")


@cy.step("async_permanent", max_attempts=3)
async def permanent(ctx: cy.Context, inp: dict) -> dict:
    raise cy.Permanent("bad input")


@cy.step("async_own_cancel", max_attempts=1)
async def own_cancel(ctx: cy.Context, inp: dict) -> dict:
    """A CancelledError nobody asked for (an inner task cancelled) is an ordinary error."""
    inner = asyncio.get_running_loop().create_task(asyncio.sleep(10))
    inner.cancel()
    await inner
    return {}


@cy.step("async_cancel_wait", max_attempts=1)
async def cancel_wait(ctx: cy.Context, inp: dict) -> dict:
    """Returns the reason ``await ctx.cancellation`` gives when the cancel came first."""
    return {"reason": await asyncio.wait_for(ctx.cancellation, 0.01) if ctx.cancelled else None}


def marker_lines(path: Path) -> list[str]:
    return path.read_text().splitlines() if path.exists() else []


@cy.step("side_by_side", async_concurrency=50, max_attempts=2, timeout=20)
async def side_by_side(ctx: cy.Context, inp: dict) -> dict:
    """Awaits ``seconds``, beside up to 49 others in its child; ``wedge``: blocks its
    child's event loop (time.sleep in an async def) past its timeout."""
    import time as _time

    if inp.get("log"):
        with open(inp["log"], "a") as fh:
            fh.write(f"{ctx.run_id} {ctx.attempt} {__import__('os').getpid()}\n")
    if inp.get("wedge"):
        _time.sleep(inp["wedge"])
    await asyncio.sleep(inp.get("seconds", 1.0))
    return {"attempt": ctx.attempt}
