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
import compileall
import contextlib
import datetime as dt
import importlib.util
import itertools
import json
import logging
import multiprocessing
import os
import platform
import shutil
import signal
import statistics
import subprocess
import sys
import tempfile
import threading
import time
import traceback
import uuid
from typing import Any, Callable, Iterator

HERE = os.path.dirname(os.path.abspath(__file__))
if HERE not in sys.path:
    sys.path.insert(0, HERE)  # children inherit sys.path: they import bench_steps by name

import psutil
import psycopg
from psycopg import sql
from psycopg.conninfo import conninfo_to_dict, make_conninfo
from rich.console import Console
from rich.table import Table

import bench_steps
import cyclone_mp as cy
from cyclone_mp.store import Store

console = Console(width=None if sys.stdout.isatty() else 160)
ALL = ("B1", "B2", "B3", "B4", "B5", "B6", "B7", "B8", "B9", "B10", "B11", "B12")
ON_REQUEST = ("B11", "B12")  # minutes long: run with --only
# The default prefetch (issue 23), measured beside prefetch=0 (claims only for idle children, SPEC 4).
PREFETCH = 64
#: Connections one supervisor holds (docs/operating.md#connections): lease keeper, its
#: LISTEN, outcome writer, maintenance. B12 judges what pg_stat_activity shows against it.
SUPERVISOR_CONNECTIONS = 4
PREFETCH_KEYS = ("steps_per_s", "steps_per_s_from_first_start", "statements", "wal_kb_per_step")
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
    "b12_sizes": (1, 2, 4, 8, 16), "b12_steps": 20000, "b12_idle_s": 5.0, "b12_prefetch": 64,
}
QUICK = {
    "b1_steps": 300, "b1_single": 100, "b1_bulk": 2000, "b1_batch": 200,
    "b2_steps": 40, "b5_samples": 10, "b6_queued": 10_000, "b6_finished": 100_000,
    "b7_steps": 2000, "b7_child_starts": 3, "b8_pairs": 1, "b8_keys": 20, "b8_claims": 50,
    "b8_queued": 10_000, "b8_claim_keys": 100, "b9_kills": 3,
    "b10_archived": 100_000, "b10_days": 10,
    "b11_warmup_s": 20, "b11_base_s": 10, "b11_hold_s": 20, "b11_after_s": 20,
    "b12_sizes": (1, 2, 4), "b12_steps": 2000, "b12_idle_s": 2.0, "b12_prefetch": 64,
}
#: B11's window (seconds): throughput is sampled once per window.
B11_WINDOW = 10
#: B11: the supervisor archives finished runs after this many seconds (the hot tables then
#: hold the live backlog and a short tail, as in production; the default is 600 s).
B11_ARCHIVE_AFTER = 10


# -- helpers ------------------------------------------------------------------------------


def median(values: list[float]) -> float | None:
    values = [v for v in values if v is not None]
    return statistics.median(values) if values else None


def percentile(values: list[float], q: float) -> float:
    """Linear-interpolated percentile (q in 0..100)."""
    xs = sorted(values)
    if len(xs) == 1:
        return xs[0]
    pos = (len(xs) - 1) * q / 100.0
    lo = int(pos)
    hi = min(lo + 1, len(xs) - 1)
    return xs[lo] + (xs[hi] - xs[lo]) * (pos - lo)


def wait_until(pred: Callable[[], bool], timeout: float, every: float = 0.005, what: str = "condition") -> None:
    deadline = time.monotonic() + timeout
    while not pred():
        if time.monotonic() > deadline:
            raise TimeoutError(f"{what} not reached within {timeout:.0f} s")
        time.sleep(every)


def epoch(ts: dt.datetime) -> float:
    return ts.timestamp()


def loadavg() -> list[float]:
    return [round(x, 2) for x in os.getloadavg()]


class Server:
    """The PostgreSQL the benchmarks use: --dsn, or an embedded server in a temp dir."""

    def __init__(self, dsn: str | None) -> None:
        self._embedded: Any = None
        self._tmp: str | None = None
        if dsn:
            self.admin_dsn, self.source = dsn, "dsn"
        else:
            from cyclone_mp.embedded import EmbeddedServer

            self._tmp = tempfile.mkdtemp(prefix="cyclone-mp-bench-")
            os.chmod(self._tmp, 0o755)  # as root the server runs as its own user
            self._embedded = EmbeddedServer(os.path.join(self._tmp, "pgdata"))
            self.admin_dsn, self.source = self._embedded.start(timeout=120), "embedded"
        self.template = f"cyclone_bench_tpl_{uuid.uuid4().hex[:8]}"
        self.create(self.template)
        store = Store.open(self.dsn_for(self.template))
        try:
            store.migrate()
        finally:
            store.close()
        with self.admin() as conn:
            self.version = conn.execute("SHOW server_version").fetchone()[0]
            self.settings = dict(conn.execute(
                "SELECT name, setting FROM pg_settings WHERE name IN ('fsync', 'synchronous_commit', "
                "'shared_buffers', 'max_connections', 'wal_level', 'autovacuum_naptime')").fetchall())

    def admin(self) -> psycopg.Connection:
        return psycopg.connect(self.admin_dsn, autocommit=True)

    def dsn_for(self, dbname: str) -> str:
        return make_conninfo(self.admin_dsn, dbname=dbname)

    def create(self, name: str, template: str | None = None, file_copy: bool = False) -> None:
        q = sql.SQL("CREATE DATABASE {}").format(sql.Identifier(name))
        if template:
            q += sql.SQL(" TEMPLATE {}").format(sql.Identifier(template))
        if file_copy:
            q += sql.SQL(" STRATEGY FILE_COPY")
        with self.admin() as conn:
            conn.execute(q)

    def drop(self, name: str) -> None:
        with contextlib.suppress(psycopg.Error), self.admin() as conn:
            conn.execute(sql.SQL("DROP DATABASE IF EXISTS {} WITH (FORCE)").format(sql.Identifier(name)))

    @contextlib.contextmanager
    def fresh(self, template: str | None = None, file_copy: bool = False) -> Iterator[str]:
        """A fresh migrated database (a clone of the template); dropped afterwards."""
        name = f"cyclone_bench_{uuid.uuid4().hex[:10]}"
        self.create(name, template or self.template, file_copy)
        try:
            yield self.dsn_for(name)
        finally:
            self.drop(name)

    def close(self) -> None:
        self.drop(self.template)
        if self._embedded is not None:
            with contextlib.suppress(Exception):
                self._embedded.destroy()
        if self._tmp is not None:
            shutil.rmtree(self._tmp, ignore_errors=True)


def mux_of(*steps: cy.Step) -> cy.Mux:
    mux = cy.Mux()
    for s in steps:
        mux.register(s)
    return mux


def step_times(dsn: str, step_name: str, owner: str) -> dict[str, Any]:
    """First start, last finish (epoch s), counts and re-claims of the steps of one name
    that supervisor ``owner`` ran (DB clock)."""
    with psycopg.connect(dsn, autocommit=True) as conn:
        row = conn.execute(
            "SELECT min(started_at), max(finished_at), count(*) FILTER (WHERE state = 'completed'), "
            "count(*), max(lease_generation), sum(reclaims), "
            "percentile_cont(0.5) WITHIN GROUP (ORDER BY extract(epoch FROM finished_at - started_at)) "
            "FROM cyclone_steps WHERE step_name = %s AND lease_owner = %s", (step_name, owner)).fetchone()
    return {"first_start": epoch(row[0]), "last_finish": epoch(row[1]), "completed": row[2], "total": row[3],
            "max_generation": row[4], "reclaims": int(row[5] or 0), "step_s_p50": row[6]}


class CpuMeter:
    """CPU seconds used since the last :meth:`take`: by the PostgreSQL processes of one
    database (its backends and autovacuum workers, found by their process titles:
    ``postgres: user DB ...``, ``postgres: autovacuum worker DB``), or without
    ``database`` by this process and its children (the supervisor, its threads and its
    handler children). On a shared machine CPU per step is steadier than steps/s: it
    does not depend on what else runs (B11)."""

    def __init__(self, database: str | None = None) -> None:
        self.database = database
        self.seen: dict[int, float] = {}
        self.take()

    def _now(self) -> dict[int, float]:
        procs: list[psutil.Process] = []
        if self.database is None:
            me = psutil.Process()
            procs = [me] + me.children(recursive=True)
        else:
            for p in psutil.process_iter(["cmdline"]):
                cmd = " ".join(p.info["cmdline"] or [])
                if cmd.startswith("postgres: ") and f" {self.database} " in f"{cmd} ":
                    procs.append(p)
        out = {}
        for p in procs:
            with contextlib.suppress(psutil.Error):
                t = p.cpu_times()
                out[p.pid] = t.user + t.system
        return out

    def take(self) -> float:
        now = self._now()
        used = sum(v - self.seen.get(pid, 0.0) for pid, v in now.items())
        self.seen = now
        return used


def wal_lsn(dsn: str) -> int:
    """The server's current WAL position in bytes."""
    with psycopg.connect(dsn, autocommit=True) as conn:
        return int(conn.execute("SELECT pg_current_wal_lsn() - '0/0'::pg_lsn").fetchone()[0])


class SupervisorProcess:
    """A supervisor in its own process: ``python -m cyclone_mp.testing.worker CONFIG``
    (the entry point ``Env(worker="process")`` uses; it dies with this process)."""

    def __init__(self, dsn: str, steps: list[cy.Step], options: dict[str, Any], tmp: str) -> None:
        ready = os.path.join(tmp, f"ready-{uuid.uuid4().hex[:8]}")
        config = {
            "dsn": dsn, "workflows": [], "options": options, "ready_file": ready, "parent_pid": os.getpid(),
            "sys_path": [p for p in sys.path if p],
            "steps": [{"module": s.ref.module, "qualname": s.ref.qualname, "path": s.ref.path} for s in steps],
        }
        self.popen = subprocess.Popen([sys.executable, "-m", "cyclone_mp.testing.worker", json.dumps(config)],
                                      stdin=subprocess.DEVNULL)
        self.pid = self.popen.pid
        try:
            wait_until(lambda: os.path.exists(ready) or self.popen.poll() is not None, 60, 0.005, "supervisor ready")
        except TimeoutError:
            self.stop()
            raise
        if self.popen.poll() is not None:
            raise RuntimeError(f"supervisor process exited with code {self.popen.returncode} before it was ready")
        with open(ready) as fh:
            self.id = fh.read().strip()
        os.unlink(ready)

    def children(self) -> list[psutil.Process]:
        """Its handler children (``python -m cyclone_mp._child``), not the watchdog."""
        out = []
        with contextlib.suppress(psutil.Error):
            for p in psutil.Process(self.pid).children():
                with contextlib.suppress(psutil.Error):
                    if "cyclone_mp._child" in p.cmdline():
                        out.append(p)
        return out

    def stop(self) -> None:
        if self.popen.poll() is None:
            self.popen.send_signal(signal.SIGTERM)
            try:
                self.popen.wait(timeout=15)
            except subprocess.TimeoutExpired:
                self.popen.kill()
                self.popen.wait()


# Seconds between looks at the supervisor's counters while it runs in this process. The
# times come from the database (first start, last finish), so this only decides when the
# shutdown begins; a 2 ms poll took the GIL from the supervisor 500 times a second.
POLL = 0.05


def run_until_completed(client: cy.Client, n: int, interval: float = POLL) -> tuple[Any, list[Any], float]:
    """Start ``client``'s supervisor (in this process), wait for ``n`` completions, shut
    it down and close the client; returns the supervisor, its children as they were
    before the shutdown, and the epoch time of the start."""
    try:
        t0 = time.time()
        client.start()
        sup = client.supervisor
        wait_until(lambda: sup.stats["completed"] >= n, 300, interval, f"{n} completions")
        children = list(sup.children)
        client.shutdown()
    finally:
        with contextlib.suppress(Exception):
            client.stop()
        client.close()
    return sup, children, t0


def suffixed(row: dict[str, Any], keys: tuple[str, ...], suffix: str) -> dict[str, Any]:
    """The ``keys`` of ``row``, renamed with ``suffix`` (a variant's columns beside the default's)."""
    return {f"{k}{suffix}": v for k, v in row.items() if k in keys}


def all_ready(sup: Any, workers: int) -> bool:
    """The in-process supervisor ``sup`` has ``workers`` children, all ready."""
    children = list(sup.children)
    return len(children) == workers and all(c.ready for c in children)


def dead_or_zombie(pid: int) -> bool:
    if not psutil.pid_exists(pid):
        return True
    with contextlib.suppress(psutil.Error):
        return psutil.Process(pid).status() == psutil.STATUS_ZOMBIE
    return True


# -- the benchmarks ----------------------------------------------------------------------------


class Bench:
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
        name = f"cyclone_bench_b6_{uuid.uuid4().hex[:8]}"
        self.server.create(name, self.server.template)
        dsn = self.server.dsn_for(name)
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
                    got = store.claim(owner="bench", queues=["default"], names=[bench_steps.noop_keyed.name],
                                      limit=8, ttl=60)
                    times[label].append(time.perf_counter() - t)
                    assert len(got) == 8
            for label, values in times.items():
                row[f"claim_ms_{label}"] = round(statistics.median(values[5:]) * 1000, 3)
        row["claim_big_over_small"] = round(row["claim_ms_big"] / row["claim_ms_small"], 2)
        return row

    # B10 ----------------------------------------------------------------------------------

    def seed_b10_template(self) -> tuple[str, dict[str, Any]]:
        """A migrated database holding b10_archived finished runs in the archive (issue 22):
        their partitions made, then one ``INSERT ... SELECT ... FROM generate_series`` for
        the runs and their steps (98 % completed, 1 % discarded, 1 % cancelled, finished
        over the b10_days days before today), then ``VACUUM ANALYZE``. Cloned for each
        repetition."""
        name = f"cyclone_bench_b10_{uuid.uuid4().hex[:8]}"
        self.server.create(name, self.server.template)
        dsn = self.server.dsn_for(name)
        n, days = self.n["b10_archived"], self.n["b10_days"]
        t = time.perf_counter()
        with psycopg.connect(dsn, autocommit=True) as conn:
            conn.execute("""
                SELECT cyclone_archive_partition(st, d::date)
                  FROM unnest(ARRAY['completed', 'discarded', 'cancelled']) AS st,
                       generate_series(current_date - %(days)s, current_date - 1, interval '1 day') AS d""",
                         {"days": days})
            conn.execute("""
                WITH r AS (
                    INSERT INTO cyclone_runs_archive (id, name, kind, state, input, created_at, updated_at,
                                                      finished_at, signals)
                    SELECT gen_random_uuid(), 'bench_noop', 'step',
                           CASE WHEN g %% 100 = 0 THEN 'discarded' WHEN g %% 100 = 1 THEN 'cancelled'
                                ELSE 'completed' END,
                           'null', f - interval '1 second', f, f, '[]'
                      FROM generate_series(1, %(n)s) AS g,
                           LATERAL (SELECT (current_date - %(days)s)::timestamptz
                                           + (g::float8 / (%(n)s + 1)) * %(days)s * interval '1 day' AS f) x
                    RETURNING id, state, finished_at)
                INSERT INTO cyclone_steps_archive (id, run_id, node, step_name, kind, depends_on, queue, priority,
                                                   state, attempt, max_attempts, reclaims, scheduled_at, started_at,
                                                   finished_at, lease_generation, errors, output, concurrency_key,
                                                   run_state, run_finished_at)
                SELECT nextval(pg_get_serial_sequence('cyclone_steps', 'id')), id, 'bench_noop', 'bench_noop',
                       'task', '{}', 'default', 0, state, 1, 25, 0, finished_at, finished_at, finished_at, 1, '[]',
                       'null', '', state, finished_at
                  FROM r""", {"n": n, "days": days})
            conn.execute("VACUUM ANALYZE cyclone_runs_archive")
            conn.execute("VACUUM ANALYZE cyclone_steps_archive")
            size = conn.execute("SELECT pg_database_size(current_database())").fetchone()[0]
            parts = conn.execute("SELECT count(*) FROM pg_inherits "
                                 "WHERE inhparent = 'cyclone_runs_archive'::regclass").fetchone()[0]
        return name, {"seed_s": round(time.perf_counter() - t, 1), "db_mb": round(size / 2**20), "partitions": parts}

    def b10(self, template: str) -> dict[str, Any]:
        """B1's two throughput runs on clones of the archive template, each paired with the
        same run on an empty database right before or after it (the order alternates
        between repetitions: the VM's speed drifts; the ratios are judged, as B6's), then
        retention on the last clone: every archived day but the last two dropped by one
        history pass (:class:`cyclone_mp.history.History`, as a supervisor runs it) while a
        reader looks up archived runs by id every 2 ms and a client enqueues and cancels a
        run every 10 ms: the pass's time, and the longest wait of each (the archive's locks
        are taken for a moment per partition; the hot tables never wait)."""
        from cyclone_mp.history import History, Policy

        row: dict[str, Any] = {}
        self._b10_empty_first = not getattr(self, "_b10_empty_first", False)  # alternates between repetitions
        for prefetch, suffix in ((0, ""), (PREFETCH, "_prefetch")):
            def empty() -> dict[str, Any]:
                with self.server.fresh() as dsn:
                    return self.throughput(dsn, self.n["b1_steps"], prefetch=prefetch)

            def archived() -> dict[str, Any]:
                with self.server.fresh(template, file_copy=True) as dsn:
                    with psycopg.connect(dsn, autocommit=True) as conn:
                        conn.execute("CHECKPOINT")  # the clone's copy is not charged to the run
                    got = self.throughput(dsn, self.n["b1_steps"], prefetch=prefetch)
                    if suffix:
                        row.update(self.retention(dsn, History, Policy))
                    return got

            if self._b10_empty_first:
                ref = empty()
                big = archived()
            else:
                big = archived()
                ref = empty()
            row.update(suffixed(big, PREFETCH_KEYS, suffix))
            row[f"b1_paired_steps_per_s{suffix}"] = ref["steps_per_s"]
            row[f"ratio_to_b1{suffix}"] = round(big["steps_per_s"] / ref["steps_per_s"], 3)
        return row

    def retention(self, dsn: str, history_cls: Any, policy_cls: Any) -> dict[str, Any]:
        """Drop every archived day of the B10 clone ``dsn`` but the last two (see :meth:`b10`)."""
        with psycopg.connect(dsn, autocommit=True) as conn:
            ids = [r[0] for r in conn.execute(
                "SELECT id FROM cyclone_runs_archive TABLESAMPLE SYSTEM (1) LIMIT 2000").fetchall()]
            before = conn.execute("SELECT count(*) FROM cyclone_runs_archive").fetchone()[0]
        stop = threading.Event()
        waits: dict[str, list[float]] = {"reader": [], "hot": []}

        def reader() -> None:
            with psycopg.connect(dsn, autocommit=True) as conn:
                i = 0
                while not stop.is_set():
                    t = time.perf_counter()
                    conn.execute("SELECT 1 FROM cyclone_runs_archive WHERE id = %s", (ids[i % len(ids)],))
                    waits["reader"].append(time.perf_counter() - t)
                    i += 1
                    time.sleep(0.002)

        def hot() -> None:
            with cy.Client(dsn, mux_of(bench_steps.noop)) as client:
                while not stop.is_set():
                    t = time.perf_counter()
                    client.cancel(client.enqueue(bench_steps.noop, None, delay=3600))
                    waits["hot"].append(time.perf_counter() - t)
                    time.sleep(0.01)

        threads = [threading.Thread(target=fn, daemon=True) for fn in (reader, hot)]
        for th in threads:
            th.start()
        time.sleep(0.5)
        keep = 2 * 86400.0
        work = history_cls(policy_cls(None, {"completed": keep, "discarded": keep, "cancelled": keep}), budget=600.0)
        store = Store.open(dsn)
        try:
            t = time.perf_counter()
            counts = work.run_once(store)
            took = time.perf_counter() - t
        finally:
            store.close()
        time.sleep(0.5)
        stop.set()
        for th in threads:
            th.join(30)
        with psycopg.connect(dsn, autocommit=True) as conn:
            after = conn.execute("SELECT count(*) FROM cyclone_runs_archive").fetchone()[0]
        return {
            "retention_s": round(took, 3), "partitions_dropped": counts["partitions_dropped"],
            "runs_dropped": counts["dropped_runs"], "runs_expired_by_row": counts["expired"],
            "archived_before": before, "archived_after": after,
            "archive_read_max_ms": round(max(waits["reader"]) * 1000, 1),
            "archive_read_p99_ms": round(percentile(waits["reader"], 99) * 1000, 2),
            "hot_enqueue_cancel_max_ms": round(max(waits["hot"]) * 1000, 1),
            "hot_enqueue_cancel_p99_ms": round(percentile(waits["hot"], 99) * 1000, 2),
        }

    # B11 ----------------------------------------------------------------------------------

    def b11(self) -> dict[str, Any]:
        """B1 under a long transaction (issue 22): throughput per window, prefetch=0 and
        prefetch=64, each beside a control run without the holder (the same phases; the
        order alternates between repetitions): how much the windows after the hold vary
        without one."""
        row: dict[str, Any] = {}
        self._b11_control_first = not getattr(self, "_b11_control_first", False)
        for prefetch, suffix in ((0, ""), (PREFETCH, "_prefetch")):
            runs = {}
            for hold in ((False, True) if self._b11_control_first else (True, False)):
                runs[hold] = self.long_transaction(prefetch, hold=hold)
            row.update({f"{k}{suffix}": v for k, v in runs[True].items()})
            row.update({f"{k}{suffix}_control": v for k, v in runs[False].items()
                        if k in ("base_steps_per_s", "hold_median_ratio", "after_first_ratio", "recovered_after_s",
                                 "after_last_ratio", "after_steps_per_s", "hold_steps_per_s")})
        return row

    def long_transaction(self, prefetch: int, hold: bool = True) -> dict[str, Any]:
        """A supervisor (``workers=2``, ``prefetch``, finished runs archived after
        B11_ARCHIVE_AFTER s) kept busy with no-ops (a producer tops the backlog up to
        4,000-8,000 available steps with ``enqueue_many``, from its own count of what it
        enqueued and the supervisor's of what completed); completions are counted per
        B11_WINDOW-second window: b11_warmup_s unmeasured, the baseline over b11_base_s,
        then another session opens a transaction, takes an xid (``pg_current_xact_id()``)
        and sits idle in it for b11_hold_s (vacuum can remove no row version newer than it),
        then ends it, and the windows after it over b11_after_s. Recovered: the first
        window after the holder ended at or above 90 % of the baseline; its end is the time
        to recover. The hot tables' dead tuples and sizes are recorded per window. Without
        ``hold`` (the control) nothing holds a transaction; the phases are the same."""
        win, n = B11_WINDOW, self.n
        with self.server.fresh() as dsn:
            client = cy.Client(dsn, mux_of(bench_steps.noop), workers=2, prefetch=prefetch,
                               archive_after=B11_ARCHIVE_AFTER)
            client.enqueue_many(bench_steps.noop, [None] * 8000)
            enqueued = [8000]
            stop = threading.Event()

            def producer() -> None:
                # the backlog from the counts in this process (enqueued - completed): a count of
                # the available rows in SQL would read the bloated claim index too, and its
                # cost would be charged to the engine's PostgreSQL CPU per step
                while not stop.is_set():
                    if client.supervisor is not None and enqueued[0] - client.supervisor.stats["completed"] < 4000:
                        client.enqueue_many(bench_steps.noop, [None] * 4000)
                        enqueued[0] += 4000
                    stop.wait(0.2)

            feeder = threading.Thread(target=producer, daemon=True)
            holder = psycopg.connect(dsn)  # not autocommit: its first statement opens the transaction
            monitor = psycopg.connect(dsn, autocommit=True)
            windows: list[dict[str, Any]] = []
            try:
                client.start()
                sup = client.supervisor
                feeder.start()
                bounds = list(itertools.accumulate(n[f"b11_{p}_s"] for p in ("warmup", "base", "hold", "after")))
                phase, last_done, t0, k = "warmup", sup.stats["completed"], time.monotonic(), 0
                db_cpu, engine_cpu = CpuMeter(database=conninfo_to_dict(dsn)["dbname"]), CpuMeter()
                while k * win < bounds[-1]:
                    k += 1
                    time.sleep(max(0.0, t0 + k * win - time.monotonic()))
                    done = sup.stats["completed"]
                    db_s, engine_s = db_cpu.take(), engine_cpu.take()
                    stats = monitor.execute(
                        "SELECT sum(n_dead_tup)::bigint, sum(n_live_tup)::bigint, "
                        "pg_relation_size('cyclone_steps') / 8192, pg_relation_size('cyclone_steps_claim_key_idx') / 8192 "
                        "FROM pg_stat_user_tables WHERE relname IN ('cyclone_steps', 'cyclone_runs')").fetchone()
                    steps = max(1, done - last_done)
                    windows.append({"phase": phase, "at_s": k * win, "steps_per_s": round((done - last_done) / win, 1),
                                    "db_cpu_ms_per_step": round(db_s * 1000 / steps, 3),
                                    "engine_cpu_ms_per_step": round(engine_s * 1000 / steps, 3),
                                    "dead": stats[0], "live": stats[1], "steps_pages": stats[2],
                                    "claim_idx_pages": stats[3]})
                    last_done = done
                    console.print(f"  B11 prefetch={prefetch}{'' if hold else ' (control)'} {windows[-1]}",
                                  highlight=False)
                    if k * win == bounds[0]:
                        phase = "base"
                    elif k * win == bounds[1]:
                        if hold:
                            holder.execute("SELECT pg_current_xact_id()")  # an xid, idle in transaction from now
                        phase = "hold"
                    elif k * win == bounds[2]:
                        holder.rollback()
                        phase = "after"
            finally:
                stop.set()
                feeder.join(10)
                with contextlib.suppress(Exception):
                    holder.close()
                monitor.close()
                client.shutdown()
                with contextlib.suppress(Exception):
                    client.stop()
                client.close()
        base = statistics.median([w["steps_per_s"] for w in windows if w["phase"] == "base"])
        during = [w["steps_per_s"] for w in windows if w["phase"] == "hold"]
        after = [w["steps_per_s"] for w in windows if w["phase"] == "after"]
        first_ok = next((i for i, v in enumerate(after) if v >= 0.9 * base), None)  # None: not within the windows
        cost = {p: [w["db_cpu_ms_per_step"] for w in windows if w["phase"] == p] for p in ("base", "hold", "after")}
        base_cost = statistics.median(cost["base"])
        cost_ok = next((i for i, v in enumerate(cost["after"]) if v <= 1.1 * base_cost), None)
        return {
            "base_db_cpu_ms_per_step": base_cost,
            "hold_db_cpu_ratio": round(statistics.median(cost["hold"]) / base_cost, 3),
            "after_first_db_cpu_ratio": round(cost["after"][0] / base_cost, 3),
            "after_median_db_cpu_ratio": round(statistics.median(cost["after"]) / base_cost, 3),
            "cost_recovered_after_s": (len(after) + 1) * win if cost_ok is None else (cost_ok + 1) * win,
            "base_steps_per_s": base, "hold_steps_per_s": during, "after_steps_per_s": after,
            "hold_min_ratio": round(min(during) / base, 3), "hold_median_ratio": round(statistics.median(during) / base, 3),
            "after_first_ratio": round(after[0] / base, 3),
            # not recovered within the windows measured: one window more than they cover (judged as missed)
            "recovered_after_s": (len(after) + 1) * win if first_ok is None else (first_ok + 1) * win,
            "recovered": first_ok is not None,
            "after_last_ratio": round(after[-1] / base, 3), "windows": windows,
        }

    # B12 ----------------------------------------------------------------------------------

    def b12(self) -> dict[str, Any]:
        """Many supervisors on one PostgreSQL (benchmarks/scale.py): each count in
        ``b12_sizes`` on a fresh database, ``prefetch`` as ``--scale-prefetch`` (64 by
        default: issue 23's scaling row), in one repetition."""
        import scale

        if not hasattr(self, "_pgss"):
            self._pgss = scale.enable_pgss(self.server)
        row: dict[str, Any] = {"pg_stat_statements": self._pgss}
        for k in self.n["b12_sizes"]:
            with self.server.fresh() as dsn:
                dbname = psycopg.conninfo.conninfo_to_dict(dsn)["dbname"]
                one = scale.scale_once(admin_dsn=self.server.admin_dsn, dsn=dsn, dbname=dbname, k=k,
                                       n=self.n["b12_steps"], prefetch=self.n["b12_prefetch"],
                                       idle_s=self.n["b12_idle_s"],
                                       tmp=self.tmp, start=SupervisorProcess, use_pgss=self._pgss)
            console.print(f"  B12 {k} supervisor(s): {one}", highlight=False)
            row.update({f"{key}_k{k}": v for key, v in one.items() if key != "supervisors"})
        sizes = self.n["b12_sizes"]
        for k in sizes:
            if k > 4 and 4 in sizes:
                row[f"ratio_{k}_to_4"] = round(row[f"steps_per_s_k{k}"] / row["steps_per_s_k4"], 3)
        return row

    # B7 -----------------------------------------------------------------------------------

    def child_starts(self) -> dict[str, Any]:
        """Spawn-to-ready of a fresh child (``python -m cyclone_mp._child``, as the supervisor
        starts it, via :class:`cyclone_mp.pool.ChildProc`) and its RSS once ready."""
        import selectors

        from cyclone_mp.pool import ChildProc
        from cyclone_mp.protocol import DEFAULT_MAX_PAYLOAD

        times, rss = [], []
        for _ in range(self.n["b7_child_starts"]):
            t = time.monotonic()
            child = ChildProc(f"bench:{os.getpid()}", DEFAULT_MAX_PAYLOAD)
            try:
                sel = selectors.DefaultSelector()
                sel.register(child.sock, selectors.EVENT_READ)
                ready = False
                while not ready and time.monotonic() - t < 30:
                    sel.select(1.0)
                    msgs, eof = child.receive()
                    ready = any(m.get("t") == "ready" for m in msgs)
                    if eof:
                        break
                sel.close()
                if not ready:
                    raise RuntimeError("child did not become ready")
                times.append(time.monotonic() - t)
                time.sleep(0.05)
                rss.append(psutil.Process(child.pid).memory_info().rss)
            finally:
                child.retire()
                if child.wait(timeout=5) is None:
                    child.kill()
        return {"child_start_ms_p50": round(statistics.median(times) * 1000, 1),
                "child_start_ms_each": [round(x * 1000, 1) for x in times],
                "child_rss_mb": round(statistics.median(rss) / 2**20, 1)}

    def b7(self) -> dict[str, Any]:
        n = self.n["b7_steps"]
        with self.server.fresh() as dsn, cy.Client(dsn, mux_of(bench_steps.noop)) as client:
            sup = SupervisorProcess(dsn, [bench_steps.noop], {"workers": 2, "prefetch": PREFETCH}, self.tmp)
            try:
                proc = psutil.Process(sup.pid)
                time.sleep(1.0)
                rss_start = proc.memory_info().rss
                cpu0 = sum(proc.cpu_times()[:2])
                samples = [rss_start]
                client.enqueue_many(bench_steps.noop, [None] * n)
                conn = psycopg.connect(dsn, autocommit=True)
                done = 0
                deadline = time.monotonic() + 600
                while done < n:
                    if time.monotonic() > deadline:
                        raise TimeoutError(f"{done} of {n} steps completed after 600 s")
                    time.sleep(0.25)
                    samples.append(proc.memory_info().rss)
                    done = conn.execute("SELECT count(*) FROM cyclone_steps WHERE state = 'completed'").fetchone()[0]
                last = conn.execute("SELECT max(finished_at), min(started_at) FROM cyclone_steps").fetchone()
                conn.close()
                cpu_s = sum(proc.cpu_times()[:2]) - cpu0
                time.sleep(1.0)
                rss_end = proc.memory_info().rss
                kids = [k.memory_info().rss for k in sup.children()]
            finally:
                sup.stop()
        row = {
            "steps": n, "supervisor_rss_start_mb": round(rss_start / 2**20, 1),
            "supervisor_rss_max_mb": round(max(samples + [rss_end]) / 2**20, 1),
            "supervisor_rss_end_mb": round(rss_end / 2**20, 1),
            "supervisor_rss_growth_mb": round((rss_end - rss_start) / 2**20, 1),
            "supervisor_cpu_ms_per_step": round(cpu_s * 1000 / n, 3),
            "sustained_steps_per_s": round(n / (epoch(last[0]) - epoch(last[1])), 1),
            "children_rss_after_mb": [round(k / 2**20, 1) for k in kids],
        }
        row.update(self.child_starts())
        return row


    # B9 -----------------------------------------------------------------------------------

    START_METHODS = ("spawn", "zygote")

    def b9(self) -> dict[str, Any]:
        """Children in milliseconds (issue 23), ``start_method="spawn"`` against
        ``"zygote"``, one right after the other, the first alternating between
        repetitions. Each: a supervisor in this process (``workers=2``, its handlers'
        module ``bench_steps`` preloaded), started on a fresh database; then
        ``b9_kills`` times an idle child is SIGKILLed and its replacement awaited.

        - child ready: a new child's ``ChildProc.ready_after``, the supervisor's own
          clock from asking for it (the zygote's fork, or ``Popen``) to its ``ready``
          message (handlers imported): every child, the first two and each replacement;
        - replaced after: from the SIGKILL (this thread, ``time.monotonic``) to the
          replacement's ``ready`` (``spawned + ready_after``, the same clock);
        - all ready after start: from ``client.start()`` to both children ready.

        This thread looks every 20 ms (the times are the supervisor's; a tighter poll
        would take the GIL from it)."""
        order = self.START_METHODS if self._b9_rep % 2 == 0 else tuple(reversed(self.START_METHODS))
        self._b9_rep += 1
        row: dict[str, Any] = {"order": list(order)}
        for method in order:
            got = self.child_replacements(method)
            row.update({f"{k}_{method}": v for k, v in got.items()})
        for key in ("child_ready_ms", "replaced_ms"):
            if row.get(f"{key}_spawn") and row.get(f"{key}_zygote"):
                row[f"{key}_zygote_over_spawn"] = round(row[f"{key}_zygote"] / row[f"{key}_spawn"], 3)
        return row

    _b9_rep = 0

    def child_replacements(self, method: str) -> dict[str, Any]:
        kills = self.n["b9_kills"]
        ready_ms: list[float] = []
        replaced_ms: list[float] = []
        with self.server.fresh() as dsn:
            client = cy.Client(dsn, mux_of(bench_steps.noop), workers=2, start_method=method)
            try:
                t0 = time.monotonic()
                client.start()
                sup = client.supervisor
                wait_until(lambda: all_ready(sup, 2), 60, 0.02, "children ready")
                first = list(sup.children)
                all_ready_ms = (max(c.spawned + c.ready_after for c in first) - t0) * 1000
                ready_ms += [c.ready_after * 1000 for c in first]
                for _ in range(kills):
                    time.sleep(0.1)  # the supervisor settles (its strays check, its registry row)
                    before = {c.pid for c in sup.children}
                    victim = next(c for c in sup.children if c.ready and c.attempt is None)
                    t_kill = time.monotonic()
                    os.kill(victim.pid, signal.SIGKILL)  # our own unreaped child (the supervisor runs here)
                    wait_until(lambda: all_ready(sup, 2) and {c.pid for c in sup.children} != before, 30, 0.02,
                               "a replacement ready")
                    new = next(c for c in sup.children if c.pid not in before)
                    ready_ms.append(new.ready_after * 1000)
                    replaced_ms.append((new.spawned + new.ready_after - t_kill) * 1000)
                stats = sup.stats
                client.shutdown()
            finally:
                with contextlib.suppress(Exception):
                    client.stop()
                client.close()
        return {
            "child_ready_ms": round(statistics.median(ready_ms), 2),
            "replaced_ms": round(statistics.median(replaced_ms), 2),
            "replaced_ms_max": round(max(replaced_ms), 2),
            "all_ready_after_start_ms": round(all_ready_ms, 1),
            "children_forked": stats["children_forked"], "children_spawned": stats["children_spawned"],
            "child_ready_ms_each": [round(x, 2) for x in ready_ms],
            "replaced_ms_each": [round(x, 2) for x in replaced_ms],
        }


# -- the report -------------------------------------------------------------------------------

# (benchmark, metric key, label, format, target text, check(median, medians) -> bool | None)
def rows_spec(peer: dict[str, float], n: dict[str, int]) -> list[tuple]:
    pgq, cel = peer["pgqueuer_s1"], peer["celery_s1"]
    pgq_all, cel_all = peer["pgqueuer_s1_incl_startup"], peer["celery_s1_incl_startup"]
    b1_floor, b1_floor_all = max(pgq, 4 * cel), max(pgq_all, 4 * cel_all)
    # The throughput targets are judged with prefetch, as the peers' defaults prefetch
    # (pgqueuer fetches 10 jobs a query, Celery 4 per process); without it SPEC 4 claims
    # only for free children: one database round trip per step per child.
    return [
        ("B1", "steps_per_s", f"no-op steps/s ({n['b1_steps']}, 2 workers), prefetch=0 (claims only for idle children), from start",
         "{:,.0f}",
         f"(Celery prefork {cel_all:,.0f})", None),
        ("B1", "steps_per_s_from_first_start", "no-op steps/s, prefetch=0, from first handler start (peers' way)",
         "{:,.0f}", f"(Celery prefork {cel:,.0f})", None),
        ("B1", "steps_per_s_prefetch", f"no-op steps/s, prefetch={PREFETCH} (the default), from supervisor start", "{:,.0f}",
         f">= {b1_floor_all:,.0f} (pgqueuer {pgq_all:,.0f}; 4x Celery {4 * cel_all:,.0f}; from start)",
         lambda v, m: v >= b1_floor_all),
        ("B1", "steps_per_s_from_first_start_prefetch", f"no-op steps/s, prefetch={PREFETCH}, from first start",
         "{:,.0f}", f">= {b1_floor:,.0f} (pgqueuer {pgq:,.0f}; 4x Celery {4 * cel:,.0f})",
         lambda v, m: v >= b1_floor),
        ("B1", "statements_prefetch", f"hot-path statements for {n['b1_steps']:,} steps, prefetch={PREFETCH}",
         "{:,.0f}", "", None),
        ("B1", "wal_kb_per_step", "WAL written per step, B1 (KiB)", "{:.2f}", "", None),
        ("B1", "enqueue_single_per_s", f"enqueue, 1 call/step ({n['b1_single']:,} calls)", "{:,.0f}",
         "(peers 780-2,250)", None),
        ("B1", "enqueue_many_one_call_per_s", f"enqueue_many, {n['b1_bulk']:,} in one call", "{:,.0f}",
         ">= 30,000", lambda v, m: v >= 30000),
        ("B1", "enqueue_many_batches_per_s", f"enqueue_many, batches of {n['b1_batch']:,}", "{:,.0f}",
         ">= 30,000", lambda v, m: v >= 30000),
        ("B2", "efficiency", f"CPU efficiency vs 2 ideal cores ({n['b2_steps']} x 20 ms), prefetch=0", "{:.3f}",
         "(calibrated in this process: CPU speed drifts)", None),
        ("B2", "efficiency_prefetch", f"CPU efficiency vs 2 ideal cores, prefetch={PREFETCH}", "{:.3f}",
         ">= 0.95", lambda v, m: v >= 0.95),
        ("B2", "cores_busy", "steps' CPU in the children / (2 cores x wall), prefetch=0", "{:.3f}",
         "(CPU-speed independent)", None),
        ("B2", "cores_busy_prefetch", f"steps' CPU in the children / (2 cores x wall), prefetch={PREFETCH}",
         "{:.3f}", ">= 0.95", lambda v, m: v >= 0.95),
        ("B2", "pool2_efficiency_prefetch", "multiprocessing.Pool(2) efficiency vs 2 ideal cores, no database "
         "(right after the prefetch run)", "{:.3f}", "(this VM's ceiling right then)", None),
        ("B2", "efficiency_vs_pool2", "CPU efficiency vs multiprocessing.Pool(2), prefetch=0", "{:.3f}", "", None),
        ("B2", "efficiency_vs_pool2_prefetch", f"CPU efficiency vs multiprocessing.Pool(2), prefetch={PREFETCH}",
         "{:.3f}", "", None),
        ("B2", "efficiency_incl_startup", "CPU efficiency incl. supervisor start", "{:.3f}", "", None),
        # --limits (issue 20): the same runs with every resource limit set, each beside the run without
        ("B1", "steps_per_s_limits", "no-op steps/s, prefetch=0, with limits (--limits)", "{:,.0f}", "", None),
        ("B1", "limits_ratio", "B1 with limits / without, prefetch=0 (median of the pairs' ratios)", "{:.3f}",
         ">= 0.95", lambda v, m: v >= 0.95),
        ("B1", "steps_per_s_prefetch_limits", f"no-op steps/s, prefetch={PREFETCH}, with limits", "{:,.0f}", "",
         None),
        ("B1", "limits_ratio_prefetch", f"B1 with limits / without, prefetch={PREFETCH}", "{:.3f}", ">= 0.95",
         lambda v, m: v >= 0.95),
        ("B2", "cores_busy_limits", "steps' CPU / (2 cores x wall), prefetch=0, with limits", "{:.3f}", "", None),
        ("B2", "limits_ratio_cores_busy", "B2 cores busy with limits / without, prefetch=0", "{:.3f}", ">= 0.95",
         lambda v, m: v >= 0.95),
        ("B2", "cores_busy_prefetch_limits", f"steps' CPU / (2 cores x wall), prefetch={PREFETCH}, with limits",
         "{:.3f}", "", None),
        ("B2", "limits_ratio_cores_busy_prefetch", f"B2 cores busy with limits / without, prefetch={PREFETCH}",
         "{:.3f}", ">= 0.95", lambda v, m: v >= 0.95),
        ("B2", "limits_ratio_vs_pool2_prefetch", f"B2 efficiency vs Pool(2) with limits / without, prefetch={PREFETCH}",
         "{:.3f}", ">= 0.95", lambda v, m: v >= 0.95),
        ("B3", "slot_back_after_s", "wedged C loop: slot back after (s)", "{:.3f}",
         "<= 1.75 (timeout 1 + grace 0.5 + 0.25)", lambda v, m: v <= 1.75),
        ("B3", "wedge_failed_after_s", "wedged step marked failed after (s)", "{:.3f}", "", None),
        ("B4", "rerun_started_after_s", "supervisor SIGKILL: re-run started after (s)", "{:.3f}",
         "<= 3.5 (ttl 2 + sweep tick 1 + 0.5)", lambda v, m: v <= 3.5),
        ("B4", "completed_after_s", "supervisor SIGKILL: completed by another after (s, incl. 3 s re-run)",
         "{:.3f}", "<= 6.5", lambda v, m: v <= 6.5),
        ("B4", "orphan_child_dead_after_s", "orphaned child dead after (s)", "{:.3f}", "<= 1.0",
         lambda v, m: v <= 1.0),
        ("B5", "p50_ms", f"idle pickup latency p50 (ms, {n['b5_samples']} samples)", "{:.2f}", "< 5",
         lambda v, m: v < 5),
        ("B5", "p99_ms", "idle pickup latency p99 (ms)", "{:.2f}", "", None),
        ("B6", "steps_per_s", f"B1 with {n['b6_queued']:,} queued + {n['b6_finished']:,} finished rows, "
         "prefetch=0, from start", "{:,.0f}", "", None),
        ("B6", "b1_paired_steps_per_s", "the same on an empty database, just before (the pair's B1)", "{:,.0f}",
         "", None),
        ("B6", "ratio_to_b1", "B6 / B1, defaults (median of the pairs' ratios)", "{:.2f}", ">= 0.80",
         lambda v, m: v >= 0.8),
        ("B6", "steps_per_s_prefetch", f"B6 with prefetch={PREFETCH}, from start", "{:,.0f}", "", None),
        ("B6", "b1_paired_steps_per_s_prefetch", f"the same on an empty database, just before (prefetch={PREFETCH})",
         "{:,.0f}", "", None),
        ("B6", "ratio_to_b1_prefetch", f"B6 / B1, prefetch={PREFETCH} (median of the pairs' ratios)", "{:.2f}",
         ">= 0.80", lambda v, m: v >= 0.8),
        ("B6", "wal_kb_per_step", "WAL written per step, B6 (KiB)", "{:.2f}", "", None),
        ("B1", "steps_per_s_pgbouncer", "B1 steps/s through PgBouncer, transaction mode, no prepared statements",
         "{:,.0f}", "(beside B1 direct)", None),
        ("B1", "ratio_pgbouncer", "  ... / B1 direct (same repetition)", "{:.2f}", "", None),
        ("B1", "steps_per_s_pgbouncer_prepared", "B1 steps/s through PgBouncer, max_prepared_statements=100",
         "{:,.0f}", "(beside B1 direct)", None),
        ("B1", "ratio_pgbouncer_prepared", "  ... / B1 direct (same repetition)", "{:.2f}", "", None),
        ("B1", "steps_per_s_prefetch_pgbouncer", f"B1 steps/s through PgBouncer, no prepared statements, prefetch={PREFETCH}",
         "{:,.0f}", "", None),
        ("B1", "steps_per_s_prefetch_pgbouncer_prepared",
         f"B1 steps/s through PgBouncer, max_prepared_statements=100, prefetch={PREFETCH}", "{:,.0f}", "", None),
        ("B7", "supervisor_rss_start_mb", "supervisor RSS start (MiB)", "{:.1f}", "", None),
        ("B7", "supervisor_rss_max_mb", f"supervisor RSS max over {n['b7_steps']:,} steps (MiB)", "{:.1f}", "", None),
        ("B7", "supervisor_rss_end_mb", "supervisor RSS end (MiB)", "{:.1f}", "", None),
        ("B7", "supervisor_rss_growth_mb", "supervisor RSS growth end - start (MiB)", "{:.1f}", "flat (<= 2)",
         lambda v, m: v <= 2.0),
        ("B7", "supervisor_cpu_ms_per_step", "supervisor CPU per step (ms)", "{:.3f}", "", None),
        ("B7", "sustained_steps_per_s", f"sustained steps/s over {n['b7_steps']:,} (supervisor process, prefetch={PREFETCH})",
         "{:,.0f}", f"(pgqueuer {peer['pgqueuer_s1_n20000']:,.0f} at 20,000)", None),
        ("B7", "child_start_ms_p50", "fresh child spawn to ready (ms)", "{:.1f}", "< 50", lambda v, m: v < 50),
        ("B1", "child_ready_ms", "child spawn to ready in the B1 supervisor, its handlers' module imported (ms)",
         "{:.1f}", "< 100 (replaced well under 100 ms)", lambda v, m: v < 100),
        ("B7", "child_rss_mb", "fresh child RSS (MiB)", "{:.1f}", "", None),
        ("B8", "keyed_ratio_to_b1", f"B1 with a concurrency key on every step ({n['b8_keys']} keys) / B1 "
         "(median of pairs)", "{:.2f}", ">= 0.80 (issue 21)", lambda v, m: v >= 0.80),
        ("B8", "limited_ratio_to_b1", "B1 with a key and a per-key concurrency limit / B1 (median of pairs)",
         "{:.2f}", ">= 0.80", lambda v, m: v >= 0.80),
        ("B8", "claim_ms_small", f"one claim of 8, {8 * n['b8_claims'] + n['b8_claim_keys']:,} queued over {n['b8_claim_keys']:,} keys (ms)", "{:.2f}",
         "", None),
        ("B8", "claim_ms_big", f"one claim of 8, {n['b8_queued']:,} queued over {n['b8_claim_keys']:,} keys (ms)",
         "{:.2f}", "", None),
        ("B8", "claim_big_over_small", "claim time, big backlog / small", "{:.2f}", "flat (<= 1.5)",
         lambda v, m: v <= 1.5),
        ("B9", "child_ready_ms_spawn", "fresh child ready, start_method=spawn (ms, its handlers' module imported)",
         "{:.2f}", "", None),
        ("B9", "child_ready_ms_zygote", "fresh child ready, start_method=zygote (ms)", "{:.2f}", "< 10 (issue 23)",
         lambda v, m: v < 10),
        ("B9", "replaced_ms_spawn", f"SIGKILLed child replaced (ready) after, spawn (ms, median of {n['b9_kills']})",
         "{:.2f}", "", None),
        ("B9", "replaced_ms_zygote", f"SIGKILLed child replaced (ready) after, zygote (ms, median of {n['b9_kills']})",
         "{:.2f}", "<= 20 (issue 23)", lambda v, m: v <= 20),
        ("B9", "replaced_ms_max_zygote", "  ... slowest replacement, zygote (ms)", "{:.2f}", "", None),
        ("B9", "all_ready_after_start_ms_spawn", "supervisor start to 2 children ready, spawn (ms)", "{:.1f}", "",
         None),
        ("B9", "all_ready_after_start_ms_zygote", "supervisor start to 2 children ready, zygote (ms)", "{:.1f}", "",
         None),
        ("B10", "steps_per_s", f"B1 with {n['b10_archived']:,} finished runs archived, prefetch=0, from start",
         "{:,.0f}", "", None),
        ("B10", "b1_paired_steps_per_s", "the same on an empty database, right before or after (the pair's B1)", "{:,.0f}",
         "", None),
        ("B10", "ratio_to_b1", "B10 / B1, prefetch=0 (median of the pairs' ratios)", "{:.3f}", ">= 0.90 (issue 22)",
         lambda v, m: v >= 0.9),
        ("B10", "steps_per_s_prefetch", f"B10 with prefetch={PREFETCH}, from start", "{:,.0f}", "", None),
        ("B10", "b1_paired_steps_per_s_prefetch", f"the same on an empty database (prefetch={PREFETCH})", "{:,.0f}",
         "", None),
        ("B10", "ratio_to_b1_prefetch", f"B10 / B1, prefetch={PREFETCH} (median of the pairs' ratios)", "{:.3f}",
         ">= 0.90 (issue 22)", lambda v, m: v >= 0.9),
        ("B10", "retention_s", "retention: one history pass dropping all archived days but two (s)", "{:.2f}", "",
         None),
        ("B10", "partitions_dropped", "  partitions dropped", "{:,.0f}", "", None),
        ("B10", "runs_dropped", "  runs they held", "{:,.0f}", "", None),
        ("B10", "runs_expired_by_row", "  runs deleted row by row", "{:,.0f}", "", None),
        ("B10", "archive_read_max_ms", "  longest archive read by id meanwhile (ms; every 2 ms)", "{:.1f}",
         "no long lock (< 1,000)", lambda v, m: v < 1000),
        ("B10", "hot_enqueue_cancel_max_ms", "  longest enqueue + cancel meanwhile (ms; every 10 ms)", "{:.1f}",
         "no long lock (< 1,000)", lambda v, m: v < 1000),
        ("B11", "base_steps_per_s", f"B1 sustained, prefetch=0: baseline steps/s (median of {B11_WINDOW} s windows)",
         "{:,.0f}", "", None),
        ("B11", "hold_median_ratio", "  while a transaction holds an xid (idle in transaction) / baseline",
         "{:.2f}", "", None),
        ("B11", "after_first_ratio", f"  first {B11_WINDOW} s after it ended / baseline", "{:.2f}", "", None),
        ("B11", "recovered_after_s", "  back to >= 90 % of baseline after (s)", "{:.0f}", "<= 60 (issue 22)",
         lambda v, m: v <= 60),
        ("B11", "after_first_ratio_control", "  control run (no holder): the same window / its baseline", "{:.2f}", "",
         None),
        ("B11", "base_db_cpu_ms_per_step", "  PostgreSQL CPU per step, baseline (ms; steadier than steps/s here)",
         "{:.3f}", "", None),
        ("B11", "hold_db_cpu_ratio", "  ... while the transaction is held / baseline", "{:.2f}", "", None),
        ("B11", "after_first_db_cpu_ratio", f"  ... first {B11_WINDOW} s after it ended / baseline", "{:.2f}", "", None),
        ("B11", "cost_recovered_after_s", "  PostgreSQL CPU per step back to <= 110 % of baseline after (s)", "{:.0f}",
         "<= 60", lambda v, m: v <= 60),
        ("B11", "hold_median_ratio_control", "  control run: the hold's windows / its baseline", "{:.2f}", "", None),
        ("B11", "base_steps_per_s_prefetch", f"B1 sustained, prefetch={PREFETCH}: baseline steps/s", "{:,.0f}", "",
         None),
        ("B11", "hold_median_ratio_prefetch", "  while a transaction holds an xid / baseline", "{:.2f}", "", None),
        ("B11", "after_first_ratio_prefetch", f"  first {B11_WINDOW} s after it ended / baseline", "{:.2f}", "",
         None),
        ("B11", "recovered_after_s_prefetch", "  back to >= 90 % of baseline after (s)", "{:.0f}",
         "<= 60 (issue 22)", lambda v, m: v <= 60),
        ("B11", "after_first_ratio_prefetch_control", "  control run (no holder): the same window / its baseline",
         "{:.2f}", "", None),
        ("B11", "base_db_cpu_ms_per_step_prefetch", "  PostgreSQL CPU per step, baseline (ms)", "{:.3f}", "", None),
        ("B11", "hold_db_cpu_ratio_prefetch", "  ... while the transaction is held / baseline", "{:.2f}", "", None),
        ("B11", "after_first_db_cpu_ratio_prefetch", f"  ... first {B11_WINDOW} s after it ended / baseline", "{:.2f}",
         "", None),
        ("B11", "cost_recovered_after_s_prefetch", "  PostgreSQL CPU per step back to <= 110 % of baseline after (s)",
         "{:.0f}", "<= 60", lambda v, m: v <= 60),
        ("B11", "hold_median_ratio_prefetch_control", "  control run: the hold's windows / its baseline", "{:.2f}", "",
         None),
        *b12_rows(n),
    ]


def b12_rows(n: dict[str, Any]) -> list[tuple]:
    """B12's rows, one group per supervisor count (benchmarks/scale.py)."""
    rows: list[tuple] = []
    for k in n["b12_sizes"]:
        rows += [
            ("B12", f"steps_per_s_k{k}", f"{k} supervisor(s) x 2 children, prefetch={n['b12_prefetch']}: steps/s "
             f"({n['b12_steps']:,} no-ops, first start to last finish)", "{:,.0f}", "", None),
            ("B12", f"conns_per_supervisor_max_k{k}", "  connections per supervisor (most seen, pg_stat_activity)",
             "{:.0f}", "= docs/operating.md (4)", lambda v, m: v == SUPERVISOR_CONNECTIONS),
            ("B12", f"sweep_statements_per_s_idle_k{k}", "  sweep statements/s, idle (pg_stat_statements)", "{:.1f}",
             "bounded (<= 3)", lambda v, m: v <= 3),
            ("B12", f"sweep_statements_per_s_run_k{k}", "  sweep statements/s, running", "{:.1f}", "bounded (<= 3)",
             lambda v, m: v <= 3),
            ("B12", f"sweep_turn_statements_per_s_idle_k{k}", "  sweep turn checks/s, idle (one small statement each)",
             "{:.1f}", "", None),
            ("B12", f"engine_sweeps_per_s_k{k}", "  sweep passes/s (the supervisors' own count)", "{:.2f}", "", None),
            ("B12", f"db_cpu_share_k{k}", "  database CPU / (2 cores x run wall)", "{:.2f}", "", None),
            ("B12", f"db_cpu_ms_per_step_k{k}", "  database CPU ms per step", "{:.3f}", "", None),
            ("B12", f"supervisors_cpu_ms_per_step_k{k}", "  supervisors' CPU ms per step (with their children)",
             "{:.3f}", "", None),
        ]
    for k in n["b12_sizes"]:
        if k > 4 and 4 in n["b12_sizes"]:
            rows.append(("B12", f"ratio_{k}_to_4", f"steps/s with {k} supervisors / with 4", "{:.2f}",
                         ">= 1.0 (issue 23 target 5)" if k == 8 else ">= 0.9 (no collapse)",
                         (lambda v, m: v >= 1.0) if k == 8 else (lambda v, m: v >= 0.9)))
    return rows


def summarize(results: dict[str, Any], peer: dict[str, float], counts: dict[str, int]) -> list[dict[str, Any]]:
    medians: dict[tuple[str, str], float] = {}
    for b, res in results.items():
        if b == "meta":
            continue
        for key in {k for s in res["samples"] for k, v in s.items() if isinstance(v, (int, float)) and not isinstance(v, bool)}:
            m = median([s.get(key) for s in res["samples"]])
            if m is not None:
                res["median"][key] = m
                medians[(b, key)] = m
    rows = []
    for b, key, label, fmt, target, check in rows_spec(peer, counts):
        if b not in results:
            continue
        v = medians.get((b, key))
        each = [s.get(key) for s in results[b]["samples"]]
        if v is None and "pgbouncer" in key:  # measured with --pgbouncer only
            continue
        ok = None if v is None or check is None else bool(check(v, medians))
        rows.append({"bench": b, "metric": key, "label": label, "median": v, "each": each, "target": target,
                     "met": ok, "fmt": fmt})
    rows.sort(key=lambda r: r["bench"])  # stable: spec order within a benchmark
    return rows


def print_table(rows: list[dict[str, Any]], results: dict[str, Any], quick: bool = False) -> None:
    """The table of medians beside the targets; with ``quick`` (small counts, not
    comparable to the targets) the targets are shown but not judged."""
    title = "cyclone_mp benchmarks (medians; issue 8 targets)"
    table = Table(title=title + (" - QUICK counts: targets not judged" if quick else ""), show_lines=False)
    for col, kw in (("", {}), ("metric", {}), ("median", {"justify": "right"}), ("each run", {}),
                    ("target", {}), ("", {})):
        table.add_column(col, **kw)
    for r in rows:
        fmt = r["fmt"]
        med = "-" if r["median"] is None else fmt.format(r["median"])
        each = " / ".join("-" if x is None else fmt.format(x) for x in r["each"])
        mark = "" if quick else {True: "[green]met[/]", False: "[red]missed[/]", None: ""}[r["met"]]
        table.add_row(r["bench"], r["label"], med, each, r["target"], mark)
    console.print(table)
    for b, res in results.items():
        if isinstance(res, dict) and res.get("errors"):
            for e in res["errors"]:
                console.print(f"[red]{b} error:[/] {e.splitlines()[-1] if e else e}")


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


def ensure_bytecode() -> str:
    """Compile cyclone_mp's modules to bytecode if they have none, as ``pip install``
    does for an installed package, so every child does not compile them from source at
    its start. An editable install never gets bytecode written while
    ``PYTHONDONTWRITEBYTECODE`` is set (this VM sets it): measured, a fresh child then
    took 50-52 ms to be ready instead of 29-42 ms. Returns what was done (for the JSON)."""
    pkg = os.path.dirname(os.path.abspath(cy.__file__))
    sources = [os.path.join(d, f) for d, _, files in os.walk(pkg) for f in files if f.endswith(".py")]
    def stale(source: str) -> bool:
        cached = importlib.util.cache_from_source(source)
        return not os.path.exists(cached) or os.path.getmtime(cached) < os.path.getmtime(source)

    missing = [f for f in sources if stale(f)]
    if not missing:
        return "present"
    compileall.compile_dir(pkg, quiet=1)  # py_compile writes whatever PYTHONDONTWRITEBYTECODE says
    return f"compiled by the benchmark for {len(missing)} of {len(sources)} modules (as pip install does)"


def git_state(root: str | None = None) -> dict[str, Any]:
    """The commit measured, and whether the engine (``cyclone_mp/`` and ``cli/`` of the checkout ``root``,
    this one by default) had uncommitted changes."""
    root = root or os.path.dirname(HERE)
    try:
        head = subprocess.run(["git", "rev-parse", "--short", "HEAD"], cwd=root, capture_output=True, text=True,
                              timeout=10).stdout.strip()
        dirty = subprocess.run(["git", "status", "--porcelain", "--", "cyclone_mp", "cli"], cwd=root, capture_output=True,
                               text=True, timeout=10).stdout.strip()
        return {"commit": head or None, "engine_uncommitted_changes": bool(dirty)}
    except (OSError, subprocess.SubprocessError):
        return {"commit": None}


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


def run_peers(args: argparse.Namespace) -> int:
    """``--peers`` (issue 23): the peer harness's S1 and S2, then the comparison table
    (benchmarks/peers.py). Exit status 2 with one message when the harness or pgqueuer
    is missing, 1 when the harness failed."""
    import peers

    try:
        harness = peers.find_harness(args.peer_bench)
        python = os.path.abspath(args.peer_python or os.environ.get(peers.PYTHON_ENV) or sys.executable)
        found = peers.check_python(python, harness)
    except peers.PeerBenchUnavailable as exc:
        console.print(f"[red]benchmarks --peers:[/] {exc}", highlight=False, soft_wrap=True)
        return 2
    mine = os.path.join(os.path.dirname(HERE), "cyclone_mp")
    if os.path.realpath(found.get("cyclone_mp_path", "")) != os.path.realpath(mine):
        console.print(f"[yellow]note:[/] {python} imports cyclone_mp from {found.get('cyclone_mp_path')}, "
                      f"not this checkout's {mine}: that one is measured")
    stamp = dt.datetime.now().strftime("%Y%m%d-%H%M%S")
    out = args.out or os.path.join(HERE, "results", f"peers-{stamp}.json")
    os.makedirs(os.path.dirname(os.path.abspath(out)), exist_ok=True)
    logdir = tempfile.mkdtemp(prefix="cyclone-mp-peers-")
    meta: dict[str, Any] = {"started": dt.datetime.now(dt.timezone.utc).isoformat(), "quick": args.quick,
                            "repeat": args.repeat, "harness": harness, "python": python, "imports": found,
                            "loadavg_start": loadavg(), **git_state()}
    if os.path.realpath(found.get("cyclone_mp_path", "")) == os.path.realpath(mine):
        meta["cyclone_mp_bytecode"] = ensure_bytecode()  # as an installed package has (see ensure_bytecode)
    console.print(f"peer harness {harness}; interpreter {python}; cyclone-mp {found['versions'].get('cyclone-mp')}, "
                  f"pgqueuer {found['versions'].get('pgqueuer')}; load average {meta['loadavg_start']}")
    harness_out = (out[:-len(".json")] if out.endswith(".json") else out) + "-harness.json"
    t = time.time()
    try:
        data = peers.run_harness(harness, python, quick=args.quick, repeat=args.repeat, out=harness_out,
                                 logdir=logdir, echo=lambda line: console.print(line, highlight=False, markup=False))
    except RuntimeError as exc:
        console.print(f"[red]benchmarks --peers:[/] {exc}")
        return 1
    meta.update({"loadavg_end": loadavg(), "seconds": round(time.time() - t, 1)})
    rows = peers.summarize(data)
    with open(out, "w") as fh:
        json.dump({"meta": meta, "summary": rows, "harness": data}, fh, indent=2, default=str)
    peers.print_summary(rows, data, console, args.quick)
    if data.get("errors"):
        console.print(f"worker logs kept in {logdir}")
    else:
        shutil.rmtree(logdir, ignore_errors=True)
    console.print(f"load average: start {meta['loadavg_start']}, end {meta['loadavg_end']}; {meta['seconds']} s; "
                  f"JSON: {out} (the harness's own: {harness_out})")
    return 0


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
                    help="B12's prefetch per supervisor (default 64; 0: the engine's default)")
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
        return run_peers(args)
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
