#!/usr/bin/env python3
"""Dashboard latency with 100,000 runs (issue 7, acceptance 4: every page under 300 ms).

    python benchmarks/dashboard.py                 # own embedded PostgreSQL in a temp dir
    python benchmarks/dashboard.py --dsn postgresql://...   # a server where we may CREATE DATABASE
    python benchmarks/dashboard.py --runs 20000 --repeat 5 --explain

It creates a fresh database, migrates it, fills it with ``--runs`` runs in every state
(``INSERT ... SELECT generate_series``: 90 % single-step runs of ten step names on three
queues, 10 % four-node workflows; completed, discarded with kill forensics, cancelled,
paused and running, some finished in the last 30 minutes), three live supervisors in
the registry, then ``VACUUM ANALYZE`` (a database in steady state). It serves the
dashboard with uvicorn on a loopback port (with a token, so POSTs are Bearer requests)
and times every page and API endpoint over HTTP: one warm-up, then ``--repeat``
requests, the median. ``--explain`` prints the plan of each dashboard query.
Exit code 1 when a request failed or a median is over the target.
"""

from __future__ import annotations

import argparse
import contextlib
import http.client
import json
import os
import shutil
import statistics
import sys
import tempfile
import threading
import time
import uuid
from typing import Any, Iterator
from urllib.parse import urlencode

import psycopg
from psycopg import sql
from psycopg.conninfo import make_conninfo

import cyclone_mp as cy
from cyclone_mp.store import Q, Store

TARGET_MS = 300.0
TOKEN = "bench-token-" + uuid.uuid4().hex
NAMES = ["resize", "thumbnail", "transcode", "ocr", "index", "notify", "export", "import", "score", "archive"]
QUEUES = ["default", "images", "reports"]

FILL = """
-- single-step runs: state by i mod 100 (60 completed, 8 discarded, 7 cancelled, 5 paused, 20 running);
-- every 40th run was created in the last 30 minutes (the throughput chart), the rest over 7 days.
INSERT INTO cyclone_runs (id, name, kind, state, input, created_at, updated_at, finished_at)
SELECT gen_random_uuid(), (%(names)s::text[])[1 + i %% 10], 'step', st, jsonb_build_object('i', i), c, c + d,
       CASE WHEN st IN ('completed', 'discarded', 'cancelled') THEN c + d END
  FROM (SELECT i,
               CASE WHEN i %% 40 = 0 THEN now() - random() * interval '30 minutes'
                    ELSE now() - interval '30 minutes' - random() * interval '7 days' END AS c,
               random() * interval '20 seconds' AS d,
               CASE WHEN i %% 100 < 60 THEN 'completed' WHEN i %% 100 < 68 THEN 'discarded'
                    WHEN i %% 100 < 75 THEN 'cancelled' WHEN i %% 100 < 80 THEN 'paused' ELSE 'running' END AS st
          FROM generate_series(1, %(single)s) AS i) x;

INSERT INTO cyclone_steps (run_id, node, step_name, kind, queue, state, paused_from, attempt, max_attempts,
                           timeout, scheduled_at, started_at, finished_at, lease_owner, lease_expiry,
                           lease_generation, heartbeat_at, error, error_kind, errors, output)
SELECT r.id, r.name, r.name, 'task', (%(queues)s::text[])[1 + abs(hashtext(r.name)) %% 3], s.state,
       CASE WHEN s.state = 'paused' THEN 'available' END,
       CASE WHEN s.state = 'discarded' THEN 3 WHEN s.failed THEN 2 ELSE 1 END, 3, interval '30 seconds',
       CASE WHEN s.state = 'available' THEN now() + interval '1 hour' ELSE r.created_at END,
       CASE WHEN s.state IN ('completed', 'discarded', 'running', 'cancelled') THEN r.created_at END,
       r.finished_at,
       CASE WHEN s.state = 'running' THEN 'bench-host:1:abcd' END,
       CASE WHEN s.state = 'running' THEN now() + interval '1 day' END,
       CASE WHEN s.state IN ('available', 'paused', 'pending') THEN 0 ELSE 1 END,
       CASE WHEN s.state = 'running' THEN now() END,
       CASE WHEN s.state = 'discarded' THEN 'killed' END,
       CASE WHEN s.state = 'discarded' THEN s.kill END,
       CASE WHEN s.state = 'discarded' THEN jsonb_build_array(jsonb_build_object(
                'attempt', 3, 'kind', s.kill, 'at', to_char(r.finished_at AT TIME ZONE 'UTC',
                                                            'YYYY-MM-DD"T"HH24:MI:SS.US"+00:00"'),
                'message', CASE s.kill WHEN 'timeout' THEN 'child killed by the supervisor after timeout'
                                       WHEN 'child_exited' THEN 'child process exited unexpectedly (signal SIGSEGV)'
                                       ELSE 'lease expired after 2 reclaims (max_reclaims=2)' END,
                'pid', 4000 + (random() * 30000)::int, 'killed_by_supervisor', s.kill = 'timeout',
                'trigger', CASE WHEN s.kill = 'timeout' THEN 'timeout' END,
                'signal', CASE WHEN s.kill = 'timeout' THEN 9 WHEN s.kill = 'child_exited' THEN 11 END,
                'signal_name', CASE WHEN s.kill = 'timeout' THEN 'SIGKILL' WHEN s.kill = 'child_exited' THEN 'SIGSEGV' END,
                'cpu_seconds', round((random() * 30)::numeric, 3), 'peak_rss_kb', (20000 + random() * 500000)::int,
                'elapsed', round((random() * 30)::numeric, 3), 'worker', 'bench-host:1:abcd'))
            WHEN s.failed THEN jsonb_build_array(jsonb_build_object(
                'attempt', 1, 'kind', 'error', 'type', 'ValueError', 'message', 'bad value on attempt 1',
                'traceback', 'Traceback (most recent call last):\n  File "app.py", line 1\nValueError: bad value',
                'at', to_char(r.created_at AT TIME ZONE 'UTC', 'YYYY-MM-DD"T"HH24:MI:SS.US"+00:00"'),
                'cpu_seconds', 0.01, 'peak_rss_kb', 25000))
            ELSE '[]'::jsonb END,
       CASE WHEN s.state = 'completed' THEN jsonb_build_object('ok', true) END
  FROM cyclone_runs r
 CROSS JOIN LATERAL (SELECT CASE r.state WHEN 'running' THEN CASE WHEN abs(hashtext(r.id::text)) %% 50 = 0
                                                                    THEN 'running' ELSE 'available' END
                                         ELSE r.state END AS state,
                            (ARRAY['timeout', 'child_exited', 'reclaim_limit'])[1 + abs(hashtext(r.id::text)) %% 3] AS kill,
                            abs(hashtext(r.id::text || 'f')) %% 20 = 0 AS failed) s
 WHERE r.kind = 'step';

-- workflows: fetch -> approve (signal), cooldown (timer) -> publish
INSERT INTO cyclone_runs (id, name, kind, state, input, created_at, updated_at, finished_at)
SELECT gen_random_uuid(), CASE WHEN i %% 2 = 0 THEN 'release' ELSE 'pipeline' END, 'workflow', st,
       jsonb_build_object('i', i), c, c + interval '5 seconds',
       CASE WHEN st IN ('completed', 'discarded', 'cancelled') THEN c + interval '5 seconds' END
  FROM (SELECT i, now() - interval '30 minutes' - random() * interval '7 days' AS c,
               CASE WHEN i %% 100 < 60 THEN 'completed' WHEN i %% 100 < 68 THEN 'discarded'
                    WHEN i %% 100 < 75 THEN 'cancelled' WHEN i %% 100 < 80 THEN 'paused' ELSE 'running' END AS st
          FROM generate_series(1, %(workflows)s) AS i) x;

INSERT INTO cyclone_steps (run_id, node, step_name, kind, depends_on, queue, state, paused_from, attempt,
                           max_attempts, scheduled_at, started_at, finished_at, due_at, error, error_kind, errors)
SELECT r.id, n.node, n.step_name, n.kind, n.deps, 'default',
       CASE r.state
         WHEN 'completed' THEN 'completed'
         WHEN 'cancelled' THEN CASE WHEN n.node = 'fetch' THEN 'completed' ELSE 'cancelled' END
         WHEN 'discarded' THEN CASE WHEN n.node = 'fetch' THEN 'discarded' ELSE 'pending' END
         WHEN 'paused' THEN CASE WHEN n.node = 'fetch' THEN 'completed' ELSE 'paused' END
         ELSE CASE n.node WHEN 'fetch' THEN 'completed' WHEN 'approve' THEN 'waiting_signal'
                          WHEN 'cooldown' THEN 'waiting_timer' ELSE 'pending' END END,
       CASE WHEN r.state = 'paused' AND n.node <> 'fetch'
            THEN CASE n.node WHEN 'approve' THEN 'waiting_signal' WHEN 'cooldown' THEN 'waiting_timer'
                             ELSE 'pending' END END,
       1, CASE WHEN n.kind = 'task' THEN 3 ELSE 1 END, r.created_at,
       CASE WHEN n.node = 'fetch' THEN r.created_at END,
       CASE WHEN n.node = 'fetch' AND r.state <> 'discarded' THEN r.created_at + interval '1 second'
            WHEN r.state IN ('completed', 'cancelled', 'discarded') AND n.node = 'fetch' THEN r.finished_at
            WHEN r.state = 'completed' THEN r.finished_at END,
       CASE WHEN n.kind = 'timer' THEN r.created_at + interval '1 hour' END,
       CASE WHEN r.state = 'discarded' AND n.node = 'fetch' THEN 'child killed by the supervisor after timeout' END,
       CASE WHEN r.state = 'discarded' AND n.node = 'fetch' THEN 'timeout' END,
       CASE WHEN r.state = 'discarded' AND n.node = 'fetch' THEN jsonb_build_array(jsonb_build_object(
                'attempt', 1, 'kind', 'timeout', 'killed_by_supervisor', true, 'trigger', 'timeout', 'signal', 9,
                'signal_name', 'SIGKILL', 'cpu_seconds', 12.5, 'peak_rss_kb', 120000, 'elapsed', 35.1,
                'message', 'child killed by the supervisor after timeout',
                'at', to_char(r.finished_at AT TIME ZONE 'UTC', 'YYYY-MM-DD"T"HH24:MI:SS.US"+00:00"')))
            ELSE '[]'::jsonb END
  FROM cyclone_runs r
 CROSS JOIN (VALUES ('fetch', 'resize', 'task', '{}'::text[]), ('approve', NULL, 'signal', '{fetch}'),
                    ('cooldown', NULL, 'timer', '{fetch}'), ('publish', 'notify', 'task', '{approve,cooldown}'))
       AS n(node, step_name, kind, deps)
 WHERE r.kind = 'workflow';

INSERT INTO cyclone_workers (id, hostname, pid, info)
SELECT 'bench-host:' || w || ':abcd', 'bench-host', w, jsonb_build_object(
         'workers', 4, 'queues', jsonb_build_array('default', 'images'), 'draining', false,
         'stats', jsonb_build_object('completed', 1000 * w, 'failed', 10 * w, 'killed', w),
         'children', (SELECT jsonb_agg(jsonb_build_object('pid', 1000 * w + k, 'steps_run', k * 10,
                                                         'cpu_percent', 97.5, 'rss', 50000000 + k,
                                                         'run_id', NULL)) FROM generate_series(1, 4) k))
  FROM generate_series(1, 3) w;
"""


class Server:
    """--dsn, or an embedded PostgreSQL in a temp dir (destroyed at the end)."""

    def __init__(self, dsn: str | None) -> None:
        self._embedded: Any = None
        self._tmp: str | None = None
        if dsn:
            self.admin_dsn = dsn
        else:
            from cyclone_mp.embedded import EmbeddedServer

            self._tmp = tempfile.mkdtemp(prefix="cyclone-mp-dash-bench-")
            os.chmod(self._tmp, 0o755)  # as root the server runs as its own user
            self._embedded = EmbeddedServer(os.path.join(self._tmp, "pgdata"))
            self.admin_dsn = self._embedded.start(timeout=120)

    @contextlib.contextmanager
    def fresh(self) -> Iterator[str]:
        name = f"cyclone_dash_bench_{uuid.uuid4().hex[:8]}"
        with psycopg.connect(self.admin_dsn, autocommit=True) as conn:
            conn.execute(sql.SQL("CREATE DATABASE {}").format(sql.Identifier(name)))
        try:
            yield make_conninfo(self.admin_dsn, dbname=name)
        finally:
            with contextlib.suppress(psycopg.Error), psycopg.connect(self.admin_dsn, autocommit=True) as conn:
                conn.execute(sql.SQL("DROP DATABASE IF EXISTS {} WITH (FORCE)").format(sql.Identifier(name)))

    def close(self) -> None:
        if self._embedded is not None:
            with contextlib.suppress(Exception):
                self._embedded.destroy()
        if self._tmp is not None:
            shutil.rmtree(self._tmp, ignore_errors=True)


def fill(dsn: str, runs: int) -> dict[str, Any]:
    """Migrate and fill; returns ids and counts the timed requests use."""
    store = Store.open(dsn)
    try:
        store.migrate()
    finally:
        store.close()
    workflows = runs // 10
    with psycopg.connect(dsn, autocommit=True) as conn:
        start = time.perf_counter()
        with conn.transaction():
            params = {"names": NAMES, "queues": QUEUES, "single": runs - workflows, "workflows": workflows}
            for statement in FILL.split(";\n"):
                if statement.strip():
                    conn.execute(statement, {k: v for k, v in params.items() if f"%({k})s" in statement})
        filled = time.perf_counter() - start
        conn.execute("VACUUM ANALYZE")
        n_runs, n_steps = conn.execute(
            "SELECT (SELECT count(*) FROM cyclone_runs), (SELECT count(*) FROM cyclone_steps)").fetchone()
        counts = {"runs": n_runs, "steps": n_steps}
        states = dict(conn.execute("SELECT state, count(*) FROM cyclone_runs GROUP BY 1 ORDER BY 1").fetchall())
        pick = lambda q: str(conn.execute(q).fetchone()[0])  # noqa: E731
        ids = {
            "discarded": pick("SELECT id FROM cyclone_runs WHERE kind = 'step' AND state = 'discarded' LIMIT 1"),
            "workflow": pick("SELECT id FROM cyclone_runs WHERE kind = 'workflow' AND state = 'running' LIMIT 1"),
            "running": [str(r[0]) for r in conn.execute(
                "SELECT id FROM cyclone_runs WHERE kind = 'step' AND state = 'running' LIMIT 20").fetchall()],
        }
        deep = conn.execute("SELECT created_at, id::text FROM cyclone_runs ORDER BY created_at DESC, id DESC "
                            "OFFSET %s LIMIT 1", (runs // 2,)).fetchone()
        window = conn.execute("SELECT min(created_at) + (max(created_at) - min(created_at)) / 2 FROM cyclone_runs"
                              ).fetchone()[0]
    from cyclone_mp.dashboard.params import encode_cursor

    return {"fill_s": filled, **counts, "states": states, "ids": ids, "deep_cursor": encode_cursor(deep[0], deep[1]),
            "window": window}


def explain(dsn: str, data: dict[str, Any]) -> None:
    """Print each dashboard query's plan (the lines naming a scan)."""
    mid = data["window"]
    cases = {
        "dash_run_counts": {}, "dash_step_counts": {}, "dash_throughput": {"minutes": 30},
        "dash_recent_kills": {"limit": 20}, "dash_run_names": {"limit": 200},
        "dash_runs": {"state": None, "name": None, "since": None, "until": None, "after_at": None, "after_id": None,
                      "limit": 51, "offset": 0},
        "dash_runs (state)": {"state": "discarded", "name": None, "since": None, "until": None, "after_at": None,
                              "after_id": None, "limit": 51, "offset": 0},
        "dash_runs (name, range)": {"state": None, "name": "resize", "since": mid, "until": None, "after_at": None,
                                    "after_id": None, "limit": 51, "offset": 0},
        "dash_count_runs": {"state": None, "name": None, "since": None, "until": None, "cap": 10000},
    }
    with psycopg.connect(dsn, autocommit=True) as conn:
        for label, params in cases.items():
            name = label.split(" ")[0]
            rows = conn.execute("EXPLAIN (ANALYZE, BUFFERS OFF, COSTS OFF, TIMING OFF) " + Q[name], params).fetchall()
            scans = [r[0].strip() for r in rows if "Scan" in r[0] or "Execution Time" in r[0]]
            print(f"-- {label}")
            for line in scans[:8]:
                print(f"   {line}")


def serve(dsn: str) -> tuple[Any, Any, int]:
    import uvicorn

    from cyclone_mp.dashboard import create_app
    from cyclone_mp.dashboard.server import listen

    client = cy.Client(dsn)
    sock = listen("127.0.0.1", 0)
    server = uvicorn.Server(uvicorn.Config(create_app(client, token=TOKEN), log_level="warning", access_log=False))
    thread = threading.Thread(target=server.run, kwargs={"sockets": [sock]}, daemon=True)
    thread.start()
    deadline = time.monotonic() + 30
    while not server.started:
        if time.monotonic() > deadline:
            raise RuntimeError("the dashboard did not start")
        time.sleep(0.02)
    server._bench = (client, thread, sock)  # type: ignore[attr-defined]
    return server, client, sock.getsockname()[1]


def timed(conn: http.client.HTTPConnection, method: str, path: str) -> tuple[float, int, int]:
    headers = {"Authorization": f"Bearer {TOKEN}", "Accept": "text/html" if not path.startswith("/api") else "*/*"}
    start = time.perf_counter()
    conn.request(method, path, headers=headers)
    response = conn.getresponse()
    body = response.read()
    return (time.perf_counter() - start) * 1000, response.status, len(body)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--dsn", default=None, help="a server where we may CREATE DATABASE (default: embedded)")
    parser.add_argument("--runs", type=int, default=100_000)
    parser.add_argument("--repeat", type=int, default=5)
    parser.add_argument("--explain", action="store_true", help="print the plan of each dashboard query")
    parser.add_argument("--json", default=None, metavar="FILE", help="also write the results as JSON")
    args = parser.parse_args(argv)

    server = Server(args.dsn)
    try:
        with server.fresh() as dsn:
            data = fill(dsn, args.runs)
            print(f"filled {data['runs']:,} runs / {data['steps']:,} steps in {data['fill_s']:.1f}s; "
                  f"runs by state {data['states']}")
            if args.explain:
                explain(dsn, data)
            http_server, client, port = serve(dsn)
            ids, mid = data["ids"], data["window"].isoformat()
            gets = [
                ("page  /  (overview)", "/"),
                ("api   /api/overview", "/api/overview"),
                ("page  /runs", "/runs"),
                ("api   /api/runs", "/api/runs"),
                ("page  /runs?state=discarded", "/runs?state=discarded"),
                ("api   /api/runs?state=running", "/api/runs?state=running"),
                ("page  /runs?name=resize&since=…", "/runs?" + urlencode({"name": "resize", "since": mid})),
                ("api   /api/runs?name=…&state=…&until=…", "/api/runs?" + urlencode(
                    {"name": "ocr", "state": "completed", "until": mid})),
                ("api   /api/runs?cursor=(50% deep)", "/api/runs?" + urlencode({"cursor": data["deep_cursor"]})),
                ("api   /api/runs?offset=(50% deep)", f"/api/runs?offset={args.runs // 2}"),
                ("page  /runs/{id} (discarded step)", f"/runs/{ids['discarded']}"),
                ("api   /api/runs/{id}", f"/api/runs/{ids['discarded']}"),
                ("page  /runs/{id} (workflow)", f"/runs/{ids['workflow']}"),
                ("page  /runs/{id}/cancel (confirm)", f"/runs/{ids['workflow']}/cancel"),
                ("api   /api/openapi.json", "/api/openapi.json"),
                ("asset /static/dashboard.js", "/static/dashboard.js"),
            ]
            results = []
            conn = http.client.HTTPConnection("127.0.0.1", port, timeout=30)
            failed = False
            for label, path in gets:
                timed(conn, "GET", path)  # warm-up
                samples = [timed(conn, "GET", path) for _ in range(args.repeat)]
                results.append((label, samples))
            running = iter(ids["running"])
            for action in ("pause", "cancel"):
                samples = [timed(conn, "POST", f"/api/runs/{next(running)}/{action}") for _ in range(args.repeat)]
                results.append((f"POST  /api/runs/{{id}}/{action}", samples))
            conn.close()
            http_server.should_exit = True
            http_server._bench[1].join(timeout=10)  # type: ignore[attr-defined]
            client.close()
    finally:
        server.close()

    print(f"\n{'endpoint':42} {'median':>9} {'min':>9} {'max':>9} {'status':>7} {'bytes':>8}  under {TARGET_MS:.0f} ms")
    out = []
    for label, samples in results:
        times = [s[0] for s in samples]
        med = statistics.median(times)
        statuses = {s[1] for s in samples}
        ok = statuses == {200} and med < TARGET_MS
        failed |= not ok
        print(f"{label:42} {med:8.1f}ms {min(times):8.1f}ms {max(times):8.1f}ms {','.join(map(str, sorted(statuses))):>7} "
              f"{samples[-1][2]:>8}  {'yes' if ok else 'NO'}")
        out.append({"endpoint": label, "median_ms": round(med, 2), "samples_ms": [round(t, 2) for t in times],
                    "status": sorted(statuses), "bytes": samples[-1][2]})
    print(f"\n{data['runs']:,} runs, {data['steps']:,} steps; median of {args.repeat} after one warm-up; "
          f"loadavg {os.getloadavg()[0]:.2f}")
    if args.json:
        with open(args.json, "w") as fh:
            json.dump({"runs": data["runs"], "steps": data["steps"], "results": out}, fh, indent=2)
    return 1 if failed else 0


if __name__ == "__main__":
    sys.exit(main())
