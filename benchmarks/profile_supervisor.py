"""Where a no-op step's supervisor CPU goes: process control's thread and the outcome
writer's, each under cProfile with a CPU-time clock (``time.thread_time``).

    python benchmarks/profile_supervisor.py [--steps 40000] [--prefetch 256] [--top 40]

The supervisor runs in this process (``Client.run``, 2 children) over ``--steps``
no-ops enqueued before it starts; process control is profiled on the main thread, the
writer inside each ``_write_batch``. A wall-clock sampler (py-spy's self time) bills the
time a thread waits for the GIL or in ``select`` to the line it waits on, which made
syscalls look like the cost; a CPU clock does not. cProfile's own overhead inflates
every Python call (about 4x here), so read the shares, not the seconds, and take the
per-step CPU from B7 (``run.py --only B7``).
"""

from __future__ import annotations

import argparse
import cProfile
import pstats
import sys
import threading
import time

import bench_steps
import psycopg
from common import Server, mux_of, no_op_parser

import cyclone_mp as cy
from cyclone_mp import outcomes


def main() -> None:
    parser = no_op_parser(__doc__)
    parser.add_argument("--top", type=int, default=40, help="functions listed per thread")
    args = parser.parse_args()
    server = Server(args.dsn)
    try:
        control_profile, writer_profile = profile(server, args)
    finally:
        server.close()
    for title, prof in (("process control (main thread)", control_profile), ("outcome writer", writer_profile)):
        print(f"==== {title}")
        pstats.Stats(prof).sort_stats("tottime").print_stats(args.top)
        pstats.Stats(prof).sort_stats("cumulative").print_stats(args.top)


def profile(server: Server, args: argparse.Namespace) -> tuple[cProfile.Profile, cProfile.Profile]:
    """Run the steps under the two profiles; returns (process control's, the writer's)."""
    with server.fresh() as dsn, cy.Client(dsn, mux_of(bench_steps.noop), workers=2, prefetch=args.prefetch) as client:
        client.enqueue_many(bench_steps.noop, [None] * args.steps)
        writer_profile = cProfile.Profile(time.thread_time)
        write_batch = outcomes.OutcomeWriter._write_batch

        def profiled_write_batch(self: outcomes.OutcomeWriter) -> None:
            writer_profile.enable()
            try:
                write_batch(self)
            finally:
                writer_profile.disable()

        outcomes.OutcomeWriter._write_batch = profiled_write_batch  # type: ignore[method-assign]

        def stop_when_done() -> None:
            with psycopg.connect(dsn, autocommit=True) as conn:
                while conn.execute("SELECT count(*) FROM cyclone_steps "
                                   "WHERE state IN ('available', 'running')").fetchone()[0]:
                    time.sleep(0.1)
            print(f"{args.steps} no-ops in {time.monotonic() - started:.2f} s (profiled)", file=sys.stderr)
            while client.supervisor is None:
                time.sleep(0.01)
            client.supervisor.request_shutdown()

        started = time.monotonic()
        threading.Thread(target=stop_when_done, daemon=True).start()
        control_profile = cProfile.Profile(time.thread_time)
        control_profile.enable()
        try:
            client.run()
        finally:
            control_profile.disable()
            outcomes.OutcomeWriter._write_batch = write_batch  # type: ignore[method-assign]
    return control_profile, writer_profile


if __name__ == "__main__":
    main()
