"""B7 (memory and child starts) and B9 (children in milliseconds, issue 23): methods of
:class:`run.Bench`."""

from __future__ import annotations

import contextlib
import os
import signal
import statistics
import subprocess
import time
from typing import Any

import psutil
import psycopg
from psycopg.conninfo import conninfo_to_dict

import bench_steps
import cyclone_mp as cy

from common import PREFETCH, CpuMeter, SupervisorProcess, all_ready, epoch, mux_of, tree_cpu, wait_until


def thread_cpu(proc: psutil.Process) -> dict[int, float]:
    """CPU seconds of each thread of ``proc`` (by thread id)."""
    with contextlib.suppress(psutil.Error):
        return {t.id: t.user_time + t.system_time for t in proc.threads()}
    return {}


def _is_helper(proc: psutil.Process) -> bool:
    """The supervisor's zygote or watchdog (not a handler child), by its command line."""
    with contextlib.suppress(psutil.Error):
        args = proc.cmdline()
        return "zygote" in args or "cyclone_mp._watchdog" in args
    return False


class ChildBenches:
    """B7 and B9 (the :class:`run.Bench` attributes they use: ``server``, ``n``, ``tmp``)."""

    # B7 -----------------------------------------------------------------------------------

    def child_starts(self) -> dict[str, Any]:
        """Spawn-to-ready of a fresh child (``python -m cyclone_mp._child``, as the supervisor
        starts it, via :class:`cyclone_mp.pool.ChildProc`) and its RSS once ready."""
        import selectors

        from cyclone_mp.childproc import ChildProc
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
                threads0 = thread_cpu(proc)
                kids0 = tree_cpu(proc.children(recursive=True))
                db_cpu = CpuMeter(database=conninfo_to_dict(dsn)["dbname"])
                samples = [rss_start]
                client.enqueue_many(bench_steps.noop, [None] * n)
                db_cpu.take()  # the steps' share from here: not the enqueue's insert
                conn = psycopg.connect(dsn, autocommit=True)
                done = 0
                deadline = time.monotonic() + 600
                while done < n:
                    if time.monotonic() > deadline:
                        raise TimeoutError(f"{done} of {n} steps completed after 600 s")
                    time.sleep(0.25)
                    samples.append(proc.memory_info().rss)
                    # the rows left, read through the partial indexes (a count of the completed
                    # ones scans the table and bills its CPU to the step's PostgreSQL share)
                    done = n - conn.execute("SELECT count(*) FROM cyclone_steps "
                                            "WHERE state IN ('available', 'running')").fetchone()[0]
                cpu_s = sum(proc.cpu_times()[:2]) - cpu0
                threads = {tid: t - threads0.get(tid, 0.0) for tid, t in thread_cpu(proc).items()}
                kids_now = proc.children(recursive=True)
                helpers = {k.pid for k in kids_now if _is_helper(k)}  # the zygote and the watchdog
                kids_by_pid = {pid: t - kids0.get(pid, 0.0) for pid, t in tree_cpu(kids_now).items()}
                kids_s = sum(kids_by_pid.values())
                helpers_s = sum(t for pid, t in kids_by_pid.items() if pid in helpers)
                db_s = db_cpu.take()
                last = conn.execute("SELECT max(finished_at), min(started_at) FROM cyclone_steps").fetchone()
                time.sleep(1.0)
                rss_end = proc.memory_info().rss
                kids = [k.memory_info().rss for k in sup.children()]
                # creep, apart from the high-water mark of the first waves: six more waves,
                # RSS 1 s after each, and the growth over the last two (the high-water mark
                # is reached in the second to the fourth wave, later on a faster machine;
                # after it, 400,000 steps added nothing: see benchmarks/README.md)
                waves = []
                for _ in range(6):
                    client.enqueue_many(bench_steps.noop, [None] * n)
                    wait_until(lambda: not conn.execute("SELECT count(*) FROM cyclone_steps "
                                                        "WHERE state IN ('available', 'running')").fetchone()[0], 600, every=0.25)
                    time.sleep(1.0)
                    waves.append(proc.memory_info().rss)
                conn.close()
            finally:
                sup.stop()
        row = {
            "steps": n, "supervisor_rss_start_mb": round(rss_start / 2**20, 1),
            "supervisor_rss_max_mb": round(max(samples + [rss_end]) / 2**20, 1),
            "supervisor_rss_end_mb": round(rss_end / 2**20, 1),
            "supervisor_rss_growth_mb": round((rss_end - rss_start) / 2**20, 1),
            "supervisor_rss_creep_mb": round((waves[5] - waves[3]) / 2**20, 1),
            "supervisor_cpu_ms_per_step": round(cpu_s * 1000 / n, 3),
            # issue 36's target 1, in us per step: the supervisor's threads (process control is
            # the main thread; the others are the outcome writer, the lease keeper, maintenance),
            # its processes (handler children, zygote, watchdog) and the database's backends
            "process_control_cpu_us_per_step": round(threads.get(sup.pid, 0.0) * 1e6 / n, 1),
            "other_threads_cpu_us_per_step": round(sum(t for tid, t in threads.items() if tid != sup.pid) * 1e6 / n, 1),
            "children_cpu_us_per_step": round(kids_s * 1e6 / n, 1),
            "zygote_and_watchdog_cpu_us_per_step": round(helpers_s * 1e6 / n, 1),
            "postgres_cpu_us_per_step": round(db_s * 1e6 / n, 1),
            "sustained_steps_per_s": round(n / (epoch(last[0]) - epoch(last[1])), 1),
            "children_rss_after_mb": [round(k / 2**20, 1) for k in kids],
        }
        row.update(self.child_starts())
        return row


    # B9 -----------------------------------------------------------------------------------

    START_METHODS = ("spawn", "zygote")
    # and "zygote_capped": the zygote, handlers that declare a process cap (so each child
    # joins the slot's v1 cgroups at birth, on a host whose caps live there)
    VARIANTS = {"spawn": ("spawn", False), "zygote": ("zygote", False), "zygote_capped": ("zygote", True)}

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
        - all ready after start: from ``client.start()`` to both children ready;
        - children created in their cgroup (``CLONE_INTO_CGROUP``), and children found in
          a v1 cgroup of their slot (moved there: each move may wait for a kernel RCU
          grace period), as ``/proc/<pid>/cgroup`` shows once ready.

        Three variants: ``spawn``, ``zygote``, and ``zygote_capped`` (the zygote, with a
        handler that declares ``max_processes``: children join the slot's v1 cgroups at
        birth where the caps live there, docs/operating.md "How children start").

        This thread looks every 20 ms (the times are the supervisor's; a tighter poll
        would take the GIL from it)."""
        names = list(self.VARIANTS)
        order = names if self._b9_rep % 2 == 0 else list(reversed(names))
        self._b9_rep += 1
        row: dict[str, Any] = {"order": order}
        for name in order:
            method, capped = self.VARIANTS[name]
            got = self.child_replacements(method, capped=capped)
            row.update({f"{k}_{name}": v for k, v in got.items()})
        for key in ("child_ready_ms", "replaced_ms"):
            if row.get(f"{key}_spawn") and row.get(f"{key}_zygote"):
                row[f"{key}_zygote_over_spawn"] = round(row[f"{key}_zygote"] / row[f"{key}_spawn"], 3)
        row.update(self.cgroup_moves())
        return row

    def cgroup_moves(self, times: int = 5, pause: float = 0.2) -> dict[str, Any]:
        """What one move of a process into a slot's cgroups costs on this host (the
        supervisor's own :meth:`cyclone_mp.limits.slot.Slot.enter`, timed on a ``sleep``
        process, ``pause`` seconds after the last move): the first move after a pause
        waits for a kernel RCU grace period unless a hierarchy is mounted with
        ``favordynmods`` (docs/operating.md, "How children start"). Empty without cgroups."""
        from cyclone_mp.limits.confinement import Confinement

        confinement = Confinement.detect("b9-moves")
        try:
            if not confinement.dirs:
                return {"cgroup_mechanism": confinement.mechanism.describe()}
            slot = confinement.slot(0)
            took = []
            sleeper = subprocess.Popen(["sleep", "60"])
            try:
                for _ in range(times):
                    time.sleep(pause)
                    t0 = time.perf_counter()
                    slot.enter(sleeper.pid)
                    took.append((time.perf_counter() - t0) * 1000)
            finally:
                sleeper.kill()  # our own child, by its pid
                sleeper.wait()
        finally:
            confinement.close()
        return {"cgroup_mechanism": confinement.mechanism.describe(),
                "cgroup_move_ms": round(statistics.median(took), 2), "cgroup_move_ms_each": [round(t, 2) for t in took]}

    _b9_rep = 0

    def child_replacements(self, method: str, *, capped: bool = False) -> dict[str, Any]:
        kills = self.n["b9_kills"]
        ready_ms: list[float] = []
        replaced_ms: list[float] = []
        steps = (bench_steps.noop, bench_steps.noop_capped) if capped else (bench_steps.noop,)
        born = in_v1 = 0

        def look(children: list[Any]) -> None:
            nonlocal born, in_v1
            for child in children:
                born += bool(child.in_cgroup)
                in_v1 += child_in_v1(child)

        with self.server.fresh() as dsn:
            client = cy.Client(dsn, mux_of(*steps), workers=2, start_method=method)
            try:
                t0 = time.monotonic()
                client.start()
                sup = client.supervisor
                wait_until(lambda: all_ready(sup, 2), 60, 0.02, "children ready")
                first = list(sup.children)
                all_ready_ms = (max(c.spawned + c.ready_after for c in first) - t0) * 1000
                ready_ms += [c.ready_after * 1000 for c in first]
                look(first)
                for _ in range(kills):
                    time.sleep(0.1)  # the supervisor settles (its strays check, its registry row)
                    before = {c.pid for c in sup.children}
                    victim = next(c for c in sup.children if c.ready and c.attempt is None)
                    t_kill = time.monotonic()
                    os.kill(victim.pid, signal.SIGKILL)  # our own unreaped child (the supervisor runs here)
                    wait_until(lambda: all_ready(sup, 2) and {c.pid for c in sup.children} != before, 30, 0.02,
                               "a replacement ready")
                    new = next(c for c in sup.children if c.pid not in before)
                    look([new])
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
            "children_created_in_cgroup": born, "children_in_v1_cgroups": in_v1,
            "child_ready_ms_each": [round(x, 2) for x in ready_ms],
            "replaced_ms_each": [round(x, 2) for x in replaced_ms],
        }


def child_in_v1(child: Any) -> bool:
    """The child is in one of its slot's v1 cgroups (``/proc/<pid>/cgroup``)."""
    slot = child.slot
    v1 = [path for key, path in (slot.dirs.items() if slot is not None else ()) if key != "v2"]
    try:
        with open(f"/proc/{child.pid}/cgroup") as fh:
            text = fh.read()
    except OSError:
        return False
    where = [line.split(":", 2)[2] for line in text.splitlines() if line.count(":") >= 2 and not line.startswith("0::")]
    return any(path.endswith(place) for place in where if place not in ("", "/") for path in v1)
