-- Every query cyclone_mp runs, one per "-- name:" header, with a one-line purpose.
-- Loaded once by cyclone_mp.store; parameters are named placeholders: %(name)s.

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

-- name: walk_ctes
-- (Fragment) the first half of the fair claims: each queue's keys
-- (concurrency_key) are walked in order from the key after %(cursors)s (one per queue,
-- NULL: from the first), at most %(limit)s + 2 of them; each walked key's first steps
-- (its share of the limit) are locked SKIP LOCKED; rn ranks them within their key, gr
-- within their (step, key) group. Without %(limits)s, no step with a limit is taken;
-- without %(rates)s, no step with a rate limit.
walk (queue, key, p, first) AS (
    -- a loose index scan: the next key with a due step, wrapping around once
    SELECT q.name, k.key, 1, k.key
      FROM unnest(%(queues)s::text[], %(cursors)s::text[]) AS q(name, cursor)
     CROSS JOIN LATERAL (SELECT coalesce(
            (SELECT s.concurrency_key FROM cyclone_steps s
              WHERE s.state = 'available' AND s.queue = q.name AND s.concurrency_key > q.cursor
                AND s.step_name = ANY(%(names)s) AND s.scheduled_at <= now()
              AND (s.dead_by IS NULL OR s.dead_by <= now())
              ORDER BY s.concurrency_key LIMIT 1),
            (SELECT s.concurrency_key FROM cyclone_steps s
              WHERE s.state = 'available' AND s.queue = q.name
                AND s.step_name = ANY(%(names)s) AND s.scheduled_at <= now()
              AND (s.dead_by IS NULL OR s.dead_by <= now())
              ORDER BY s.concurrency_key LIMIT 1)) AS key OFFSET 0) k  -- (OFFSET 0: probed once, not per use)
     WHERE %(limit)s > 0 AND k.key IS NOT NULL
       AND NOT EXISTS (SELECT 1 FROM cyclone_queue_pauses qp WHERE qp.queue = q.name)  -- a paused queue: nothing
    UNION ALL
    SELECT w.queue, n.key, w.p + 1, w.first
      FROM walk w
     CROSS JOIN LATERAL (SELECT coalesce(
            (SELECT s.concurrency_key FROM cyclone_steps s
              WHERE s.state = 'available' AND s.queue = w.queue AND s.concurrency_key > w.key
                AND s.step_name = ANY(%(names)s) AND s.scheduled_at <= now()
              AND (s.dead_by IS NULL OR s.dead_by <= now())
              ORDER BY s.concurrency_key LIMIT 1),
            (SELECT s.concurrency_key FROM cyclone_steps s
              WHERE s.state = 'available' AND s.queue = w.queue
                AND s.step_name = ANY(%(names)s) AND s.scheduled_at <= now()
              AND (s.dead_by IS NULL OR s.dead_by <= now())
              ORDER BY s.concurrency_key LIMIT 1)) AS key OFFSET 0) n
     WHERE w.p < %(limit)s + 2 AND n.key <> w.first
), cand AS MATERIALIZED (
    -- each walked key's first steps (as many as its share of the limit), locked
    SELECT c.*, w.queue, w.p, row_number() OVER (PARTITION BY w.queue, w.key ORDER BY c.priority, c.scheduled_at, c.id) AS rn
      FROM walk w
     CROSS JOIN LATERAL (
            SELECT s.id, s.step_name, s.concurrency_key AS key, s.priority, s.scheduled_at,
                   s.concurrency, s.rate_count, s.rate_period
              FROM cyclone_steps s
             WHERE s.state = 'available'
               AND s.queue = w.queue
               AND s.concurrency_key = w.key
               AND s.step_name = ANY(%(names)s)
               AND s.scheduled_at <= now()
               AND (s.dead_by IS NULL OR s.dead_by <= now())  -- the last attempt's processes are dead
               AND (%(limits)s OR (s.concurrency IS NULL AND s.rate_count IS NULL))  -- the fair claim takes no limited step
               AND (%(rates)s OR s.rate_count IS NULL)  -- nor the concurrency claim a rate-limited one
             ORDER BY s.priority, s.scheduled_at, s.id
             LIMIT (%(limit)s + (SELECT count(*) FROM walk) - 1) / (SELECT count(*) FROM walk)
               FOR UPDATE SKIP LOCKED
           ) c
), ranked AS (
    SELECT c.*, row_number() OVER (PARTITION BY c.step_name, c.key ORDER BY c.priority, c.rn, c.p, c.id) AS gr
      FROM cand c
)

-- name: picked_ctes
-- (Fragment) round-robin: every key's first step, then every key's second, ... (priority
-- first), from the eligible candidates.
picked AS MATERIALIZED (
    -- round-robin: every key's first step, then every key's second, ... (priority first)
    SELECT e.id, e.step_name, e.key, e.queue, e.p, e.rn, e.gr
      FROM eligible e
     ORDER BY e.priority, e.rn, e.p, e.id
     LIMIT %(limit)s
)

-- name: flow_marks_expr
-- (Fragment) what a claim's meta row tells the store of %(queues)s (cyclone_flow_queues,
-- migrations 0008-0010): per queue a step with a key, a limit or a rate limit ever
-- entered, its strongest mark ("keys", "limits", "rates"), as JSON text. The store picks
-- its next claim statement from it, so the marks cost no round trip of their own.
(SELECT coalesce(jsonb_object_agg(f.queue, CASE WHEN f.rates THEN 'rates' WHEN f.limits THEN 'limits' ELSE 'keys' END),
                 '{}'::jsonb)::text
   FROM cyclone_flow_queues f
  WHERE f.queue = ANY(%(queues)s::text[]))

-- name: claim_meta_ctes
-- (Fragment) the claim's meta row, for the store (not a claimed row): where each queue's
-- walk ended, and claim_wait's seconds until a step a rate limit held back may start
-- (the supervisor may poll again then; see Store.claim_wait).
claim_meta AS (
    -- for the store, not a claimed row: where each queue's walk ended (the next claim
    -- starts after it) and, when a rate limit held a step back, the seconds until its
    -- group's next slot frees (the supervisor may poll again then; see Store.claim_wait)
    -- a queue's walk ends at its last key before the first one that could have started a
    -- step but lost its turn to the limit of this claim (no cursor: it starts there again)
    SELECT (SELECT jsonb_object_agg(x.queue, x.key)
              FROM (SELECT DISTINCT ON (w.queue) w.queue, w.key
                      FROM walk w
                     WHERE NOT EXISTS (SELECT 1 FROM eligible e
                                        WHERE e.queue = w.queue AND e.p <= w.p AND e.rn = 1
                                          AND NOT EXISTS (SELECT 1 FROM picked k WHERE k.id = e.id))
                     ORDER BY w.queue, w.p DESC) x) AS cursors,
           (SELECT wait FROM claim_wait) AS wait
)

-- name: cslots_ctes
-- (Fragment) the free concurrency slots of the limited groups (grp: step_name, key,
-- concurrency, n wanted), locked SKIP LOCKED, numbered i within their group.
cslots AS MATERIALIZED (
    -- free concurrency slots, locked: the holder attempt no longer runs in a snapshot
    -- that includes the claim that took the slot (else held: it may have just started)
    SELECT g.step_name, g.key, f.slot, row_number() OVER (PARTITION BY g.step_name, g.key ORDER BY f.slot) AS i
      FROM grp g
     CROSS JOIN LATERAL (
            SELECT sl.slot
              FROM cyclone_slots sl
             WHERE sl.step_name = g.step_name AND sl.key = g.key AND sl.kind = 'c' AND sl.slot <= g.concurrency
               AND (sl.step_id IS NULL
                    OR (pg_visible_in_snapshot(sl.claim_xid, pg_current_snapshot())
                        -- its holder, by primary key: a scalar subquery is one probe per slot
                        -- looked at (a NOT EXISTS became a hash of every running row, dead
                        -- index entries included, built at every claim)
                        -- (running, or settled while its process may still live: dead_by)
                        AND (NOT coalesce((SELECT h.state = 'running' OR coalesce(h.dead_by > now(), false)
                                             FROM cyclone_steps h
                                            WHERE h.id = sl.step_id AND h.lease_generation = sl.generation), false)
                             OR EXISTS (SELECT 1 FROM finished f WHERE f.id = sl.step_id AND f.generation = sl.generation))))
             ORDER BY sl.slot
             LIMIT g.n
               FOR NO KEY UPDATE SKIP LOCKED  -- (an enqueue holds them FOR KEY SHARE: no conflict)
           ) f
     WHERE g.concurrency IS NOT NULL
)

-- name: claim_ctes
-- (Fragment) claim up to %(limit)s available steps, SKIP LOCKED; the claim is the first
-- heartbeat (SPEC 4). Fair by key (walk_ctes) and within limits: a step with a
-- limit is claimed only with a free slot of its (step, key) (see migration 0007), taken in
-- this statement. Needs a "finished" CTE before it: attempts this statement ends, whose
-- concurrency slots are free for this claim.
{walk_ctes}, grp AS MATERIALIZED (
    -- the limited (step, key) groups among them: their limits, and how many want a slot
    SELECT step_name, key, min(concurrency) AS concurrency, min(rate_count) AS rate_count,
           max(rate_period) AS rate_period, count(*) AS n
      FROM cand
     WHERE concurrency IS NOT NULL OR rate_count IS NOT NULL
     GROUP BY step_name, key
), {cslots_ctes}, rslots AS MATERIALIZED (
    -- free rate slots, locked: last used at least one period ago (the latest row version decides)
    SELECT g.step_name, g.key, f.slot, row_number() OVER (PARTITION BY g.step_name, g.key ORDER BY f.slot) AS i
      FROM grp g
     CROSS JOIN LATERAL (
            SELECT sl.slot
              FROM cyclone_slots sl
             WHERE sl.step_name = g.step_name AND sl.key = g.key AND sl.kind = 'r' AND sl.slot <= g.rate_count
               AND (sl.used_at IS NULL OR sl.used_at + g.rate_period <= now())
             ORDER BY sl.slot
             LIMIT g.n
               FOR NO KEY UPDATE SKIP LOCKED
           ) f
     WHERE g.rate_count IS NOT NULL
), allowed AS (
    -- how many of each limited group's steps this claim may start
    SELECT g.step_name, g.key, g.n,
           least(CASE WHEN g.concurrency IS NULL THEN g.n
                      ELSE (SELECT count(*) FROM cslots c WHERE c.step_name = g.step_name AND c.key = g.key) END,
                 CASE WHEN g.rate_count IS NULL THEN g.n
                      ELSE (SELECT count(*) FROM rslots r WHERE r.step_name = g.step_name AND r.key = g.key) END) AS ok
      FROM grp g
), eligible AS MATERIALIZED (
    -- the candidates their limits let start now; of the rate-limited ones no more than the
    -- idle children can start at once (%(start_now)s): a rate limit counts handler starts,
    -- so such a step is never held or queued behind a busy child after taking its slot
    SELECT e.id, e.step_name, e.key, e.queue, e.p, e.rn, e.gr, e.priority
      FROM (SELECT r.*, count(*) FILTER (WHERE r.rate_count IS NOT NULL)
                            OVER (ORDER BY r.priority, r.rn, r.p, r.id) AS rated_rank
              FROM ranked r
              LEFT JOIN allowed a ON a.step_name = r.step_name AND a.key = r.key
             WHERE a.ok IS NULL OR r.gr <= a.ok) e
     WHERE e.rate_count IS NULL OR e.rated_rank <= %(start_now)s
), {picked_ctes}, {claimed_ctes}, took_slots AS (
    -- each limited step claimed takes the gr-th free slot of its group (concurrency, rate);
    -- a rate slot counts from 50 ms after the claim: its handler starts on an idle child
    -- within that (the claim returns, the task goes out), so two starts of one slot are a
    -- whole period apart on the handlers' clocks too, not only the claims
    UPDATE cyclone_slots sl
       SET step_id = c.id, generation = c.lease_generation, claim_xid = pg_current_xact_id(),
           used_at = CASE WHEN sl.kind = 'r' THEN now() + interval '50 milliseconds' ELSE now() END
      FROM picked p
      JOIN claimed c ON c.id = p.id
      JOIN (SELECT 'c'::"char" AS kind, step_name, key, slot, i FROM cslots
            UNION ALL
            SELECT 'r'::"char", step_name, key, slot, i FROM rslots) f
        ON f.step_name = p.step_name AND f.key = p.key AND f.i = p.gr
     WHERE sl.step_name = f.step_name AND sl.key = f.key AND sl.kind = f.kind AND sl.slot = f.slot
    RETURNING sl.slot
), claim_wait AS (
    SELECT (SELECT greatest(0, z.w)::float8 FROM (SELECT extract(epoch FROM min(
                       CASE WHEN EXISTS (SELECT 1 FROM rslots r JOIN picked p ON p.step_name = r.step_name
                                                                            AND p.key = r.key AND p.gr = r.i
                                          WHERE r.step_name = sl.step_name AND r.key = sl.key AND r.slot = sl.slot)
                            THEN now()  -- taken by this claim
                            WHEN sl.used_at + g.rate_period > now() THEN sl.used_at END
                       + g.rate_period) - now()) AS w
              FROM grp g
              JOIN allowed a ON a.step_name = g.step_name AND a.key = g.key AND a.ok < a.n
              JOIN cyclone_slots sl ON sl.step_name = g.step_name AND sl.key = g.key AND sl.kind = 'r'
                                   AND sl.slot <= g.rate_count
             WHERE g.rate_count IS NOT NULL
               AND (SELECT count(*) FROM rslots r WHERE r.step_name = g.step_name AND r.key = g.key) < a.n) z
             WHERE z.w IS NOT NULL) AS wait
), {claim_meta_ctes}

-- name: claim_concurrency_ctes
-- (Fragment) the limited claim of queues that no rate-limited step ever entered (see
-- cyclone_flow_queues.rates, migration 0010): claim_ctes with its concurrency slots only,
-- a plan of about half the nodes (%(rates)s false: a rate-limited step is left to the
-- full claim). Needs a "finished" CTE before it, as claim_ctes does.
{walk_ctes}, grp AS MATERIALIZED (
    -- the limited (step, key) groups among them, and how many want a slot
    SELECT step_name, key, min(concurrency) AS concurrency, count(*) AS n
      FROM cand
     WHERE concurrency IS NOT NULL
     GROUP BY step_name, key
), {cslots_ctes}, eligible AS MATERIALIZED (
    -- the candidates their limits let start now: the gr-th of a group needs gr free slots
    SELECT r.id, r.step_name, r.key, r.queue, r.p, r.rn, r.gr, r.priority
      FROM ranked r
     WHERE r.concurrency IS NULL
        OR r.gr <= (SELECT count(*) FROM cslots c WHERE c.step_name = r.step_name AND c.key = r.key)
), {picked_ctes}, {claimed_ctes}, took_slots AS (
    -- each limited step claimed takes the gr-th free slot of its group
    UPDATE cyclone_slots sl
       SET step_id = c.id, generation = c.lease_generation, claim_xid = pg_current_xact_id(), used_at = now()
      FROM picked p
      JOIN claimed c ON c.id = p.id
      JOIN cslots f ON f.step_name = p.step_name AND f.key = p.key AND f.i = p.gr
     WHERE sl.step_name = f.step_name AND sl.key = f.key AND sl.kind = 'c' AND sl.slot = f.slot
    RETURNING sl.slot
), claim_wait AS (
    SELECT NULL::float8 AS wait
), {claim_meta_ctes}

-- name: claim_fair_ctes
-- (Fragment) the fair claim of queues with keys but no limited step (walk_ctes without the
-- slots; %(limits)s false: a limited step is left to the limited claims).
{walk_ctes}, eligible AS MATERIALIZED (
    SELECT r.id, r.step_name, r.key, r.queue, r.p, r.rn, r.gr, r.priority FROM ranked r
), {picked_ctes}, {claimed_ctes}, claim_wait AS (
    SELECT NULL::float8 AS wait
), {claim_meta_ctes}

-- name: claimed_ctes
-- (Fragment) the claim's write: the picked steps become running under this lease, the
-- claim being their first heartbeat (SPEC 4); returns what the supervisor starts them with.
claimed AS (
    UPDATE cyclone_steps s
       SET state = 'running',
           started_at = now(),
           lease_owner = %(owner)s,
           lease_expiry = now() + (%(ttl_us)s::bigint * interval '1 microsecond'),
           lease_generation = s.lease_generation + 1,
           heartbeat_at = now(),
           progress = NULL,
           dead_by = NULL,
           kill_within = %(kill_within_us)s::bigint * interval '1 microsecond'
     WHERE s.id = ANY(ARRAY(SELECT id FROM picked))  -- by primary key whatever the plan's row guess
    RETURNING s.id, s.run_id::text AS run_id, s.node, s.step_name, s.attempt, s.max_attempts, s.backoff,
              extract(epoch FROM now() - s.scheduled_at)::float8 AS pickup,  -- claimable to claimed (metrics)
              extract(epoch FROM s.timeout)::float8 AS timeout, s.lease_generation,
              s.memory_limit, s.cpu_limit, s.max_processes, s.max_open_files,  -- resource limits
              s.rate_count IS NOT NULL AS rated,  -- its start must follow its claim at once (a rate slot was taken)
              -- the run's row by primary key, once (its input and kind are read from it):
              -- a join here became a hash join over a scan of every run in generic plans
              -- built on small tables
              (SELECT r FROM cyclone_runs r WHERE r.id = s.run_id) AS run,
              s.input AS item_input,  -- a map item's input (NULL: the run's)
              coalesce(s.wait_spawned, false) AS wait_spawned,
              s.depends_on <> '{}' AS has_upstream,
              CASE WHEN s.depends_on <> '{}' THEN  -- NULL for a step without upstream nodes
                  -- a JSON object as text, built as text (a fan-in past jsonb's 256 MB is
                  -- still read: text holds 1 GB), and only when small: a big one (stored
                  -- size over %(inline_max)s bytes) is loaded alone, off the claim's path
                  (SELECT CASE WHEN sum(pg_column_size(d.output)) <= %(inline_max)s AND bool_and(d.kind <> 'map') THEN
                              '{' || coalesce(string_agg(to_json(d.node)::text || ':' || coalesce(d.output::text, 'null'),
                                                         ','), '') || '}' END
                     FROM cyclone_steps d
                    WHERE d.run_id = s.run_id AND d.node = ANY(s.depends_on)) END AS upstream
)

-- name: claim_plain_ctes
-- (Fragment) the claim of queues no step with a key or a limit ever entered (see
-- cyclone_flow_queues, migration 0008): one ordered index scan per queue, SKIP LOCKED.
-- It never takes a step with a key or a limit, whatever the store believes of a queue.
picked AS (
    -- one ordered index scan per queue (queue = ANY would read and sort the whole backlog)
    SELECT c.id
      FROM (SELECT u.name FROM unnest(%(queues)s::text[]) AS u(name)  -- a paused queue: nothing locked, nothing taken
             WHERE NOT EXISTS (SELECT 1 FROM cyclone_queue_pauses qp WHERE qp.queue = u.name)) AS q(name)
     CROSS JOIN LATERAL (
            SELECT id, priority, scheduled_at
              FROM cyclone_steps
             WHERE state = 'available'
               AND queue = q.name
               AND concurrency_key = ''
               AND step_name = ANY(%(names)s)
               AND scheduled_at <= now()
               AND (dead_by IS NULL OR dead_by <= now())  -- the last attempt's processes are dead
               AND concurrency IS NULL AND rate_count IS NULL
             ORDER BY priority, scheduled_at, id
             LIMIT %(limit)s
               FOR UPDATE SKIP LOCKED
           ) c
     ORDER BY c.priority, c.scheduled_at, c.id
     LIMIT %(limit)s
), {claimed_ctes}, claim_meta AS (
    SELECT NULL::jsonb AS cursors, NULL::float8 AS wait  -- no walk, no rate limit: nothing to say
)

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

-- name: load_payload
-- A claimed step's input and upstream outputs as JSON text, read alone (they were too big
-- to come with its claim), with the upstream object's size in bytes and its number of
-- outputs. Each output is made text once (parts); the object is built only when it is
-- at most %(max_upstream)s bytes: over it, upstream is NULL and upstream_bytes says why
-- (a fan-in past PostgreSQL's 1 GB text limit never fails the statement).
WITH parts AS MATERIALIZED (
    SELECT to_json(d.node)::text AS key, coalesce(d.output::text, 'null') AS value
      FROM cyclone_steps s
      JOIN cyclone_steps d ON d.run_id = s.run_id AND d.node = ANY(s.depends_on)
     WHERE s.id = %(id)s AND d.kind <> 'map'  -- (a map's outputs are read in pages: map_outputs_page)
), size AS (
    SELECT count(*) AS outputs,
           2 + coalesce(sum(octet_length(key) + 1 + octet_length(value)), 0) + greatest(count(*) - 1, 0) AS bytes
      FROM parts
)
SELECT coalesce(s.input, r.input)::text AS input, size.outputs AS upstream_outputs, size.bytes::bigint AS upstream_bytes,
       CASE WHEN s.depends_on <> '{}' AND size.bytes <= %(max_upstream)s THEN
           (SELECT '{' || coalesce(string_agg(key || ':' || value, ','), '') || '}' FROM parts) END AS upstream,
       -- its upstream map nodes: [[node, items], ...] (NULL: none)
       (SELECT jsonb_agg(jsonb_build_array(d.node, d.items_total) ORDER BY d.node)
          FROM cyclone_steps d
         WHERE d.run_id = s.run_id AND d.node = ANY(s.depends_on) AND d.kind = 'map') AS maps,
       CASE WHEN s.wait_spawned THEN {spawned_expr} END AS spawned
  FROM cyclone_steps s
  JOIN cyclone_runs r ON r.id = s.run_id
 CROSS JOIN size
 WHERE s.id = %(id)s;

-- name: spawned_expr
-- (Fragment) for a step row s: the runs its upstream nodes spawned, hot or archived, as JSON
-- text {node: {key: {run_id, state, output, error, error_kind}}} (ctx.spawned); output: a
-- single-step run's step output, else {node: output} of its nodes; error: its first
-- discarded step's.
(SELECT coalesce(jsonb_object_agg(x.node, x.runs), '{}'::jsonb)::text FROM (
    SELECT c.parent_node AS node,
           jsonb_object_agg(c.parent_key, jsonb_build_object('run_id', c.id, 'state', c.state, 'output', o.output,
                                                             'error', o.error, 'error_kind', o.error_kind)) AS runs
      FROM (SELECT r.id, r.kind, r.state, r.parent_node, r.parent_key FROM cyclone_runs r
             WHERE r.parent_id = s.run_id AND r.parent_node = ANY(s.depends_on)
            UNION ALL
            SELECT a.id, a.kind, a.state, a.parent_node, a.parent_key FROM cyclone_runs_archive a
             WHERE a.parent_id = s.run_id AND a.parent_node = ANY(s.depends_on)) c
     CROSS JOIN LATERAL (
            SELECT CASE WHEN c.kind = 'step' THEN (array_agg(t.output ORDER BY t.id))[1]
                        ELSE jsonb_object_agg(t.node, t.output) END AS output,
                   (array_agg(t.error ORDER BY t.id) FILTER (WHERE t.state = 'discarded'))[1] AS error,
                   (array_agg(t.error_kind ORDER BY t.id) FILTER (WHERE t.state = 'discarded'))[1] AS error_kind
              FROM (SELECT h.id, h.node, h.state, h.output, h.error, h.error_kind
                      FROM cyclone_steps h WHERE h.run_id = c.id AND h.map_node IS NULL
                    UNION ALL
                    SELECT h.id, h.node, h.state, h.output, h.error, h.error_kind
                      FROM cyclone_steps_archive h WHERE h.run_id = c.id AND h.map_node IS NULL) t) o
     GROUP BY c.parent_node) x)

-- name: map_outputs_page
-- One page of a map's items in item order, after item %(after)s, at most %(limit)s (keyset, by
-- cyclone_steps_items_idx): each item's index, whether it completed, its output as JSON text
-- (what its join reads), its error and error kind (a discarded item's, with allow_failures).
SELECT i.item, i.state = 'completed' AS ok, coalesce(i.output::text, 'null') AS output, i.error, i.error_kind
  FROM cyclone_steps i
 WHERE i.run_id = %(run_id)s AND i.map_node = %(node)s AND i.item > %(after)s
 ORDER BY i.item
 LIMIT %(limit)s;

-- name: local_statement_timeout
-- Set statement_timeout for the rest of this transaction only (%(timeout)s: "120000ms").
SELECT set_config('statement_timeout', %(timeout)s, true);

-- name: lease_state
-- After a renewal matched nothing: why (cancelled, reclaimed, timed out, finished).
SELECT state, lease_owner, lease_generation,
       (timeout IS NOT NULL AND started_at + timeout <= now()) AS timed_out,
       errors -> -1 ->> 'kind' AS last_error_kind,
       (errors -> -1 ->> 'lease_generation')::bigint AS last_error_generation
  FROM cyclone_steps
 WHERE id = %(id)s;

-- name: settle_ctes
-- (Fragment) one tick's completions. Every row is checked on its own (the
-- CAS): still running under the same lease_owner and lease_generation, and before its
-- DB deadline. The runs of every row of the tick (completions and failures) are locked
-- first, all at once, by id.
runs AS (
    -- by primary key only: a state predicate here made generic plans scan every running run
    SELECT r.id, r.kind, r.state, r.parent_id
      FROM cyclone_runs r
     WHERE r.id = ANY(ARRAY(SELECT s.run_id FROM cyclone_steps s
                             WHERE s.id = ANY(%(ids)s::bigint[] || %(fail_ids)s::bigint[])))
     ORDER BY r.id
       FOR UPDATE
), done AS (
    -- Each row's own item (output, progress) is found by its lease, "id:generation", in
    -- the leases array (array_position, in C): no item for this lease, no update (the
    -- CAS on the generation; a step listed twice under two leases takes its current
    -- one's). A join with the unnested arrays compared every row with every row.
    UPDATE cyclone_steps s
       SET state = 'completed',
           output = (%(outputs)s::jsonb[])[array_position(%(leases)s::text[], s.id || ':' || s.lease_generation)],
           progress = coalesce((%(progress)s::jsonb[])[array_position(%(leases)s::text[], s.id || ':' || s.lease_generation)],
                               s.progress),
           finished_at = now(),
           lease_expiry = NULL,
           error = NULL,
           error_kind = NULL,
           start_delay = coalesce((%(start_delays_us)s::bigint[])[array_position(%(leases)s::text[],
                                                                                s.id || ':' || s.lease_generation)]
                                  * interval '1 microsecond', s.start_delay)
     WHERE s.id = ANY(%(ids)s::bigint[])  -- by primary key (the supervisor reuses generic plans)
       AND (s.run_id = ANY(ARRAY(SELECT id FROM runs))) IS TRUE  -- one array, not a join per row (nor an index: by id)
       AND (s.state = 'running') IS TRUE  -- (not the partial index of every running row)
       AND s.lease_owner = %(owner)s
       AND array_position(%(leases)s::text[], s.id || ':' || s.lease_generation) IS NOT NULL
       AND (s.timeout IS NULL OR s.started_at + s.timeout > now())
    RETURNING s.id, s.run_id, s.lease_generation, s.map_node
), items_done AS (
    -- completed items count down their map row (its run is locked above); over: no item
    -- of that map is left to run (its run moves on: the map ends, and its join may start)
    UPDATE cyclone_steps m
       SET items_left = m.items_left - d.n
      FROM (SELECT run_id, map_node, count(*) AS n FROM done WHERE map_node IS NOT NULL
             GROUP BY run_id, map_node) d
     WHERE m.run_id = d.run_id AND m.node = d.map_node AND m.kind = 'map'
    RETURNING m.run_id, m.node,
              m.items_left <= (SELECT count(*) FROM cyclone_steps f
                                WHERE f.run_id = m.run_id AND f.map_node = m.node AND f.state = 'discarded') AS over
), completed_runs AS (
    UPDATE cyclone_runs r
       SET state = 'completed', finished_at = now(), updated_at = now()
      FROM done d
     WHERE r.id = d.run_id AND r.kind = 'step' AND r.state IN ('running', 'paused')
    RETURNING r.id, {run_ended_expr}
)

-- name: fail_ctes
-- (Fragment) one tick's failed attempts, after settle_ctes: each row's CAS as a
-- completion's, and a timeout the worker clock reported must be past its DB deadline.
-- Rows of workflow runs only when %(in_tx)s: the caller then advances those runs in the
-- same transaction.
fail_in AS MATERIALIZED (
    SELECT * FROM unnest(%(fail_ids)s::bigint[], %(fail_generations)s::bigint[], %(kinds)s::text[],
                         %(entries)s::jsonb[], %(delays_us)s::bigint[], %(require_timed_out)s::boolean[],
                         %(fail_progress)s::jsonb[])
        AS t(id, generation, kind, entry, delay_us, require_timed_out, progress)
), judged AS (
    -- What a failed attempt makes of its row is decisions.end_attempt. t: the DB
    -- deadline has passed (a DB timeout wins over the reported kind); d: the attempt
    -- ends the step (a permanent kind, or exhausted: discard), else available after the delay.
    -- Only rows of running or paused runs (the run rows are locked, so their state
    -- holds); in a paused run a retried step is held paused, as hold_paused does.
    SELECT s.id, i.generation, i.kind, i.entry, i.delay_us, i.require_timed_out, i.progress, t.t,
           (i.kind IN ({permanent_kinds_expr}) AND NOT t.t) OR s.attempt >= s.max_attempts AS d,
           runs.kind AS run_kind, runs.state AS run_state, runs.parent_id AS run_parent
      FROM cyclone_steps s
      JOIN fail_in i ON i.id = s.id
      JOIN runs ON runs.id = s.run_id AND runs.state IN ('running', 'paused')
                   AND (runs.kind = 'step' OR %(in_tx)s)
     CROSS JOIN LATERAL (SELECT coalesce(s.started_at + s.timeout <= now(), false) AS t) t
     WHERE s.id = ANY(%(fail_ids)s::bigint[])
), ended AS (
    UPDATE cyclone_steps s
       SET state = CASE WHEN j.d THEN 'discarded' WHEN j.run_state = 'paused' THEN 'paused' ELSE 'available' END,
           paused_from = CASE WHEN NOT j.d AND j.run_state = 'paused' THEN 'available' ELSE s.paused_from END,
           attempt = CASE WHEN j.d THEN s.attempt ELSE s.attempt + 1 END,
           scheduled_at = CASE WHEN j.d THEN s.scheduled_at
                               ELSE now() + (j.delay_us * interval '1 microsecond') END,
           finished_at = CASE WHEN j.d THEN now() ELSE NULL END,
           lease_owner = CASE WHEN j.d THEN s.lease_owner ELSE NULL END,
           lease_expiry = NULL,
           error = coalesce(CASE WHEN j.d AND NOT j.t THEN {quarantine_error_expr} END,
                            nullif(j.entry ->> 'message', ''), CASE WHEN j.t THEN 'timeout' ELSE j.kind END),
           error_kind = CASE WHEN j.t THEN 'timeout' ELSE j.kind END,
           errors = s.errors || jsonb_build_array(
               j.entry
               || jsonb_build_object('attempt', s.attempt, 'kind', CASE WHEN j.t THEN 'timeout' ELSE j.kind END)
               || CASE WHEN j.t AND j.kind <> 'timeout' THEN jsonb_build_object('reported_kind', j.kind)
                       ELSE '{}'::jsonb END
               || jsonb_build_object('at', {utc_now_expr})),
           progress = coalesce(j.progress, s.progress),
           start_delay = coalesce((j.entry ->> 'start_delay')::float8 * interval '1 second', s.start_delay)
      FROM judged j
     WHERE s.id = ANY(%(fail_ids)s::bigint[])  -- by primary key (generic plans)
       AND s.id = j.id
       AND (s.state = 'running') IS TRUE  -- (not the partial index of every running row)
       AND s.lease_owner = %(owner)s
       AND s.lease_generation = j.generation
       AND (NOT j.require_timed_out OR j.t)
    RETURNING s.id, s.run_id, s.state, s.lease_generation, s.error_kind, j.run_kind, j.run_state, s.map_node,
              j.run_parent
), discarded_runs AS (
    -- a workflow's run state is refresh_run_state's; a paused run stays paused
    UPDATE cyclone_runs r
       SET state = 'discarded', finished_at = now(), updated_at = now()
      FROM ended e
     WHERE r.id = e.run_id AND e.state = 'discarded' AND e.run_kind = 'step' AND e.run_state = 'running'
    RETURNING r.id, {run_ended_expr}
)

-- name: quarantine_error_expr
-- (Fragment) the poison quarantine (decisions.discard_message): the error of a
-- step discarded by an attempt j that died of a resource cause (its entry has a "cause"),
-- when the attempts before it died of the same cause: "killed 3 times: memory_limit
-- 512 MiB, peak 2.1 GiB". NULL otherwise. Earlier entries of cancelled attempts are skipped.
CASE WHEN j.kind IN ('memory_limit', 'cpu_limit', 'process_limit', 'oom_killed') AND j.entry ? 'cause' THEN
    (SELECT 'killed ' || (n.same + 1) || ' times: ' || (j.entry ->> 'cause')
       FROM (SELECT count(*) AS same
               FROM jsonb_array_elements(s.errors) WITH ORDINALITY AS e(v, i)
              WHERE e.v ->> 'kind' = j.kind
                AND e.i > coalesce((SELECT max(f.i)
                                      FROM jsonb_array_elements(s.errors) WITH ORDINALITY AS f(v, i)
                                     WHERE f.v ->> 'kind' NOT IN (j.kind, 'cancelled')), 0)) n
      WHERE n.same > 0)
END

-- name: claimed_input_expr
-- (Fragment) a claimed row's input as JSON text (a map item's own, else the run's), unless
-- its stored size is over %(inline_max)s bytes (then NULL, and "big": the supervisor loads it alone).
CASE WHEN pg_column_size(coalesce(c.item_input, (c.run).input)) <= %(inline_max)s
     THEN coalesce(c.item_input, (c.run).input)::text END

-- name: claimed_kind_expr
-- (Fragment) a claimed row's run kind as the supervisor reads it: 'step', 'workflow', or
-- 'child' for a spawned single-step run (its outcome is written in a transaction that
-- moves its parent run on, which may wait for it).
CASE WHEN (c.run).parent_id IS NOT NULL AND (c.run).kind = 'step' THEN 'child' ELSE (c.run).kind END

-- name: claimed_big_expr
-- (Fragment) true when a claimed row's input or upstream outputs were left out: for size,
-- or because a map node is among its upstream nodes (its outputs are read in pages), or
-- it waited for spawned runs (their outcomes are read with its payload).
(pg_column_size(coalesce(c.item_input, (c.run).input)) > %(inline_max)s OR (c.has_upstream AND c.upstream IS NULL)
 OR c.wait_spawned)

-- name: claim
-- Claim up to %(limit)s available steps in one statement. The input and the upstream
-- outputs come back as JSON text: the supervisor hands them to the child unread (a value
-- too deep to decode fails its own attempt in the child, never the claim of its batch).
-- The last row (id NULL) is the claim's meta row, for the store: timeout =
-- claim_meta.wait, node = claim_meta.cursors, step_name = the queues' marks
-- (flow_marks_expr; JSON texts: columns whose types the claimed rows fix).
WITH RECURSIVE finished AS (SELECT NULL::bigint AS id, NULL::bigint AS generation WHERE false),
{claim_ctes}
{claim_rows_expr}

-- name: claim_concurrency
-- claim with the concurrency claim (queues with concurrency limits, no rate limit); the
-- same rows and meta row.
WITH RECURSIVE finished AS (SELECT NULL::bigint AS id, NULL::bigint AS generation WHERE false),
{claim_concurrency_ctes}
{claim_rows_expr}

-- name: claim_fair
-- claim with the fair claim (queues with keys, no limited step); the same rows and meta row.
WITH RECURSIVE {claim_fair_ctes}
{claim_rows_expr}

-- name: claim_plain
-- The claim of queues without keys or limits (claim_plain_ctes); its meta row carries the
-- queues' marks only.
WITH {claim_plain_ctes}
{claim_rows_expr}

-- name: settled_ctes
-- (Fragment) the rows a settle statement returns: completed, then claimed.
settled_completed AS (
    SELECT 'completed' AS what, d.id, d.run_id::text AS run_id, NULL::text AS node, NULL::text AS step_name,
           NULL::integer AS attempt, NULL::integer AS max_attempts, NULL::jsonb AS backoff,
           NULL::float8 AS timeout, d.lease_generation, NULL::text AS input,
           runs.kind AS run_kind, NULL::text AS upstream, NULL::boolean AS big, NULL::float8 AS pickup,
           NULL::jsonb AS trace, NULL::bigint AS memory_limit, NULL::float8 AS cpu_limit, NULL::integer AS max_processes,
           NULL::integer AS max_open_files, NULL::boolean AS rated,
           -- its workflow run must move on now: not an item, or the last item of its map
           (d.map_node IS NULL OR EXISTS (SELECT 1 FROM items_done i
                                           WHERE i.run_id = d.run_id AND i.node = d.map_node AND i.over)) AS moves_run,
           runs.parent_id::text AS parent_id  -- a spawned run's parent (it may wait for it)
      FROM done d
      JOIN runs ON runs.id = d.run_id
), settled_claimed AS (
    SELECT 'claimed' AS what, c.id, c.run_id, c.node, c.step_name, c.attempt, c.max_attempts, c.backoff,
           c.timeout, c.lease_generation, {claimed_input_expr}, {claimed_kind_expr}, c.upstream, {claimed_big_expr},
           c.pickup, (c.run).trace, c.memory_limit, c.cpu_limit, c.max_processes, c.max_open_files, c.rated,
           NULL::boolean, NULL::text
      FROM claimed c
)

-- name: claim_rows_expr
-- (Fragment) what a claim statement returns: the claimed rows, then the claim's meta row
-- (id NULL; see claim).
SELECT c.id, c.run_id, c.node, c.step_name, c.attempt, c.max_attempts, c.backoff, c.timeout,
       c.lease_generation, {claimed_input_expr} AS input, {claimed_kind_expr} AS run_kind, c.upstream,
       {claimed_big_expr} AS big, c.pickup, (c.run).trace, c.memory_limit, c.cpu_limit, c.max_processes, c.max_open_files,
       c.rated
  FROM claimed c
UNION ALL
SELECT NULL, NULL, m.cursors::text, {flow_marks_expr}, NULL, NULL, NULL, m.wait, NULL, NULL, NULL, NULL, NULL, NULL, NULL, NULL, NULL, NULL, NULL,
       NULL
  FROM claim_meta m

-- name: settle_rows_expr
-- (Fragment) what a settle statement returns: completed, failed (node: the error kind
-- stored; step_name: the state it got), claimed, then the claim's meta row (what = 'meta').
-- moves_run: a completed or failed row whose workflow run must move on (an item that
-- neither was its map's last nor was discarded leaves it as it is).
SELECT * FROM settled_completed
UNION ALL
SELECT 'failed', e.id, e.run_id::text, e.error_kind, e.state, NULL, NULL, NULL, NULL, e.lease_generation, NULL, e.run_kind,
       NULL, NULL, NULL, NULL, NULL, NULL, NULL, NULL, NULL, e.map_node IS NULL OR e.state = 'discarded',
       e.run_parent::text
  FROM ended e
UNION ALL
SELECT * FROM settled_claimed
UNION ALL
SELECT 'meta', NULL, NULL, m.cursors::text, {flow_marks_expr}, NULL, NULL, NULL, m.wait, NULL, NULL, NULL, NULL, NULL, NULL, NULL, NULL, NULL, NULL, NULL,
       NULL, NULL, NULL
  FROM claim_meta m

-- name: settle_completions_rows_expr
-- (Fragment) settle_rows_expr without failed rows (the settle_completions statements).
SELECT * FROM settled_completed
UNION ALL
SELECT * FROM settled_claimed
UNION ALL
SELECT 'meta', NULL, NULL, m.cursors::text, {flow_marks_expr}, NULL, NULL, NULL, m.wait, NULL, NULL, NULL, NULL, NULL, NULL, NULL, NULL, NULL, NULL, NULL,
       NULL, NULL, NULL
  FROM claim_meta m

-- name: settle
-- The hot path: a tick's completions, its failed attempts and the next claim (up to
-- %(limit)s, which may be 0) in one statement and one commit; the last row is the
-- claim's meta row (what = 'meta', see claim). A failed row's node column carries the
-- error kind stored (the worker's, or timeout when the DB deadline passed).
WITH RECURSIVE {settle_ctes}, {fail_ctes},
finished AS (SELECT id, lease_generation AS generation FROM done
             UNION ALL SELECT id, lease_generation FROM ended),
{claim_ctes}, {settled_ctes}
{settle_rows_expr}

-- name: settle_concurrency
-- settle with the concurrency claim (queues with concurrency limits, no rate limit).
WITH RECURSIVE {settle_ctes}, {fail_ctes},
finished AS (SELECT id, lease_generation AS generation FROM done
             UNION ALL SELECT id, lease_generation FROM ended),
{claim_concurrency_ctes}, {settled_ctes}
{settle_rows_expr}

-- name: settle_fair
-- settle with the fair claim (queues with keys, no limited step).
WITH RECURSIVE {settle_ctes}, {fail_ctes}, {claim_fair_ctes}, {settled_ctes}
{settle_rows_expr}

-- name: settle_plain
-- settle with the plain claim (queues without keys or limits: claim_plain_ctes).
WITH {settle_ctes}, {fail_ctes}, {claim_plain_ctes}, {settled_ctes}
{settle_rows_expr}

-- name: settle_completions
-- The hot path of a tick without failures (most ticks): its completions and the next
-- claim. A smaller plan than settle's (about 10 % less PostgreSQL CPU for one step).
WITH RECURSIVE {settle_ctes}, finished AS (SELECT id, lease_generation AS generation FROM done),
{claim_ctes}, {settled_ctes}
{settle_completions_rows_expr}

-- name: settle_completions_concurrency
-- settle_completions with the concurrency claim (queues with concurrency limits, no rate limit).
WITH RECURSIVE {settle_ctes}, finished AS (SELECT id, lease_generation AS generation FROM done),
{claim_concurrency_ctes}, {settled_ctes}
{settle_completions_rows_expr}

-- name: settle_completions_fair
-- settle_completions with the fair claim (queues with keys, no limited step).
WITH RECURSIVE {settle_ctes}, {claim_fair_ctes}, {settled_ctes}
{settle_completions_rows_expr}

-- name: settle_completions_plain
-- settle_completions with the plain claim (queues without keys or limits).
WITH {settle_ctes}, {claim_plain_ctes}, {settled_ctes}
{settle_completions_rows_expr}

-- name: lock_run
-- Take the run row lock (always before any step row lock of that run).
SELECT id::text AS id, kind, state FROM cyclone_runs WHERE id = %(run_id)s FOR UPDATE;

-- name: lock_run_of_step
-- Take the run row lock of the run that owns step %(id)s.
SELECT r.id::text AS id, r.kind, r.state
  FROM cyclone_runs r
 WHERE r.id = (SELECT run_id FROM cyclone_steps WHERE id = %(id)s)
   FOR UPDATE;

-- name: lock_attempt
-- Under the run lock: the step row of one attempt, if still running under that lease.
SELECT attempt, max_attempts, reclaims, max_reclaims, step_name, backoff,
       (timeout IS NOT NULL AND started_at + timeout <= now()) AS timed_out,
       ARRAY(SELECT e ->> 'kind' FROM jsonb_array_elements(errors) AS e) AS error_kinds  -- the poison quarantine's
  FROM cyclone_steps
 WHERE id = %(id)s
   AND state = 'running'
   AND lease_owner = %(owner)s
   AND lease_generation = %(generation)s
   FOR UPDATE;

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
       errors = errors || jsonb_build_array(%(entry)s::jsonb || jsonb_build_object('at', {utc_now_expr})),
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
-- are woken (a retry or a concurrency sibling may be claimable now).
WITH dead AS (
    UPDATE cyclone_steps s
       SET dead_by = 'epoch'
      FROM unnest(%(ids)s::bigint[], %(generations)s::bigint[]) AS k(id, generation)
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
-- Recovery sweep page: running rows whose lease expired or whose DB deadline passed (a
-- running map row holds no lease: its items do).
SELECT id, run_id::text AS run_id
  FROM cyclone_steps
 WHERE state = 'running'
   AND (lease_expiry < now() OR (timeout IS NOT NULL AND started_at + timeout <= now()))
   AND kind <> 'map'
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
       errors = errors || jsonb_build_array(%(entry)s::jsonb || jsonb_build_object('at', {utc_now_expr}))
 WHERE id = %(id)s;

-- name: due_timer_runs
-- Runs with a timer node due on the database clock.
SELECT DISTINCT run_id::text AS run_id
  FROM cyclone_steps
 WHERE state = 'waiting_timer' AND due_at <= now()
 LIMIT %(limit)s;

-- name: promote_ready
-- Nodes whose dependencies all completed (and, for one with wait_spawned, whose upstream
-- nodes' spawned runs all ended) leave pending (or stay paused, remembering where to go);
-- map nodes are expand_maps'.
WITH ready AS (
    SELECT s.id,
           CASE s.kind WHEN 'task' THEN 'available'
                       WHEN 'signal' THEN 'waiting_signal'
                       ELSE 'waiting_timer' END AS target
      FROM cyclone_steps s
     WHERE s.run_id = %(run_id)s
       AND s.kind <> 'map'
       AND (s.state = 'pending' OR (s.state = 'paused' AND s.paused_from = 'pending'))
       AND NOT EXISTS (
            SELECT 1 FROM cyclone_steps d
             WHERE d.run_id = s.run_id AND d.node = ANY(s.depends_on) AND d.state <> 'completed')
       AND (s.wait_spawned IS NOT TRUE OR NOT EXISTS (  -- the runs its upstream nodes spawned have ended
            SELECT 1 FROM cyclone_runs c
             WHERE c.parent_id = s.run_id AND c.parent_node = ANY(s.depends_on)
               AND c.state NOT IN ('completed', 'discarded', 'cancelled')))
)
UPDATE cyclone_steps s
   SET state = CASE WHEN s.state = 'paused' THEN 'paused' ELSE ready.target END,
       paused_from = CASE WHEN s.state = 'paused' THEN ready.target ELSE NULL END,
       scheduled_at = greatest(s.scheduled_at, now()),
       due_at = CASE WHEN s.kind = 'timer' THEN coalesce(s.due_at, now() + s.timer_delay) ELSE s.due_at END
  FROM ready
 WHERE s.id = ready.id;

-- name: expand_maps
-- Map nodes whose node mapped over (depends_on[1]) completed: one item row per element of
-- its output list, inserted in one statement with the map row's options, the element as
-- input and "<map>[<index>]" as node (paused, to be available, in a paused run); the map
-- row becomes running and counts them (items_total, items_left). An output that is not a
-- list, or a list of more than %(max_items)s items, discards the map row (output_invalid)
-- with an error that says so. Runs under the
-- run lock, in the transaction of the completion that made the node ready: the map row
-- leaves pending there, so a list is mapped once whatever completes later.
WITH ready AS MATERIALIZED (
    -- (a map over a map maps the items' outputs: read from its items, never aggregated)
    SELECT m.id, m.node, o.node AS over, o.kind = 'map' AS over_map, o.output AS list,
           (o.kind = 'map' OR jsonb_typeof(o.output) = 'array')
           AND coalesce(CASE WHEN o.kind = 'map' THEN o.items_total ELSE jsonb_array_length(o.output) END, 0)
               <= %(max_items)s AS ok,
           CASE WHEN o.kind = 'map' THEN o.items_total
                WHEN jsonb_typeof(o.output) = 'array' THEN jsonb_array_length(o.output) END AS total,
           coalesce(jsonb_typeof(o.output), 'nothing') AS got,
           (SELECT r.state FROM cyclone_runs r WHERE r.id = m.run_id) = 'paused' AS paused
      FROM cyclone_steps m
      JOIN cyclone_steps o ON o.run_id = m.run_id AND o.node = m.depends_on[1]
     WHERE m.run_id = %(run_id)s AND m.kind = 'map'
       AND (m.state = 'pending' OR (m.state = 'paused' AND m.paused_from = 'pending'))
       AND o.state = 'completed'
), elements AS (
    SELECT r.id, e.v, (e.i - 1)::int AS i
      FROM ready r
     CROSS JOIN LATERAL jsonb_array_elements(CASE WHEN r.ok AND NOT r.over_map THEN r.list ELSE '[]'::jsonb END)
           WITH ORDINALITY AS e(v, i)
    UNION ALL
    SELECT r.id, coalesce(x.output, 'null'::jsonb), x.item
      FROM ready r
      JOIN cyclone_steps m ON m.id = r.id
      JOIN cyclone_steps x ON x.run_id = m.run_id AND x.map_node = r.over AND r.over_map
), items AS (
    INSERT INTO cyclone_steps (run_id, node, step_name, kind, queue, priority, state, paused_from,
                               max_attempts, max_reclaims, timeout, backoff, scheduled_at,
                               concurrency_key, concurrency, rate_count, rate_period,
                               memory_limit, cpu_limit, max_processes, max_open_files, input, map_node, item)
    SELECT m.run_id, m.node || '[' || e.i || ']', m.step_name, 'item', m.queue, m.priority,
           CASE WHEN r.paused THEN 'paused' ELSE 'available' END, CASE WHEN r.paused THEN 'available' END,
           m.max_attempts, m.max_reclaims, m.timeout, m.backoff, now(),
           m.concurrency_key, m.concurrency, m.rate_count, m.rate_period,
           m.memory_limit, m.cpu_limit, m.max_processes, m.max_open_files, e.v, m.node, e.i
      FROM elements e
      JOIN ready r ON r.id = e.id
      JOIN cyclone_steps m ON m.id = e.id
    RETURNING 1
)
UPDATE cyclone_steps m
   SET state = CASE WHEN r.ok THEN 'running' ELSE 'discarded' END,
       paused_from = NULL,
       items_total = CASE WHEN r.ok THEN r.total END,
       items_left = CASE WHEN r.ok THEN r.total END,
       finished_at = CASE WHEN r.ok THEN NULL ELSE now() END,
       error = CASE WHEN r.ok THEN NULL
                    WHEN r.total IS NOT NULL
                    THEN 'map ' || m.node || ': the list of ' || r.over || ' has ' || r.total || ' items, over the '
                         || %(max_items)s || ' a map may have (map over a list of batches instead)'
                    ELSE 'map ' || m.node || ': the output of ' || r.over || ' is not a JSON list (it is '
                         || r.got || '): map() runs its step once per item of a list' END,
       error_kind = CASE WHEN r.ok THEN NULL ELSE 'output_invalid' END
  FROM ready r
 WHERE m.id = r.id
RETURNING m.id, (SELECT count(*) FROM items) AS items;

-- name: settle_maps
-- Running map nodes none of whose items is left to run (items_left counts the items not
-- completed; the discarded ones are found by cyclone_steps_failed_items_idx): completed when
-- every item completed, or with allow_failures; else discarded, with the first discarded
-- item's error kind and an error that names it.
WITH maps AS MATERIALIZED (
    SELECT m.id, m.node, m.run_id,
           (SELECT count(*) FROM cyclone_steps f
             WHERE f.run_id = m.run_id AND f.map_node = m.node AND f.state = 'discarded') AS failed
      FROM cyclone_steps m
     WHERE m.run_id = %(run_id)s AND m.kind = 'map' AND m.state = 'running'
), over AS (
    SELECT x.id, x.failed,
           (SELECT f FROM cyclone_steps f
             WHERE f.run_id = x.run_id AND f.map_node = x.node AND f.state = 'discarded'
             ORDER BY f.item LIMIT 1) AS first
      FROM maps x
      JOIN cyclone_steps m ON m.id = x.id
     WHERE m.items_left <= x.failed
)
UPDATE cyclone_steps m
   SET state = CASE WHEN o.failed = 0 OR m.allow_failures THEN 'completed' ELSE 'discarded' END,
       finished_at = now(),
       error = CASE WHEN o.failed > 0 AND NOT coalesce(m.allow_failures, false)
                    THEN 'item ' || (o.first).item || ' of ' || m.items_total || ' discarded'
                         || CASE WHEN o.failed > 1 THEN ' (and ' || (o.failed - 1) || ' more)' ELSE '' END
                         || ': ' || coalesce((o.first).error, (o.first).error_kind) END,
       error_kind = CASE WHEN o.failed > 0 AND NOT coalesce(m.allow_failures, false) THEN (o.first).error_kind END
  FROM over o
 WHERE m.id = o.id;

-- name: fire_nodes
-- Signal nodes whose signal arrived and timer nodes due (DB clock) complete.
UPDATE cyclone_steps s
   SET state = 'completed',
       finished_at = now(),
       output = CASE WHEN s.kind = 'signal'
                     THEN (SELECT g.payload FROM cyclone_signals g WHERE g.run_id = s.run_id AND g.name = s.node)
                     ELSE to_jsonb(s.due_at) END
 WHERE s.run_id = %(run_id)s
   AND ((s.state = 'waiting_signal'
         AND EXISTS (SELECT 1 FROM cyclone_signals g WHERE g.run_id = s.run_id AND g.name = s.node))
     OR (s.state = 'waiting_timer' AND s.due_at <= now()));

-- name: parent_to_advance
-- The parent of run %(run_id)s when it is a spawned run that has ended (its parent may wait for it).
SELECT parent_id::text AS parent_id
  FROM cyclone_runs
 WHERE id = %(run_id)s AND parent_id IS NOT NULL AND state IN ('completed', 'discarded', 'cancelled');

-- name: available_queues
-- The queues in which a run has claimable steps (each gets a NOTIFY after the run moved on).
SELECT DISTINCT queue FROM cyclone_steps WHERE run_id = %(run_id)s AND state = 'available';

-- name: refresh_run_state
-- Keep the run state in step with its steps: completed when all are, discarded when a
-- discarded step leaves nothing that can progress (a map node stands for its items).
UPDATE cyclone_runs r
   SET state = x.new_state,
       finished_at = CASE WHEN x.new_state IN ('completed', 'discarded') THEN now() ELSE NULL END,
       updated_at = now()
  FROM (
    SELECT CASE
             WHEN bool_and(state = 'completed') THEN 'completed'
             WHEN bool_or(state = 'discarded')
                  AND NOT bool_or(state IN ('available', 'running', 'waiting_signal', 'waiting_timer', 'paused'))
                  THEN 'discarded'
             ELSE NULL END AS new_state
      FROM cyclone_steps WHERE run_id = %(run_id)s
       AND kind <> 'item'  -- a map's items count through their map row (with allow_failures some may be discarded)
  ) x
 WHERE r.id = %(run_id)s
   AND (r.state IN ('running', 'discarded') OR (r.state = 'paused' AND x.new_state = 'completed'))
   AND x.new_state IS NOT NULL
   AND x.new_state <> r.state
RETURNING r.id, CASE WHEN x.new_state IN ('completed', 'discarded') THEN {run_ended_expr} END;

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

-- name: cancel_run
-- client.cancel: every non-terminal step of the run, then the run, in one transaction. A
-- running attempt leaves an entry in errors (kind "cancelled", with its started_at, lease
-- owner and generation, so the supervisor's kill forensics can join it), consuming no
-- attempt and leaving error and error_kind as they were: after cancel, retry, cancel the
-- history still shows both attempts and when each started.
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
                        'started_at', started_at, 'at', {utc_now_expr},
                        'elapsed', round(extract(epoch FROM now() - started_at)::numeric, 3),
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

-- name: permanent_kinds_expr
-- (Fragment) the error kinds that discard their step at once: no retry can heal them (decisions.PERMANENT_KINDS; a unit test keeps them equal)
'permanent', 'output_invalid', 'not_importable'

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

-- name: notify
-- Wake idle supervisors serving this queue (delivered at commit).
SELECT pg_notify('cyclone_mp', %(queue)s);

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

-- name: annotate_attempt
-- The sweep settled a timed-out attempt first: add the killing supervisor's forensics to
-- that attempt's entry (found by its lease owner and generation, wherever it is: the step
-- may have been retried and failed again before the kill), and %(note)s (what the
-- supervisor did, or NULL) to its message.
UPDATE cyclone_steps s
   SET errors = jsonb_set(s.errors, ARRAY[(e.idx - 1)::text],
                          e.entry || %(forensics)s::jsonb
                          || CASE WHEN %(note)s::text IS NULL THEN '{}'::jsonb
                                  ELSE jsonb_build_object('message', concat_ws('; ', e.entry ->> 'message', %(note)s::text))
                             END)
  FROM (SELECT t.entry, t.idx
          FROM cyclone_steps c, jsonb_array_elements(c.errors) WITH ORDINALITY AS t(entry, idx)
         WHERE c.id = %(id)s
           AND t.entry ->> 'lease_owner' = %(owner)s
           AND (t.entry ->> 'lease_generation')::bigint = %(generation)s
           AND NOT t.entry ? 'killed_by_supervisor'  -- once
         ORDER BY t.idx DESC
         LIMIT 1) e
 WHERE s.id = %(id)s;

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
