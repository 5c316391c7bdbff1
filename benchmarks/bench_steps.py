"""Step handlers of the benchmarks (module level, so child processes import them by name).

``benchmarks/run.py`` puts this folder on ``sys.path``; the supervisor passes its
``sys.path`` to its children, which import ``bench_steps`` by module path.
"""

from __future__ import annotations

import collections
import itertools
import time

import cyclone_mp as cy


def cpu_work(n: int) -> int:
    """Pure-Python CPU work (the peer harness's body); ``n`` is calibrated to ~20 ms."""
    x = 0
    for i in range(n):
        x = (x * 31 + i) % 1000003
    return x


@cy.step("bench_noop")
def noop(ctx: cy.Context, inp: object) -> None:
    """B1, B5, B6, B7 and the step after the wedge in B3: does nothing."""
    return None


@cy.step("bench_noop_capped", max_processes=4096)
def noop_capped(ctx: cy.Context, inp: Any) -> None:
    """A no-op that declares a process cap (B9: children then join v1 cgroups at birth)."""
    return None


@cy.step("bench_cpu")
def cpu(ctx: cy.Context, inp: dict) -> None:
    """B2: ``inp["n"]`` iterations of :func:`cpu_work` (about 20 ms)."""
    cpu_work(int(inp["n"]))
    return None


@cy.step("bench_wedge", max_attempts=1)
def wedge(ctx: cy.Context, inp: object) -> None:
    """B3: one C call that never returns to the bytecode loop (holds the GIL, runs no
    signal handler, ignores cancellation). Only a SIGKILL stops it."""
    collections.deque(itertools.repeat(None, 10**12), maxlen=0)
    return None


@cy.step("bench_sleep")
def sleep(ctx: cy.Context, inp: dict) -> dict:
    """B4: sleeps ``inp["seconds"]`` (3 s), ignoring cancellation."""
    time.sleep(float(inp["seconds"]))
    return {"ok": True}


@cy.step("bench_noop_keyed", concurrency_key=lambda inp: inp["k"])
def noop_keyed(ctx: cy.Context, inp: object) -> None:
    """B8: B1's no-op with a concurrency key on every step (fair claiming by key)."""
    return None


@cy.step("bench_noop_limited", concurrency_key=lambda inp: inp["k"], concurrency=1000)
def noop_limited(ctx: cy.Context, inp: object) -> None:
    """B8: the same with a per-key concurrency limit that never binds (its slots are taken
    and freed by every claim, so the limit's whole cost is paid)."""
    return None


@cy.step("bench_list")
def make_list(ctx: cy.Context, inp: dict) -> list:
    """M1-M3 (benchmarks/maps.py): the list a map runs over, ``inp["n"]`` copies of
    ``inp.get("item")``."""
    return [inp.get("item")] * int(inp["n"])


@cy.step("bench_item")
def item(ctx: cy.Context, inp: object) -> object:
    """M1-M3: one mapped item; returns its input (None: a no-op)."""
    return inp


@cy.step("bench_join")
def join(ctx: cy.Context, inp: dict) -> dict:
    """M1-M3: the map's join: iterates every output once; returns how many, their total
    length, what ``ctx.upstream`` held them in, and this child's peak RSS (KiB)."""
    import resource

    outputs = ctx.upstream["bench_item"]
    count = size = 0
    for out in outputs:
        count += 1
        size += len(out) if isinstance(out, str) else 0
    return {"count": count, "chars": size, "kind": type(outputs).__name__,
            "child_maxrss_kb": resource.getrusage(resource.RUSAGE_SELF).ru_maxrss}


bench_map = cy.Workflow("bench_map")
_listed = bench_map.add(make_list)
_items = bench_map.map(item, over=_listed)
bench_map.add(join, after=[_items])
