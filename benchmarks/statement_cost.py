"""The hot statement alone: wall time of a claim, a settle of completions, and the two in
one statement (the outcome writer's usual tick), on one connection with nothing else
running, over a deep queue of no-op steps.

    python benchmarks/statement_cost.py [--batch 110] [--queue 60000] [--rounds 60]

Prints the median per statement and per step of each. It isolates the database's share
(and the store's Python around it) from the supervisor's threads and children, which B7
measures together.
"""

from __future__ import annotations

import argparse
import statistics
import time
from collections.abc import Callable
from typing import Any

import bench_steps
from common import Server, mux_of

import cyclone_mp as cy
from cyclone_mp.store import Store

OWNER = "statement-cost"


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--batch", type=int, default=110, help="steps per claim and per settle")
    parser.add_argument("--queue", type=int, default=60000, help="no-op steps enqueued first")
    parser.add_argument("--rounds", type=int, default=60, help="statements timed per kind (the first 10 not counted)")
    parser.add_argument("--dsn", default=None, help="a server to use (default: an embedded one in a temp dir)")
    args = parser.parse_args()
    server = Server(args.dsn)
    try:
        with server.fresh() as dsn:
            with cy.Client(dsn, mux_of(bench_steps.noop)) as client:
                client.enqueue_many(bench_steps.noop, [None] * args.queue)
            store = Store.open(dsn, generic_plans=True)
            try:
                measure(store, args)
            finally:
                store.close()
    finally:
        server.close()


def measure(store: Store, args: argparse.Namespace) -> None:
    """Time each kind of statement ``args.rounds`` times; what a timed statement needs
    (rows to settle) or leaves (rows claimed) is done around it, untimed."""
    where = {"owner": OWNER, "queues": ["default"], "names": [bench_steps.noop.name], "ttl": 30.0}
    held: list[dict[str, Any]] = []  # claimed and not settled yet

    def items() -> list[tuple[Any, ...]]:
        return [(r["id"], r["lease_generation"], None, None, 0.001) for r in held]

    def claimed_rows() -> None:  # untimed: rows to settle
        if not held:
            held.extend(store.claims.claim(limit=args.batch, **where).rows)

    def settled_rows() -> None:  # untimed: nothing left running
        if held:
            store.outcomes.settle(completions=items(), limit=0, **where)
            held.clear()

    def settle_and_claim() -> None:
        rows = store.outcomes.settle(completions=items(), limit=args.batch, **where).claimed
        held[:] = rows

    def claim_alone() -> None:
        held[:] = store.claims.claim(limit=args.batch, **where).rows

    def settle_alone() -> None:
        store.outcomes.settle(completions=items(), limit=0, **where)
        held.clear()

    kinds: list[tuple[str, Callable[[], None], Callable[[], None]]] = [
        ("claim and settle in one statement", claimed_rows, settle_and_claim),
        ("claim alone", settled_rows, claim_alone),
        ("settle alone (completions)", claimed_rows, settle_alone)]
    for label, prepare, run in kinds:
        times = []
        for _ in range(args.rounds):
            prepare()
            started = time.perf_counter()
            run()
            times.append(time.perf_counter() - started)
        median = statistics.median(times[10:])
        print(f"{label:36s} batch {args.batch}: {median * 1e3:6.2f} ms, {median * 1e6 / args.batch:6.1f} us per step")


if __name__ == "__main__":
    main()
