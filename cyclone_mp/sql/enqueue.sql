-- Making runs: the run row, its steps, unique keys, flow marks and slots, the NOTIFY.
-- Parameters are named placeholders: %(name)s.

-- name: insert_run
-- One run row (a spawned run's with its parent); with an idempotency key or a unique place
-- (cy.Unique) held, or its id taken (a spawn made before), the existing run wins (returns
-- nothing then).
WITH place AS ({unique_place_ctes})
INSERT INTO cyclone_runs (id, name, kind, input, idempotency_key, trace, unique_key, parent_id, parent_node, parent_key)
SELECT %(id)s, %(name)s, %(kind)s, %(input)s, %(idempotency_key)s, %(trace)s, (SELECT key FROM place),
       %(parent_id)s::uuid, %(parent_node)s, %(parent_key)s
 WHERE %(unique)s::text IS NULL OR EXISTS (SELECT 1 FROM place)
ON CONFLICT DO NOTHING
RETURNING id::text AS id;

-- name: unique_place_ctes
-- (Fragment) take a unique run's place (cy.Unique) for run %(id)s: the client's digest
-- %(unique)s and, with a period of %(unique_period_us)s, the window of the database clock it
-- falls in; nothing when another run holds it (or the run has none).
INSERT INTO cyclone_unique_places (unique_key, run_id, states)
SELECT {unique_key_expr}, %(id)s, %(unique_states)s::smallint
 WHERE %(unique)s::text IS NOT NULL
   -- (an idempotency key's run wins first: its own enqueue inserts nothing, nor a place)
   AND NOT EXISTS (SELECT 1 FROM cyclone_runs r WHERE r.idempotency_key = %(idempotency_key)s)
ON CONFLICT DO NOTHING
RETURNING unique_key AS key

-- name: unique_key_expr
-- (Fragment) a unique run's key (cy.Unique): the client's digest %(unique)s and, with a
-- period of %(unique_period_us)s, the window of the database clock it falls in.
CASE WHEN %(unique)s::text IS NOT NULL
     THEN %(unique)s::text || coalesce(':' || floor(extract(epoch FROM now()) * 1e6
                                                     / %(unique_period_us)s::bigint)::bigint::text, '') END

-- name: run_by_unique
-- The run that holds a unique place now (cy.Unique), if any.
SELECT run_id::text AS id FROM cyclone_unique_places WHERE unique_key = {unique_key_expr};

-- name: enqueue_step
-- A single-step run in one statement (run row, step row, NOTIFY): one round trip, one commit.
-- With an idempotency key already used (or a unique key held), nothing is written and id is NULL. %(input)s is
-- the input as JSON text (the client's payload check encoded it: it is not encoded twice).
WITH place AS ({unique_place_ctes}), run AS (
    INSERT INTO cyclone_runs (id, name, kind, input, idempotency_key, trace, unique_key,
                              parent_id, parent_node, parent_key)
    SELECT %(id)s, %(name)s, 'step', %(input)s::jsonb, %(idempotency_key)s, %(trace)s, (SELECT key FROM place),
           %(parent_id)s::uuid, %(parent_node)s, %(parent_key)s
     WHERE %(unique)s::text IS NULL OR EXISTS (SELECT 1 FROM place)
    ON CONFLICT DO NOTHING
    RETURNING id
), step AS (
    INSERT INTO cyclone_steps (run_id, node, step_name, kind, queue, priority, state, max_attempts,
                               max_reclaims, timeout, backoff, scheduled_at,
                               concurrency_key, concurrency, rate_count, rate_period,
                               memory_limit, cpu_limit, max_processes, max_open_files)
    SELECT run.id, %(name)s, %(name)s, 'task', %(queue)s, %(priority)s, 'available', %(max_attempts)s,
           %(max_reclaims)s, %(timeout_us)s::bigint * interval '1 microsecond', %(backoff)s::jsonb,
           coalesce(%(scheduled_at)s::timestamptz, now() + (%(delay_us)s::bigint * interval '1 microsecond')),
           %(key)s, %(concurrency)s, %(rate_count)s, %(rate_period_us)s::bigint * interval '1 microsecond',
           %(memory_limit)s::bigint, %(cpu_limit)s::float8, %(max_processes)s::int, %(max_open_files)s::int
      FROM run
    RETURNING run_id
)
SELECT (SELECT id::text FROM run) AS id,
       (SELECT count(pg_notify('cyclone_mp', %(queue)s)) FROM step) AS notified

-- name: run_by_key
-- The run that holds an idempotency key, hot or archived.
SELECT * FROM (
    (SELECT id::text AS id FROM cyclone_runs WHERE idempotency_key = %(key)s)
    UNION ALL
    (SELECT id::text FROM cyclone_runs_archive WHERE idempotency_key = %(key)s)
) x
LIMIT 1;

-- name: archived_run_by_key
-- The archived run that holds an idempotency key: an enqueue that inserted a run with
-- that key looks here before it commits (the hot table's unique index does not cover the
-- archive). Read after the insert, in a statement of its own: an archiving that moved the
-- key's holder before that insert committed first (the insert waited for it), so it is seen.
SELECT id::text AS id FROM cyclone_runs_archive WHERE idempotency_key = %(key)s LIMIT 1;

-- name: insert_steps
-- The step rows of one run (one per node), from parallel arrays.
INSERT INTO cyclone_steps (run_id, node, step_name, kind, depends_on, queue, priority, state,
                           max_attempts, max_reclaims, timeout, timer_delay, due_at, backoff, scheduled_at,
                           concurrency_key, concurrency, rate_count, rate_period,
                           memory_limit, cpu_limit, max_processes, max_open_files, allow_failures, wait_spawned)
SELECT %(run_id)s, t.node, t.step_name, t.kind,
       coalesce((SELECT array_agg(x) FROM jsonb_array_elements_text(t.depends_on) x), '{}'),
       t.queue, t.priority, t.state, t.max_attempts, t.max_reclaims,
       t.timeout_us * interval '1 microsecond', t.timer_delay_us * interval '1 microsecond', t.due_at,
       t.backoff,
       coalesce(%(scheduled_at)s::timestamptz, now() + (%(delay_us)s::bigint * interval '1 microsecond')),
       t.key, t.concurrency, t.rate_count, t.rate_period_us * interval '1 microsecond',
       t.memory_limit, t.cpu_limit, t.max_processes, t.max_open_files, t.allow_failures, t.wait_spawned
  FROM unnest(%(nodes)s::text[], %(step_names)s::text[], %(kinds)s::text[], %(depends_on)s::jsonb[],
              %(queues)s::text[], %(priorities)s::int[], %(states)s::text[], %(max_attempts)s::int[],
              %(max_reclaims)s::int[], %(timeouts_us)s::bigint[], %(timer_delays_us)s::bigint[],
              %(due_ats)s::timestamptz[], %(backoffs)s::jsonb[], %(keys)s::text[], %(concurrencies)s::int[],
              %(rate_counts)s::int[], %(rate_periods_us)s::bigint[], %(memory_limits)s::bigint[],
              %(cpu_limits)s::float8[], %(max_processes)s::int[], %(max_open_files)s::int[],
              %(allow_failures)s::boolean[], %(wait_spawned)s::boolean[])
    AS t(node, step_name, kind, depends_on, queue, priority, state, max_attempts, max_reclaims,
         timeout_us, timer_delay_us, due_at, backoff, key, concurrency, rate_count, rate_period_us,
         memory_limit, cpu_limit, max_processes, max_open_files, allow_failures, wait_spawned);

-- name: enqueue_many
-- Many single-step runs in one statement (bulk load), each with its concurrency key.
WITH runs AS (
    INSERT INTO cyclone_runs (id, name, kind, input, trace)
    SELECT t.id, %(name)s, 'step', t.input, %(trace)s::jsonb
      FROM unnest(%(ids)b::uuid[], %(inputs)b::text[]::jsonb[]) AS t(id, input)  -- binary: nothing to escape
    RETURNING id
)
INSERT INTO cyclone_steps (run_id, node, step_name, kind, queue, priority, state, max_attempts,
                           max_reclaims, timeout, backoff, scheduled_at,
                           concurrency_key, concurrency, rate_count, rate_period,
                           memory_limit, cpu_limit, max_processes, max_open_files)
SELECT runs.id, %(name)s, %(name)s, 'task', %(queue)s, %(priority)s, 'available', %(max_attempts)s,
       %(max_reclaims)s, %(timeout_us)s::bigint * interval '1 microsecond', %(backoff)s::jsonb,
       coalesce(%(scheduled_at)s::timestamptz, now() + (%(delay_us)s::bigint * interval '1 microsecond')),
       k.key, %(concurrency)s, %(rate_count)s, %(rate_period_us)s::bigint * interval '1 microsecond',
       %(memory_limit)s::bigint, %(cpu_limit)s::float8, %(max_processes)s::int, %(max_open_files)s::int
  FROM runs
  JOIN unnest(%(ids)b::uuid[], %(keys)s::text[]) AS k(id, key) ON k.id = runs.id;

-- name: flag_flow_queues
-- Queues that a step with a key or a limit entered (limits: one with a limit did; rates:
-- one with a rate limit did): their supervisors claim with the fair, the concurrency or
-- the full limited claim from then on. A mark is only ever raised.
INSERT INTO cyclone_flow_queues (queue, limits, rates)
SELECT t.queue, bool_or(t.limits), bool_or(t.rates)
  FROM unnest(%(queues)s::text[], %(limits)s::boolean[], %(rates)s::boolean[]) AS t(queue, limits, rates)
 GROUP BY t.queue
 ORDER BY t.queue
ON CONFLICT (queue) DO UPDATE
   SET limits = cyclone_flow_queues.limits OR excluded.limits, rates = cyclone_flow_queues.rates OR excluded.rates
 WHERE (excluded.limits AND NOT cyclone_flow_queues.limits) OR (excluded.rates AND NOT cyclone_flow_queues.rates);

-- name: ensure_slots
-- The slot rows of limited (step, key) groups: concurrency slots 1..n and rate slots
-- 1..n with their period (migrations 0007, 0022). Rows already there are kept (a raised
-- limit adds the new ones). The group's rows are then held (FOR KEY SHARE) until the
-- enqueue commits, so the cleanup (delete_idle_slots), which skips locked rows, never
-- deletes them under a step that is not visible yet.
WITH made AS (
    INSERT INTO cyclone_slots (step_name, key, kind, slot, period)
    SELECT g.step_name, g.key, x.kind, x.slot, CASE WHEN x.kind = 'r' THEN p.period END
      FROM unnest(%(step_names)s::text[], %(keys)s::text[], %(concurrencies)s::int[], %(rate_counts)s::int[],
                  %(periods_us)s::bigint[] ) AS g(step_name, key, concurrency, rate_count, period_us)
     CROSS JOIN LATERAL (SELECT g.period_us * interval '1 microsecond' AS period) p
     CROSS JOIN LATERAL (SELECT 'c'::"char" AS kind, generate_series(1, g.concurrency) AS slot
                         UNION ALL
                         SELECT 'r'::"char", generate_series(1, g.rate_count)) x
     ORDER BY 1, 2, 3, 4
    ON CONFLICT DO NOTHING
    RETURNING 1
)
SELECT count(*) AS held FROM (
    SELECT 1 FROM cyclone_slots sl
     WHERE (sl.step_name, sl.key) IN (SELECT * FROM unnest(%(step_names)s::text[], %(keys)s::text[]))
     ORDER BY sl.step_name, sl.key, sl.kind, sl.slot
       FOR KEY SHARE OF sl
) locked;

-- name: delete_idle_slots
-- Delete up to %(limit)s slot rows of groups none of whose steps waits or runs (hot table:
-- the archive holds finished runs only): a concurrency slot whose holder is over (not
-- running, and its processes dead: dead_by), a rate slot last used a whole period ago (a
-- day when its period is unknown). Rows locked by a claim or an enqueue are skipped.
WITH doomed AS (
    SELECT sl.step_name, sl.key, sl.kind, sl.slot
      FROM cyclone_slots sl
     WHERE NOT EXISTS (SELECT 1 FROM cyclone_steps s
                        WHERE s.step_name = sl.step_name AND s.concurrency_key = sl.key
                          AND s.state NOT IN ('completed', 'discarded', 'cancelled')
                          AND (s.concurrency IS NOT NULL OR s.rate_count IS NOT NULL))
       AND (sl.kind <> 'c' OR sl.step_id IS NULL
            OR NOT EXISTS (SELECT 1 FROM cyclone_steps h
                            WHERE h.id = sl.step_id AND h.lease_generation = sl.generation
                              AND (h.state = 'running' OR h.dead_by > now())))
       AND (sl.kind <> 'r' OR sl.used_at IS NULL OR sl.used_at + coalesce(sl.period, interval '1 day') <= now())
     LIMIT %(limit)s
       FOR UPDATE SKIP LOCKED
)
DELETE FROM cyclone_slots sl
 USING doomed d
 WHERE sl.step_name = d.step_name AND sl.key = d.key AND sl.kind = d.kind AND sl.slot = d.slot;

-- name: notify
-- Wake idle supervisors serving this queue (delivered at commit).
SELECT pg_notify('cyclone_mp', %(queue)s);
