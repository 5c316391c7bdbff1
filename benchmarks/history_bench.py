"""B10 (B1 beside B1 with a big archive, and retention) and B11 (B1 through a long
transaction), issue 22: methods of :class:`run.Bench`."""

from __future__ import annotations

import contextlib
import itertools
import statistics
import threading
import time
from typing import Any

import psycopg
from psycopg.conninfo import conninfo_to_dict

import bench_steps
import cyclone_mp as cy
from cyclone_mp.store import Store

from common import CpuMeter, PREFETCH, PREFETCH_KEYS, console, mux_of, percentile, suffixed


#: B11's window (seconds): throughput is sampled once per window.
B11_WINDOW = 10
#: B11: the supervisor archives finished runs after this many seconds (the hot tables then
#: hold the live backlog and a short tail, as in production; the default is 600 s).
B11_ARCHIVE_AFTER = 10


class HistoryBenches:
    """B10 and B11 (the :class:`run.Bench` attributes they use: ``server``, ``n``, ``tmp``)."""

    # B10 ----------------------------------------------------------------------------------

    def seed_b10_template(self) -> tuple[str, dict[str, Any]]:
        """A migrated database holding b10_archived finished runs in the archive (issue 22):
        their partitions made, then one ``INSERT ... SELECT ... FROM generate_series`` for
        the runs and their steps (98 % completed, 1 % discarded, 1 % cancelled, finished
        over the b10_days days before today), then ``VACUUM ANALYZE``. Cloned for each
        repetition."""
        name, dsn = self.server.copy_of_template("cyclone_bench_b10")
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
        the default prefetch, each beside a control run without the holder (the same phases; the
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
