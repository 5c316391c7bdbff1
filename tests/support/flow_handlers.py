"""Module-level steps of the schedule and flow-control tests (issue 21): children import them."""

from __future__ import annotations

import time

import cyclone_mp as cy


@cy.step("flow_noop", max_attempts=3)
def noop(ctx: cy.Context, inp: dict) -> dict:
    return {}


@cy.step("flow_tick", max_attempts=3)
def tick(ctx: cy.Context, inp: dict) -> dict:
    return {"slot_input": inp}


@cy.step("per_tenant", concurrency=2, concurrency_key=lambda inp: inp["tenant"], max_attempts=5)
def per_tenant(ctx: cy.Context, inp: dict) -> dict:
    time.sleep(inp.get("sleep", 0.15))
    return {}


@cy.step("unlimited_tenant", concurrency_key=lambda inp: inp["tenant"], max_attempts=5)
def unlimited_tenant(ctx: cy.Context, inp: dict) -> dict:
    time.sleep(inp.get("sleep", 0.15))
    return {}


@cy.step("rate_limited", rate_limit=(10, 1.0), concurrency_key=lambda inp: inp["key"], max_attempts=3)
def rate_limited(ctx: cy.Context, inp: dict) -> dict:
    return {}


@cy.step("fair", concurrency_key=lambda inp: inp["tenant"], max_attempts=3)
def fair(ctx: cy.Context, inp: dict) -> dict:
    return {}
