"""Module-level steps and workflows for the map tests (``wf.map``, SPEC section 10).

Worker processes rebuild their mux by importing this module. The run's input drives
the steps:

- ``n``: how many items ``numbers`` lists (``0 .. n-1``), or ``items``: the list itself;
- ``dir``: each execution of an item appends ``start <item> <attempt> <pid> <time>`` and
  ``end ...`` lines to ``<dir>/items.log`` (``O_APPEND``: lines never interleave);
- ``fail``: items whose input is in it raise (``permanent``: ``cy.Permanent``) until
  the file ``fail_until`` exists;
- ``hold``: items wait (cooperatively) until the file ``hold`` exists;
- ``stubborn``: items whose input is in it ignore cancellation while they wait for ``hold``;
- ``sleep``: seconds each item sleeps.
"""

from __future__ import annotations

import os
import time

import cyclone_mp as cy

HOLD_LIMIT = 60.0


def _no_backoff(attempt: int) -> float:
    return 0.0


def _log(folder: str | None, line: str) -> None:
    if not folder:
        return
    fd = os.open(os.path.join(folder, "items.log"), os.O_WRONLY | os.O_CREAT | os.O_APPEND, 0o644)
    try:
        os.write(fd, f"{line}\n".encode())
    finally:
        os.close(fd)


@cy.step("numbers")
def numbers(ctx: cy.Context, inp: dict) -> list:
    if "items" in inp:
        return inp["items"]
    return [{"x": i, **{k: inp[k] for k in ("dir", "fail", "fail_until", "hold", "permanent", "stubborn", "sleep")
                             if k in inp}}
            for i in range(inp["n"])]


@cy.step("square", backoff=_no_backoff, max_attempts=2)
def square(ctx: cy.Context, item: dict) -> int:
    x = item["x"]
    _log(item.get("dir"), f"start {x} {ctx.attempt} {os.getpid()} {time.time()}")
    if item.get("sleep"):
        time.sleep(item["sleep"])
    if item.get("hold") and x in (item.get("stubborn") or ()):
        deadline = time.monotonic() + HOLD_LIMIT
        while not os.path.exists(item["hold"]) and time.monotonic() < deadline:
            time.sleep(0.02)  # deaf to cancellation: killed after kill_grace
    elif item.get("hold"):
        deadline = time.monotonic() + HOLD_LIMIT
        while not os.path.exists(item["hold"]):
            if ctx.cancellation.wait(0.02):
                _log(item.get("dir"), f"cancelled {x} {ctx.attempt} {os.getpid()}")
                ctx.check_cancellation()
            if time.monotonic() > deadline:
                raise RuntimeError("hold file never appeared")
    if x in (item.get("fail") or ()) and not os.path.exists(item.get("fail_until") or "/nonexistent"):
        _log(item.get("dir"), f"fail {x} {ctx.attempt} {os.getpid()}")
        if item.get("permanent"):
            raise cy.Permanent(f"item {x} is bad")
        raise RuntimeError(f"item {x} failed")
    _log(item.get("dir"), f"end {x} {ctx.attempt} {os.getpid()} {time.time()}")
    return x * x


@cy.step("total")
def total(ctx: cy.Context, inp: dict) -> dict:
    outputs = ctx.upstream["square"]
    failed = [o.item for o in outputs if isinstance(o, cy.ItemFailed)]
    values = [o for o in outputs if not isinstance(o, cy.ItemFailed)]
    return {"count": len(outputs), "sum": sum(values), "first": values[:3], "failed": failed,
            "ordered": values == sorted(values), "kind": type(outputs).__name__}


@cy.step("noop")
def noop(ctx: cy.Context, item: object) -> object:
    return item


squares = cy.Workflow("squares")
_numbers = squares.add(numbers)
_square = squares.map(square, over=_numbers)
squares.add(total, after=[_square])

tolerant = cy.Workflow("tolerant")
_tn = tolerant.add(numbers)
_ts = tolerant.map(square, over=_tn, allow_failures=True)
tolerant.add(total, after=[_ts])

one_at_a_time = cy.Workflow("one_at_a_time")
_on = one_at_a_time.add(numbers)
_os = one_at_a_time.map(square, over=_on, concurrency=1, priority=5, queue="maps", max_attempts=4)
one_at_a_time.add(total, after=[_os])


# -- spawning (ctx.spawn) --------------------------------------------------------------------------


@cy.step("child")
def child(ctx: cy.Context, inp: dict) -> dict:
    if inp.get("fail"):
        raise cy.Permanent(f"child {inp['i']} failed")
    if inp.get("sleep"):
        time.sleep(inp["sleep"])
    return {"double": inp["i"] * 2}


@cy.step("fanout", backoff=_no_backoff, max_attempts=3)
def fanout(ctx: cy.Context, inp: dict) -> dict:
    """Spawns ``inp["children"]`` child runs (keys ``c0``, ``c1``...); with ``hold``, waits
    for that file after spawning (so a test can take its lease away); fails its first
    attempt with ``fail_first``."""
    ids = [ctx.spawn(child, {"i": i, "fail": i in (inp.get("fail") or ()), "sleep": inp.get("sleep", 0)},
                     key=f"c{i}") for i in range(inp.get("children", 3))]
    _log(inp.get("dir"), f"spawned {ctx.attempt} {' '.join(ids)}")
    if inp.get("hold"):
        deadline = time.monotonic() + HOLD_LIMIT
        while not os.path.exists(inp["hold"]) and time.monotonic() < deadline:
            time.sleep(0.02)  # deaf to cancellation: its lease is taken away meanwhile
    if inp.get("fail_first") and ctx.attempt == 1:
        raise RuntimeError("first attempt fails after spawning")
    return {"spawned": ids}


@cy.step("gather")
def gather(ctx: cy.Context, inp: dict) -> dict:
    runs = ctx.spawned["fanout"]
    return {key: [run["state"], run["output"], run["error"]] for key, run in sorted(runs.items())}


spawner = cy.Workflow("spawner")
_f = spawner.add(fanout)
spawner.add(gather, after=[_f], wait_for_spawned=True)


@cy.step("aspawn", async_concurrency=2)
async def aspawn(ctx: cy.Context, inp: dict) -> dict:
    """An async handler run beside others in its child: spawns one child run."""
    return {"child": ctx.spawn("child", {"i": inp["i"]}, key="only")}
