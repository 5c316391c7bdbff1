"""Steps for tests/acceptance/test_cli.py, loaded by the CLI as a file APP (``tests/support/cli_app.py:mux``).

Module-level handlers, so a worker's children re-import them from this file.
"""

from __future__ import annotations

import time

import cyclone_mp as cy


@cy.step("echo", timeout=10, max_attempts=3)
def echo(ctx: cy.Context, inp: object) -> dict:
    """Return the input at once."""
    return {"echo": inp, "attempt": ctx.attempt}


@cy.step("slow", timeout=60, max_attempts=1)
def slow(ctx: cy.Context, inp: dict) -> dict:
    """Take ``seconds`` (default 3) in ticks of 0.1 s, reporting progress; ignores
    cancellation so a drained worker must really let it finish."""
    seconds = float((inp or {}).get("seconds", 3.0))
    ticks = max(1, int(seconds / 0.1))
    for i in range(ticks):
        time.sleep(0.1)
        ctx.set_progress(i + 1, ticks, "sleeping")
    return {"slept": seconds}


@cy.step("reject", timeout=10, max_attempts=3)
def reject(ctx: cy.Context, inp: object) -> None:
    """Always discard: raise cy.Permanent."""
    raise cy.Permanent("rejected by the test app")


@cy.step("interrupt", timeout=10, max_attempts=1)
def interrupt(ctx: cy.Context, inp: object) -> None:
    """Raise KeyboardInterrupt (no message): status must still name what was raised."""
    raise KeyboardInterrupt


@cy.step("boom", timeout=10, max_attempts=1)
def boom(ctx: cy.Context, inp: object) -> None:
    """Raise ValueError with a message holding brackets (shown as is, not as markup)."""
    raise ValueError("bad [value] in the input")


@cy.step("publish", timeout=10, max_attempts=3)
def publish(ctx: cy.Context, inp: object) -> dict:
    """Return the payload of the ``approve`` signal this node waited for."""
    return {"approved_with": ctx.upstream.get("approve")}


approval = cy.Workflow("approval")
_prepare = approval.add(echo)
_approve = approval.signal("approve", after=[_prepare])
approval.add(publish, after=[_approve])

mux = cy.Mux().register(echo, slow, reject, interrupt, boom, approval)
