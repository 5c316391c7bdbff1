-- Fragments other files' statements cite as {name}: spliced in at load time.
-- Parameters are named placeholders: %(name)s.

-- name: run_ended_expr
-- (Fragment) announce that run r ended, to the waiters of client.wait: a NOTIFY on
-- channel cyclone_mp_runs with the run's id, sent at commit, while anyone waits on this
-- database (waiting_expr). Every statement that makes a run completed, discarded or
-- cancelled returns it (a RETURNING expression is computed for each row, whatever reads it).
CASE WHEN {waiting_expr} THEN pg_notify('cyclone_mp_runs', r.id::text) END

-- name: waiting_expr
-- (Fragment) true while a client waits for runs on this database: a session named
-- 'cyclone_mp waiting' (cyclone_mp.waiting's listener) is connected to it. Read from the
-- server's activity array once per statement (about 25 us), no table. A transaction that
-- NOTIFYs takes, at commit, a lock every other notifying commit of the server waits for,
-- through its WAL flush: 16 writers committed a third as fast with a NOTIFY each as
-- without, so runs that end notify only while someone listens.
EXISTS (SELECT 1 FROM pg_stat_get_activity(NULL) a
         WHERE a.application_name = 'cyclone_mp waiting'
           AND a.datid = (SELECT d.oid FROM pg_database d WHERE d.datname = current_database()))

-- name: utc_now_expr
-- (Fragment) now() as ISO 8601 text in UTC, whatever the session's TimeZone: the "at"
-- of an error entry, whose text order must be time order (cyclone_steps_kills_idx).
to_char(now() AT TIME ZONE 'UTC', 'YYYY-MM-DD"T"HH24:MI:SS.US"+00:00"')

-- name: waiting_on_expr
-- (Fragment) for a step row s: the limit that holds it back now ('concurrency' when its
-- group's concurrency slots are all held by running attempts, 'rate_limit' when its
-- group started rate_count steps in the last period), or NULL. Reads, for status views.
CASE WHEN s.state = 'available' AND s.scheduled_at <= now() THEN
    CASE WHEN s.dead_by > now() THEN 'previous_attempt'
         WHEN s.concurrency IS NOT NULL
              AND (SELECT count(*) FROM cyclone_slots sl
                     JOIN cyclone_steps h ON h.id = sl.step_id AND h.lease_generation = sl.generation
                                          AND (h.state = 'running' OR h.dead_by > now())
                    WHERE sl.step_name = s.step_name AND sl.key = s.concurrency_key AND sl.kind = 'c'
                      AND sl.slot <= s.concurrency) >= s.concurrency THEN 'concurrency'
         WHEN s.rate_count IS NOT NULL
              AND (SELECT count(*) FROM cyclone_slots sl
                    WHERE sl.step_name = s.step_name AND sl.key = s.concurrency_key AND sl.kind = 'r'
                      AND sl.slot <= s.rate_count AND sl.used_at + s.rate_period > now()) >= s.rate_count
              THEN 'rate_limit' END END
