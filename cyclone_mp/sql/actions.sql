-- The operator's actions on runs and queues: cancel, retry, pause, resume, signal.
-- Parameters are named placeholders: %(name)s.

-- name: cancel_run
-- client.cancel: every non-terminal step of the run, then the run, in one transaction. A
-- running attempt leaves an entry in errors (kind "cancelled", with its started_at and
-- claimed_at, lease owner and generation, so the supervisor's kill forensics can join
-- it), consuming no attempt and leaving error and error_kind as they were: after cancel,
-- retry, cancel the history still shows both attempts and when each started. (A row
-- claimed but never started, held or queued, is running here too: its supervisor rewrites
-- that entry once it knows, with mark_dead.)
WITH steps AS (
    UPDATE cyclone_steps
       SET state = 'cancelled', finished_at = now(), lease_expiry = NULL, paused_from = NULL,
           -- a running attempt lives on until its supervisor hears of the cancel (LISTEN, or
           -- its next renewal, before lease_expiry) and kills it (kill_within): its
           -- concurrency slot and a retry wait for that, or for the supervisor's report
           dead_by = CASE WHEN state = 'running' AND kind <> 'map'  -- (a running map row holds no lease)
                          THEN coalesce(dead_by, greatest(lease_expiry, now()) + coalesce(kill_within, interval '0'))
                          ELSE dead_by END,
           errors = CASE WHEN state = 'running' AND kind <> 'map' THEN errors || jsonb_build_array(jsonb_build_object(
                        'attempt', attempt, 'kind', 'cancelled', 'message', 'cancelled while running (client.cancel)',
                        -- started_at as status says it: the handler's start once its supervisor reported it
                        'started_at', started_at + coalesce(start_delay, interval '0'), 'claimed_at', started_at,
                        'at', {utc_now_expr},
                        'elapsed', round(extract(epoch FROM now() - started_at
                                                            - coalesce(start_delay, interval '0'))::numeric, 3),
                        'lease_owner', lease_owner, 'lease_generation', lease_generation))
                    ELSE errors END
     WHERE run_id = %(run_id)s
       AND state IN ('pending', 'available', 'running', 'waiting_signal', 'waiting_timer', 'paused')
    RETURNING id, lease_generation, (dead_by IS NOT NULL AND dead_by > now()) AS live
)
UPDATE cyclone_runs r
   SET state = 'cancelled', finished_at = now(), updated_at = now()
 WHERE id = %(run_id)s AND state IN ('running', 'paused')
RETURNING (SELECT count(*) FROM steps) AS steps, {run_ended_expr},
          -- the supervisors running its attempts hear of the cancel at once (LISTEN), at commit
          (SELECT count(pg_notify('cyclone_mp_cancel', st.id || '.' || st.lease_generation))
             FROM steps st WHERE st.live) AS pushed;

-- name: attempt_kinds_expr
-- (Fragment) the error kinds of an attempt that ended (decisions.FAILURE_KINDS; a unit test keeps them equal)
'timeout', 'error', 'permanent', 'child_exited', 'output_invalid', 'not_importable', 'memory_error', 'exit', 'memory_limit', 'cpu_limit', 'process_limit', 'oom_killed'

-- name: retry_run
-- client.retry: reopen discarded (or cancelled) steps; no attempt consumed. A step
-- discarded by its attempts gets max_attempts raised to attempt + 1, as River does. A
-- cancelled step keeps its attempt: its error_kind may be an earlier attempt's, already
-- counted when that attempt ended. A discarded map row runs again (its discarded items
-- are reopened here too; the completed ones stay completed), or, when its list was never
-- mapped, waits to be mapped again.
UPDATE cyclone_steps
   SET state = CASE WHEN kind <> 'map' THEN 'available' WHEN items_total IS NULL THEN 'pending' ELSE 'running' END,
       attempt = CASE WHEN state = 'discarded' AND error_kind IN ({attempt_kinds_expr}) AND kind <> 'map'
                      THEN attempt + 1 ELSE attempt END,
       max_attempts = CASE WHEN state = 'discarded' AND error_kind IN ({attempt_kinds_expr}) AND kind <> 'map'
                           THEN greatest(max_attempts, attempt + 1) ELSE max_attempts END,
       reclaims = CASE WHEN state = 'discarded' AND error_kind = 'reclaim_limit' THEN 0 ELSE reclaims END,
       scheduled_at = now(), finished_at = NULL, lease_owner = NULL, lease_expiry = NULL,
       error = NULL, error_kind = NULL
 WHERE run_id = %(run_id)s AND state = %(from_state)s AND kind IN ('task', 'map', 'item');

-- name: reopen_run
-- After a retry: the run is running again.
UPDATE cyclone_runs SET state = 'running', finished_at = NULL, updated_at = now() WHERE id = %(run_id)s;

-- name: pause_run
-- client.pause: pending, available and waiting steps become paused, remembering where they were.
WITH steps AS (
    UPDATE cyclone_steps
       SET paused_from = state, state = 'paused'
     WHERE run_id = %(run_id)s AND state IN ('pending', 'available', 'waiting_signal', 'waiting_timer')
    RETURNING id
)
UPDATE cyclone_runs SET state = 'paused', updated_at = now()
 WHERE id = %(run_id)s AND state = 'running'
RETURNING (SELECT count(*) FROM steps) AS steps;

-- name: resume_run
-- client.resume: each paused step goes back to the state it was paused from.
WITH steps AS (
    UPDATE cyclone_steps
       SET state = paused_from, paused_from = NULL,
           scheduled_at = CASE WHEN paused_from = 'available' THEN greatest(scheduled_at, now()) ELSE scheduled_at END
     WHERE run_id = %(run_id)s AND state = 'paused'
    RETURNING id
)
UPDATE cyclone_runs SET state = 'running', updated_at = now()
 WHERE id = %(run_id)s AND state = 'paused'
RETURNING (SELECT count(*) FROM steps) AS steps;

-- name: put_signal
-- Keep the first signal of a name for a run; later ones are ignored (returns nothing).
INSERT INTO cyclone_signals (run_id, name, payload)
VALUES (%(run_id)s, %(name)s, %(payload)s)
ON CONFLICT (run_id, name) DO NOTHING
RETURNING name;

-- name: pause_queue
-- client.pause_queue: no claim takes a step of queue %(queue)s from now on; returns whether
-- it was running (not paused already).
INSERT INTO cyclone_queue_pauses (queue, reason) VALUES (%(queue)s, %(reason)s)
ON CONFLICT (queue) DO NOTHING
RETURNING queue;

-- name: resume_queue
-- client.resume_queue: claims take the queue's steps again (its supervisors are woken at
-- commit); returns whether it was paused.
WITH resumed AS (DELETE FROM cyclone_queue_pauses WHERE queue = %(queue)s RETURNING queue)
SELECT r.queue, pg_notify('cyclone_mp', r.queue) FROM resumed r;

-- name: paused_queues
-- The paused queues, oldest pause first.
SELECT queue, paused_at, reason FROM cyclone_queue_pauses ORDER BY paused_at, queue;
