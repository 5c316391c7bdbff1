-- The supervisors' registry and the queues' depths.
-- Parameters are named placeholders: %(name)s.

-- name: register_worker
-- Announce or refresh a live supervisor, and count the live ones: this one and every
-- other whose row was refreshed within live_us (each sizes its prefetch by its share of
-- the fleet's). Recovery never reads these rows.
WITH me AS (
INSERT INTO cyclone_workers (id, hostname, pid, info)
VALUES (%(id)s, %(hostname)s, %(pid)s, %(info)s)
ON CONFLICT (id) DO UPDATE SET heartbeat_at = now(), info = excluded.info
RETURNING id
)
SELECT (SELECT count(*) FROM me) + count(*) AS live,
       (SELECT coalesce(array_agg(p.queue ORDER BY p.queue), '{}') FROM cyclone_queue_pauses p
         WHERE p.queue = ANY(%(queues)s::text[])) AS paused  -- which of its queues are paused (workers, metrics)
FROM cyclone_workers w
WHERE w.id <> %(id)s
AND w.heartbeat_at > now() - (%(live_us)s::bigint * interval '1 microsecond');

-- name: unregister_worker
-- A supervisor that exits cleanly removes its row.
DELETE FROM cyclone_workers WHERE id = %(id)s;

-- name: list_workers
-- Supervisors seen recently, with their children.
SELECT id, hostname, pid, started_at, heartbeat_at, info,
       extract(epoch FROM now() - heartbeat_at)::float8 AS age
  FROM cyclone_workers
 WHERE heartbeat_at > now() - (%(within_us)s::bigint * interval '1 microsecond')
 ORDER BY started_at;

-- name: queue_depths
-- Per queue: claimable steps (counted up to %(cap)s, in the claim's index order) and how
-- long the oldest of them has been claimable (the supervisor's metrics, every few seconds).
SELECT q.name AS queue, d.depth, d.oldest
  FROM unnest(%(queues)s::text[]) AS q(name)
 CROSS JOIN LATERAL (
        SELECT count(*)::bigint AS depth, extract(epoch FROM now() - min(a.scheduled_at))::float8 AS oldest
          FROM (SELECT scheduled_at
                  FROM cyclone_steps
                 WHERE state = 'available' AND queue = q.name AND scheduled_at <= now()
                 ORDER BY priority, scheduled_at, id
                 LIMIT %(cap)s) a
       ) d;

-- name: prune_workers
-- Forget supervisors silent for a long time.
DELETE FROM cyclone_workers WHERE heartbeat_at < now() - interval '1 hour';
