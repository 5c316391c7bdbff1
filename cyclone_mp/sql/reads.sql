-- Reads of runs and steps for the clients (status, lists, waits).
-- Parameters are named placeholders: %(name)s.

-- name: get_run
-- The run row of client.status, from the hot table or else from the archive:
-- one statement, so a run moved meanwhile is found in one or the other, and the archive
-- is read only when the hot table has no such run (the Append stops at the first row).
SELECT * FROM (
    (SELECT id::text AS id, name, kind, state, input, idempotency_key, created_at, updated_at, finished_at,
            false AS archived, parent_id::text AS parent_id, parent_node, parent_key
       FROM cyclone_runs WHERE id = %(run_id)s)
    UNION ALL
    (SELECT id::text, name, kind, state, input, idempotency_key, created_at, updated_at, finished_at, true,
            parent_id::text, parent_node, parent_key
       FROM cyclone_runs_archive WHERE id = %(run_id)s)
) x
LIMIT 1;

-- name: children_of_run
-- The runs run %(run_id)s spawned (ctx.spawn), hot and archived, by node and key, at most
-- %(limit)s (cyclone_runs_parent_idx).
SELECT * FROM (
    (SELECT id::text AS id, name, state, parent_node, parent_key FROM cyclone_runs WHERE parent_id = %(run_id)s)
    UNION ALL
    (SELECT id::text, name, state, parent_node, parent_key FROM cyclone_runs_archive WHERE parent_id = %(run_id)s)
) x
ORDER BY parent_node, parent_key
LIMIT %(limit)s;

-- name: step_status_columns_expr
-- (Fragment) the columns a step row s (hot or archived) gives to step_columns_expr and
-- archived_step_columns_expr
s.id, s.node, s.step_name, s.kind, s.depends_on, s.queue, s.priority, s.state, s.paused_from, s.attempt,
s.max_attempts, s.reclaims, s.max_reclaims, extract(epoch FROM s.timeout)::float8 AS timeout,
s.due_at, s.scheduled_at, s.started_at AS claimed_at,  -- (the column is the claim's now(): the timeout's base)
s.started_at + coalesce(s.start_delay, interval '0') AS started_at,  -- the handler's start, once reported
s.finished_at, s.lease_owner, s.lease_expiry,
s.lease_generation, s.heartbeat_at, s.error, s.error_kind, s.errors, s.output, s.progress,
s.concurrency_key, s.concurrency, s.rate_count, extract(epoch FROM s.rate_period)::float8 AS rate_seconds,
s.memory_limit, s.cpu_limit, s.max_processes, s.max_open_files,
CASE WHEN s.dead_by > 'epoch' THEN s.dead_by END AS dead_by,  -- ('epoch': its processes were reaped)
s.snoozes, s.items_total

-- name: step_columns_expr
-- (Fragment) the columns of a step row s as client.status shows it (StepStatus.from_row),
-- with its key and limits: running_in_group counts the group's attempts that
-- hold a concurrency slot, starts_in_period the starts of the last rate period (both from
-- step_limits_expr, which the query joins).
{step_status_columns_expr},
g.running_in_group, g.starts_in_period, {waiting_on_expr} AS waiting_on,
CASE WHEN s.kind = 'map' AND s.items_total IS NOT NULL THEN  -- a map's items by state (StepStatus.items)
    (SELECT jsonb_object_agg(x.state, x.n) FROM (SELECT i.state, count(*) AS n FROM cyclone_steps i
                                                   WHERE i.run_id = s.run_id AND i.map_node = s.node
                                                   GROUP BY i.state) x) END AS items

-- name: archived_step_columns_expr
-- (Fragment) step_columns_expr of an archived step row s (cyclone_steps_archive): its
-- limits hold nothing back any more (running_in_group, starts_in_period, waiting_on NULL).
{step_status_columns_expr},
NULL::bigint AS running_in_group, NULL::bigint AS starts_in_period, NULL::text AS waiting_on,
CASE WHEN s.kind = 'map' AND s.items_total IS NOT NULL THEN
    (SELECT jsonb_object_agg(x.state, x.n) FROM (SELECT i.state, count(*) AS n FROM cyclone_steps_archive i
                                                   WHERE i.run_id = s.run_id AND i.map_node = s.node
                                                   GROUP BY i.state) x) END AS items

-- name: step_limits_expr
-- (Fragment) the join of step_columns_expr's group counts, for a step row s.
LEFT JOIN LATERAL (
      SELECT (SELECT count(*) FROM cyclone_slots sl
                JOIN cyclone_steps h ON h.id = sl.step_id AND h.lease_generation = sl.generation
                                     AND (h.state = 'running' OR h.dead_by > now())
               WHERE sl.step_name = s.step_name AND sl.key = s.concurrency_key AND sl.kind = 'c'
                 AND s.concurrency IS NOT NULL) AS running_in_group,
             (SELECT count(*) FROM cyclone_slots sl
               WHERE sl.step_name = s.step_name AND sl.key = s.concurrency_key AND sl.kind = 'r'
                 AND sl.used_at + s.rate_period > now() AND s.rate_count IS NOT NULL) AS starts_in_period
       WHERE s.concurrency IS NOT NULL OR s.rate_count IS NOT NULL) g ON true

-- name: get_steps
-- Every step row of a run, in definition order, but a map's items (its row counts them:
-- map_items lists them): from the hot table, or from the archive when the hot table has
-- none (one statement: a run's steps are all in one table).
SELECT {step_columns_expr}
  FROM cyclone_steps s {step_limits_expr}
 WHERE s.run_id = %(run_id)s AND s.map_node IS NULL
UNION ALL
SELECT {archived_step_columns_expr}
  FROM cyclone_steps_archive s
 WHERE s.run_id = %(run_id)s AND s.map_node IS NULL
   AND NOT EXISTS (SELECT 1 FROM cyclone_steps h WHERE h.run_id = %(run_id)s)
 ORDER BY id;

-- name: map_items
-- A page of a map's items in item order (keyset: after item %(after)s, at most %(limit)s),
-- those in %(states)s when given, as get_steps gives steps; the hot table's, or the
-- archive's when the hot table has none.
SELECT * FROM (
    SELECT {step_columns_expr}, s.item
      FROM cyclone_steps s {step_limits_expr}
     WHERE s.run_id = %(run_id)s AND s.map_node = %(node)s AND s.item > %(after)s
       AND (%(states)s::text[] IS NULL OR s.state = ANY(%(states)s::text[]))
     ORDER BY s.item
     LIMIT %(limit)s) h
UNION ALL
SELECT * FROM (
    SELECT {archived_step_columns_expr}, s.item
      FROM cyclone_steps_archive s
     WHERE s.run_id = %(run_id)s AND s.map_node = %(node)s AND s.item > %(after)s
       AND (%(states)s::text[] IS NULL OR s.state = ANY(%(states)s::text[]))
       AND NOT EXISTS (SELECT 1 FROM cyclone_steps x WHERE x.run_id = %(run_id)s)
     ORDER BY s.item
     LIMIT %(limit)s) a
 ORDER BY item;

-- name: finished_runs
-- The runs among some ids that are completed, discarded or cancelled (what a waiter reads
-- when woken: the notification says which runs ended); the archive is read for the ids
-- the hot table does not hold (archived runs are all finished).
SELECT id::text AS id, name, kind, state, input, idempotency_key, created_at, updated_at, finished_at,
       false AS archived
  FROM cyclone_runs
 WHERE id = ANY(%(ids)s::uuid[]) AND state IN ('completed', 'discarded', 'cancelled')
UNION ALL
SELECT id::text, name, kind, state, input, idempotency_key, created_at, updated_at, finished_at, true
  FROM cyclone_runs_archive
 WHERE id = ANY(ARRAY(SELECT unnest(%(ids)s::uuid[])
                      EXCEPT SELECT r.id FROM cyclone_runs r WHERE r.id = ANY(%(ids)s::uuid[])));

-- name: steps_of_runs
-- Every step row of some runs, by run then in definition order (of an archived run, its
-- archived rows, as get_steps).
SELECT s.run_id::text AS run_id, {step_columns_expr}
  FROM cyclone_steps s {step_limits_expr}
 WHERE s.run_id = ANY(%(ids)s::uuid[]) AND s.map_node IS NULL
UNION ALL
SELECT s.run_id::text, {archived_step_columns_expr}
  FROM cyclone_steps_archive s
 WHERE s.map_node IS NULL AND s.run_id = ANY(ARRAY(SELECT unnest(%(ids)s::uuid[])
                            EXCEPT SELECT h.run_id FROM cyclone_steps h WHERE h.run_id = ANY(%(ids)s::uuid[])))
 ORDER BY run_id, id;

-- name: runs_filter_expr
-- (Fragment) the filters of a run row r (hot or archived), each NULL when not asked for:
-- its state is one of %(states)s; it was created at or after since (%(since_at)s, or
-- %(since_us)s microseconds before now()) and before until (likewise); the schedule that
-- enqueued it (its idempotency key) is %(schedule)s.
(%(states)s::text[] IS NULL OR r.state = ANY(%(states)s::text[]))
AND ((%(since_at)s::timestamptz IS NULL AND %(since_us)s::bigint IS NULL)
     OR r.created_at >= coalesce(%(since_at)s::timestamptz, now() - %(since_us)s::bigint * interval '1 microsecond'))
AND ((%(until_at)s::timestamptz IS NULL AND %(until_us)s::bigint IS NULL)
     OR r.created_at < coalesce(%(until_at)s::timestamptz, now() - %(until_us)s::bigint * interval '1 microsecond'))
AND (%(schedule)s::text IS NULL
     OR substring(r.idempotency_key FROM '^cyclone-schedule:(.*):[^:]*(?::[^:]*){3}$') = %(schedule)s::text)

-- name: steps_filter_expr
-- (Fragment) a step row s of the step name, queue and concurrency key asked for (each
-- NULL when not asked for).
(%(step)s::text IS NULL OR s.step_name = %(step)s::text)
AND (%(queue)s::text IS NULL OR s.queue = %(queue)s::text)
AND (%(key)s::text IS NULL OR s.concurrency_key = %(key)s::text)

-- name: list_runs
-- Recent runs, newest first, that match runs_filter_expr and have a step that matches
-- steps_filter_expr (when a step, queue or key is asked for), each with the run that spawned
-- it (parent_id) and its steps counted without a map's items; archived runs too when
-- %(archived)s (an archived run finished after it was created: since also bounds its
-- finished_at, which prunes the archive's partitions). The page is chosen first; then,
-- for its rows only: how many steps, the concurrency keys of its steps (key), the limit
-- that holds one of its steps back (waiting_on, see waiting_on_expr) and the schedule
-- that enqueued it.
WITH page AS (
    SELECT u.*
      FROM ((SELECT r.id, r.name, r.kind, r.state, r.created_at, r.finished_at, r.idempotency_key,
                    false AS archived, r.parent_id
               FROM cyclone_runs r
              WHERE {runs_filter_expr}
                AND (%(step)s::text IS NULL AND %(queue)s::text IS NULL AND %(key)s::text IS NULL
                     OR EXISTS (SELECT 1 FROM cyclone_steps s WHERE s.run_id = r.id AND {steps_filter_expr}))
              ORDER BY r.created_at DESC, r.id DESC
              LIMIT %(limit)s)
            UNION ALL
            (SELECT r.id, r.name, r.kind, r.state, r.created_at, r.finished_at, r.idempotency_key, true,
                    r.parent_id
               FROM cyclone_runs_archive r
              WHERE %(archived)s::boolean
                AND {runs_filter_expr}
                AND ((%(since_at)s::timestamptz IS NULL AND %(since_us)s::bigint IS NULL)
                     OR r.finished_at >= coalesce(%(since_at)s::timestamptz,
                                                  now() - %(since_us)s::bigint * interval '1 microsecond'))
                AND (%(step)s::text IS NULL AND %(queue)s::text IS NULL AND %(key)s::text IS NULL
                     OR EXISTS (SELECT 1 FROM cyclone_steps_archive s  -- (the run's own partition)
                                 WHERE s.run_id = r.id AND s.run_state = r.state
                                   AND s.run_finished_at = r.finished_at AND {steps_filter_expr}))
              ORDER BY r.created_at DESC, r.id DESC
              LIMIT %(limit)s)) u
     ORDER BY u.created_at DESC, u.id DESC
     LIMIT %(limit)s
)
SELECT p.id::text AS id, p.name, p.kind, p.state, p.created_at, p.finished_at, p.archived,
       p.parent_id::text AS parent_id,  -- the run that spawned it (ctx.spawn), or NULL
       CASE WHEN p.archived THEN
           (SELECT count(*) FROM cyclone_steps_archive s
             WHERE s.run_id = p.id AND s.run_state = p.state AND s.run_finished_at = p.finished_at
               AND s.map_node IS NULL)
       ELSE (SELECT count(*) FROM cyclone_steps s WHERE s.run_id = p.id AND s.map_node IS NULL) END AS steps,
       CASE WHEN p.archived THEN
           (SELECT string_agg(DISTINCT s.concurrency_key, ',') FROM cyclone_steps_archive s
             WHERE s.run_id = p.id AND s.run_state = p.state AND s.run_finished_at = p.finished_at
               AND s.concurrency_key <> '')
       ELSE (SELECT string_agg(DISTINCT s.concurrency_key, ',') FROM cyclone_steps s
              WHERE s.run_id = p.id AND s.concurrency_key <> '') END AS key,
       CASE WHEN p.archived THEN NULL ELSE
           (SELECT {waiting_on_expr} FROM cyclone_steps s
             WHERE s.run_id = p.id AND s.state = 'available' AND s.scheduled_at <= now()
               AND (s.concurrency IS NOT NULL OR s.rate_count IS NOT NULL)
             ORDER BY 1 NULLS LAST LIMIT 1) END AS waiting_on,
       substring(p.idempotency_key FROM '^cyclone-schedule:(.*):[^:]*(?::[^:]*){3}$') AS schedule
  FROM page p
 ORDER BY p.created_at DESC, p.id DESC;

-- name: runs_by_prefix
-- Up to two runs whose id starts with a prefix (so a short id from a table is usable),
-- hot or archived.
SELECT DISTINCT id FROM (
    (SELECT id::text AS id FROM cyclone_runs
      WHERE id >= %(low)s::uuid AND id <= %(high)s::uuid ORDER BY id LIMIT 2)
    UNION ALL
    (SELECT id::text FROM cyclone_runs_archive
      WHERE id >= %(low)s::uuid AND id <= %(high)s::uuid ORDER BY id LIMIT 2)
) x
 ORDER BY id
 LIMIT 2;


-- History: finished runs move from the hot tables to the archive, retention
-- deletes them; see migrations/0017_history.sql and cyclone_mp/history.py.
