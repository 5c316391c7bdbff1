"""The table ``benchmarks/run.py`` prints: each metric beside its target (issue 8 and
after), from the medians of the repetitions."""

from __future__ import annotations

from typing import Any

from rich.table import Table

from common import PREFETCH, SUPERVISOR_CONNECTIONS, console, median
from history_bench import B11_WINDOW





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
        ("B7", "supervisor_rss_growth_mb", "supervisor RSS growth end - start (MiB; the high-water mark)", "{:.1f}",
         "", None),
        ("B7", "supervisor_rss_creep_mb", f"supervisor RSS growth over waves 6 and 7 of {n['b7_steps']:,} (MiB)",
         "{:.1f}", "flat (<= 2)", lambda v, m: v <= 2.0),
        ("B7", "supervisor_cpu_ms_per_step", "supervisor CPU per step (ms)", "{:.3f}", "<= 0.030 (issue 36)",
         lambda v, m: v <= 0.030),
        ("B7", "process_control_cpu_us_per_step", "  process control's thread, CPU per step (us)", "{:.1f}", "", None),
        ("B7", "other_threads_cpu_us_per_step", "  its other threads (writer, keeper, maintenance) (us)", "{:.1f}", "",
         None),
        ("B7", "children_cpu_us_per_step", "  the supervisor's processes (children, zygote, watchdog) (us)", "{:.1f}",
         "<= 20 (issue 36)", lambda v, m: v <= 20),
        ("B7", "zygote_and_watchdog_cpu_us_per_step", "    of which the zygote and the watchdog (us)", "{:.1f}", "",
         None),
        ("B7", "postgres_cpu_us_per_step", "  PostgreSQL's backends (us)", "{:.1f}", "<= 40 (issue 36)",
         lambda v, m: v <= 40),
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
        ("B9", "children_in_v1_cgroups_zygote", "  ... children of the run moved into a v1 cgroup (no step has a cap)",
         "{:g}", "0", lambda v, m: v == 0),
        ("B9", "child_ready_ms_zygote_capped", "fresh child ready, zygote, a step declares max_processes (ms; it "
         "joins v1 cgroups where the host has them)", "{:.2f}", "", None),
        ("B9", "replaced_ms_zygote_capped", "SIGKILLed child replaced (ready) after, zygote, a step declares "
         "max_processes (ms)", "{:.2f}", "", None),
        ("B9", "all_ready_after_start_ms_spawn", "supervisor start to 2 children ready, spawn (ms)", "{:.1f}", "",
         None),
        ("B9", "all_ready_after_start_ms_zygote", "supervisor start to 2 children ready, zygote (ms)", "{:.1f}", "",
         None),
        ("B9", "cgroup_move_ms", "one move of a process into its slot's cgroups, 0.2 s after the last (ms; a kernel "
         "RCU grace period unless favordynmods)", "{:.2f}", "", None),
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
