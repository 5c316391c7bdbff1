"""Handlers and hooks of tests/acceptance/test_hooks.py (module level: children import them by name)."""

from __future__ import annotations

import json
import os

import cyclone_mp as cy


def _note(ctx: cy.Context, **record) -> None:
    path = os.environ.get("CYCLONE_TEST_HOOK_LOG")
    if path:
        with open(path, "a") as fh:
            fh.write(json.dumps({"node": ctx.node, "attempt": ctx.attempt, "pid": os.getpid(), **record}) + "\n")


def opened(ctx: cy.Context) -> None:
    """Set up what the handler needs (here: a note, and a value it reads)."""
    ctx.session = {"opened_for": ctx.run_id}
    _note(ctx, event="start")


def closed(ctx: cy.Context, outcome: dict) -> None:
    _note(ctx, event="end", ok=outcome["ok"], kind=outcome["kind"], error=outcome["error"])


@cy.step("hooked_ok")
def hooked_ok(ctx: cy.Context, inp: dict) -> dict:
    return {"session": ctx.session["opened_for"] == ctx.run_id}


@cy.step("hooked_fails", max_attempts=2, backoff=0)
def hooked_fails(ctx: cy.Context, inp: dict) -> dict:
    raise RuntimeError("no luck")

