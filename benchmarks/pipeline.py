"""Where a deep queue of no-op steps waits: the outcome writer's statements and the gaps
between them, and how often the held steps and the children's queues run dry.

    python benchmarks/pipeline.py [--steps 40000] [--prefetch 256] [--every 0.002]

The supervisor runs in this process (``Client.run``, 2 children) over ``--steps`` no-ops
enqueued before it starts. Two wrappers record, on the outcome writer's thread, each
``_write_batch`` (wall and thread CPU seconds, outcomes and claim) and each statement's
``execute``; a sampler thread reads process control's state every ``--every`` seconds
(held steps, idle children, statements not yet Written, outcomes gathered, steps queued
per child). The middle three fifths of the run are reported, so start-up and the tail do
not count. The sampler takes the GIL for a moment each time: read the shares, and take
the rate from B7 (``run.py --only B7``).
"""

from __future__ import annotations

import argparse
import statistics
import sys
import threading
import time
from typing import Any

import bench_steps
import psycopg
from common import Server, mux_of, no_op_parser

import cyclone_mp as cy
from cyclone_mp import control, outcomes


def main() -> None:
    parser = no_op_parser(__doc__)
    parser.add_argument("--every", type=float, default=0.002, help="seconds between samples of process control")
    args = parser.parse_args()
    server = Server(args.dsn)
    try:
        batches, statements, samples, seconds = record(server, args)
    finally:
        server.close()
    report(batches, statements, samples, args.steps / seconds)


def record(server: Server, args: argparse.Namespace) -> tuple[list[tuple], list[tuple], list[tuple], float]:
    """Run the steps under the wrappers and the sampler; returns (batches, statements,
    samples, seconds the steps took)."""
    batches: list[tuple] = []  # (start, end, thread CPU seconds, outcomes, claim)
    statements: list[tuple] = []  # (start, end)
    samples: list[tuple] = []  # (at, held, idle children, batches out, outcomes, queued per child)
    write_batch = outcomes.OutcomeWriter._write_batch
    execute = psycopg.Cursor.execute
    run = control.ProcessControl.run

    def timed_write_batch(self: outcomes.OutcomeWriter) -> None:
        size, claim = len(self.batch), self.claim
        start, cpu = time.perf_counter(), time.thread_time()
        try:
            write_batch(self)
        finally:
            batches.append((start, time.perf_counter(), time.thread_time() - cpu, size, claim))

    def timed_execute(self: psycopg.Cursor, *a: Any, **kw: Any) -> Any:
        if threading.current_thread().name != "cyclone-outcome-writer":
            return execute(self, *a, **kw)
        start = time.perf_counter()
        try:
            return execute(self, *a, **kw)
        finally:
            statements.append((start, time.perf_counter()))

    def sampled_run(self: control.ProcessControl, *a: Any, **kw: Any) -> Any:
        done = threading.Event()

        def sample() -> None:
            while not done.wait(args.every):
                try:
                    samples.append((time.perf_counter(), len(self.held), len(self.pool.idle()), self.batches_out,
                                    len(self.outcomes),
                                    tuple(len(c.queued) + (c.attempt is not None) for c in self.pool.children)))
                except (RuntimeError, AttributeError):  # changed while read: skip this sample
                    continue

        threading.Thread(target=sample, daemon=True).start()
        try:
            return run(self, *a, **kw)
        finally:
            done.set()

    with server.fresh() as dsn, cy.Client(dsn, mux_of(bench_steps.noop), workers=2, prefetch=args.prefetch) as client:
        client.enqueue_many(bench_steps.noop, [None] * args.steps)
        took = [0.0]

        def stop_when_done() -> None:
            with psycopg.connect(dsn, autocommit=True) as conn:
                while conn.execute("SELECT count(*) FROM cyclone_steps "
                                   "WHERE state IN ('available', 'running')").fetchone()[0]:
                    time.sleep(0.1)
                took[0] = conn.execute("SELECT extract(epoch FROM max(finished_at) - min(started_at))::float8 "
                                       "FROM cyclone_steps").fetchone()[0]
            while client.supervisor is None:
                time.sleep(0.01)
            client.supervisor.request_shutdown()

        outcomes.OutcomeWriter._write_batch = timed_write_batch  # type: ignore[method-assign]
        psycopg.Cursor.execute = timed_execute  # type: ignore[method-assign]
        control.ProcessControl.run = sampled_run  # type: ignore[method-assign]
        threading.Thread(target=stop_when_done, daemon=True).start()
        try:
            client.run()
        finally:
            outcomes.OutcomeWriter._write_batch = write_batch  # type: ignore[method-assign]
            psycopg.Cursor.execute = execute  # type: ignore[method-assign]
            control.ProcessControl.run = run  # type: ignore[method-assign]
    return batches, statements, samples, took[0]


def report(batches: list[tuple], statements: list[tuple], samples: list[tuple], rate: float) -> None:
    writes = [b for b in batches if b[3]]  # batches that settled outcomes
    if len(writes) < 10:
        sys.exit(f"only {len(writes)} statements settled outcomes: too few to report")
    first, last = writes[len(writes) // 5], writes[4 * len(writes) // 5]
    start, end = first[0], last[1]
    span = end - start
    writes = [b for b in writes if start <= b[0] and b[1] <= end]
    stmts = [s for s in statements if start <= s[0] and s[1] <= end]
    seen = [s for s in samples if start <= s[0] <= end]
    gaps = [b[0] - a[1] for a, b in zip(writes, writes[1:])]
    ms = 1000.0
    print(f"steps/s over the whole run: {rate:,.0f}")
    print(f"outcome writer, {len(writes)} statements over {span:.2f} s (the middle three fifths):")
    print(f"  in _write_batch {sum(b[1] - b[0] for b in writes) / span:.0%} of the time, "
          f"in execute {sum(s[1] - s[0] for s in stmts) / span:.0%}")
    print(f"  outcomes per statement: median {statistics.median(b[3] for b in writes):.0f}; "
          f"claim per statement: median {statistics.median(b[4] for b in writes):.0f}")
    print(f"  a statement's execute: median {statistics.median(s[1] - s[0] for s in stmts) * ms:.2f} ms; "
          f"_write_batch: median {statistics.median(b[1] - b[0] for b in writes) * ms:.2f} ms wall, "
          f"{statistics.median(b[2] for b in writes) * ms:.2f} ms thread CPU")
    print(f"  between two statements: median {statistics.median(gaps) * ms:.2f} ms, "
          f"mean {statistics.mean(gaps) * ms:.2f} ms")
    if seen:
        n = len(seen)
        print(f"process control, {n} samples:")
        print(f"  held steps: median {statistics.median(s[1] for s in seen):.0f}, "
              f"none held in {sum(not s[1] for s in seen) / n:.0%}")
        print(f"  an idle child in {sum(s[2] > 0 for s in seen) / n:.0%}; "
              f"a child with under 4 steps queued in {sum(min(s[5], default=0) < 4 for s in seen) / n:.0%}")
        print(f"  statements not yet Written: median {statistics.median(s[3] for s in seen):.0f}; "
              f"outcomes gathered: median {statistics.median(s[4] for s in seen):.0f}")


if __name__ == "__main__":
    main()
