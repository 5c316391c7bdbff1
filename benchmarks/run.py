#!/usr/bin/env python3
"""cyclone_mp benchmarks B1-B10, and B11 and B12 on request (issues 8, 22, 23). See benchmarks/README.md.

    python benchmarks/run.py                      # B1-B10, 3 repetitions, own embedded server
    python benchmarks/run.py --quick --repeat 1   # smoke run (small counts)
    python benchmarks/run.py --only B1,B3 --dsn postgresql://...
    python benchmarks/run.py --only B1 --pgbouncer  # B1 direct beside B1 through PgBouncer
    python benchmarks/run.py --only B10 --archived 1000000  # B1 beside B1 with 1,000,000 archived runs
    python benchmarks/run.py --only B11 --repeat 1  # B1 through a 60 s idle-in-transaction holder

Every measurement runs against a fresh database (created on the server, migrated,
dropped afterwards). The table shows the median of the repetitions beside issue 8's
target; the JSON in ``benchmarks/results/<timestamp>.json`` has every sample.
"""

from __future__ import annotations

import argparse
import contextlib
import datetime as dt
import json
import logging
import multiprocessing
import os
import platform
import shutil
import signal
import statistics
import sys
import tempfile
import time
import traceback
from typing import Any, Callable

HERE = os.path.dirname(os.path.abspath(__file__))
if HERE not in sys.path:
    sys.path.insert(0, HERE)  # children inherit sys.path: they import bench_steps by name

import psycopg

import bench_steps
import cyclone_mp as cy
from cyclone_mp.config import PREFETCH_DEFAULT
from cyclone_mp.store import Store

from children_bench import ChildBenches
from common import (
    PREFETCH, PREFETCH_KEYS, Server, SupervisorProcess, all_ready, console, dead_or_zombie, ensure_bytecode, epoch,
    git_state, loadavg, mux_of, percentile, run_until_completed, step_times, suffixed, wait_until, wal_lsn,
)
from history_bench import HistoryBenches
from report import print_table, summarize
from scale import ScaleBenches

ALL = ("B1", "B2", "B3", "B4", "B5", "B6", "B7", "B8", "B9", "B10", "B11", "B12")
ON_REQUEST = ("B11", "B12")  # minutes long: run with --only
# --limits (issue 20): B1 and B2 also run with every resource limit set on their steps,
# each run beside the same run without, so the cost of enforcing them is measured.
LIMITS = {"memory_limit": "1GiB", "cpu_limit": 60, "max_processes": 64, "max_open_files": 1024}

# Peer numbers from ../shared/peer-bench/results-2026-11-30.md (medians), used for the
# targets unless --peer-results points at a JSON written by the peer harness.
PEER_REF = {"pgqueuer_s1": 7013.0, "pgqueuer_s1_n20000": 5874.0, "celery_s1": 1186.0,
            "pgqueuer_s1_incl_startup": 3467.0, "celery_s1_incl_startup": 946.0}

FULL = {
    "b1_steps": 2000, "b1_single": 1000, "b1_bulk": 20000, "b1_batch": 1000,
    "b2_steps": 200, "b5_samples": 50, "b6_queued": 100_000, "b6_finished": 1_000_000,
    "b7_steps": 20000, "b7_child_starts": 10, "b8_pairs": 3, "b8_keys": 100, "b8_claims": 200,
    "b8_queued": 100_000, "b8_claim_keys": 1000, "b9_kills": 10,
    "b10_archived": 1_000_000, "b10_days": 10,
    "b11_warmup_s": 40, "b11_base_s": 30, "b11_hold_s": 60, "b11_after_s": 60,
    "b12_sizes": (1, 2, 4, 8, 16), "b12_steps": 20000, "b12_idle_s": 5.0, "b12_prefetch": PREFETCH_DEFAULT,
}
QUICK = {
    "b1_steps": 300, "b1_single": 100, "b1_bulk": 2000, "b1_batch": 200,
    "b2_steps": 40, "b5_samples": 10, "b6_queued": 10_000, "b6_finished": 100_000,
    "b7_steps": 2000, "b7_child_starts": 3, "b8_pairs": 1, "b8_keys": 20, "b8_claims": 50,
    "b8_queued": 10_000, "b8_claim_keys": 100, "b9_kills": 3,
    "b10_archived": 100_000, "b10_days": 10,
    "b11_warmup_s": 20, "b11_base_s": 10, "b11_hold_s": 20, "b11_after_s": 20,
    "b12_sizes": (1, 2, 4), "b12_steps": 2000, "b12_idle_s": 2.0, "b12_prefetch": PREFETCH_DEFAULT,
}
#: B11's window (seconds): throughput is sampled once per window.
B11_WINDOW = 10
#: B11: the supervisor archives finished runs after this many seconds (the hot tables then
#: hold the live backlog and a short tail, as in production; the default is 600 s).
B11_ARCHIVE_AFTER = 10


# -- the benchmarks ----------------------------------------------------------------------------


class Bench(HistoryBenches, ChildBenches, ScaleBenches):
    def __init__(self, server: Server, counts: dict[str, int], tmp: str, limits: bool = False,
                 bouncers: dict[str, Any] | None = None) -> None:
        self.server = server
        self.n = counts
        self.tmp = tmp
        self.limits = limits  # also measure B1 and B2 with LIMITS set (issue 20)
        #: --pgbouncer (issue 22): B1 also through these PgBouncers in transaction mode, by
        #: suffix: "_pgbouncer" (max_prepared_statements off) and "_pgbouncer_prepared" (on)
        self.bouncers = bouncers or {}

    # B1 -----------------------------------------------------------------------------------

    def throughput(self, dsn: str, n: int, workers: int = 2, prefetch: int = 0, step: cy.Step | None = None,
                   keys: int = 0, limits: dict[str, Any] | None = None, via: Any = None) -> dict[str, Any]:
        """Enqueue ``n`` no-ops with enqueue_many (with ``limits``, if given), then start a
        supervisor and time it. ``step``/``keys`` (B8): another no-op step, its inputs spread
        over ``keys`` keys. ``via``: a PgBouncer the client and supervisor go through
        (``pgbouncer=True``; prepared statements when it has ``max_prepared_statements``)."""
        step = step or bench_steps.noop
        if via is None:
            client = cy.Client(dsn, mux_of(step), workers=workers, prefetch=prefetch)
        else:
            client = cy.Client(via.dsn(dsn), mux_of(step), workers=workers, prefetch=prefetch, pgbouncer=True,
                               prepared_statements=via.max_prepared_statements > 0)
        client.enqueue_many(step, [{"k": f"key-{i % keys}"} for i in range(n)] if keys else [None] * n,
                            **(limits or {}))
        wal0 = wal_lsn(dsn)
        sup, children, t0 = run_until_completed(client, n)
        wal = wal_lsn(dsn) - wal0  # the whole server's WAL; nothing else writes to it meanwhile
        stats = sup.stats
        ready_after = [c.ready_after for c in children if c.ready_after is not None]
        t = step_times(dsn, step.name, sup.id)
        if t["completed"] != n:
            raise AssertionError(f"{t['completed']} of {n} steps completed")
        return {
            "steps": n, "workers": workers,
            "steps_per_s": round(n / (t["last_finish"] - t0), 1),
            "steps_per_s_from_first_start": round(n / (t["last_finish"] - t["first_start"]), 1),
            "startup_s": round(t["first_start"] - t0, 3),
            "process_s": round(t["last_finish"] - t["first_start"], 3),
            "wal_kb_per_step": round(wal / n / 1024, 2), "statements": stats["batches"],
            "max_lease_generation": t["max_generation"], "reclaims": t["reclaims"],
            "children_spawned": stats["children_spawned"], "child_ready_after_s": ready_after,
            "child_ready_ms": round(statistics.median(ready_after) * 1000, 1) if ready_after else None,
        }

    def enqueue_rates(self) -> dict[str, Any]:
        out: dict[str, Any] = {}
        mux = mux_of(bench_steps.noop)
        with self.server.fresh() as dsn, cy.Client(dsn, mux) as client:
            client.migrate()  # opens the pool
            n = self.n["b1_single"]
            t = time.perf_counter()
            for _ in range(n):
                client.enqueue(bench_steps.noop, None)
            out["enqueue_single_per_s"] = round(n / (time.perf_counter() - t), 1)
        with self.server.fresh() as dsn, cy.Client(dsn, mux) as client:
            client.migrate()
            n = self.n["b1_bulk"]
            items = [None] * n
            t = time.perf_counter()
            client.enqueue_many(bench_steps.noop, items)
            out["enqueue_many_one_call_per_s"] = round(n / (time.perf_counter() - t), 1)
        with self.server.fresh() as dsn, cy.Client(dsn, mux) as client:
            client.migrate()
            n, b = self.n["b1_bulk"], self.n["b1_batch"]
            batch = [None] * b
            t = time.perf_counter()
            for _ in range(n // b):
                client.enqueue_many(bench_steps.noop, batch)
            out["enqueue_many_batches_per_s"] = round((n // b) * b / (time.perf_counter() - t), 1)
            out["batch_size"] = b
        return out

    def paired(self, run: Callable[[dict[str, Any] | None], dict[str, Any]]) -> tuple[dict[str, Any], dict[str, Any]]:
        """``run(None)`` and ``run(LIMITS)`` one right after the other (--limits), the
        first one alternating between repetitions so neither side always goes first."""
        self._limits_first = not getattr(self, "_limits_first", True)
        if self._limits_first:
            with_limits = run(LIMITS)
            return run(None), with_limits
        without = run(None)
        return without, run(LIMITS)

    def b1(self) -> dict[str, Any]:
        def plain(limits: dict[str, Any] | None, prefetch: int = 0) -> dict[str, Any]:
            with self.server.fresh() as dsn:
                return self.throughput(dsn, self.n["b1_steps"], prefetch=prefetch, limits=limits)

        if not self.limits:
            row, fast = plain(None), plain(None, PREFETCH)
        else:  # each run right beside the same run with every resource limit set
            row, lim = self.paired(plain)
            row.update(suffixed(lim, PREFETCH_KEYS, "_limits"))
            fast, lim = self.paired(lambda limits: plain(limits, PREFETCH))
            row.update(suffixed(lim, PREFETCH_KEYS, "_prefetch_limits"))
        row.update(suffixed(fast, PREFETCH_KEYS, "_prefetch"))
        if self.limits:
            row["limits_ratio"] = round(row["steps_per_s_limits"] / row["steps_per_s"], 3)
            row["limits_ratio_prefetch"] = round(row["steps_per_s_prefetch_limits"] / row["steps_per_s_prefetch"], 3)
        for suffix, pgb in self.bouncers.items():  # right after the direct runs of this repetition
            for prefetch, tail in ((0, ""), (PREFETCH, "_prefetch")):
                with self.server.fresh() as dsn:
                    via = self.throughput(dsn, self.n["b1_steps"], prefetch=prefetch, via=pgb)
                row[f"steps_per_s{tail}{suffix}"] = via["steps_per_s"]
                row[f"ratio{tail}{suffix}"] = round(via["steps_per_s"] / row[f"steps_per_s{tail}"], 3)
        row.update(self.enqueue_rates())
        return row

    # B2 -----------------------------------------------------------------------------------

    @staticmethod
    def job_ms(iters: int, calls: int = 25) -> float:
        """One ``cpu_work(iters)`` call in this process, in ms (median of ``calls``)."""
        samples = []
        for _ in range(calls):
            t = time.perf_counter()
            bench_steps.cpu_work(iters)
            samples.append(time.perf_counter() - t)
        return statistics.median(samples) * 1000

    def calibrate(self) -> int:
        """``cpu_work`` iterations for a 20 ms call in this process now (the peer harness's
        method, with medians: this VM's speed drifts, a loop once took 12.6 ms where it
        had been calibrated to 20 minutes before)."""
        bench_steps.cpu_work(300_000)
        iters = int(20 / self.job_ms(100_000, 7) * 100_000)
        return int(iters * 20 / self.job_ms(iters, 9))

    def pool2_s(self, iters: int) -> float:
        """Wall seconds of multiprocessing.Pool(2) for the B2 calls (the 2-core ceiling)."""
        with multiprocessing.get_context("fork").Pool(2) as pool:
            pool.map(bench_steps.cpu_work, [iters] * 4)
            t = time.perf_counter()
            pool.map(bench_steps.cpu_work, [iters] * self.n["b2_steps"], chunksize=1)
            return time.perf_counter() - t

    def b2(self) -> dict[str, Any]:
        keys = ("efficiency", "steps_per_s", "cores_busy", "efficiency_vs_pool2", "cpu_job_ms", "pool2_efficiency")
        if not self.limits:
            row, fast = self.cpu_bound(prefetch=0), self.cpu_bound(prefetch=PREFETCH)
        else:  # each run right beside the same run with every resource limit set
            row, lim = self.paired(lambda limits: self.cpu_bound(prefetch=0, limits=limits))
            row.update(suffixed(lim, keys, "_limits"))
            fast, lim = self.paired(lambda limits: self.cpu_bound(prefetch=PREFETCH, limits=limits))
            row.update(suffixed(lim, keys, "_prefetch_limits"))
        row.update(suffixed(fast, keys, "_prefetch"))
        if self.limits:
            for suffix in ("", "_prefetch"):  # against the calibration-free measure and the Pool(2) one
                row[f"limits_ratio_cores_busy{suffix}"] = round(
                    row[f"cores_busy{suffix}_limits"] / row[f"cores_busy{suffix}"], 3)
                row[f"limits_ratio_vs_pool2{suffix}"] = round(
                    row[f"efficiency_vs_pool2{suffix}_limits"] / row[f"efficiency_vs_pool2{suffix}"], 3)
        return row

    def cpu_bound(self, prefetch: int, limits: dict[str, Any] | None = None) -> dict[str, Any]:
        """B2 once. The calls are calibrated to 20 ms right before the run; the ideal is
        taken from the call's time right before and right after it; then Pool(2) runs the
        same calls (this VM's CPU speed drifts within minutes)."""
        n = self.n["b2_steps"]
        iters = self.calibrate()
        before = self.job_ms(iters)
        with self.server.fresh() as dsn:
            client = cy.Client(dsn, mux_of(bench_steps.cpu), workers=2, prefetch=prefetch)
            client.enqueue_many(bench_steps.cpu, [{"n": iters}] * n, **(limits or {}))
            sup, children, t0 = run_until_completed(client, n)
            # as of each child's last result, without what it took to start (imports)
            child_cpu = sum(c.cpu_total - c.cpu_at_ready for c in children)
            t = step_times(dsn, bench_steps.cpu.name, sup.id)
        cpu_ms = (before + self.job_ms(iters)) / 2
        pool_s = self.pool2_s(iters)
        ideal = n * cpu_ms / 1000 / 2
        wall = t["last_finish"] - t["first_start"]
        return {
            "steps": n, "cpu_iters": iters, "cpu_job_ms": round(cpu_ms, 3), "ideal_s": round(ideal, 3),
            "wall_s": round(wall, 3), "efficiency": round(ideal / wall, 3),
            "efficiency_incl_startup": round(ideal / (t["last_finish"] - t0), 3),
            "efficiency_vs_pool2": round(pool_s / wall, 3),
            # the same calls in multiprocessing.Pool(2), no database: what this VM's two busy
            # cores gave right then (below 1 when a core slows while both work)
            "pool2_s": round(pool_s, 3), "pool2_efficiency": round(ideal / pool_s, 3),
            # CPU seconds the children's steps used over 2 cores x wall:
            # independent of how fast the VM's CPU happened to be during calibration.
            "cores_busy": round(child_cpu / (2 * wall), 3),
            "steps_per_s": round(n / wall, 1), "step_ms_p50_db": round(t["step_s_p50"] * 1000, 2),
        }

    # B3 -----------------------------------------------------------------------------------

    def b3(self) -> dict[str, Any]:
        timeout, grace = 1.0, 0.5
        with self.server.fresh() as dsn:
            client = cy.Client(dsn, mux_of(bench_steps.wedge, bench_steps.noop), workers=1, kill_grace=grace)
            try:
                client.start()
                wait_until(lambda: all_ready(client.supervisor, 1), 30, 0.005, "child ready")
                wedge_id = client.enqueue(bench_steps.wedge, None, timeout=timeout, max_attempts=1)
                wait_until(lambda: client.status(wedge_id).step.state != "available", 30, 0.005, "wedge started")
                noop_id = client.enqueue(bench_steps.noop, None)
                wait_until(lambda: client.status(noop_id).state == "completed", 60, 0.01, "no-op after the wedge")
                w = client.status(wedge_id).step
                nop = client.status(noop_id).step
                client.shutdown()
            finally:
                with contextlib.suppress(Exception):
                    client.stop()
                client.close()
        entry = (w.errors or [{}])[-1]
        return {
            "timeout_s": timeout, "kill_grace_s": grace,
            "slot_back_after_s": round(epoch(nop.started_at) - epoch(w.started_at), 3),
            "wedge_state": w.state, "wedge_error_kind": w.error_kind,
            "wedge_failed_after_s": round(epoch(w.finished_at) - epoch(w.started_at), 3) if w.finished_at else None,
            "killed_by_supervisor": entry.get("killed_by_supervisor"), "trigger": entry.get("trigger"),
            "signal": entry.get("signal_name") or entry.get("signal"),
        }

    # B4 -----------------------------------------------------------------------------------

    def b4(self) -> dict[str, Any]:
        ttl = 2.0
        options = {"workers": 1, "lease_ttl": ttl}
        procs: list[SupervisorProcess] = []
        with self.server.fresh() as dsn, cy.Client(dsn, mux_of(bench_steps.sleep)) as client:
            try:
                a = SupervisorProcess(dsn, [bench_steps.sleep], options, self.tmp)
                procs.append(a)
                run_id = client.enqueue(bench_steps.sleep, {"seconds": 3.0})
                wait_until(lambda: client.status(run_id).step.lease_owner == a.id, 30, 0.005, "claimed by A")
                b = SupervisorProcess(dsn, [bench_steps.sleep], options, self.tmp)
                procs.append(b)
                first = client.status(run_id).step
                kids = a.children()
                if len(kids) != 1:
                    raise AssertionError(f"expected one handler child of supervisor A, found {len(kids)}")
                child_pid = kids[0].pid
                kill_at = epoch(first.started_at) + 1.0
                time.sleep(max(0.0, kill_at - time.time()))
                t_kill = time.time()
                os.kill(a.pid, signal.SIGKILL)
                child_dead_after = None
                deadline = t_kill + 5.0
                while time.time() < deadline:
                    if dead_or_zombie(child_pid):
                        child_dead_after = time.time() - t_kill
                        break
                    time.sleep(0.002)
                a.popen.wait()
                wait_until(lambda: client.status(run_id).state == "completed", 60, 0.01, "completed by B")
                st = client.status(run_id).step
            finally:
                for p in procs:
                    p.stop()
        return {
            "lease_ttl_s": ttl, "handler_s": 3.0,
            "killed_after_start_s": round(t_kill - epoch(first.started_at), 3),
            "rerun_started_after_s": round(epoch(st.started_at) - t_kill, 3),
            "completed_after_s": round(epoch(st.finished_at) - t_kill, 3),
            "completed_by_second": st.lease_owner == b.id, "reclaims": st.reclaims, "attempt": st.attempt,
            "orphan_child_dead_after_s": round(child_dead_after, 3) if child_dead_after is not None else None,
        }

    # B5 -----------------------------------------------------------------------------------

    def b5(self) -> dict[str, Any]:
        n = self.n["b5_samples"]
        with self.server.fresh() as dsn:
            client = cy.Client(dsn, mux_of(bench_steps.noop), workers=2)
            try:
                client.start()
                sup = client.supervisor
                wait_until(lambda: all_ready(sup, 2), 30, 0.005, "children ready")
                time.sleep(1.5)  # idle: the poll backoff has grown to its maximum
                t0 = time.monotonic()
                for i in range(n):
                    time.sleep(max(0.0, t0 + i * 0.05 - time.monotonic()))
                    client.enqueue(bench_steps.noop, None)
                wait_until(lambda: sup.stats["completed"] >= n, 60, 0.005, f"{n} completions")
                client.shutdown()
            finally:
                with contextlib.suppress(Exception):
                    client.stop()
                client.close()
            with psycopg.connect(dsn, autocommit=True) as conn:
                rows = conn.execute(
                    "SELECT extract(epoch FROM s.started_at - r.created_at) FROM cyclone_steps s "
                    "JOIN cyclone_runs r ON r.id = s.run_id ORDER BY r.created_at").fetchall()
        lat = [float(r[0]) * 1000 for r in rows]
        return {"samples": len(lat), "p50_ms": round(percentile(lat, 50), 2), "p99_ms": round(percentile(lat, 99), 2),
                "max_ms": round(max(lat), 2), "min_ms": round(min(lat), 2)}

    # B6 -----------------------------------------------------------------------------------

    def seed_b6_template(self) -> tuple[str, dict[str, Any]]:
        """A migrated database holding the B6 ballast; cloned for each repetition."""
        name, dsn = self.server.copy_of_template("cyclone_bench_b6")
        fin, queued = self.n["b6_finished"], self.n["b6_queued"]
        t = time.perf_counter()
        with psycopg.connect(dsn, autocommit=True) as conn:
            # One statement per kind: the runs, then their one step each (the FK needs the run).
            conn.execute("""
                WITH r AS (
                    INSERT INTO cyclone_runs (id, name, kind, state, input, created_at, updated_at, finished_at)
                    SELECT gen_random_uuid(), 'bench_noop', 'step', 'completed', 'null',
                           now() - interval '1 day', now() - interval '1 day', now() - interval '1 day'
                      FROM generate_series(1, %(n)s)
                    RETURNING id, finished_at)
                INSERT INTO cyclone_steps (run_id, node, step_name, kind, queue, state, attempt, scheduled_at,
                                           started_at, finished_at, lease_generation, output)
                SELECT id, 'bench_noop', 'bench_noop', 'task', 'default', 'completed', 1, finished_at,
                       finished_at, finished_at, 1, 'null' FROM r""", {"n": fin})
            conn.execute("""
                WITH r AS (
                    INSERT INTO cyclone_runs (id, name, kind, state, input)
                    SELECT gen_random_uuid(), 'bench_noop', 'step', 'running', 'null'
                      FROM generate_series(1, %(n)s)
                    RETURNING id)
                INSERT INTO cyclone_steps (run_id, node, step_name, kind, queue, state)
                SELECT id, 'bench_noop', 'bench_noop', 'task', 'other', 'available' FROM r""", {"n": queued})
            conn.execute("VACUUM ANALYZE cyclone_runs")
            conn.execute("VACUUM ANALYZE cyclone_steps")
            size = conn.execute("SELECT pg_database_size(current_database())").fetchone()[0]
        return name, {"seed_s": round(time.perf_counter() - t, 1), "db_mb": round(size / 2**20)}

    def b6(self, template: str) -> dict[str, Any]:
        """B1's two throughput runs on clones of the big template, each paired with the
        same run on an empty database just before it: the ratio of each pair is judged,
        so a VM that changes speed between B1 and B6 (minutes apart) does not decide it."""
        row: dict[str, Any] = {}
        for prefetch, suffix in ((0, ""), (PREFETCH, "_prefetch")):
            with self.server.fresh() as dsn:
                ref = self.throughput(dsn, self.n["b1_steps"], prefetch=prefetch)
            with self.server.fresh(template, file_copy=True) as dsn:
                with psycopg.connect(dsn, autocommit=True) as conn:
                    conn.execute("CHECKPOINT")  # the clone's copy is not charged to the run
                big = self.throughput(dsn, self.n["b1_steps"], prefetch=prefetch)
                with psycopg.connect(dsn, autocommit=True) as conn:
                    row["other_queue_left"] = conn.execute(
                        "SELECT count(*) FROM cyclone_steps WHERE queue = 'other' AND state = 'available'"
                    ).fetchone()[0]
            row.update(suffixed(big, PREFETCH_KEYS, suffix))
            row[f"b1_paired_steps_per_s{suffix}"] = ref["steps_per_s"]
            row[f"ratio_to_b1{suffix}"] = round(big["steps_per_s"] / ref["steps_per_s"], 3)
        return row

    # B8 -----------------------------------------------------------------------------------

    def b8(self) -> dict[str, Any]:
        """Flow control (issue 21). B1 (2 workers, defaults) with a concurrency key on every
        step (spread over b8_keys keys), and with a per-key concurrency limit that never
        binds, each in pairs with plain B1 run just before (the VM's speed drifts): the
        medians of the pairs' ratios. Then the claim's cost as the backlog grows: the median
        time of one claim of 8 (the supervisor's generic plan) with b8_queued available
        steps over b8_claim_keys keys, against just enough for the claims, alternating."""
        row: dict[str, Any] = {}
        ratios: dict[str, list[float]] = {"keyed": [], "limited": []}
        for _ in range(self.n["b8_pairs"]):
            for name, step in (("keyed", bench_steps.noop_keyed), ("limited", bench_steps.noop_limited)):
                with self.server.fresh() as dsn:
                    ref = self.throughput(dsn, self.n["b1_steps"])
                with self.server.fresh() as dsn:
                    got = self.throughput(dsn, self.n["b1_steps"], step=step, keys=self.n["b8_keys"])
                ratios[name].append(got["steps_per_s"] / ref["steps_per_s"])
                row[f"{name}_steps_per_s"] = got["steps_per_s"]
                row[f"{name}_b1_steps_per_s"] = ref["steps_per_s"]
        for name, values in ratios.items():
            row[f"{name}_ratio_to_b1"] = round(statistics.median(values), 3)
            row[f"{name}_ratios"] = [round(v, 3) for v in values]
        keys = self.n["b8_claim_keys"]
        stores: dict[str, Store] = {}
        with contextlib.ExitStack() as stack:
            for label, queued in (("small", 8 * self.n["b8_claims"] + keys), ("big", self.n["b8_queued"])):
                dsn = stack.enter_context(self.server.fresh())
                client = cy.Client(dsn, mux_of(bench_steps.noop_keyed))
                for start in range(0, queued, 20_000):
                    client.enqueue_many(bench_steps.noop_keyed,
                                        [{"k": f"key-{i % keys:05d}"} for i in range(start, min(queued, start + 20_000))])
                client.close()
                with psycopg.connect(dsn, autocommit=True) as conn:
                    conn.execute("VACUUM ANALYZE cyclone_steps")
                stores[label] = Store.open(dsn, generic_plans=True)
                stack.callback(stores[label].close)
            # alternate the two, claim by claim: the VM's speed drifts within seconds
            times: dict[str, list[float]] = {"small": [], "big": []}
            for _ in range(self.n["b8_claims"]):
                for label, store in stores.items():
                    t = time.perf_counter()
                    got = store.claims.claim(owner="bench", queues=["default"], names=[bench_steps.noop_keyed.name],
                                             limit=8, ttl=60).rows
                    times[label].append(time.perf_counter() - t)
                    assert len(got) == 8
            for label, values in times.items():
                row[f"claim_ms_{label}"] = round(statistics.median(values[5:]) * 1000, 3)
        row["claim_big_over_small"] = round(row["claim_ms_big"] / row["claim_ms_small"], 2)
        return row


def load_peer(path: str | None) -> dict[str, float]:
    peer = dict(PEER_REF)
    if not path:
        return peer
    with open(path) as fh:
        data = json.load(fh)
    for name in ("pgqueuer", "celery"):
        for key, field in ((f"{name}_s1", "jobs_per_s"), (f"{name}_s1_incl_startup", "jobs_per_s_incl_startup")):
            vals = [r[field] for r in data.get("S1", []) if r.get("peer") == name and r.get(field)]
            if vals:
                peer[key] = statistics.median(vals)
                peer["source_" + name] = path  # type: ignore[assignment]
    return peer


def start_bouncers(upstream_dsn: str) -> dict[str, Any]:
    """The PgBouncers of --pgbouncer, by result-key suffix: transaction mode with
    ``max_prepared_statements`` off, and on (100) when a PgBouncer >= 1.21 is installed.
    Raises PgBouncerMissing (none installed)."""
    from cyclone_mp.testing.pgbouncer import PREPARED_SINCE, PgBouncer, PgBouncerMissing, find_pgbouncer

    found: dict[str, Any] = {}
    found["_pgbouncer"] = PgBouncer(upstream_dsn, pool_size=4)
    try:
        binary = find_pgbouncer(PREPARED_SINCE)
    except PgBouncerMissing as exc:
        console.print(f"[yellow]B1 through PgBouncer with prepared statements skipped:[/] {exc}")
        return found
    found["_pgbouncer_prepared"] = PgBouncer(upstream_dsn, pool_size=4, max_prepared_statements=100, binary=binary)
    return found


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--quick", action="store_true", help="small counts (a smoke run)")
    ap.add_argument("--repeat", type=int, default=3, help="repetitions of each benchmark (median reported)")
    ap.add_argument("--only", default=",".join(b for b in ALL if b not in ON_REQUEST),
                    help="comma-separated subset, e.g. B1,B3 (default: all but " + ", ".join(ON_REQUEST) + ")")
    ap.add_argument("--archived", type=int, default=None, metavar="N",
                    help="B10: archived runs in its template (default 1,000,000; --quick 100,000)")
    ap.add_argument("--scale", default=None,
                    help="B12's supervisor counts, e.g. 1,4,8 (default 1,2,4,8,16; --quick 1,2,4)")
    ap.add_argument("--scale-prefetch", type=int, default=None,
                    help=f"B12's prefetch per supervisor (default: the engine's, {PREFETCH_DEFAULT}; 0: none)")
    ap.add_argument("--dsn", default=None, help="PostgreSQL server to use (default: an embedded one in a temp dir)")
    ap.add_argument("--out", default=None, help="results JSON (default benchmarks/results/<timestamp>.json)")
    ap.add_argument("--peer-results", default=None,
                    help="a JSON written by ../shared/peer-bench (S1 of pgqueuer/celery) to take targets from")
    ap.add_argument("--limits", action="store_true",
                    help="B1 and B2 also with every resource limit set (issue 20), each beside the run without")
    ap.add_argument("--pgbouncer", action="store_true",
                    help="B1 also through PgBouncer in transaction mode (issue 22): max_prepared_statements "
                         "off, and on when a PgBouncer >= 1.21 is installed; printed beside B1 direct")
    ap.add_argument("--peers", action="store_true",
                    help="instead of B1-B8: the peer harness's S1 and S2 (issue 23) for cyclone_mp (defaults and "
                         "prefetch=64) and pgqueuer in one sitting, with the ratios (see benchmarks/peers.py)")
    ap.add_argument("--peer-bench", default=None,
                    help="the peer harness's directory (default $CYCLONE_PEER_BENCH, else ../shared/peer-bench)")
    ap.add_argument("--peer-python", default=None,
                    help="the interpreter that runs the harness (default $CYCLONE_PEER_PYTHON, else this one)")
    ap.add_argument("--autovacuum-naptime", default=None, metavar="SECONDS",
                    help="the embedded server's autovacuum_naptime (default 10s, the engine's; PostgreSQL's own "
                         "default is 60s): B11 shows what a long transaction costs with either")
    ap.add_argument("--no-vacuum-watch", action="store_true",
                    help="turn the supervisors' VACUUM after a long transaction off (B11's comparison)")
    ap.add_argument("-v", "--verbose", action="store_true", help="engine log at INFO")
    args = ap.parse_args(argv)
    if args.peers:
        if args.repeat < 1:
            ap.error("--repeat must be >= 1")
        import peers

        return peers.run(args)
    only = [b.strip().upper() for b in args.only.split(",") if b.strip()]
    bad = [b for b in only if b not in ALL]
    if bad or args.repeat < 1:
        ap.error(f"unknown benchmark(s) {bad}" if bad else "--repeat must be >= 1")
    logging.basicConfig(level=logging.INFO if args.verbose else logging.CRITICAL,
                        format="%(asctime)s %(name)s: %(message)s")
    if args.autovacuum_naptime:
        if args.dsn:
            ap.error("--autovacuum-naptime sets the embedded server's setting: not with --dsn")
        from cyclone_mp import embedded

        embedded.SERVER_SETTINGS["autovacuum_naptime"] = args.autovacuum_naptime
    if args.no_vacuum_watch:
        from cyclone_mp.history import VacuumWatch

        VacuumWatch.decide = lambda self, xmin, dead: False  # type: ignore[method-assign]
    counts = dict(QUICK if args.quick else FULL)
    if args.archived is not None:
        if args.archived < 1:
            ap.error("--archived must be >= 1")
        counts["b10_archived"] = args.archived
    if args.scale:
        try:
            counts["b12_sizes"] = tuple(int(x) for x in args.scale.split(",") if x.strip())
        except ValueError:
            ap.error(f"--scale takes supervisor counts, e.g. 1,4,8; got {args.scale!r}")
        if not counts["b12_sizes"] or min(counts["b12_sizes"]) < 1:
            ap.error("--scale takes counts >= 1")
    if args.scale_prefetch is not None:
        if args.scale_prefetch < 0:
            ap.error("--scale-prefetch must be >= 0")
        counts["b12_prefetch"] = args.scale_prefetch
    peer = load_peer(args.peer_results)
    stamp = dt.datetime.now().strftime("%Y%m%d-%H%M%S")
    out = args.out or os.path.join(HERE, "results", f"{stamp}.json")
    tmp = tempfile.mkdtemp(prefix="cyclone-mp-bench-run-")
    results: dict[str, Any] = {"meta": {
        "started": dt.datetime.now(dt.timezone.utc).isoformat(), "quick": args.quick, "repeat": args.repeat,
        "counts": counts, "python": platform.python_version(), "cpus": os.cpu_count(),
        "cyclone_mp": cy.__version__, "loadavg_start": loadavg(), "peer_reference": peer, **git_state(),
        "limits": LIMITS if args.limits else None,
        "autovacuum_naptime": args.autovacuum_naptime, "vacuum_watch": not args.no_vacuum_watch,
        "cyclone_mp_bytecode": ensure_bytecode(),
    }}
    server = None
    bouncers: dict[str, Any] = {}
    t_all = time.time()
    try:
        console.print(f"cyclone_mp bytecode: {results['meta']['cyclone_mp_bytecode']}")
        console.print(f"[bold]starting PostgreSQL[/] ({'--dsn' if args.dsn else 'embedded, temp data dir'}) ...")
        server = Server(args.dsn)
        results["meta"].update({"postgres": server.version, "postgres_settings": server.settings,
                                "server": server.source})
        if args.pgbouncer:
            bouncers = start_bouncers(server.admin_dsn)
            results["meta"]["pgbouncer"] = {suffix: {"version": ".".join(map(str, pgb.version)),
                                                     "max_prepared_statements": pgb.max_prepared_statements}
                                            for suffix, pgb in bouncers.items()}
        bench = Bench(server, counts, tmp, limits=args.limits, bouncers=bouncers)
        b6_template = b10_template = None
        for b in ALL:
            if b not in only:
                continue
            res = results[b] = {"samples": [], "median": {}, "errors": []}
            if b == "B6":
                console.print(f"[bold]B6[/] seeding {counts['b6_finished']:,} finished + "
                              f"{counts['b6_queued']:,} queued rows ...")
                b6_template, res["seed"] = bench.seed_b6_template()
            if b == "B10":
                console.print(f"[bold]B10[/] seeding {counts['b10_archived']:,} archived runs over "
                              f"{counts['b10_days']} days ...")
                b10_template, res["seed"] = bench.seed_b10_template()
                console.print(f"  {res['seed']}", highlight=False)
            for rep in range(args.repeat):
                la = loadavg()
                t = time.time()
                try:
                    fn = getattr(bench, b.lower())
                    sample = fn(b6_template) if b == "B6" else fn(b10_template) if b == "B10" else fn()
                except Exception:  # noqa: BLE001 - one failed benchmark must not hide the others
                    res["errors"].append(traceback.format_exc())
                    console.print(f"[red]{b} rep {rep + 1} failed:[/]\n{traceback.format_exc()}")
                    continue
                sample.update({"rep": rep + 1, "loadavg": la, "seconds": round(time.time() - t, 1)})
                res["samples"].append(sample)
                shown = {k: v for k, v in sample.items() if not isinstance(v, list)}
                console.print(f"[bold]{b}[/] rep {rep + 1}: {shown}")
            for template in (b6_template, b10_template):
                if template:
                    server.drop(template)
            b6_template = b10_template = None
    finally:
        for pgb in bouncers.values():
            pgb.close()
        if server is not None:
            server.close()
        shutil.rmtree(tmp, ignore_errors=True)
    results["meta"]["loadavg_end"] = loadavg()
    results["meta"]["seconds"] = round(time.time() - t_all, 1)
    rows = summarize(results, peer, counts)
    results["summary"] = [{k: v for k, v in r.items() if k != "fmt"} for r in rows]
    os.makedirs(os.path.dirname(os.path.abspath(out)), exist_ok=True)
    with open(out, "w") as fh:
        json.dump(results, fh, indent=2, default=str)
    print_table(rows, results, quick=args.quick)
    console.print(f"load average: start {results['meta']['loadavg_start']}, end {results['meta']['loadavg_end']}; "
                  f"{results['meta']['seconds']} s; JSON: {out}")
    failed = [b for b in only if results.get(b, {}).get("errors")]
    return 1 if failed else 0


if __name__ == "__main__":
    sys.exit(main())
