"""What every benchmark of ``benchmarks/run.py`` uses: the server, timing helpers, a
supervisor in this process or in its own, and the settings measured beside the defaults."""

from __future__ import annotations

import argparse
import compileall
import contextlib
import datetime as dt
import importlib.util
import os
import statistics
import subprocess
import json
import shutil
import signal
import sys
import tempfile
import time
import uuid
from typing import Any, Callable, Iterator

import psutil
import psycopg
from psycopg import sql
from psycopg.conninfo import make_conninfo

import cyclone_mp as cy
from cyclone_mp.config import PREFETCH_DEFAULT
from cyclone_mp.store import Store
from rich.console import Console

console = Console(width=None if sys.stdout.isatty() else 160)
# The default prefetch (issue 23), measured beside prefetch=0 (claims only for idle children, SPEC 4).
PREFETCH = PREFETCH_DEFAULT  # the "prefetch" runs measure the engine's default (256; 64 until 2026-12-03)
PREFETCH_KEYS = ("steps_per_s", "steps_per_s_from_first_start", "statements", "wal_kb_per_step")
#: Connections one supervisor holds (docs/operating.md#connections): lease keeper, its
#: LISTEN, outcome writer, maintenance. B12 judges what pg_stat_activity shows against it.
SUPERVISOR_CONNECTIONS = 4


def median(values: list[Any]) -> float | None:
    """The median of the numbers among ``values`` (None, text and the like left out), or None."""
    values = [v for v in values if isinstance(v, (int, float)) and not isinstance(v, bool)]
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

    def copy_of_template(self, prefix: str) -> tuple[str, str]:
        """A new database ``<prefix>_<random>`` cloned from the migrated template: ``(name, dsn)``."""
        name = f"{prefix}_{uuid.uuid4().hex[:8]}"
        self.create(name, self.template)
        return name, self.dsn_for(name)

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


def no_op_parser(doc: str) -> argparse.ArgumentParser:
    """The options of a script that runs a supervisor in this process over a queue of
    no-ops (``--steps``, ``--prefetch``, ``--dsn``); the script adds its own."""
    parser = argparse.ArgumentParser(description=doc.split("\n\n")[0])
    parser.add_argument("--steps", type=int, default=40000)
    parser.add_argument("--prefetch", type=int, default=256)
    parser.add_argument("--dsn", default=None, help="a server to use (default: an embedded one in a temp dir)")
    return parser


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


def tree_cpu(procs: list[psutil.Process]) -> dict[int, float]:
    """CPU seconds of each of ``procs`` (by pid; those gone are left out)."""
    out = {}
    for p in procs:
        with contextlib.suppress(psutil.Error):
            t = p.cpu_times()
            out[p.pid] = t.user + t.system
    return out


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
        return tree_cpu(procs)

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

    def __init__(self, dsn: str, steps: list[cy.Step], options: dict[str, Any], tmp: str,
                 workflows: tuple[cy.Workflow, ...] = ()) -> None:
        ready = os.path.join(tmp, f"ready-{uuid.uuid4().hex[:8]}")
        config = {
            "dsn": dsn, "workflows": [{"module": w.module, "name": w.name} for w in workflows],
            "options": options, "ready_file": ready, "parent_pid": os.getpid(),
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
    root = root or os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
    try:
        head = subprocess.run(["git", "rev-parse", "--short", "HEAD"], cwd=root, capture_output=True, text=True,
                              timeout=10).stdout.strip()
        dirty = subprocess.run(["git", "status", "--porcelain", "--", "cyclone_mp", "cli"], cwd=root, capture_output=True,
                               text=True, timeout=10).stdout.strip()
        return {"commit": head or None, "engine_uncommitted_changes": bool(dirty)}
    except (OSError, subprocess.SubprocessError):
        return {"commit": None}
