"""A small cyclone_mp app for the README tour.

In one terminal (from the repository root)::

    cyclone-mp worker examples.app:mux

In another::

    cyclone-mp enqueue examples.app:mux greet --input '{"name": "Ada"}' --wait
    cyclone-mp enqueue examples.app:mux count --input '{"to": 10, "every": 0.5}' --wait

Progress reaches the database with each lease renewal (every ``lease_ttl / 3``: 10 s
with the default 30 s lease); run the worker with ``--lease-ttl 3`` to watch the bar
move every second.

``greet`` returns at once. ``count`` is slow: it reports progress on every tick and
stops cooperatively when cancelled (``cyclone-mp cancel RUN_ID``, a timeout or a
shutdown): ``ctx.cancellation.wait(seconds)`` sleeps, but wakes at once on a cancel.
"""

from __future__ import annotations

import cyclone_mp as cy


@cy.step("greet", timeout=10, max_attempts=3)
def greet(ctx: cy.Context, inp: dict) -> dict:
    """Fast: ``{"name": str}`` -> ``{"greeting": str}``."""
    name = (inp or {}).get("name", "world")
    return {"greeting": f"hello, {name}!", "attempt": ctx.attempt}


@cy.step("count", timeout=120, max_attempts=3)
def count(ctx: cy.Context, inp: dict) -> dict:
    """Slow: count to ``to`` (default 10), one tick every ``every`` seconds (default 0.5).

    Reports ``ctx.set_progress(i, to)`` on each tick. On cancellation it raises
    ``cy.Cancelled`` (via ``ctx.check_cancellation()``) so the attempt ends at once
    instead of being killed after the grace period.
    """
    inp = inp or {}
    to, every = int(inp.get("to", 10)), float(inp.get("every", 0.5))
    for i in range(1, to + 1):
        if ctx.cancellation.wait(every):  # True: woken by a cancel (timeout, cancel, shutdown)
            ctx.check_cancellation()
        ctx.set_progress(i, to, f"tick {i} of {to}")
    return {"counted": to}


mux = cy.Mux().register(greet, count)
