#!/usr/bin/env python3
"""Issue 24's measurements: waiting for 1,000 runs, and B1 with metrics on and off.

    python benchmarks/wait.py                     # W1, W1p, W2, W3, 3 repetitions each (~3 min)
    python benchmarks/wait.py --only W1 --repeat 5
    python benchmarks/wait.py --dsn postgresql://...

* **W1, 1,000 waits, one process** (acceptance 3): 1,000 single-step no-op runs are
  enqueued with a 2 s delay; one ``cy.AsyncClient`` starts ``await client.wait(run_id)``
  for each, all at once (1,000 tasks); a supervisor with the default settings
  (``workers=2``, ``prefetch=0``: SPEC 4's claim, in this process's thread) runs them.
  **Wake-up = the moment ``wait`` returned
  (``time.time()``) - the run's ``finished_at``** (DB clock; the database is on this
  host). Reported: p50, p99, max; the listening connections seen
  (``application_name = 'cyclone_mp waiting'``) while the waits are pending. Target:
  p99 <= 50 ms.
* **W1p**: W1 with ``prefetch=64``: the supervisor writes up to 64 outcomes and claims
  64 steps in one statement, whose ``now()`` is every row's ``finished_at``; the
  notification leaves at its commit, so the wake-up includes that statement's time
  (about 20 ms here, measured by a bare LISTEN connection; 2.5 ms with ``prefetch=0``).
* **W3**: W1 with a sync ``cy.Client`` and 1,000 threads calling ``client.wait``.
* **W2, B1 with metrics**: B1's throughput (2,000 no-ops, ``enqueue_many``, then
  ``workers=2``, ``prefetch=64``; steps/s = 2,000 / (last ``finished_at`` - start)) with
  ``metrics_port`` unset and set, in alternating order (off-on, on-off, ...: on this VM
  the second run of a pair was faster whatever it ran), each in a fresh database. With metrics on,
  ``/metrics`` is scraped every 50 ms during the run; at the end the counters are
  compared with the database (completions and claims by step, failures) and the scrape
  time is reported (p50, p99).

Every measurement runs in a fresh database (a clone of a migrated template), as
``benchmarks/run.py`` does; this script reuses its server handling. Timed targets are
checked here, never in a test.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import statistics
import sys
import threading
import time
import urllib.request
from typing import Any

HERE = os.path.dirname(os.path.abspath(__file__))
if HERE not in sys.path:
    sys.path.insert(0, HERE)

import psycopg  # noqa: E402

import bench_steps  # noqa: E402
import cyclone_mp as cy  # noqa: E402
from common import Server, loadavg, mux_of, percentile, wait_until  # noqa: E402
from common import ensure_bytecode  # noqa: E402

RUNS = 1000
B1_STEPS = 2000


def listening(dsn: str) -> int:
    with psycopg.connect(dsn, autocommit=True) as conn:
        return conn.execute("SELECT count(*) FROM pg_stat_activity WHERE datname = current_database() "
                            "AND application_name = 'cyclone_mp waiting'").fetchone()[0]


def finished_at(dsn: str, ids: list[str]) -> dict[str, float]:
    with psycopg.connect(dsn, autocommit=True) as conn:
        rows = conn.execute("SELECT id::text, extract(epoch FROM finished_at)::float8 FROM cyclone_runs "
                            "WHERE id = ANY(%s::uuid[])", (ids,)).fetchall()
    return dict(rows)


def latencies(dsn: str, woke: dict[str, float]) -> dict[str, Any]:
    done = finished_at(dsn, list(woke))
    ms = [(woke[i] - done[i]) * 1000 for i in woke]
    return {"waits": len(ms), "wake_p50_ms": round(percentile(ms, 50), 2), "wake_p99_ms": round(percentile(ms, 99), 2),
            "wake_max_ms": round(max(ms), 2), "wake_min_ms": round(min(ms), 2)}


def supervisor(dsn: str, prefetch: int = 0) -> cy.Client:
    client = cy.Client(dsn, mux_of(bench_steps.noop), workers=2, prefetch=prefetch)
    client.start()
    return client


def w1(dsn: str, prefetch: int = 0) -> dict[str, Any]:
    """1,000 concurrent ``await client.wait`` from one AsyncClient."""
    ids = cy.Client(dsn, mux_of(bench_steps.noop)).enqueue_many(bench_steps.noop, [None] * RUNS, delay=2.0)
    woke: dict[str, float] = {}
    seen: list[int] = []

    async def wait_one(client: cy.AsyncClient, run_id: str) -> None:
        await client.wait(run_id, timeout=120)
        woke[run_id] = time.time()

    async def main() -> None:
        async with cy.AsyncClient(dsn, mux_of(bench_steps.noop)) as client:
            tasks = [asyncio.ensure_future(wait_one(client, run_id)) for run_id in ids]
            await asyncio.sleep(0.5)
            seen.append(await asyncio.to_thread(listening, dsn))
            await asyncio.gather(*tasks)

    worker = supervisor(dsn, prefetch)
    try:
        asyncio.run(main())
    finally:
        worker.stop()
        worker.close()
    return {**latencies(dsn, woke), "listening_connections": max(seen)}


def w3(dsn: str) -> dict[str, Any]:
    """1,000 threads, each ``client.wait`` on a sync Client."""
    client = cy.Client(dsn, mux_of(bench_steps.noop))
    ids = client.enqueue_many(bench_steps.noop, [None] * RUNS, delay=3.0)
    woke: dict[str, float] = {}

    def wait_one(run_id: str) -> None:
        client.wait(run_id, timeout=120)
        woke[run_id] = time.time()

    threads = [threading.Thread(target=wait_one, args=(run_id,), daemon=True) for run_id in ids]
    for thread in threads:
        thread.start()
    wait_until(lambda: len(client._waiter().book.slots) == RUNS, 60, 0.05, "every thread to wait")
    seen = listening(dsn)
    worker = supervisor(dsn)
    try:
        for thread in threads:
            thread.join(120)
    finally:
        worker.stop()
        worker.close()
        client.close()
    return {**latencies(dsn, woke), "listening_connections": seen}


def scrape(port: int) -> tuple[float, str]:
    t = time.perf_counter()
    with urllib.request.urlopen(f"http://127.0.0.1:{port}/metrics", timeout=5) as response:
        text = response.read().decode()
    return time.perf_counter() - t, text


def sample(text: str, name: str) -> float:
    from prometheus_client.parser import text_string_to_metric_families

    return sum(s.value for f in text_string_to_metric_families(text) for s in f.samples if s.name == name)


def w2(dsn: str, metrics: bool) -> dict[str, Any]:
    """B1's throughput (prefetch=64) with metrics off or on (scraped every 50 ms)."""
    client = cy.Client(dsn, mux_of(bench_steps.noop), workers=2, prefetch=64,
                       metrics_port=0 if metrics else None)
    client.enqueue_many(bench_steps.noop, [None] * B1_STEPS)
    scrapes: list[float] = []
    t0 = time.time()
    client.start()
    sup = client.supervisor
    try:
        while sup.stats["completed"] < B1_STEPS:
            if metrics:
                scrapes.append(scrape(sup.metrics.port)[0])
            time.sleep(0.05)
        row: dict[str, Any] = {}
        if metrics:
            _, text = scrape(sup.metrics.port)
            with psycopg.connect(dsn, autocommit=True) as conn:
                done, claims, failed = conn.execute(
                    "SELECT count(*) FILTER (WHERE state = 'completed'), sum(lease_generation), "
                    "coalesce(sum(jsonb_array_length(errors)), 0) FROM cyclone_steps").fetchone()
            row.update({
                "scrapes": len(scrapes), "scrape_p50_ms": round(percentile(scrapes, 50) * 1000, 2),
                "scrape_p99_ms": round(percentile(scrapes, 99) * 1000, 2),
                "completions_metric": sample(text, "cyclone_completions_total"), "completions_db": done,
                "claims_metric": sample(text, "cyclone_claims_total"), "claims_db": int(claims),
                "failures_metric": sample(text, "cyclone_failures_total"), "failures_db": int(failed),
                "queue_depth_reads": sup.stats["queue_depth_reads"],
            })
            row["metrics_match_db"] = (row["completions_metric"] == done and row["claims_metric"] == claims
                                       and row["failures_metric"] == failed)
    finally:
        client.shutdown()
        client.close()
    with psycopg.connect(dsn, autocommit=True) as conn:
        last = conn.execute("SELECT extract(epoch FROM max(finished_at))::float8 FROM cyclone_steps").fetchone()[0]
    return {"steps_per_s": round(B1_STEPS / (last - t0), 1), **row}


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--repeat", type=int, default=3)
    ap.add_argument("--only", default="W1,W1p,W2,W3")
    ap.add_argument("--dsn", default=None)
    ap.add_argument("--out", default=None, help="results JSON (default: print only)")
    args = ap.parse_args(argv)
    only = set(args.only.split(","))
    meta = {"bytecode": ensure_bytecode(), "loadavg_start": loadavg()}
    server = Server(args.dsn)
    results: dict[str, list[dict[str, Any]]] = {}
    try:
        for i in range(args.repeat):
            if "W1" in only:
                with server.fresh() as dsn:
                    row = {"loadavg": loadavg(), **w1(dsn)}
                results.setdefault("W1", []).append(row)
                print("W1", i, json.dumps(row), flush=True)
            if "W1p" in only:
                with server.fresh() as dsn:
                    row = {"loadavg": loadavg(), **w1(dsn, prefetch=64)}
                results.setdefault("W1p", []).append(row)
                print("W1p", i, json.dumps(row), flush=True)
            if "W3" in only:
                with server.fresh() as dsn:
                    row = {"loadavg": loadavg(), **w3(dsn)}
                results.setdefault("W3", []).append(row)
                print("W3", i, json.dumps(row), flush=True)
            if "W2" in only:
                # ABBA: the second run of a pair tends to be faster whatever it runs
                for metrics in ((False, True) if i % 2 == 0 else (True, False)):
                    with server.fresh() as dsn:
                        row = {"loadavg": loadavg(), "metrics": metrics, **w2(dsn, metrics)}
                    results.setdefault("W2_on" if metrics else "W2_off", []).append(row)
                    print("W2", i, json.dumps(row), flush=True)
    finally:
        server.close()
    meta["loadavg_end"] = loadavg()
    print("\nmedians:")
    for name, rows in results.items():
        keys = [k for k, v in rows[0].items() if isinstance(v, (int, float)) and not isinstance(v, bool)]
        print(f"  {name}: " + ", ".join(f"{k}={statistics.median(r[k] for r in rows)}" for k in keys if k != "loadavg"))
    if "W1" in results:
        p99 = statistics.median(r["wake_p99_ms"] for r in results["W1"])
        print(f"  W1 target: p99 wake-up <= 50 ms: {'met' if p99 <= 50 else 'missed'} ({p99} ms)")
    if args.out:
        with open(args.out, "w") as fh:
            json.dump({"meta": meta, "results": results}, fh, indent=2, default=str)
    return 0


if __name__ == "__main__":
    sys.exit(main())
