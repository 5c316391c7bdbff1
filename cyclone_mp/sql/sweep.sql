-- The recovery sweep: its turn among supervisors, the rows it looks at and what it writes
-- (SPEC 9), and the workflow timers it fires.
-- Parameters are named placeholders: %(name)s.

-- name: sweep_turn
-- Take the turn of a maintenance task %(task)s ('sweep': the recovery sweep; 'history': the
-- history pass) for every supervisor: move the task's ran_at to now when it is at least
-- %(every_us)s old. mine: this caller took it (and does the task now); due_in: seconds from
-- now until the turn it saw ends (the others ask again then); since_success: seconds since
-- a pass of the task last succeeded, on any supervisor (NULL: never). No write unless the
-- turn is taken; a missing row is made, and taken. Only finite timestamps are subtracted
-- (PostgreSQL before 17 refuses infinite ones).
WITH took AS (
    UPDATE cyclone_maintenance
       SET holder = %(owner)s, ran_at = now()
     WHERE task = %(task)s AND ran_at <= now() - %(every_us)s::bigint * interval '1 microsecond'
    RETURNING ran_at
), made AS (
    INSERT INTO cyclone_maintenance (task, holder, ran_at)
    SELECT %(task)s, %(owner)s, now()
     WHERE NOT EXISTS (SELECT 1 FROM cyclone_maintenance WHERE task = %(task)s)
    ON CONFLICT (task) DO NOTHING
    RETURNING ran_at
), seen AS (
    SELECT ran_at, succeeded_at FROM cyclone_maintenance WHERE task = %(task)s
)
SELECT EXISTS (SELECT 1 FROM took UNION ALL SELECT 1 FROM made) AS mine,
       (SELECT CASE WHEN isfinite(ran_at)
                    THEN extract(epoch FROM ran_at - now())::float8 + %(every_us)s::bigint / 1e6::float8
                    ELSE 0 END FROM seen) AS due_in,
       (SELECT extract(epoch FROM now() - succeeded_at)::float8 FROM seen) AS since_success;

-- name: maintenance_succeeded
-- A pass of the maintenance task %(task)s ended without an error (sweep_turn reports it).
UPDATE cyclone_maintenance SET succeeded_at = now() WHERE task = %(task)s;

-- name: sweep_candidates
-- Recovery sweep page: running rows whose DB deadline passed, or whose lease expired (a
-- running map row holds no lease: its items do) unless the sweeping supervisor %(owner)s
-- still holds it: its (id, generation) is among %(held_ids)s / %(held_generations)s, the
-- leases its keeper renews (an expired one too; its outcome writer may hold the outcome).
SELECT id, run_id::text AS run_id
  FROM cyclone_steps
 WHERE state = 'running'
   AND kind <> 'map'
   AND ((timeout IS NOT NULL AND started_at + timeout <= now())
        OR (lease_expiry < now()
            AND (lease_owner IS DISTINCT FROM %(owner)s
                 OR (id, lease_generation) NOT IN (
                      SELECT held.id, held.generation
                        FROM unnest(%(held_ids)s::bigint[], %(held_generations)s::bigint[]) AS held (id, generation)))))
 ORDER BY id
 LIMIT %(limit)s;

-- name: sweep_recheck
-- Under the run lock and the step lock, re-check a sweep candidate's expiry.
SELECT id, step_name, queue, attempt, max_attempts, reclaims, max_reclaims, lease_owner, lease_generation, backoff,
       node, run_id::text AS run_id,
       lease_expiry < now() AS lease_expired,
       (timeout IS NOT NULL AND started_at + timeout <= now()) AS timed_out
  FROM cyclone_steps
 WHERE id = %(id)s AND state = 'running'
   FOR UPDATE;

-- name: reclaim
-- A crash is a lease expiry: available at once, same attempt and scheduled_at, reclaims + 1.
UPDATE cyclone_steps
   SET state = 'available', lease_owner = NULL, lease_expiry = NULL, reclaims = reclaims + 1
 WHERE id = %(id)s;

-- name: discard_reclaim_limit
-- The expiry after the n-th reclaim with max_reclaims = n discards the step.
UPDATE cyclone_steps
   SET state = 'discarded', lease_expiry = NULL, finished_at = now(),
       error = %(error)s, error_kind = 'reclaim_limit',
       errors = errors || jsonb_build_array(%(entry)s::jsonb || jsonb_build_object('at', to_char(now() AT TIME ZONE 'UTC', 'YYYY-MM-DD"T"HH24:MI:SS.US"+00:00"')))
 WHERE id = %(id)s;

-- name: due_timer_runs
-- Runs with a timer node due on the database clock.
SELECT DISTINCT run_id::text AS run_id
  FROM cyclone_steps
 WHERE state = 'waiting_timer' AND due_at <= now()
 LIMIT %(limit)s;
