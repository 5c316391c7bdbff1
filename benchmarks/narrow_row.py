"""How low PostgreSQL's CPU per no-op step can go, and what each part of it costs. One
connection drains a deep queue of one-step runs, ``--batch`` steps a statement (the
completions of the last batch settled and the next batch claimed in one statement, as
the outcome writer's usual tick), four ways:

- ``engine``: the engine's own settle-and-claim statement over its own tables;
- ``tables``: a minimal statement (:data:`SIMPLE_TICK`: the CAS, the run ended, the
  claim) over the engine's own tables, so their width and indexes without the engine
  statement's other work (payloads, limits, workflow bookkeeping, run locks);
- ``narrow``: the same minimal statement over a narrow table holding only what a claim
  reads and a completion writes, with the same indexes on the same columns;
- ``lean``: ``narrow`` without the ``(run_id, node)`` and finished rows' indexes.

    python benchmarks/narrow_row.py [--steps 40000] [--batch 140] [--rounds 3]

No supervisor and no children. The CPU of the database's backends and autovacuum
workers (``CpuMeter``, as B7 counts it) is divided by the steps, and so is the backends'
alone (autovacuum's share moves a lot from one loop to the next). ``narrow`` and ``lean``
are floors, not engines; they say how low the statement can go on this machine beside
issue 36's target (40 us a step).
"""

from __future__ import annotations

import argparse
import statistics
import time
import uuid

import bench_steps
import psutil
import psycopg
from common import CpuMeter, Server, mux_of

import cyclone_mp as cy
from cyclone_mp.store import Store

OWNER = "narrow-row"


class BackendMeter(CpuMeter):
    """CPU seconds of one database's backends alone, without its autovacuum workers
    (whose share moves a lot from one loop to the next with when they happen to run)."""

    def _now(self) -> dict[int, float]:
        return {pid: cpu for pid, cpu in super()._now().items() if pid not in self.vacuums()}

    @staticmethod
    def vacuums() -> set[int]:
        found = set()
        for p in psutil.process_iter(["cmdline"]):
            if "autovacuum worker" in " ".join(p.info["cmdline"] or []):
                found.add(p.pid)
        return found

NARROW_SCHEMA = """
CREATE TABLE hot_runs (
    id          uuid PRIMARY KEY,
    state       text NOT NULL DEFAULT 'running',
    finished_at timestamptz
);
CREATE TABLE hot_steps (
    id               bigint GENERATED ALWAYS AS IDENTITY PRIMARY KEY,
    run_id           uuid NOT NULL REFERENCES hot_runs (id),
    node             text NOT NULL,
    queue            text NOT NULL DEFAULT 'default',
    priority         integer NOT NULL DEFAULT 0,
    scheduled_at     timestamptz NOT NULL DEFAULT now(),
    state            text NOT NULL DEFAULT 'available',
    lease_owner      text,
    lease_expiry     timestamptz,
    lease_generation bigint NOT NULL DEFAULT 0,
    started_at       timestamptz,
    heartbeat_at     timestamptz,
    finished_at      timestamptz,
    UNIQUE (run_id, node)
);
CREATE INDEX ON hot_steps (queue, priority, scheduled_at, id) WHERE state = 'available';
CREATE INDEX ON hot_steps (lease_expiry) WHERE state = 'running';
CREATE INDEX ON hot_steps (finished_at) WHERE finished_at IS NOT NULL;
"""

SIMPLE_TICK = """
WITH done AS (
    UPDATE {steps} s
       SET state = 'completed', finished_at = now(), lease_expiry = NULL
      FROM unnest(%(ids)s::bigint[], %(generations)s::bigint[]) AS d (id, generation)
     WHERE s.id = d.id AND s.lease_generation = d.generation AND s.state = 'running'
       AND s.lease_owner = %(owner)s
    RETURNING s.run_id
), runs_done AS (
    UPDATE {runs} r SET state = 'completed', finished_at = now()
      FROM done WHERE r.id = done.run_id
    RETURNING r.id
), picked AS (
    SELECT id FROM {steps}
     WHERE state = 'available' AND queue = 'default' AND scheduled_at <= now(){claimable}
     ORDER BY priority, scheduled_at, id
     LIMIT %(limit)s
       FOR UPDATE SKIP LOCKED
), claimed AS (
    UPDATE {steps} s
       SET state = 'running', lease_owner = %(owner)s, lease_expiry = now() + interval '30 seconds',
           lease_generation = s.lease_generation + 1, started_at = now(), heartbeat_at = now()
      FROM picked WHERE s.id = picked.id
    RETURNING s.id, s.lease_generation
)
SELECT id, lease_generation, (SELECT count(*) FROM runs_done) AS runs_done FROM claimed
"""
NARROW_TICK = SIMPLE_TICK.format(steps="hot_steps", runs="hot_runs", claimable="")
#: The same statement over the engine's own tables: their width and indexes, none of the
#: engine statement's other work (its claim index leads with the concurrency key).
ENGINE_TABLES_TICK = SIMPLE_TICK.format(steps="cyclone_steps", runs="cyclone_runs",
                                        claimable=" AND concurrency_key = ''")


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--steps", type=int, default=40000, help="one-step runs drained by each loop")
    parser.add_argument("--batch", type=int, default=140, help="steps claimed (and settled) per statement")
    parser.add_argument("--rounds", type=int, default=2, help="alternating rounds of the two loops")
    parser.add_argument("--dsn", default=None, help="a server to use (default: an embedded one in a temp dir)")
    args = parser.parse_args()
    server = Server(args.dsn)
    print(f"PostgreSQL {server.version} ({server.source}); {args.steps} steps a loop, {args.batch} a statement")
    loops = {"engine": engine_loop, "tables": tables_loop, "narrow": narrow_loop,
             "lean": lambda dsn, args: narrow_loop(dsn, args, lean=True)}
    results: dict[str, list[tuple[float, float, float]]] = {label: [] for label in loops}
    try:
        for _ in range(args.rounds):
            for label, loop in loops.items():
                with server.fresh() as dsn:
                    cpu_us, backend_us, rate = loop(dsn, args)
                results[label].append((cpu_us, backend_us, rate))
                print(f"  {label:6s}: {cpu_us:6.1f} us of PostgreSQL CPU a step ({backend_us:6.1f} without "
                      f"autovacuum), {rate:8.0f} steps/s (one connection)")
    finally:
        server.close()
    for label, rows in results.items():
        print(f"{label:6s} median: {statistics.median(r[0] for r in rows):6.1f} us a step "
              f"({statistics.median(r[1] for r in rows):6.1f} without autovacuum), "
              f"{statistics.median(r[2] for r in rows):8.0f} steps/s")


def database_of(dsn: str) -> str:
    return psycopg.conninfo.conninfo_to_dict(dsn)["dbname"]


def engine_loop(dsn: str, args: argparse.Namespace) -> tuple[float, float, float]:
    """Drain ``args.steps`` no-op runs with the engine's own settle-and-claim statement."""
    with cy.Client(dsn, mux_of(bench_steps.noop)) as client:
        client.enqueue_many(bench_steps.noop, [None] * args.steps)
    where = {"owner": OWNER, "queues": ["default"], "names": [bench_steps.noop.name], "ttl": 30.0}
    with psycopg.connect(dsn, autocommit=True) as conn:
        conn.execute("VACUUM ANALYZE cyclone_steps")
        conn.execute("VACUUM ANALYZE cyclone_runs")
    store = Store.open(dsn, generic_plans=True)
    try:
        held: list = []
        meter, backends = CpuMeter(database_of(dsn)), BackendMeter(database_of(dsn))
        started, done = time.perf_counter(), 0
        while True:
            items = [(r["id"], r["lease_generation"], None, None, 0.001) for r in held]
            done += len(items)
            held = store.outcomes.settle(completions=items, limit=args.batch, **where).claimed
            if not held:
                break
        elapsed, cpu, backend = time.perf_counter() - started, meter.take(), backends.take()
    finally:
        store.close()
    assert done == args.steps, (done, args.steps)
    return cpu * 1e6 / done, backend * 1e6 / done, done / elapsed


def narrow_loop(dsn: str, args: argparse.Namespace, lean: bool = False) -> tuple[float, float, float]:
    """Drain ``args.steps`` one-step runs of the narrow tables with :data:`NARROW_TICK`;
    ``lean``: without the ``(run_id, node)`` and finished rows' indexes (two index
    entries a step fewer)."""
    with psycopg.connect(dsn, autocommit=True) as conn:
        conn.execute(NARROW_SCHEMA)
        if lean:
            conn.execute("ALTER TABLE hot_steps DROP CONSTRAINT hot_steps_run_id_node_key")
            conn.execute("DROP INDEX hot_steps_finished_at_idx")
        runs = [uuid.uuid4() for _ in range(args.steps)]
        with conn.cursor() as cur:
            with cur.copy("COPY hot_runs (id) FROM STDIN") as copy:
                for run_id in runs:
                    copy.write_row((run_id,))
            with cur.copy("COPY hot_steps (run_id, node) FROM STDIN") as copy:
                for run_id in runs:
                    copy.write_row((run_id, "noop"))
        return drain(conn, dsn, NARROW_TICK, ("hot_steps", "hot_runs"), args)


def tables_loop(dsn: str, args: argparse.Namespace) -> tuple[float, float, float]:
    """Drain ``args.steps`` no-op runs of the engine's tables with :data:`ENGINE_TABLES_TICK`."""
    with cy.Client(dsn, mux_of(bench_steps.noop)) as client:
        client.enqueue_many(bench_steps.noop, [None] * args.steps)
    with psycopg.connect(dsn, autocommit=True) as conn:
        return drain(conn, dsn, ENGINE_TABLES_TICK, ("cyclone_steps", "cyclone_runs"), args)


def drain(conn: psycopg.Connection, dsn: str, tick: str, tables: tuple[str, str],
          args: argparse.Namespace) -> tuple[float, float, float]:
    """Run ``tick`` until nothing is left to claim; returns PostgreSQL's CPU a step (us:
    backends and autovacuum, backends alone) and steps/s, and checks that every step and
    run completed once."""
    steps, runs = tables
    conn.execute(f"VACUUM ANALYZE {runs}")
    conn.execute(f"VACUUM ANALYZE {steps}")
    held: list[tuple[int, int]] = []
    meter, backends = CpuMeter(database_of(dsn)), BackendMeter(database_of(dsn))
    started, done = time.perf_counter(), 0
    while True:
        done += len(held)
        rows = conn.execute(tick, {"ids": [h[0] for h in held], "generations": [h[1] for h in held],
                                   "owner": OWNER, "limit": args.batch}, prepare=True).fetchall()
        held = [(row[0], row[1]) for row in rows]
        if not held:
            break
    elapsed, cpu, backend = time.perf_counter() - started, meter.take(), backends.take()
    ended = conn.execute(f"SELECT (SELECT count(*) FROM {steps} WHERE state = 'completed' AND lease_generation = 1), "
                         f"(SELECT count(*) FROM {runs} WHERE state = 'completed')").fetchone()
    assert done == args.steps and ended == (args.steps, args.steps), (done, ended, args.steps)
    return cpu * 1e6 / done, backend * 1e6 / done, done / elapsed


if __name__ == "__main__":
    main()
