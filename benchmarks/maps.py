#!/usr/bin/env python3
"""Mapped nodes (``wf.map``): throughput, the fan-out and the join's read, the join's memory.

    python benchmarks/maps.py                  # M1, M2, M3, 3 repetitions (~4 min)
    python benchmarks/maps.py --only M1 --repeat 5
    python benchmarks/maps.py --quick --repeat 1   # small counts (~40 s; the table does not judge)
    python benchmarks/maps.py --dsn postgresql://...

* **M1, throughput**: 20,000 no-op items of one map (``bench_map``: ``bench_list`` makes
  the list, ``wf.map(bench_item)``, ``bench_join`` reads the outputs) against the same
  20,000 no-op steps enqueued with one ``enqueue_many``, alternately (many then map, map
  then many: on this VM the second run of a pair is often faster, whatever it runs), each
  in a fresh database, one supervisor in this process (``workers=2``, the default
  prefetch). **items/s = 20,000 / (last item ``finished_at`` - first item
  ``started_at``)** (DB clock), the same for both; also from the supervisor's start (for
  the map this includes running ``bench_list`` and the fan-out). Target: map >= 0.9 x
  ``enqueue_many``.
* **M2, the fan-out statement and the join's read**: in a fresh database, the time of one
  ``enqueue_many`` of 20,000 (the client call, its pool open); then a ``bench_map`` run whose
  ``bench_list`` step is claimed and completed by hand with a 20,000-item list: the time
  of that completion (one transaction: the CAS, the list stored as the step's output, and
  the run's advance with the fan-out); then the fan-out statement alone
  (``expand_maps``, timed in a transaction of its own after the items were deleted and
  the map row reset); then, the items marked completed, the join's read
  (:func:`cyclone_mp.mapped.write_outputs`: 20,000 outputs in keyset pages to a file).
  Targets: the fan-out statement and the join's read each <= 2 x ``enqueue_many``'s time.
* **M3, the join's supervisor memory**: a supervisor process (``workers=2``) runs a map of
  100,000 items, each returning a 200-character string (about 20 MB of outputs, past
  what the join's child takes as a list: it iterates a file). Its RSS (psutil) is sampled
  every 0.1 s: **growth during the join = max RSS between the join's claim and its end -
  the last RSS before its claim**. Target: flat (under 10 MB, against the 20 MB the
  outputs take). The maximum before the join is reported too: it includes the list
  node's output (the 100,000 strings the map runs over, one 20 MB value through the
  supervisor, as any step's output is), which is what reading the join's outputs as one
  value would cost again.

Every measurement runs in a fresh database (a clone of a migrated template), on the
server ``benchmarks/run.py`` would use.
"""

from __future__ import annotations

import argparse
import json
import os
import sys
import tempfile
import threading
import time
from typing import Any, Callable

HERE = os.path.dirname(os.path.abspath(__file__))
if HERE not in sys.path:
    sys.path.insert(0, HERE)  # children inherit sys.path: they import bench_steps by name

import psutil  # noqa: E402
import psycopg  # noqa: E402

import bench_steps  # noqa: E402
import cyclone_mp as cy  # noqa: E402
from common import (  # noqa: E402
    PREFETCH, Server, SupervisorProcess, console, ensure_bytecode, epoch, git_state, loadavg, median, mux_of,
    run_until_completed, step_times, wait_until,
)
from cyclone_mp import mapped  # noqa: E402
from cyclone_mp.store.operations import MAX_MAP_ITEMS  # noqa: E402
from cyclone_mp.store import Q, Store  # noqa: E402

FULL = {"m1_items": 20_000, "m2_items": 20_000, "m3_items": 100_000, "m3_chars": 200}
QUICK = {"m1_items": 2_000, "m2_items": 2_000, "m3_items": 10_000, "m3_chars": 200}


def db_rows(dsn: str, query: str, params: Any = ()) -> list[tuple[Any, ...]]:
    with psycopg.connect(dsn, autocommit=True) as conn:
        return conn.execute(query, params).fetchall()


class MapBenches:
    def __init__(self, server: Server, counts: dict[str, int], tmp: str) -> None:
        self.server = server
        self.n = counts
        self.tmp = tmp

    # M1 -----------------------------------------------------------------------------------

    def many(self, dsn: str, n: int) -> dict[str, Any]:
        client = cy.Client(dsn, mux_of(bench_steps.noop), workers=2, prefetch=PREFETCH)
        client.enqueue_many(bench_steps.noop, [None] * n)
        sup, _, t0 = run_until_completed(client, n)
        t = step_times(dsn, bench_steps.noop.name, sup.id)
        assert t["completed"] == n, t
        return {"per_s": round(n / (t["last_finish"] - t["first_start"]), 1),
                "per_s_from_start": round(n / (t["last_finish"] - t0), 1)}

    def mapped(self, dsn: str, n: int) -> dict[str, Any]:
        client = cy.Client(dsn, cy.Mux().register(bench_steps.bench_map), workers=2, prefetch=PREFETCH)
        run_id = client.enqueue(bench_steps.bench_map, {"n": n})
        sup, _, t0 = run_until_completed(client, n + 2)  # the list, the items, the join
        t = step_times(dsn, bench_steps.item.name, sup.id)
        assert t["completed"] == n, t
        [(state, joined)] = db_rows(dsn, "SELECT r.state, s.output FROM cyclone_runs r JOIN cyclone_steps s "
                                          "ON s.run_id = r.id AND s.node = 'bench_join' WHERE r.id = %s", (run_id,))
        assert state == "completed" and joined["count"] == n, (state, joined)
        return {"per_s": round(n / (t["last_finish"] - t["first_start"]), 1),
                "per_s_from_start": round(n / (t["last_finish"] - t0), 1)}

    def m1(self, rep: int) -> dict[str, Any]:
        n = self.n["m1_items"]
        row: dict[str, Any] = {"items": n}
        order: list[tuple[str, Callable[[str, int], dict[str, Any]]]] = [("many", self.many), ("map", self.mapped)]
        for name, fn in order if rep % 2 == 0 else order[::-1]:
            with self.server.fresh() as dsn:
                out = fn(dsn, n)
            row.update({f"{name}_{k}": v for k, v in out.items()})
        row["ratio"] = round(row["map_per_s"] / row["many_per_s"], 3)
        row["ratio_from_start"] = round(row["map_per_s_from_start"] / row["many_per_s_from_start"], 3)
        return row

    # M2 -----------------------------------------------------------------------------------

    def m2(self, rep: int) -> dict[str, Any]:
        n = self.n["m2_items"]
        row: dict[str, Any] = {"items": n}
        mux = cy.Mux().register(bench_steps.noop, bench_steps.bench_map)
        with self.server.fresh() as dsn, cy.Client(dsn, mux) as client:
            client.migrate()  # opens the pool
            t = time.perf_counter()
            client.enqueue_many(bench_steps.noop, [None] * n)
            row["enqueue_many_s"] = round(time.perf_counter() - t, 4)
            run_id = client.enqueue(bench_steps.bench_map, {"n": n})
            store = Store.open(dsn)
            try:
                [claimed] = store.claims.claim(owner="bench", queues=["default"], names=[bench_steps.make_list.name],
                                               limit=1, ttl=600).rows
                t = time.perf_counter()
                done = store.outcomes.complete(owner="bench", items=[
                    (claimed["id"], claimed["lease_generation"], [None] * n, None)])
                row["completion_with_fanout_s"] = round(time.perf_counter() - t, 4)
                assert done, "the list's completion did not apply"
                row["fanout_s"] = self.fanout_alone(store, run_id, n)
                with store.conn.transaction():
                    store.conn.execute("UPDATE cyclone_steps SET state = 'completed', output = 'null', "
                                       "finished_at = now() WHERE run_id = %s AND map_node IS NOT NULL", (run_id,))
                t = time.perf_counter()
                files = mapped.write_outputs(lambda fn: fn(store), run_id, [[bench_steps.item.name, n]])
                row["join_read_s"] = round(time.perf_counter() - t, 4)
                out = files[bench_steps.item.name]
                assert out["count"] == n, out
                row["join_file_kb"] = round(os.path.getsize(out["path"]) / 1024, 1)
                mapped.discard(out["path"])
            finally:
                store.close()
        row["fanout_ratio"] = round(row["fanout_s"] / row["enqueue_many_s"], 3)
        row["join_read_ratio"] = round(row["join_read_s"] / row["enqueue_many_s"], 3)
        return row

    @staticmethod
    def fanout_alone(store: Store, run_id: str, n: int) -> float:
        """The ``expand_maps`` statement alone, in a transaction of its own: the items the
        completion made are deleted and the map row reset first."""
        with store.conn.transaction():
            store.conn.execute("DELETE FROM cyclone_steps WHERE run_id = %s AND map_node IS NOT NULL", (run_id,))
            store.conn.execute("UPDATE cyclone_steps SET state = 'pending', items_total = NULL, items_left = NULL "
                               "WHERE run_id = %s AND kind = 'map'", (run_id,))
        store.conn.execute("VACUUM ANALYZE cyclone_steps")
        with store.conn.transaction():
            t = time.perf_counter()
            cur = store.conn.execute(Q["expand_maps"], {"run_id": run_id, "max_items": MAX_MAP_ITEMS})
            seconds = time.perf_counter() - t
            [row] = cur.fetchall()
            assert row["items"] == n, row
        return round(seconds, 4)

    # M3 -----------------------------------------------------------------------------------

    def m3(self, rep: int) -> dict[str, Any]:
        n, chars = self.n["m3_items"], self.n["m3_chars"]
        with self.server.fresh() as dsn:
            sup = SupervisorProcess(dsn, [], {"workers": 2}, self.tmp, workflows=(bench_steps.bench_map,))
            samples: list[tuple[float, int]] = []
            stop = threading.Event()

            def sample() -> None:
                proc = psutil.Process(sup.pid)
                while not stop.is_set():
                    try:
                        samples.append((time.time(), proc.memory_info().rss))
                    except psutil.Error:
                        return
                    stop.wait(0.1)

            sampler = threading.Thread(target=sample, daemon=True)
            try:
                time.sleep(1.0)
                sampler.start()
                with cy.Client(dsn, cy.Mux().register(bench_steps.bench_map)) as client:
                    run_id = client.enqueue(bench_steps.bench_map, {"n": n, "item": "x" * chars})
                    status = client.wait(run_id, timeout=600)
                time.sleep(0.5)
            finally:
                stop.set()
                sampler.join()
                sup.stop()
            join = status.steps[bench_steps.join.name]
            assert status.state == "completed" and join.output["count"] == n, (status.state, join.output)
            claimed, ended = epoch(join.claimed_at), epoch(join.finished_at)
            before = [rss for at, rss in samples if at < claimed]
            during = [rss for at, rss in samples if claimed <= at <= ended + 0.1] or before[-1:]
            mib = 1024 * 1024
            return {
                "items": n, "outputs_mb": round(n * (chars + 5) / 1e6, 1),
                "rss_start_mb": round(samples[0][1] / mib, 1), "rss_max_before_join_mb": round(max(before) / mib, 1),
                "rss_at_join_claim_mb": round(before[-1] / mib, 1),
                "rss_max_during_join_mb": round(max(during) / mib, 1),
                "rss_end_mb": round(samples[-1][1] / mib, 1),
                "growth_during_join_mb": round((max(during) - before[-1]) / mib, 2),
                "join_s": round(ended - claimed, 3), "join_kind": join.output["kind"],
                "join_child_maxrss_mb": round(join.output["child_maxrss_kb"] / 1024, 1),
            }


TARGETS = {
    "M1": ("ratio", ">=", 0.9, "map items/s / enqueue_many steps/s"),
    "M2": ("fanout_ratio", "<=", 2.0, "fan-out statement / enqueue_many"),
    "M2j": ("join_read_ratio", "<=", 2.0, "join read / enqueue_many"),
    "M3": ("growth_during_join_mb", "<=", 10.0, "supervisor RSS growth during the join (MB)"),
}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--only", default="M1,M2,M3")
    parser.add_argument("--repeat", type=int, default=3)
    parser.add_argument("--quick", action="store_true")
    parser.add_argument("--dsn")
    parser.add_argument("--out")
    args = parser.parse_args()
    meta = {"bytecode": ensure_bytecode(), **git_state(), "loadavg_start": loadavg()}
    benches = [b.strip() for b in args.only.split(",") if b.strip()]
    server = Server(args.dsn)
    results: dict[str, list[dict[str, Any]]] = {b: [] for b in benches}
    try:
        with tempfile.TemporaryDirectory(prefix="cyclone-maps-bench-") as tmp:
            bench = MapBenches(server, QUICK if args.quick else FULL, tmp)
            for rep in range(args.repeat):
                for name in benches:
                    row = {"loadavg": loadavg(), **getattr(bench, name.lower())(rep)}
                    results[name].append(row)
                    console.print(f"{name} #{rep + 1}: {json.dumps(row)}")
    finally:
        server.close()
    meta.update(loadavg_end=loadavg(), server=server.version)
    console.print(f"\nPostgreSQL {server.version}; load average {meta['loadavg_start']} -> {meta['loadavg_end']}")
    for key, (field, op, target, what) in TARGETS.items():
        rows = results.get(key[:2]) or []
        value = median([r.get(field) for r in rows])
        if value is None:
            continue
        met = value >= target if op == ">=" else value <= target
        verdict = "" if args.quick else (" met" if met else " MISSED")
        console.print(f"{key:4} {what:48} median {value:>9}  target {op} {target}{verdict}  "
                      f"(runs: {[r.get(field) for r in rows]})")
    out = args.out or os.path.join(HERE, "results", f"maps-{time.strftime('%Y%m%d-%H%M%S')}.json")
    os.makedirs(os.path.dirname(out), exist_ok=True)
    with open(out, "w") as fh:
        json.dump({"meta": meta, "results": results}, fh, indent=1, default=str)
    console.print(f"results: {out}")


if __name__ == "__main__":
    main()
