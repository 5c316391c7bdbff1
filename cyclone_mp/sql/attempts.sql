-- One attempt at a time: renewal, locks, a failed attempt's end, snooze, release, and the
-- record that an attempt's processes are dead.
-- Parameters are named placeholders: %(name)s.

-- name: heartbeat
-- Renew one step's lease, addressed by id, with exactly the seed's WHERE clause.
UPDATE cyclone_steps
   SET lease_expiry = now() + (%(ttl_us)s::bigint * interval '1 microsecond'),
       heartbeat_at = now(),
       progress = coalesce(%(progress)s::jsonb, progress),
       start_delay = coalesce(%(start_delay_us)s::bigint * interval '1 microsecond', start_delay)
 WHERE id = %(id)s
   AND state = 'running'
   AND lease_owner = %(owner)s
   AND lease_generation = %(generation)s
   AND (timeout IS NULL OR started_at + timeout > now());

-- name: lease_state
-- After a renewal matched nothing: why (cancelled, reclaimed, timed out, finished).
SELECT state, lease_owner, lease_generation,
       (timeout IS NOT NULL AND started_at + timeout <= now()) AS timed_out,
       errors -> -1 ->> 'kind' AS last_error_kind,
       (errors -> -1 ->> 'lease_generation')::bigint AS last_error_generation
  FROM cyclone_steps
 WHERE id = %(id)s;

-- name: lock_run
-- Take the run row lock (always before any step row lock of that run).
SELECT id::text AS id, kind, state FROM cyclone_runs WHERE id = %(run_id)s FOR UPDATE;

-- name: lock_run_of_step
-- Take the run row lock of the run that owns step %(id)s.
SELECT r.id::text AS id, r.kind, r.state
  FROM cyclone_runs r
 WHERE r.id = (SELECT run_id FROM cyclone_steps WHERE id = %(id)s)
   FOR UPDATE;

-- name: lock_run_of_step_nowait
-- lock_run_of_step for the outcome writer's writes alone: a run another session holds
-- fails the call at once (55P03, DatabaseBusy: tried again later) instead of holding the
-- writer, which makes every claim, for lock_timeout.
SELECT r.id::text AS id, r.kind, r.state
  FROM cyclone_runs r
 WHERE r.id = (SELECT run_id FROM cyclone_steps WHERE id = %(id)s)
   FOR UPDATE NOWAIT;

-- name: lock_attempt
-- Under the run lock: the step row of one attempt, if still running under that lease
-- (NOWAIT: see lock_run_of_step_nowait).
SELECT attempt, max_attempts, reclaims, max_reclaims, step_name, backoff,
       (timeout IS NOT NULL AND started_at + timeout <= now()) AS timed_out,
       ARRAY(SELECT e ->> 'kind' FROM jsonb_array_elements(errors) AS e) AS error_kinds  -- the poison quarantine's
  FROM cyclone_steps
 WHERE id = %(id)s
   AND state = 'running'
   AND lease_owner = %(owner)s
   AND lease_generation = %(generation)s
   FOR UPDATE NOWAIT;

-- name: end_attempt
-- Record a failed or timed-out attempt (already checked under lock): retry later or discard.
UPDATE cyclone_steps
   SET state = %(state)s,
       attempt = %(attempt)s,
       scheduled_at = CASE WHEN %(state)s = 'available'
                           THEN now() + (%(delay_us)s::bigint * interval '1 microsecond')
                           ELSE scheduled_at END,
       finished_at = CASE WHEN %(state)s = 'discarded' THEN now() ELSE NULL END,
       lease_owner = CASE WHEN %(state)s = 'available' THEN NULL ELSE lease_owner END,
       lease_expiry = NULL,
       error = %(error)s,
       error_kind = %(error_kind)s,
       errors = errors || jsonb_build_array(%(entry)s::jsonb || jsonb_build_object('at', to_char(now() AT TIME ZONE 'UTC', 'YYYY-MM-DD"T"HH24:MI:SS.US"+00:00"'))),
       progress = coalesce(%(progress)s::jsonb, progress),
       start_delay = coalesce((%(entry)s::jsonb ->> 'start_delay')::float8 * interval '1 second', start_delay),
       -- settled by the sweep while the attempt may still run: not claimed again before its
       -- processes are dead (its supervisor kills it by the deadline plus kill_within; one
       -- frozen or partitioned kills it before its lease expires)
       dead_by = CASE WHEN %(swept)s::boolean
                      THEN coalesce(dead_by, greatest(started_at + timeout + coalesce(kill_within, interval '0'),
                                                      lease_expiry))
                      ELSE dead_by END
 WHERE id = %(id)s;

-- name: mark_dead
-- A supervisor reaped the processes of these attempts (%(ids)s, %(generations)s) that ended
-- after a cancel or a timeout: whatever their rows say now, nothing of them runs any more
-- (dead_by = 'epoch', until the next claim of the step). The queues of the steps this frees
-- are woken (a retry or a concurrency sibling may be claimable now). An attempt whose
-- handler never started (%(started)s false: held, or queued behind a busy child, when the
-- cancel came): the entry client.cancel wrote for it (the last, of its lease generation)
-- loses started_at and elapsed and says so.
WITH dead AS (
    UPDATE cyclone_steps s
       SET dead_by = 'epoch',
           errors = CASE WHEN NOT k.started AND s.errors -> -1 ->> 'kind' = 'cancelled'
                              AND s.errors -> -1 ->> 'lease_generation' = k.generation::text
                         THEN jsonb_set(s.errors, '{-1}', ((s.errors -> -1) - 'started_at' - 'elapsed')
                                        || '{"message": "cancelled before it started (client.cancel)"}'::jsonb)
                         ELSE s.errors END
      FROM unnest(%(ids)s::bigint[], %(generations)s::bigint[], %(started)s::boolean[]) AS k(id, generation, started)
     WHERE s.id = k.id AND s.lease_generation = k.generation
       AND (s.dead_by IS NULL OR s.dead_by > 'epoch')
    RETURNING s.queue
)
SELECT count(pg_notify('cyclone_mp', q.queue)) AS woken FROM (SELECT DISTINCT queue FROM dead) q;

-- name: snooze
-- A handler raised cy.Snooze: under the run lock, the attempt's CAS (still running under
-- this lease, before its DB deadline), the step goes back to available %(delay_us)s later,
-- no attempt spent, snoozes + 1; past %(max_snoozes)s it is discarded (snooze_limit, the
-- entry kept). Returns the state it got (no row: the CAS failed, a late end).
UPDATE cyclone_steps
   SET state = CASE WHEN snoozes >= %(max_snoozes)s THEN 'discarded' ELSE 'available' END,
       scheduled_at = CASE WHEN snoozes >= %(max_snoozes)s THEN scheduled_at
                           ELSE now() + (%(delay_us)s::bigint * interval '1 microsecond') END,
       snoozes = snoozes + 1,
       finished_at = CASE WHEN snoozes >= %(max_snoozes)s THEN now() END,
       lease_owner = CASE WHEN snoozes >= %(max_snoozes)s THEN lease_owner END,
       lease_expiry = NULL,
       error = CASE WHEN snoozes >= %(max_snoozes)s
                    THEN 'snoozed ' || (snoozes + 1) || ' times, over max_snoozes=' || %(max_snoozes)s::int
                    ELSE error END,
       error_kind = CASE WHEN snoozes >= %(max_snoozes)s THEN 'snooze_limit' ELSE error_kind END,
       errors = CASE WHEN snoozes >= %(max_snoozes)s
                     THEN errors || jsonb_build_array(%(entry)s::jsonb || jsonb_build_object(
                              'attempt', attempt, 'kind', 'snooze_limit', 'at', {utc_now_expr}))
                     ELSE errors END,
       progress = coalesce(%(progress)s::jsonb, progress),
       start_delay = coalesce((%(entry)s::jsonb ->> 'start_delay')::float8 * interval '1 second', start_delay)
 WHERE id = %(id)s
   AND state = 'running'
   AND lease_owner = %(owner)s
   AND lease_generation = %(generation)s
   AND (timeout IS NULL OR started_at + timeout > now())
RETURNING state, run_id::text AS run_id;

-- name: release
-- Graceful shutdown gives a step back: available at once, no attempt, no reclaim (SPEC 5).
UPDATE cyclone_steps
   SET state = 'available', lease_owner = NULL, lease_expiry = NULL
 WHERE id = %(id)s
   AND state = 'running'
   AND lease_owner = %(owner)s
   AND lease_generation = %(generation)s
   AND (timeout IS NULL OR started_at + timeout > now());

-- name: annotate_attempt
-- The sweep settled a timed-out attempt first: add what its supervisor learnt since to
-- that attempt's entry (found by its lease owner and generation, wherever it is: the step
-- may have been retried and failed again before the kill): %(forensics)s (the kill's, or a
-- late return's), and %(note)s (what happened, or NULL) to its message, and to the step's
-- error while that is this last entry's message. The handler's last progress,
-- %(progress)s, and %(start_delay_us)s (its start after the claim), each NULL when
-- unknown, are stored too unless the step was claimed again since (its lease generation
-- moved on): the sweep could store only what the heartbeats had, and a handler may report
-- progress, or start, after the last renewal.
UPDATE cyclone_steps s
   SET errors = CASE WHEN e.idx IS NULL THEN s.errors
                     ELSE jsonb_set(s.errors, ARRAY[(e.idx - 1)::text],
                                    e.entry || %(forensics)s::jsonb
                                    || CASE WHEN %(note)s::text IS NULL THEN '{}'::jsonb
                                            ELSE jsonb_build_object('message', concat_ws('; ', e.entry ->> 'message', %(note)s::text))
                                       END)
                END,
       -- the step's error is that entry's message while that entry is the last
       error = CASE WHEN e.idx = jsonb_array_length(s.errors) AND %(note)s::text IS NOT NULL
                         AND s.error = e.entry ->> 'message'
                    THEN concat_ws('; ', s.error, %(note)s::text)
                    ELSE s.error END,
       progress = CASE WHEN s.lease_generation = %(generation)s AND s.state <> 'running'
                       THEN coalesce(%(progress)s::jsonb, s.progress)
                       ELSE s.progress END,
       start_delay = CASE WHEN s.lease_generation = %(generation)s AND s.state <> 'running'
                          THEN coalesce(%(start_delay_us)s::bigint * interval '1 microsecond', s.start_delay)
                          ELSE s.start_delay END
  FROM (SELECT 1) one
  LEFT JOIN (
        SELECT t.entry, t.idx
          FROM cyclone_steps c, jsonb_array_elements(c.errors) WITH ORDINALITY AS t(entry, idx)
         WHERE c.id = %(id)s
           AND t.entry ->> 'lease_owner' = %(owner)s
           AND (t.entry ->> 'lease_generation')::bigint = %(generation)s
           AND NOT t.entry ? 'killed_by_supervisor'  -- once
           AND NOT t.entry ? 'returned_late'         -- once
         ORDER BY t.idx DESC
         LIMIT 1) e ON true
 WHERE s.id = %(id)s
   AND (e.idx IS NOT NULL  -- else nothing to write: the row is left unlocked
        OR (s.lease_generation = %(generation)s AND s.state <> 'running'
            AND (%(progress)s::jsonb IS NOT NULL OR %(start_delay_us)s::bigint IS NOT NULL)));

-- name: hold_paused
-- In a paused run, a step that became claimable or waiting (a retry, a reclaim, a release)
-- is held paused too, remembering where to go on resume.
UPDATE cyclone_steps s
   SET paused_from = s.state, state = 'paused'
  FROM cyclone_runs r
 WHERE s.run_id = %(run_id)s
   AND r.id = s.run_id
   AND r.state = 'paused'
   AND s.state IN ('pending', 'available', 'waiting_signal', 'waiting_timer');

-- Dashboard reads
-- Read-only queries of the operator dashboard (cyclone_mp.dashboard). Optional
-- filters are written "(%(x)s IS NULL OR ...)"; the store runs these queries unprepared,
-- so PostgreSQL plans each with its actual values, folds away the unused filters and
-- uses the indexes of migrations/0002_dashboard.sql.
