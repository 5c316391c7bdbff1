"""Steps no retry can heal (tests/acceptance/test_permanent_errors.py): outputs that are not JSON,
and handlers a child cannot import or call.

Every step keeps the defaults (25 attempts, ``attempt**4`` backoff): a retried step
would wait a second, then 16, and so on, so a test sees at once whether it was
discarded at its first attempt. The test process imports this module without error;
children carry their supervisor's id in ``CYCLONE_MP_SUPERVISOR``, and
``PERMANENT_HANDLERS_BREAK`` (set by a test before its worker starts) chooses how the
module breaks there.
"""

from __future__ import annotations

import os
import sys

import cyclone_mp as cy

IN_CHILD = bool(os.environ.get("CYCLONE_MP_SUPERVISOR"))
BREAK = os.environ.get("PERMANENT_HANDLERS_BREAK", "") if IN_CHILD else ""

if BREAK == "import_error":
    import cyclone_mp_no_such_package  # noqa: F401 - a dependency missing where the worker runs
if BREAK == "raises":
    raise RuntimeError("permanent_handlers: broken on purpose")
if BREAK == "exit":
    sys.exit(2)  # e.g. argparse refusing the child's command line
if BREAK == "supervisor":
    # A script without a ``__main__`` guard: its module-level code starts a supervisor.
    cy.Client("postgresql://nobody@127.0.0.1:1/unused", cy.Mux()).start()


@cy.step("perm_fine")
def fine(ctx: cy.Context, inp: dict) -> dict:
    return {"attempt": ctx.attempt}


@cy.step("perm_returns_set")
def returns_set(ctx: cy.Context, inp: dict) -> object:
    return {"a", "b"}


@cy.step("perm_returns_object")
def returns_object(ctx: cy.Context, inp: dict) -> object:
    return object()


@cy.step("perm_returns_nan")
def returns_nan(ctx: cy.Context, inp: dict) -> object:
    return {"ratio": float("nan")}


@cy.step("perm_async_returns_set")
async def async_returns_set(ctx: cy.Context, inp: dict) -> object:
    return {1, 2}


@cy.step("perm_bad_progress")
def bad_progress(ctx: cy.Context, inp: dict) -> dict:
    ctx.set_progress({"not", "a", "number"})
    return {}


@cy.step("perm_too_big")
def too_big(ctx: cy.Context, inp: dict) -> dict:
    return {"blob": "x" * inp["bytes"]}


@cy.step("perm_rebound")
def rebound(ctx: cy.Context, inp: dict) -> dict:
    return {}


if IN_CHILD:
    rebound = {"not": "callable"}  # type: ignore[assignment]  # the name means something else here
else:
    @cy.step("perm_parent_only")
    def parent_only(ctx: cy.Context, inp: dict) -> dict:
        """Defined only in the parent (as under a ``__main__`` guard): no child finds it."""
        return {}


@cy.step("perm_huge_int")
def huge_int(ctx: cy.Context, inp: dict) -> dict:
    """Encodes in this child (its digit limit lifted), but no supervisor decodes it: the
    result frame is undecodable on the other side."""
    sys.set_int_max_str_digits(0)
    return {"n": 10 ** 5000}
