"""B12, many supervisors on one PostgreSQL (issue 22 acceptance 3, issue 23 target 5).

For each count k (1, 2, 4, 8, 16): k supervisor processes (``python -m
cyclone_mp.testing.worker``, ``workers=2`` each, ``prefetch`` as asked) on one fresh
database. Once every one of them runs, they are left idle for a few seconds (what idle
supervisors cost the database), then n no-ops are enqueued in one ``enqueue_many``
and timed until all are completed. Measured:

* **steps/s**: n / (last ``finished_at`` - first ``started_at``), the database clock;
* **connections per supervisor**: ``pg_stat_activity`` sampled every 0.1 s, sessions
  grouped by the supervisor id that ends their ``application_name``
  (``cyclone_mp <part> <supervisor id>``): the most any supervisor had, and the parts;
* **statements per second** by kind (sweep, registry, claim and settle, renewal,
  other), idle and while running: ``pg_stat_statements`` when the server has it loaded
  (the benchmark's own embedded server is restarted with it for B12), else only the
  engine's own count of sweep passes (each supervisor's ``stats``, published in its
  registry row);
* **database CPU**: CPU seconds of the postmaster and every process under it (psutil)
  over the run, and as a share of two cores;
* the supervisors' own CPU (each process and its children), and what the server's
  active sessions waited on most (``wait_event``, sampled).
"""

from __future__ import annotations

import collections
import contextlib
import os
import re
import threading
import time
from typing import Any, Callable

import psutil
import psycopg

import bench_steps
from common import SupervisorProcess, console
from cyclone_mp.store import Q

PARTS_PREFIX = "cyclone_mp "
REGISTRY_INTERVAL = 2.0  # seconds: the supervisors' default registry_interval
#: statement kinds of the report, by the names of the sql/*.sql files they come from
KINDS = {
    "sweep": ("sweep_candidates", "due_timer_runs", "sweep_recheck", "reclaim", "discard_reclaim_limit"),
    "sweep_turn": ("sweep_turn",),
    "registry": ("register_worker", "unregister_worker", "queue_depths", "prune_workers"),
    "claim_settle": ("claim", "claim_concurrency", "claim_fair", "claim_plain", "settle", "settle_concurrency",
                     "settle_fair", "settle_plain", "settle_completions", "settle_completions_concurrency",
                     "settle_completions_fair", "settle_completions_plain", "release"),
    "renew": ("heartbeat", "renew_many", "lease_state"),
    "schedules": ("sync_schedules", "sync_schedule_definitions", "forget_schedule_definitions", "due_schedules",
                  "schedules_in_force", "advance_schedule"),
}


BENCH_MARK = "/* cyclone_mp bench */"  # starts the benchmark's own statements (not counted)
#: Steps not yet done, read through the partial indexes of the claim and the sweep (as the
#: peer harness does): cheap enough to poll every 20 ms while 20,000 rows finish.
LEFT = (" SELECT (SELECT count(*) FROM cyclone_steps WHERE state = 'available')"
        " + (SELECT count(*) FROM cyclone_steps WHERE state = 'running')")
_CONSTANT = re.compile(r"%\(\w+\)s|\$\d+|'(?:[^']|'')*'|\b\d+(?:\.\d+)?\b")


def _normal(sql: str) -> str:
    """A statement's text with parameters and constants as ``?`` (what pg_stat_statements
    keeps has them as $n) and white space squeezed, up to its 200th character."""
    return " ".join(_CONSTANT.sub("?", sql).split())[:200]


_KNOWN = sorted(((_normal(sql), name) for name, sql in Q.items() if not name.endswith(("_ctes", "_expr"))),
                key=lambda p: -len(p[0]))


def statement_name(query: str) -> str | None:
    """The sql/*.sql name a ``pg_stat_statements`` query text comes from (the longest
    known text it starts with), or None."""
    text = _normal(query)
    for known, name in _KNOWN:
        if len(known) >= 12 and (text.startswith(known) or known.startswith(text) and len(text) >= 150):
            return name
    return None


def statement_kind(name: str | None) -> str:
    for kind, names in KINDS.items():
        if name in names:
            return kind
    return "other"


class Sampler:
    """Samples ``pg_stat_activity`` of one database every ``every`` seconds on a thread:
    sessions per supervisor (by the id that ends their application name) and parts, and
    the wait events of active sessions."""

    def __init__(self, admin_dsn: str, dbname: str, every: float = 0.1) -> None:
        self.admin_dsn, self.dbname, self.every = admin_dsn, dbname, every
        self.max_per_supervisor: dict[str, int] = {}
        self.parts: dict[str, set[str]] = collections.defaultdict(set)
        self.waits: collections.Counter[str] = collections.Counter()
        self.active_samples = 0
        self.samples = 0
        self.max_total = 0
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._run, daemon=True)

    def __enter__(self) -> "Sampler":
        self._thread.start()
        return self

    def __exit__(self, *exc: object) -> None:
        self._stop.set()
        self._thread.join(5)

    def _run(self) -> None:
        with psycopg.connect(self.admin_dsn, autocommit=True) as conn:
            while not self._stop.wait(self.every):
                rows = conn.execute(
                    "SELECT application_name, state, wait_event_type, wait_event FROM pg_stat_activity"
                    " WHERE datname = %s AND pid <> pg_backend_pid() AND backend_type = 'client backend'",
                    (self.dbname,)).fetchall()
                self.samples += 1
                self.max_total = max(self.max_total, len(rows))
                per: collections.Counter[str] = collections.Counter()
                for app, state, wtype, wevent in rows:
                    if app and app.startswith(PARTS_PREFIX):
                        part, _, owner = app[len(PARTS_PREFIX):].rpartition(" ")
                        if ":" in owner:  # a supervisor's part (the client pool has no id)
                            per[owner] += 1
                            self.parts[owner].add(part)
                    if state == "active":
                        self.active_samples += 1
                        self.waits[f"{wtype}:{wevent}" if wtype else "CPU"] += 1
                for owner, n in per.items():
                    self.max_per_supervisor[owner] = max(self.max_per_supervisor.get(owner, 0), n)


def postmaster_pid(conn: psycopg.Connection) -> int | None:
    """The server's postmaster pid when it runs on this host and we may read its data
    directory (the embedded server, or a local one as root), else None."""
    with contextlib.suppress(Exception):
        data_dir = conn.execute("SHOW data_directory").fetchone()[0]
        with open(os.path.join(data_dir, "postmaster.pid")) as fh:
            pid = int(fh.readline())
        if psutil.pid_exists(pid):
            return pid
    return None


def tree_cpu(pid: int | None) -> dict[int, float]:
    """CPU seconds (user + system) of ``pid`` and each of its descendants, by pid."""
    if pid is None:
        return {}
    out: dict[int, float] = {}
    with contextlib.suppress(psutil.Error):
        root = psutil.Process(pid)
        for p in [root, *root.children(recursive=True)]:
            with contextlib.suppress(psutil.Error):
                t = p.cpu_times()
                out[p.pid] = t.user + t.system
    return out


def cpu_delta(before: dict[int, float], after: dict[int, float]) -> float:
    """CPU seconds used between two :func:`tree_cpu` snapshots (a process that is gone by
    the second one is not counted: supervisors' sessions stay for the whole run)."""
    return sum(v - before.get(pid, 0.0) for pid, v in after.items())


def pgss_loaded(conn: psycopg.Connection) -> bool:
    """True when ``pg_stat_statements`` is loaded and its view exists in ``conn``'s database."""
    with contextlib.suppress(psycopg.Error):
        libs = conn.execute("SHOW shared_preload_libraries").fetchone()[0]
        if "pg_stat_statements" not in libs:
            return False
        conn.execute("CREATE EXTENSION IF NOT EXISTS pg_stat_statements")
        return True
    return False


def statement_counts(admin: psycopg.Connection, dbname: str) -> dict[str, int]:
    """Calls per sql/*.sql name (unknown ones as ``?<first words>``) in database ``dbname``."""
    rows = admin.execute(
        "SELECT query, calls FROM pg_stat_statements s JOIN pg_database d ON d.oid = s.dbid WHERE d.datname = %s",
        (dbname,)).fetchall()
    out: collections.Counter[str] = collections.Counter()
    for query, calls in rows:
        if query.startswith(BENCH_MARK):
            continue
        name = statement_name(query)
        out[name or "?" + " ".join(query.split()[:4])[:40]] += calls
    return dict(out)


def per_second(before: dict[str, int], after: dict[str, int], seconds: float) -> dict[str, float]:
    """Statements per second by kind (:data:`KINDS`) between two :func:`statement_counts`."""
    kinds: collections.Counter[str] = collections.Counter()
    for name, calls in after.items():
        kinds[statement_kind(name)] += calls - before.get(name, 0)
    kinds["all"] = sum(kinds.values())
    return {k: round(v / seconds, 1) for k, v in kinds.items()}


def engine_sweeps(conn: psycopg.Connection) -> int:
    """Sweep passes the supervisors say they made (their registry rows' ``stats``)."""
    row = conn.execute(BENCH_MARK + " SELECT coalesce(sum((info -> 'stats' ->> 'sweeps')::bigint), 0)"
                       " FROM cyclone_workers").fetchone()
    return int(row[0])


def supervisor_stats(conn: psycopg.Connection, keys: tuple[str, ...]) -> dict[str, int]:
    """The supervisors' counters summed, as their registry rows last published them."""
    rows = conn.execute(BENCH_MARK + " SELECT info -> 'stats' AS stats FROM cyclone_workers").fetchall()
    return {key: sum(int((r[0] or {}).get(key, 0)) for r in rows) for key in keys}


STATS = ("claimed", "completed", "prefetch_released", "released", "batches", "pipelined", "sweeps")


def scale_once(*, admin_dsn: str, dsn: str, dbname: str, k: int, n: int, prefetch: int, idle_s: float, tmp: str,
               start: Callable[..., Any], use_pgss: bool) -> dict[str, Any]:
    """One count ``k`` of B12 (see the module docstring); ``start(dsn, steps, options, tmp)``
    starts one supervisor process (``SupervisorProcess``)."""
    import cyclone_mp as cy

    sups: list[Any] = []
    try:
        for _ in range(k):
            sups.append(start(dsn, [bench_steps.noop], {"workers": 2, "prefetch": prefetch}, tmp))
        with psycopg.connect(admin_dsn, autocommit=True) as admin, psycopg.connect(dsn, autocommit=True) as db, \
                Sampler(admin_dsn, dbname) as sampler:
            deadline = time.monotonic() + 60
            while db.execute(BENCH_MARK + " SELECT count(*) FROM cyclone_workers").fetchone()[0] < k:
                if time.monotonic() > deadline:
                    raise TimeoutError(f"{k} supervisors not registered within 60 s")
                time.sleep(0.05)
            pm = postmaster_pid(admin)
            pgss = use_pgss and pgss_loaded(admin)
            # idle: what k idle supervisors cost the database
            s0 = statement_counts(admin, dbname) if pgss else {}
            sw0 = engine_sweeps(db)
            c0 = tree_cpu(pm)
            idle_sup0 = {s.pid: tree_cpu(s.pid) for s in sups}
            t0 = time.monotonic()
            time.sleep(idle_s)
            idle_wall = time.monotonic() - t0
            s1 = statement_counts(admin, dbname) if pgss else {}
            idle_db_cpu = cpu_delta(c0, tree_cpu(pm))
            idle_sup_cpu = sum(cpu_delta(idle_sup0[s.pid], tree_cpu(s.pid)) for s in sups)
            # the run
            sup_cpu0 = {s.pid: tree_cpu(s.pid) for s in sups}
            c1 = tree_cpu(pm)
            client = cy.Client(dsn, cy.Mux().register(bench_steps.noop))
            try:
                t_run = time.monotonic()
                client.enqueue_many(bench_steps.noop, [None] * n)
                while db.execute(BENCH_MARK + LEFT).fetchone()[0] > 0:
                    if time.monotonic() - t_run > 600:
                        raise TimeoutError(f"{n} steps not completed within 600 s with {k} supervisors")
                    time.sleep(0.02)
                run_wall = time.monotonic() - t_run
            finally:
                client.close()
            db_cpu = cpu_delta(c1, tree_cpu(pm)) if pm else None
            sup_cpu = sum(cpu_delta(sup_cpu0[s.pid], tree_cpu(s.pid)) for s in sups)
            s2 = statement_counts(admin, dbname) if pgss else {}
            sw1 = engine_sweeps(db)
            time.sleep(REGISTRY_INTERVAL + 0.3)  # every registry row refreshed once more
            counters = supervisor_stats(db, STATS)
            first, last, reclaims, gens = db.execute(
                BENCH_MARK + " SELECT extract(epoch FROM min(started_at)), extract(epoch FROM max(finished_at)), sum(reclaims),"
                " max(lease_generation) FROM cyclone_steps").fetchone()
        per_sup = sorted(sampler.max_per_supervisor.values())
        parts = sorted({p for ps in sampler.parts.values() for p in ps})
        process_s = float(last) - float(first)
        row: dict[str, Any] = {
            "supervisors": k, "steps": n, "prefetch": prefetch,
            "steps_per_s": round(n / process_s, 1), "steps_per_s_from_enqueue": round(n / run_wall, 1),
            "conns_per_supervisor_max": per_sup[-1] if per_sup else None,
            "conns_per_supervisor_min": per_sup[0] if per_sup else None,
            "supervisors_seen": len(per_sup), "conn_parts": parts, "conns_total_max": sampler.max_total,
            "db_cpu_s": round(db_cpu, 2) if db_cpu is not None else None,
            "db_cpu_share": round(db_cpu / (2 * run_wall), 3) if db_cpu is not None else None,
            "db_cpu_ms_per_step": round(db_cpu * 1000 / n, 3) if db_cpu is not None else None,
            "idle_db_cpu_share": round(idle_db_cpu / (2 * idle_wall), 3) if pm else None,
            "idle_supervisors_cpu_share": round(idle_sup_cpu / (2 * idle_wall), 3),
            "supervisors_cpu_ms_per_step": round(sup_cpu * 1000 / n, 3),
            "reclaims": int(reclaims or 0), "max_lease_generation": int(gens or 0),
            "top_waits": dict(sampler.waits.most_common(5)), "active_sessions_avg": round(
                sampler.active_samples / max(1, sampler.samples), 2),
            "engine_sweeps_per_s": round((sw1 - sw0) / (idle_wall + run_wall), 2),
            **{f"sup_{key}": v for key, v in counters.items()},
        }
        if pgss:
            row["idle_statements_per_s"] = per_second(s0, s1, idle_wall)
            row["run_statements_per_s"] = per_second(s1, s2, run_wall)
            row["sweep_statements_per_s_idle"] = row["idle_statements_per_s"].get("sweep", 0.0)
            row["sweep_statements_per_s_run"] = row["run_statements_per_s"].get("sweep", 0.0)
            row["sweep_turn_statements_per_s_idle"] = row["idle_statements_per_s"].get("sweep_turn", 0.0)
            row["statements_per_step"] = round((sum(s2.values()) - sum(s1.values())) / n, 3)
            row["top_statements_run"] = dict(collections.Counter(
                {name: s2[name] - s1.get(name, 0) for name in s2}).most_common(8))
        return row
    finally:
        for s in sups:
            with contextlib.suppress(Exception):
                s.stop()


def enable_pgss(server: Any) -> bool:
    """Restart the benchmark's own embedded server with ``pg_stat_statements`` loaded
    (``shared_preload_libraries``); False when it is not the benchmark's own server."""
    embedded = getattr(server, "_embedded", None)
    if embedded is None:
        return False
    with server.admin() as conn:
        libs = conn.execute("SHOW shared_preload_libraries").fetchone()[0]
        if "pg_stat_statements" in libs:
            return True
        conn.execute("ALTER SYSTEM SET shared_preload_libraries = 'pg_stat_statements'")
    embedded.stop()
    server.admin_dsn = embedded.start(timeout=120)
    return True


class ScaleBenches:
    """B12, for :class:`run.Bench` (``self.server``, ``self.n``, ``self.tmp``)."""

    server: Any
    n: dict[str, Any]
    tmp: str

    def b12(self) -> dict[str, Any]:
        """Many supervisors on one PostgreSQL (benchmarks/py): each count in
        ``b12_sizes`` on a fresh database, ``prefetch`` as ``--scale-prefetch`` (the
        engine's default by default: what a user runs), in one repetition."""
        if not hasattr(self, "_pgss"):
            self._pgss = enable_pgss(self.server)
        row: dict[str, Any] = {"pg_stat_statements": self._pgss}
        for k in self.n["b12_sizes"]:
            with self.server.fresh() as dsn:
                dbname = psycopg.conninfo.conninfo_to_dict(dsn)["dbname"]
                one = scale_once(admin_dsn=self.server.admin_dsn, dsn=dsn, dbname=dbname, k=k,
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
