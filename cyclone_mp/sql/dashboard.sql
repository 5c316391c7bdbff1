-- The dashboard's reads.
-- Parameters are named placeholders: %(name)s.

-- name: dash_now
-- The database clock: the dashboard shows and compares every time on it.
SELECT now() AS now;

-- name: dash_run_counts
-- Runs by state in the hot table (the live work and the last archive_after seconds).
SELECT state, count(*)::bigint AS n
  FROM cyclone_runs
 GROUP BY state;

-- name: dash_archived_counts
-- Archived runs by state: counted up to %(cap)s per state, so a small archive's counts
-- are exact; past that, the planner's estimate from each partition's statistics
-- (pg_class.reltuples, kept by autovacuum's ANALYZE, which a small table may not have
-- had yet): counting a big archive row by row at every refresh would cost a scan of it.
-- exact: the count is exact (below the cap).
WITH estimates AS (
    SELECT substring(c.relname FROM '^cyclone_runs_archive_([a-z]+)_') AS state,
           sum(greatest(c.reltuples, 0))::bigint AS n
      FROM pg_inherits i
      JOIN pg_class c ON c.oid = i.inhrelid
     WHERE i.inhparent = 'cyclone_runs_archive'::regclass
     GROUP BY 1
)
SELECT f.state, CASE WHEN c.n < %(cap)s THEN c.n ELSE greatest(c.n, coalesce(e.n, 0)) END AS n,
       c.n < %(cap)s AS exact
  FROM unnest(ARRAY['completed', 'discarded', 'cancelled']) AS f(state)
 CROSS JOIN LATERAL (SELECT count(*)::bigint AS n
                       FROM (SELECT 1 FROM cyclone_runs_archive a WHERE a.state = f.state LIMIT %(cap)s) x) c
  LEFT JOIN estimates e ON e.state = f.state;

-- name: dash_step_counts
-- Steps by step name (signal and timer nodes by their kind), queue and state, in the hot
-- table (archived steps: see dash_archived_counts).
SELECT coalesce(step_name, '(' || kind || ')') AS name, queue, state, count(*)::bigint AS n
  FROM cyclone_steps
 GROUP BY 1, 2, 3
 ORDER BY 1, 2, 3;

-- name: dash_throughput
-- Task steps finished per minute (finished_at, DB clock) over the last %(minutes)s minutes, oldest first.
WITH bounds AS (
    SELECT date_trunc('minute', now()) AS last,
           date_trunc('minute', now()) - (%(minutes)s::int - 1) * interval '1 minute' AS first
), finished AS (
    SELECT date_trunc('minute', s.finished_at) AS minute,
           count(*) FILTER (WHERE s.state = 'completed') AS completed,
           count(*) FILTER (WHERE s.state = 'discarded') AS discarded
      FROM {recent_steps_expr} s
     WHERE s.kind = 'task'
     GROUP BY 1
)
SELECT m.minute, coalesce(f.completed, 0)::bigint AS completed, coalesce(f.discarded, 0)::bigint AS discarded
  FROM bounds
 CROSS JOIN generate_series(bounds.first, bounds.last, interval '1 minute') AS m(minute)
  LEFT JOIN finished f ON f.minute = m.minute
 ORDER BY m.minute;

-- name: dash_pickup
-- Pickup latency (started_at - scheduled_at: claimable to claimed) of the task steps that
-- finished in each of the last %(minutes)s minutes (finished_at, DB clock), oldest first:
-- how many, the median and the 95th percentile, in seconds.
WITH bounds AS (
    SELECT date_trunc('minute', now()) AS last,
           date_trunc('minute', now()) - (%(minutes)s::int - 1) * interval '1 minute' AS first
), finished AS (
    SELECT date_trunc('minute', s.finished_at) AS minute, count(*) AS n,
           percentile_cont(0.5) WITHIN GROUP (ORDER BY greatest(0, extract(epoch FROM s.started_at - s.scheduled_at)))
               AS p50,
           percentile_cont(0.95) WITHIN GROUP (ORDER BY greatest(0, extract(epoch FROM s.started_at - s.scheduled_at)))
               AS p95
      FROM {recent_steps_expr} s
     WHERE s.kind = 'task'
       AND s.started_at IS NOT NULL
     GROUP BY 1
)
SELECT m.minute, coalesce(f.n, 0)::bigint AS n, f.p50::float8 AS p50, f.p95::float8 AS p95
  FROM bounds
 CROSS JOIN generate_series(bounds.first, bounds.last, interval '1 minute') AS m(minute)
  LEFT JOIN finished f ON f.minute = m.minute
 ORDER BY m.minute;

-- name: dash_kills_by_trigger
-- Children the supervisors killed in each of the last %(minutes)s minutes, by trigger
-- (error entries with killed_by_supervisor, by their "at"), oldest first: {trigger: n}.
WITH bounds AS (
    SELECT date_trunc('minute', now()) AS last,
           date_trunc('minute', now()) - (%(minutes)s::int - 1) * interval '1 minute' AS first
), since AS (
    SELECT to_char(bounds.first AT TIME ZONE 'UTC', 'YYYY-MM-DD"T"HH24:MI:SS.US"+00:00"') AS at FROM bounds
), errored AS (
    -- the steps whose latest error entry is recent, hot and archived (migrations 0016, 0017)
    SELECT s.errors FROM since, cyclone_steps s
     WHERE s.errors <> '[]'::jsonb AND (s.errors -> -1 ->> 'at') >= since.at
    UNION ALL
    SELECT s.errors FROM since, bounds, cyclone_steps_archive s
     WHERE s.errors <> '[]'::jsonb AND (s.errors -> -1 ->> 'at') >= since.at AND s.run_finished_at >= bounds.first
), kills AS (
    SELECT date_trunc('minute', (e ->> 'at')::timestamptz) AS minute, coalesce(e ->> 'trigger', 'kill') AS trigger
      FROM since, errored s
     CROSS JOIN LATERAL jsonb_array_elements(s.errors) AS e
     WHERE (e ->> 'at') >= since.at
       AND e ->> 'killed_by_supervisor' = 'true'
), per_minute AS (
    SELECT x.minute, jsonb_object_agg(x.trigger, x.n) AS triggers
      FROM (SELECT minute, trigger, count(*) AS n FROM kills GROUP BY 1, 2) x
     GROUP BY x.minute
)
SELECT m.minute, coalesce(p.triggers, '{}'::jsonb) AS triggers
  FROM bounds
 CROSS JOIN generate_series(bounds.first, bounds.last, interval '1 minute') AS m(minute)
  LEFT JOIN per_minute p ON p.minute = m.minute
 ORDER BY m.minute;

-- name: dash_durations
-- Per step: the task steps completed in the last %(minutes)s minutes and the percentiles
-- of their run time (finished_at - started_at of the attempt that completed), in seconds.
WITH bounds AS (
    SELECT now() - %(minutes)s::int * interval '1 minute' AS first
)
SELECT s.step_name AS step, count(*)::bigint AS n,
       percentile_cont(0.5) WITHIN GROUP (ORDER BY extract(epoch FROM s.finished_at - s.started_at))::float8 AS p50,
       percentile_cont(0.95) WITHIN GROUP (ORDER BY extract(epoch FROM s.finished_at - s.started_at))::float8 AS p95,
       percentile_cont(0.99) WITHIN GROUP (ORDER BY extract(epoch FROM s.finished_at - s.started_at))::float8 AS p99,
       max(extract(epoch FROM s.finished_at - s.started_at))::float8 AS max
  FROM {recent_steps_expr} s
 WHERE s.kind = 'task'
   AND s.state = 'completed'
   AND s.started_at IS NOT NULL
 GROUP BY s.step_name
 ORDER BY s.step_name
 LIMIT %(limit)s;

-- name: dash_recent_kills
-- Steps whose latest error entry is a kill (timeout, child exit, reclaim limit, a resource
-- cause of death), newest entry first.
-- Hot and archived: the newest of each, merged.
SELECT * FROM (
    (SELECT s.id, s.run_id::text AS run_id, s.node, s.step_name, s.queue, s.state, s.attempt, s.max_attempts,
            s.reclaims, s.max_reclaims, s.errors -> -1 AS entry, (s.errors -> -1 ->> 'at') AS at
       FROM cyclone_steps s
      WHERE (s.errors -> -1 ->> 'kind') IN ('timeout', 'child_exited', 'reclaim_limit',
                                            'memory_limit', 'cpu_limit', 'process_limit', 'oom_killed')
      ORDER BY (s.errors -> -1 ->> 'at') DESC, s.id DESC
      LIMIT %(limit)s)
    UNION ALL
    (SELECT s.id, s.run_id::text, s.node, s.step_name, s.queue, s.state, s.attempt, s.max_attempts,
            s.reclaims, s.max_reclaims, s.errors -> -1, (s.errors -> -1 ->> 'at')
       FROM cyclone_steps_archive s
      WHERE (s.errors -> -1 ->> 'kind') IN ('timeout', 'child_exited', 'reclaim_limit',
                                            'memory_limit', 'cpu_limit', 'process_limit', 'oom_killed')
      ORDER BY (s.errors -> -1 ->> 'at') DESC, s.id DESC
      LIMIT %(limit)s)
) x
 ORDER BY at DESC, id DESC
 LIMIT %(limit)s;

-- name: dash_runs_page_expr
-- (Fragment) dash_runs: one table's (``r``) first rows of the page: the filters, the keyset cursor, newest first
WHERE (%(state)s::text IS NULL OR r.state = %(state)s::text)
  AND (%(name)s::text IS NULL OR r.name = %(name)s::text)
  AND (%(since)s::timestamptz IS NULL OR r.created_at >= %(since)s::timestamptz)
  AND (%(until)s::timestamptz IS NULL OR r.created_at < %(until)s::timestamptz)
  AND (%(after_at)s::timestamptz IS NULL OR (r.created_at, r.id) < (%(after_at)s::timestamptz, %(after_id)s::uuid))
ORDER BY r.created_at DESC, r.id DESC
LIMIT %(limit)s::bigint + %(offset)s::bigint

-- name: dash_runs
-- One page of runs, newest first: optional state, name and created_at filters, a keyset
-- cursor (created_at, id) of the last row seen, and an offset. The page is chosen first,
-- so the step counts are computed for its rows only (not for every row an offset skips; a
-- map's items are counted, by state, with the other steps). Each row says the run that
-- spawned it (parent_id). Archived runs are listed too: each table's first rows of the
-- page, merged.
SELECT p.id::text AS id, p.name, p.kind, p.state, p.created_at, p.updated_at, p.finished_at,
       p.parent_id::text AS parent_id,
       CASE WHEN p.archived THEN
           (SELECT coalesce(jsonb_object_agg(x.state, x.n), '{}'::jsonb)
              FROM (SELECT s.state, count(*) AS n
                      FROM cyclone_steps_archive s  -- (the run's own partition)
                     WHERE s.run_id = p.id AND s.run_state = p.state AND s.run_finished_at = p.finished_at
                     GROUP BY s.state) x)
       ELSE
           (SELECT coalesce(jsonb_object_agg(x.state, x.n), '{}'::jsonb)
              FROM (SELECT s.state, count(*) AS n
                      FROM cyclone_steps s
                     WHERE s.run_id = p.id
                     GROUP BY s.state) x)
       END AS steps
  FROM (SELECT u.*
          FROM ((SELECT r.id, r.name, r.kind, r.state, r.created_at, r.updated_at, r.finished_at, false AS archived,
                        r.parent_id
                   FROM cyclone_runs r
                 {dash_runs_page_expr})
                UNION ALL
                (SELECT r.id, r.name, r.kind, r.state, r.created_at, r.updated_at, r.finished_at, true, r.parent_id
                   FROM cyclone_runs_archive r
                 {dash_runs_page_expr})) u
         ORDER BY u.created_at DESC, u.id DESC
         LIMIT %(limit)s OFFSET %(offset)s) p
 ORDER BY p.created_at DESC, p.id DESC;

-- name: dash_count_runs
-- How many runs match the filters of dash_runs, hot and archived, counted up to %(cap)s
-- (a page never counts more).
SELECT least(count(*), %(cap)s)::bigint AS n
  FROM ((SELECT 1
           FROM cyclone_runs r
          WHERE (%(state)s::text IS NULL OR r.state = %(state)s::text)
           AND (%(name)s::text IS NULL OR r.name = %(name)s::text)
           AND (%(since)s::timestamptz IS NULL OR r.created_at >= %(since)s::timestamptz)
           AND (%(until)s::timestamptz IS NULL OR r.created_at < %(until)s::timestamptz)
          LIMIT %(cap)s)
        UNION ALL
        (SELECT 1
           FROM cyclone_runs_archive a
          WHERE (%(state)s::text IS NULL OR a.state = %(state)s::text)
           AND (%(name)s::text IS NULL OR a.name = %(name)s::text)
           AND (%(since)s::timestamptz IS NULL OR a.created_at >= %(since)s::timestamptz)
           AND (%(until)s::timestamptz IS NULL OR a.created_at < %(until)s::timestamptz)
          LIMIT %(cap)s)) x;

-- name: dash_run_names
-- Distinct run names in order, hot and archived, at most %(limit)s (a loose index scan of
-- each table: one index probe per name).
WITH RECURSIVE names AS (
    (SELECT name FROM cyclone_runs ORDER BY name LIMIT 1)
    UNION ALL
    SELECT (SELECT r.name FROM cyclone_runs r WHERE r.name > n.name ORDER BY r.name LIMIT 1)
      FROM names n
     WHERE n.name IS NOT NULL
), archived_names AS (
    (SELECT name FROM cyclone_runs_archive ORDER BY name LIMIT 1)
    UNION ALL
    SELECT (SELECT a.name FROM cyclone_runs_archive a WHERE a.name > n.name ORDER BY a.name LIMIT 1)
      FROM archived_names n
     WHERE n.name IS NOT NULL
)
SELECT name
  FROM ((SELECT name FROM names WHERE name IS NOT NULL LIMIT %(limit)s)
        UNION
        (SELECT name FROM archived_names WHERE name IS NOT NULL LIMIT %(limit)s)) x
 ORDER BY name
 LIMIT %(limit)s;

-- name: dash_run_signals
-- The signals a run received (the first of each name is kept); an archived run's are kept
-- on its archive row.
SELECT name, payload, created_at
  FROM cyclone_signals
 WHERE run_id = %(run_id)s
UNION ALL
SELECT g ->> 'name', g -> 'payload', (g ->> 'created_at')::timestamptz
  FROM cyclone_runs_archive a, jsonb_array_elements(a.signals) AS g
 WHERE a.id = %(run_id)s
 ORDER BY created_at, name;

-- name: recent_steps_expr
-- (Fragment) the step rows finished since bounds.first, hot and archived: an
-- archived step's run finished no earlier than it did, so its partitions are pruned by
-- run_finished_at; rows keep the columns the charts read.
(SELECT s.finished_at, s.state, s.kind, s.step_name, s.started_at, s.scheduled_at
   FROM cyclone_steps s, bounds
  WHERE s.finished_at >= bounds.first
 UNION ALL
 SELECT s.finished_at, s.state, s.kind, s.step_name, s.started_at, s.scheduled_at
   FROM cyclone_steps_archive s, bounds
  WHERE s.run_finished_at >= bounds.first AND s.finished_at >= bounds.first)
