-- History: pruning, the archive partitions and moving finished runs into them.
-- Parameters are named placeholders: %(name)s.

-- name: prune_runs
-- Delete up to %(limit)s finished runs that finished more than %(older_us)s microseconds
-- ago and match the filters (runs_filter_expr; a step of them steps_filter_expr), oldest
-- first; their steps go with them (a trigger, migration 0006) and their signals (by cascade).
WITH doomed AS (
    SELECT r.id
      FROM cyclone_runs r
     WHERE r.state IN ('completed', 'discarded', 'cancelled')
       AND r.finished_at < now() - (%(older_us)s::bigint * interval '1 microsecond')
       AND {runs_filter_expr}
       AND (%(step)s::text IS NULL AND %(queue)s::text IS NULL AND %(key)s::text IS NULL
            OR EXISTS (SELECT 1 FROM cyclone_steps s WHERE s.run_id = r.id AND {steps_filter_expr}))
     ORDER BY r.finished_at
     LIMIT %(limit)s
       FOR UPDATE SKIP LOCKED
)
DELETE FROM cyclone_runs r USING doomed WHERE r.id = doomed.id;

-- name: prune_archived
-- Delete up to %(limit)s archived runs that finished more than %(older_us)s microseconds
-- ago and match the filters, with their steps, row by row (prune with filters besides the
-- states; without, whole partitions go, as retention's do).
WITH doomed AS (
    SELECT r.id, r.state, r.finished_at
      FROM cyclone_runs_archive r
     WHERE r.finished_at < now() - (%(older_us)s::bigint * interval '1 microsecond')
       AND {runs_filter_expr}
       AND (%(step)s::text IS NULL AND %(queue)s::text IS NULL AND %(key)s::text IS NULL
            OR EXISTS (SELECT 1 FROM cyclone_steps_archive s  -- (the run's own partition)
                        WHERE s.run_id = r.id AND s.run_state = r.state AND s.run_finished_at = r.finished_at
                          AND {steps_filter_expr}))
     LIMIT %(limit)s
), runs AS (
    DELETE FROM cyclone_runs_archive a
     USING doomed d
     WHERE a.state = d.state AND a.id = d.id AND a.finished_at = d.finished_at
    RETURNING a.id, a.state, a.finished_at
), steps AS (
    DELETE FROM cyclone_steps_archive s
     USING runs r
     WHERE s.run_state = r.state AND s.run_id = r.id AND s.run_finished_at = r.finished_at
    RETURNING 1
)
SELECT (SELECT count(*) FROM runs) AS runs, (SELECT count(*) FROM steps) AS steps;

-- name: delete_runs
-- Delete the given runs in any state (their steps go by trigger, their signals by cascade).
DELETE FROM cyclone_runs WHERE id = ANY(%(ids)s::uuid[]);

-- name: xmin_horizon
-- What holds vacuum back (history.VacuumWatch): xmin, the oldest transaction id still
-- running in the cluster (the next one to be given out when none runs), and dead, the
-- dead row versions of the hot tables (the statistics' count).
SELECT pg_snapshot_xmin(pg_current_snapshot())::text::bigint AS xmin,
       (SELECT coalesce(sum(n_dead_tup), 0)::bigint FROM pg_stat_user_tables
         WHERE relid IN ('cyclone_steps'::regclass, 'cyclone_runs'::regclass)) AS dead;

-- name: run_row_columns_expr
-- (Fragment) the stored columns of a run row (cyclone_runs and cyclone_runs_archive).
id, name, kind, state, input, idempotency_key, created_at, updated_at, finished_at, trace, unique_key,
parent_id, parent_node, parent_key

-- name: step_row_columns_expr
-- (Fragment) the stored columns of a step row (cyclone_steps and cyclone_steps_archive).
id, run_id, node, step_name, kind, depends_on, queue, priority, state, paused_from, attempt, max_attempts,
reclaims, max_reclaims, timeout, timer_delay, due_at, scheduled_at, started_at, finished_at, lease_owner,
lease_expiry, lease_generation, heartbeat_at, error, error_kind, errors, output, progress, backoff,
concurrency_key, concurrency, rate_count, rate_period, memory_limit, cpu_limit, max_processes, max_open_files,
dead_by, kill_within, start_delay, snoozes, input, map_node, item, items_total, items_left, allow_failures,
wait_spawned

-- name: history_lock
-- One supervisor at a time does history work: each of its transactions first takes this
-- transaction-level advisory lock (PgBouncer-safe), and skips its work when another holds it.
SELECT pg_try_advisory_xact_lock(%(key)s::bigint) AS got;

-- name: history_scan_ctes
-- (Fragment) where a history batch looks: policy, per finished state, the age
-- in microseconds after which a run leaves the hot tables (move_us: NULL, never) and after
-- which it is deleted rather than archived (drop_us: NULL, kept); scanned, up to %(limit)s
-- finished step rows older than %(scan_us)s, from the cursor %(after)s on (finished_at
-- order, by cyclone_steps_finished_idx; rows at the cursor again when %(inclusive)s): the
-- runs of finished steps are the candidates (cyclone_runs has no index on finished_at,
-- so that a run's completion stays a HOT update, migration 0004).
policy AS (
    SELECT p.state, p.move_us, p.drop_us
      FROM unnest(%(states)s::text[], %(move_us)s::bigint[], %(drop_us)s::bigint[]) AS p(state, move_us, drop_us)
     WHERE p.move_us IS NOT NULL
), scanned AS MATERIALIZED (
    SELECT s.run_id, s.finished_at
      FROM cyclone_steps s
     WHERE s.finished_at IS NOT NULL
       AND s.finished_at >= %(after)s::timestamptz
       AND (%(inclusive)s OR s.finished_at > %(after)s::timestamptz)
       AND s.finished_at < now() - (%(scan_us)s::bigint * interval '1 microsecond')
     ORDER BY s.finished_at
     LIMIT %(limit)s
)

-- name: archive_runs
-- One history batch: the finished runs among the scanned candidates that are past their
-- state's move_us (locked SKIP LOCKED: a run an operator acts on waits for the next
-- pass) leave the hot tables with their steps and signals; those past drop_us are deleted,
-- the others inserted into the archive (its partition must exist: archive_days). Steps go
-- by their run (the delete trigger of 0006 then finds none left). Returns what it did and
-- where the scan ended (first, last: the scanned rows' finished_at range).
WITH {history_scan_ctes}, doomed AS MATERIALIZED (
    SELECT r.id, r.state, r.finished_at,
           coalesce(r.finished_at < now() - (p.drop_us * interval '1 microsecond'), false) AS drop
      FROM cyclone_runs r
      JOIN policy p ON p.state = r.state
     WHERE r.id = ANY(ARRAY(SELECT DISTINCT run_id FROM scanned))
       AND r.finished_at < now() - (p.move_us * interval '1 microsecond')
       FOR UPDATE OF r SKIP LOCKED
), moved_steps AS (
    DELETE FROM cyclone_steps s
     USING doomed d
     WHERE s.run_id = d.id
    RETURNING s.*, d.state AS run_state, d.finished_at AS run_finished_at, d.drop
), moved_runs AS (
    DELETE FROM cyclone_runs r
     USING doomed d
     WHERE r.id = d.id
    RETURNING r.*, d.drop,
              (SELECT coalesce(jsonb_agg(jsonb_build_object('name', g.name, 'payload', g.payload,
                                                            'created_at', g.created_at)
                                         ORDER BY g.created_at, g.name), '[]'::jsonb)
                 FROM cyclone_signals g WHERE g.run_id = r.id) AS signals
), archived_runs AS (
    INSERT INTO cyclone_runs_archive ({run_row_columns_expr}, signals)
    SELECT {run_row_columns_expr}, signals FROM moved_runs WHERE NOT drop
    RETURNING 1
), archived_steps AS (
    INSERT INTO cyclone_steps_archive ({step_row_columns_expr}, run_state, run_finished_at)
    SELECT {step_row_columns_expr}, run_state, run_finished_at FROM moved_steps WHERE NOT drop
    RETURNING 1
)
SELECT (SELECT count(*) FROM scanned) AS scanned,
       (SELECT min(finished_at) FROM scanned) AS first,
       (SELECT max(finished_at) FROM scanned) AS last,
       (SELECT count(*) FROM archived_runs) AS archived,
       (SELECT count(*) FROM moved_runs WHERE drop) AS deleted,
       (SELECT count(*) FROM archived_steps) AS archived_steps;

-- name: archive_days
-- The archive partitions (state, UTC day) that archive_runs would need for the same
-- candidates (read without locks; maintenance makes the missing ones, then moves).
WITH {history_scan_ctes}
SELECT DISTINCT r.state, (r.finished_at AT TIME ZONE 'UTC')::date AS day
  FROM cyclone_runs r
  JOIN policy p ON p.state = r.state
 WHERE r.id = ANY(ARRAY(SELECT DISTINCT run_id FROM scanned))
   AND r.finished_at < now() - (p.move_us * interval '1 microsecond')
   AND NOT coalesce(r.finished_at < now() - (p.drop_us * interval '1 microsecond'), false)
 ORDER BY 1, 2;

-- name: archive_partitions
-- The archive's partitions, as (state, UTC day), and the database clock.
SELECT substring(c.relname FROM '^cyclone_runs_archive_([a-z]+)_[0-9]{8}$') AS state,
       to_date(substring(c.relname FROM '_([0-9]{8})$'), 'YYYYMMDD') AS day,
       now() AS now
  FROM pg_inherits i
  JOIN pg_class c ON c.oid = i.inhrelid
 WHERE i.inhparent = 'cyclone_runs_archive'::regclass
UNION ALL
SELECT NULL, NULL, now()
 ORDER BY 1, 2;

-- name: make_archive_partition
-- The partitions of one (state, UTC day), when missing (migration 0017), waiting at most
-- %(lock_timeout)s for their lock; made: true when they were made now.
SELECT cyclone_archive_partition(%(state)s, %(day)s::date, %(lock_timeout)s) AS made;

-- name: drop_archive_partition
-- Drop the partitions of one (state, UTC day) (migration 0017), waiting at most
-- %(lock_timeout)s for their lock; runs: how many runs they held.
SELECT cyclone_drop_archive_partition(%(state)s, %(day)s::date, %(lock_timeout)s) AS runs;

-- name: retain_archived
-- Retention's row deletes, in the archive partition that a state's cut-off falls in (a
-- whole older day is a dropped partition): up to %(limit)s runs of %(state)s that
-- finished more than %(drop_us)s ago, with their steps.
WITH doomed AS (
    SELECT a.id, a.finished_at
      FROM cyclone_runs_archive a
     WHERE a.state = %(state)s
       AND a.finished_at < now() - (%(drop_us)s::bigint * interval '1 microsecond')
     LIMIT %(limit)s
), runs AS (
    DELETE FROM cyclone_runs_archive a
     USING doomed d
     WHERE a.state = %(state)s AND a.id = d.id AND a.finished_at = d.finished_at
    RETURNING a.id, a.finished_at
), steps AS (
    DELETE FROM cyclone_steps_archive s
     USING runs r
     WHERE s.run_state = %(state)s AND s.run_id = r.id AND s.run_finished_at = r.finished_at
    RETURNING 1
)
SELECT (SELECT count(*) FROM runs) AS runs, (SELECT count(*) FROM steps) AS steps;

-- name: archived_run
-- An archived run's id, kind and state (an operator action on a finished run).
SELECT id::text AS id, kind, state FROM cyclone_runs_archive WHERE id = %(run_id)s LIMIT 1;

-- name: restore_run
-- Move an archived run back to the hot tables, with its steps and signals (client.retry
-- or client.signal of an archived run); the caller then locks it there as usual. A run
-- another caller restored meanwhile is not found here (nothing happens).
WITH run AS (
    DELETE FROM cyclone_runs_archive WHERE id = %(run_id)s
    RETURNING *
), steps AS (
    DELETE FROM cyclone_steps_archive s USING run r
     WHERE s.run_id = r.id AND s.run_state = r.state AND s.run_finished_at = r.finished_at
    RETURNING s.*
), hot_run AS (
    INSERT INTO cyclone_runs ({run_row_columns_expr})
    SELECT {run_row_columns_expr} FROM run
    RETURNING id
), hot_steps AS (
    INSERT INTO cyclone_steps ({step_row_columns_expr}) OVERRIDING SYSTEM VALUE
    SELECT {step_row_columns_expr} FROM steps
    RETURNING 1
), hot_signals AS (
    INSERT INTO cyclone_signals (run_id, name, payload, created_at)
    SELECT h.id, g ->> 'name', g -> 'payload', (g ->> 'created_at')::timestamptz
      FROM hot_run h, run r, jsonb_array_elements(r.signals) AS g
    ON CONFLICT (run_id, name) DO NOTHING
    RETURNING 1
)
SELECT (SELECT count(*) FROM hot_run) AS runs, (SELECT count(*) FROM hot_steps) AS steps;
