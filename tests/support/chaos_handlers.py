"""Handlers of the chaos test: each completed step writes its side effect idempotently,
and every execution leaves ``start``/``tick``/``end`` lines (run id, pid, wall clock) in
``inp["log"]`` so the test can tell whether two executions of one step overlapped."""

from __future__ import annotations

import collections
import hashlib
import itertools
import os
import time

import psycopg

import cyclone_mp as cy


def _no_backoff(attempt: int) -> float:
    return 0.0


def note(inp: dict, ctx: cy.Context, what: str) -> None:
    if "log" in inp:
        with open(inp["log"], "a") as fh:
            fh.write(f"{what} {ctx.run_id} {os.getpid()} {time.time():.6f}\n")


def effect(inp: dict, ctx: cy.Context) -> None:
    """The user's side effect, keyed by run id (idempotent: exactly once per run)."""
    with psycopg.connect(inp["dsn"], autocommit=True) as conn:
        conn.execute(
            "INSERT INTO chaos_effects (run_id, attempt, pid) VALUES (%s, %s, %s) ON CONFLICT (run_id) DO NOTHING",
            (ctx.run_id, ctx.attempt, os.getpid()),
        )
        conn.execute("INSERT INTO chaos_log (run_id, attempt) VALUES (%s, %s)", (ctx.run_id, ctx.attempt))


@cy.step("chaos_fast", max_attempts=10, backoff=_no_backoff)
def chaos_fast(ctx: cy.Context, inp: dict) -> dict:
    note(inp, ctx, "start")
    effect(inp, ctx)
    note(inp, ctx, "end")
    return {"kind": "fast"}


@cy.step("chaos_slow", max_attempts=10, backoff=_no_backoff)
def chaos_slow(ctx: cy.Context, inp: dict) -> dict:
    note(inp, ctx, "start")
    end = time.monotonic() + inp.get("seconds", 1.0)
    while time.monotonic() < end:
        time.sleep(0.02)
        note(inp, ctx, "tick")
    effect(inp, ctx)
    note(inp, ctx, "end")
    return {"kind": "slow"}


@cy.step("chaos_cpu", max_attempts=10, backoff=_no_backoff)
def chaos_cpu(ctx: cy.Context, inp: dict) -> dict:
    note(inp, ctx, "start")
    data = b"x" * 4096
    end = time.process_time() + 0.15
    tick = time.monotonic()
    while time.process_time() < end:
        data = hashlib.sha256(data).digest() * 128
        if time.monotonic() - tick > 0.02:
            tick = time.monotonic()
            note(inp, ctx, "tick")
    effect(inp, ctx)
    note(inp, ctx, "end")
    return {"kind": "cpu"}


@cy.step("chaos_wedged", timeout=1, max_attempts=2, backoff=_no_backoff)
def chaos_wedged(ctx: cy.Context, inp: dict) -> dict:
    collections.deque(itertools.repeat(None, 10**12), maxlen=0)
    return {}


@cy.step("chaos_crash", max_attempts=10, backoff=_no_backoff)
def chaos_crash(ctx: cy.Context, inp: dict) -> dict:
    note(inp, ctx, "start")
    if ctx.attempt == 1:
        os._exit(9)
    effect(inp, ctx)
    note(inp, ctx, "end")
    return {"kind": "crash"}
