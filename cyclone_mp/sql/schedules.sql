-- Schedules and their definitions (cyclone_mp.schedules holds the logic).
-- Parameters are named placeholders: %(name)s.

-- name: sync_schedules
-- Create the rows of a supervisor's schedules, or refresh their seen_at (at most every
-- 5 s). The definitions are synced by sync_schedule_definitions; neither touches a row's
-- slots. Sorted by name (the caller's order), so concurrent supervisors lock rows in one order.
INSERT INTO cyclone_schedules (name, target, spec, next_at, seen_at, created_at)
SELECT t.name, t.target, t.spec, now(), now(), now()
  FROM unnest(%(names)s::text[], %(targets)s::text[], %(specs)s::jsonb[]) WITH ORDINALITY AS t(name, target, spec, i)
 ORDER BY t.i
ON CONFLICT (name) DO UPDATE
   SET seen_at = now()
 WHERE cyclone_schedules.seen_at < now() - interval '5 seconds';

-- name: sync_schedule_definitions
-- The definitions a supervisor declares: new ones are in force from now on (first_seen_at);
-- seen_at is refreshed at most every 5 s. One undeclared for %(active_us)s (no live
-- supervisor declared it) counts as new when declared again.
INSERT INTO cyclone_schedule_definitions AS d (name, fingerprint, target, spec, first_seen_at, seen_at)
SELECT t.name, t.fingerprint, t.target, t.spec, now(), now()
  FROM unnest(%(names)s::text[], %(fingerprints)s::text[], %(targets)s::text[], %(specs)s::jsonb[])
       WITH ORDINALITY AS t(name, fingerprint, target, spec, i)
 ORDER BY t.i
ON CONFLICT (name, fingerprint) DO UPDATE
   SET seen_at = now(),
       first_seen_at = CASE WHEN d.seen_at < now() - %(active_us)s::bigint * interval '1 microsecond'
                            THEN now() ELSE d.first_seen_at END
 WHERE d.seen_at < now() - interval '5 seconds';

-- name: forget_schedule_definitions
-- Drop the definitions of %(names)s that no live supervisor declared for %(active_us)s
-- (none of them is in force); rows another session holds are left for a later pass.
DELETE FROM cyclone_schedule_definitions d
 USING (SELECT name, fingerprint FROM cyclone_schedule_definitions
         WHERE name = ANY(%(names)s) AND seen_at < now() - %(active_us)s::bigint * interval '1 microsecond'
         ORDER BY name, fingerprint
           FOR UPDATE SKIP LOCKED) stale
 WHERE d.name = stale.name AND d.fingerprint = stale.fingerprint;

-- name: in_force_ctes
-- (Fragment) in_force: for each schedule among %(names)s, the definition in force: of
-- those a supervisor declared within %(active_us)s, the one first declared last.
in_force AS (
    SELECT DISTINCT ON (d.name) d.name, d.fingerprint, d.first_seen_at
      FROM cyclone_schedule_definitions d
     WHERE d.name = ANY(%(names)s) AND d.seen_at >= now() - %(active_us)s::bigint * interval '1 microsecond'
     ORDER BY d.name, d.first_seen_at DESC, d.fingerprint DESC
)

-- name: due_schedules
-- The schedules among %(names)s whose definition in force is the caller's (%(fingerprints)s,
-- one per name) and that are due: their next slot has come on the database clock, or
-- another definition decided them last (a handover is due at once). Locked (NO KEY: a
-- definition's insert, which checks its row exists, never waits on a tick); one another
-- supervisor is deciding is skipped (it enqueues that slot).
WITH {in_force_ctes}
SELECT s.name, s.target, s.spec, s.fingerprint, s.last_slot, now() AS now
  FROM cyclone_schedules s
  JOIN in_force f ON f.name = s.name
  JOIN unnest(%(names)s::text[], %(fingerprints)s::text[]) AS m(name, fingerprint)
       ON m.name = s.name AND m.fingerprint = f.fingerprint
 WHERE s.next_at <= now() OR s.fingerprint IS DISTINCT FROM f.fingerprint
 ORDER BY s.name
   FOR NO KEY UPDATE OF s SKIP LOCKED;

-- name: schedules_in_force
-- The definition in force of each schedule among %(names)s and since when, read again once
-- due_schedules holds their rows: a definition declared meanwhile is seen.
WITH {in_force_ctes}
SELECT name, fingerprint, first_seen_at FROM in_force;

-- name: advance_schedule
-- After a tick enqueued a schedule's due slots: the definition that decided it, the last
-- slot decided, the next one.
UPDATE cyclone_schedules
   SET target = %(target)s, spec = %(spec)s, fingerprint = %(fingerprint)s, last_slot = %(last_slot)s,
       next_at = %(next_at)s, runs = runs + %(n)s, skipped = skipped + %(skipped)s,
       last_run_id = coalesce(%(run_id)s::uuid, last_run_id), seen_at = now()
 WHERE name = %(name)s;

-- name: get_schedule
-- One schedule row (a scheduled run's status shows its next slot).
SELECT name, target, spec, last_slot, next_at, runs, skipped, seen_at FROM cyclone_schedules WHERE name = %(name)s;

-- name: delete_schedule
-- cyclone-mp schedules --delete: forget a schedule's row unless a supervisor ticked it in the
-- last %(active_s)s seconds (the runs it enqueued stay). Returns the row's age, whether deleted.
WITH s AS (
    SELECT name, extract(epoch FROM now() - seen_at)::float8 AS age
      FROM cyclone_schedules WHERE name = %(name)s FOR UPDATE
), gone AS (
    DELETE FROM cyclone_schedules c USING s WHERE c.name = s.name AND s.age >= %(active_s)s RETURNING c.name
)
SELECT s.age, EXISTS (SELECT 1 FROM gone) AS deleted FROM s;

-- name: list_schedules
-- Every schedule with the database clock: the CLI's and the dashboard's table.
SELECT name, target, spec, last_slot, last_run_id::text AS last_run_id, next_at, runs, skipped,
       seen_at, created_at, now() AS now, extract(epoch FROM now() - seen_at)::float8 AS age
  FROM cyclone_schedules
 ORDER BY name;

-- name: list_schedule_definitions
-- The definitions a supervisor declared within %(active_us)s, per schedule, the one in
-- force first (the order of in_force_ctes).
SELECT name, fingerprint, target, spec, first_seen_at, seen_at
  FROM cyclone_schedule_definitions
 WHERE seen_at >= now() - %(active_us)s::bigint * interval '1 microsecond'
 ORDER BY name, first_seen_at DESC, fingerprint DESC;
