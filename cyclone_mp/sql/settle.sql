-- The settle statements: a tick's completions and failed attempts, each under its CAS,
-- and the next claim, in one statement (the hot path). settle_completions* are the same
-- without failures; the suffix names the claim (see claim.sql). Each is whole.
-- Parameters are named placeholders: %(name)s.

-- name: settle
-- The hot path: a tick's completions, its failed attempts and the next claim (up to
-- %(limit)s, which may be 0) in one statement and one commit; the last row is the
-- claim's meta row (what = 'meta', see claim). A failed row's node column carries the
-- error kind stored (the worker's, or timeout when the DB deadline passed).
-- The completions: one tick's completions. Every row is checked on its own (the
-- CAS): still running under the same lease_owner and lease_generation, and before its
-- DB deadline. The runs of every row of the tick (completions and failures) are locked
-- first, all at once, by id.
WITH RECURSIVE runs AS (
    -- by primary key only: a state predicate here made generic plans scan every running run
    SELECT r.id, r.kind, r.state, r.parent_id
      FROM cyclone_runs r
     WHERE r.id = ANY(ARRAY(SELECT s.run_id FROM cyclone_steps s
                             WHERE s.id = ANY(%(ids)s::bigint[] || %(fail_ids)s::bigint[])))
     ORDER BY r.id
       FOR UPDATE SKIP LOCKED  -- a run another session holds: its rows wait for a later statement
), done AS (
    -- Each row's own item (output, progress) is found by its lease, "id:generation", a key
    -- of the leases object whose value is the item's position in the arrays (a binary
    -- search; a search of a text array compared each row with every item, and so did a
    -- join with the unnested arrays). No item for this lease, no update (the CAS on the
    -- generation; a step listed twice under two leases takes its current one's).
    UPDATE cyclone_steps s
       SET state = 'completed',
           output = (%(outputs)s::jsonb[])[(%(leases)s::jsonb ->> (s.id || ':' || s.lease_generation))::int],
           progress = coalesce((%(progress)s::jsonb[])[(%(leases)s::jsonb ->> (s.id || ':' || s.lease_generation))::int],
                               s.progress),
           finished_at = now(),
           lease_expiry = NULL,
           error = NULL,
           error_kind = NULL,
           start_delay = coalesce((%(start_delays_us)s::bigint[])[(%(leases)s::jsonb ->> (s.id || ':' || s.lease_generation))::int]
                                  * interval '1 microsecond', s.start_delay)
     WHERE s.id = ANY(%(ids)s::bigint[])  -- by primary key (the supervisor reuses generic plans)
       AND (s.run_id IN (SELECT id FROM runs)) IS TRUE  -- one hash of the locked runs (not a join, nor an index)
       AND (s.state = 'running') IS TRUE  -- (not the partial index of every running row)
       AND s.lease_owner = %(owner)s
       AND (%(leases)s::jsonb ->> (s.id || ':' || s.lease_generation)) IS NOT NULL
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
    RETURNING r.id, CASE WHEN EXISTS (SELECT 1 FROM pg_stat_get_activity(NULL) a
    WHERE a.application_name = 'cyclone_mp waiting'
      AND a.datid = (SELECT d.oid FROM pg_database d WHERE d.datname = current_database())) THEN pg_notify('cyclone_mp_runs', r.id::text) END
-- The failed attempts: one tick's failed attempts, after the completions: each row's CAS as a
-- completion's, and a timeout the worker clock reported must be past its DB deadline.
-- Rows of workflow runs only when %(in_tx)s: the caller then advances those runs in the
-- same transaction.
), fail_in AS MATERIALIZED (
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
           (i.kind IN ('permanent', 'output_invalid', 'not_importable') AND NOT t.t) OR s.attempt >= s.max_attempts AS d,
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
           error = coalesce(CASE WHEN j.d AND NOT j.t THEN CASE WHEN j.kind IN ('memory_limit', 'cpu_limit', 'process_limit', 'oom_killed') AND j.entry ? 'cause' THEN
               (SELECT 'killed ' || (n.same + 1) || ' times: ' || (j.entry ->> 'cause')
                  FROM (SELECT count(*) AS same
                          FROM jsonb_array_elements(s.errors) WITH ORDINALITY AS e(v, i)
                         WHERE e.v ->> 'kind' = j.kind
                           AND e.i > coalesce((SELECT max(f.i)
                                                 FROM jsonb_array_elements(s.errors) WITH ORDINALITY AS f(v, i)
                                                WHERE f.v ->> 'kind' NOT IN (j.kind, 'cancelled')), 0)) n
                 WHERE n.same > 0)
           END END,
                            nullif(j.entry ->> 'message', ''), CASE WHEN j.t THEN 'timeout' ELSE j.kind END),
           error_kind = CASE WHEN j.t THEN 'timeout' ELSE j.kind END,
           errors = s.errors || jsonb_build_array(
               j.entry
               || jsonb_build_object('attempt', s.attempt, 'kind', CASE WHEN j.t THEN 'timeout' ELSE j.kind END)
               || CASE WHEN j.t AND j.kind <> 'timeout' THEN jsonb_build_object('reported_kind', j.kind)
                       ELSE '{}'::jsonb END
               || jsonb_build_object('at', to_char(now() AT TIME ZONE 'UTC', 'YYYY-MM-DD"T"HH24:MI:SS.US"+00:00"'))),
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
    RETURNING r.id, CASE WHEN EXISTS (SELECT 1 FROM pg_stat_get_activity(NULL) a
    WHERE a.application_name = 'cyclone_mp waiting'
      AND a.datid = (SELECT d.oid FROM pg_database d WHERE d.datname = current_database())) THEN pg_notify('cyclone_mp_runs', r.id::text) END
),
finished AS (SELECT id, lease_generation AS generation FROM done
             UNION ALL SELECT id, lease_generation FROM ended),
-- The full claim: claim up to %(limit)s available steps, SKIP LOCKED; the claim is the first
-- heartbeat (SPEC 4). Fair by key (the walk) and within limits: a step with a
-- limit is claimed only with a free slot of its (step, key) (see migration 0007), taken in
-- this statement. Needs a "finished" CTE before it: attempts this statement ends, whose
-- concurrency slots are free for this claim.
-- The walk, the first half of the fair claims: the first half of the fair claims: each queue's keys
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
), grp AS MATERIALIZED (
    -- the limited (step, key) groups among them: their limits, and how many want a slot
    SELECT step_name, key, min(concurrency) AS concurrency, min(rate_count) AS rate_count,
           max(rate_period) AS rate_period, count(*) AS n
      FROM cand
     WHERE concurrency IS NOT NULL OR rate_count IS NOT NULL
     GROUP BY step_name, key
-- Free concurrency slots: the free concurrency slots of the limited groups (grp: step_name, key,
-- concurrency, n wanted), locked SKIP LOCKED, numbered i within their group.
), cslots AS MATERIALIZED (
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
), rslots AS MATERIALIZED (
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
-- Picked: round-robin: every key's first step, then every key's second, ... (priority
-- first), from the eligible candidates.
), picked AS MATERIALIZED (
    -- round-robin: every key's first step, then every key's second, ... (priority first)
    SELECT e.id, e.step_name, e.key, e.queue, e.p, e.rn, e.gr
      FROM eligible e
     ORDER BY e.priority, e.rn, e.p, e.id
     LIMIT %(limit)s
-- The claim's write: the claim's write: the picked steps become running under this lease, the
-- claim being their first heartbeat (SPEC 4); returns what the supervisor starts them with.
), claimed AS (
    UPDATE cyclone_steps s
       SET state = 'running',
           started_at = now(),
           lease_owner = %(owner)s,
           lease_expiry = now() + (%(ttl_us)s::bigint * interval '1 microsecond'),
           lease_generation = s.lease_generation + 1,
           heartbeat_at = now(),
           progress = NULL,
           start_delay = NULL,  -- this attempt's own, once its supervisor reports it
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
), took_slots AS (
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
-- The meta row: the claim's meta row, for the store (not a claimed row): where each queue's
-- walk ended, and claim_wait's seconds until a step a rate limit held back may start
-- (the supervisor may poll again then; see Store.claim_wait).
), claim_meta AS (
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
-- The settled rows: the rows a settle statement returns: completed, then claimed.
), settled_completed AS (
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
           c.timeout, c.lease_generation, CASE WHEN pg_column_size(coalesce(c.item_input, (c.run).input)) <= %(inline_max)s
           THEN coalesce(c.item_input, (c.run).input)::text END, CASE WHEN (c.run).parent_id IS NOT NULL AND (c.run).kind = 'step' THEN 'child' ELSE (c.run).kind END, c.upstream, (pg_column_size(coalesce(c.item_input, (c.run).input)) > %(inline_max)s OR (c.has_upstream AND c.upstream IS NULL)
           OR c.wait_spawned),
           c.pickup, (c.run).trace, c.memory_limit, c.cpu_limit, c.max_processes, c.max_open_files, c.rated,
           NULL::boolean, NULL::text
      FROM claimed c
)
-- The result: what a settle statement returns: completed, failed (node: the error kind
-- stored; step_name: the state it got), claimed, then the claim's meta row (what = 'meta').
-- moves_run: a completed or failed row whose workflow run must move on (an item that
-- neither was its map's last nor was discarded leaves it as it is). The meta row's input
-- (skipped): the rows of the tick whose run another session holds locked (the runs CTE
-- skipped it: their CAS was not tried, nothing waited), "id:generation" items joined by
-- commas, or NULL; the writer keeps their outcomes for a later statement.
SELECT * FROM settled_completed
UNION ALL
SELECT 'failed', e.id, e.run_id::text, e.error_kind, e.state, NULL, NULL, NULL, NULL, e.lease_generation, NULL, e.run_kind,
       NULL, NULL, NULL, NULL, NULL, NULL, NULL, NULL, NULL, e.map_node IS NULL OR e.state = 'discarded',
       e.run_parent::text
  FROM ended e
UNION ALL
SELECT * FROM settled_claimed
UNION ALL
SELECT 'meta', NULL, NULL, m.cursors::text, (SELECT coalesce(jsonb_object_agg(f.queue, CASE WHEN f.rates THEN 'rates' WHEN f.limits THEN 'limits' ELSE 'keys' END),
               '{}'::jsonb)::text
 FROM cyclone_flow_queues f
WHERE f.queue = ANY(%(queues)s::text[])), NULL, NULL, NULL, m.wait, NULL, (SELECT string_agg(w.id || ':' || w.lease_generation, ',')  -- skipped (see above)
          FROM cyclone_steps w
         WHERE w.id = ANY(ARRAY(SELECT unnest(%(ids)s::bigint[] || %(fail_ids)s::bigint[])
                                EXCEPT SELECT id FROM done EXCEPT SELECT id FROM ended))
           AND w.run_id NOT IN (SELECT id FROM runs)), NULL, NULL, NULL, NULL, NULL, NULL, NULL, NULL, NULL,
       NULL, NULL, NULL
  FROM claim_meta m

-- name: settle_concurrency
-- settle with the concurrency claim (queues with concurrency limits, no rate limit).
-- The completions: one tick's completions. Every row is checked on its own (the
-- CAS): still running under the same lease_owner and lease_generation, and before its
-- DB deadline. The runs of every row of the tick (completions and failures) are locked
-- first, all at once, by id.
WITH RECURSIVE runs AS (
    -- by primary key only: a state predicate here made generic plans scan every running run
    SELECT r.id, r.kind, r.state, r.parent_id
      FROM cyclone_runs r
     WHERE r.id = ANY(ARRAY(SELECT s.run_id FROM cyclone_steps s
                             WHERE s.id = ANY(%(ids)s::bigint[] || %(fail_ids)s::bigint[])))
     ORDER BY r.id
       FOR UPDATE SKIP LOCKED  -- a run another session holds: its rows wait for a later statement
), done AS (
    -- Each row's own item (output, progress) is found by its lease, "id:generation", a key
    -- of the leases object whose value is the item's position in the arrays (a binary
    -- search; a search of a text array compared each row with every item, and so did a
    -- join with the unnested arrays). No item for this lease, no update (the CAS on the
    -- generation; a step listed twice under two leases takes its current one's).
    UPDATE cyclone_steps s
       SET state = 'completed',
           output = (%(outputs)s::jsonb[])[(%(leases)s::jsonb ->> (s.id || ':' || s.lease_generation))::int],
           progress = coalesce((%(progress)s::jsonb[])[(%(leases)s::jsonb ->> (s.id || ':' || s.lease_generation))::int],
                               s.progress),
           finished_at = now(),
           lease_expiry = NULL,
           error = NULL,
           error_kind = NULL,
           start_delay = coalesce((%(start_delays_us)s::bigint[])[(%(leases)s::jsonb ->> (s.id || ':' || s.lease_generation))::int]
                                  * interval '1 microsecond', s.start_delay)
     WHERE s.id = ANY(%(ids)s::bigint[])  -- by primary key (the supervisor reuses generic plans)
       AND (s.run_id IN (SELECT id FROM runs)) IS TRUE  -- one hash of the locked runs (not a join, nor an index)
       AND (s.state = 'running') IS TRUE  -- (not the partial index of every running row)
       AND s.lease_owner = %(owner)s
       AND (%(leases)s::jsonb ->> (s.id || ':' || s.lease_generation)) IS NOT NULL
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
    RETURNING r.id, CASE WHEN EXISTS (SELECT 1 FROM pg_stat_get_activity(NULL) a
    WHERE a.application_name = 'cyclone_mp waiting'
      AND a.datid = (SELECT d.oid FROM pg_database d WHERE d.datname = current_database())) THEN pg_notify('cyclone_mp_runs', r.id::text) END
-- The failed attempts: one tick's failed attempts, after the completions: each row's CAS as a
-- completion's, and a timeout the worker clock reported must be past its DB deadline.
-- Rows of workflow runs only when %(in_tx)s: the caller then advances those runs in the
-- same transaction.
), fail_in AS MATERIALIZED (
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
           (i.kind IN ('permanent', 'output_invalid', 'not_importable') AND NOT t.t) OR s.attempt >= s.max_attempts AS d,
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
           error = coalesce(CASE WHEN j.d AND NOT j.t THEN CASE WHEN j.kind IN ('memory_limit', 'cpu_limit', 'process_limit', 'oom_killed') AND j.entry ? 'cause' THEN
               (SELECT 'killed ' || (n.same + 1) || ' times: ' || (j.entry ->> 'cause')
                  FROM (SELECT count(*) AS same
                          FROM jsonb_array_elements(s.errors) WITH ORDINALITY AS e(v, i)
                         WHERE e.v ->> 'kind' = j.kind
                           AND e.i > coalesce((SELECT max(f.i)
                                                 FROM jsonb_array_elements(s.errors) WITH ORDINALITY AS f(v, i)
                                                WHERE f.v ->> 'kind' NOT IN (j.kind, 'cancelled')), 0)) n
                 WHERE n.same > 0)
           END END,
                            nullif(j.entry ->> 'message', ''), CASE WHEN j.t THEN 'timeout' ELSE j.kind END),
           error_kind = CASE WHEN j.t THEN 'timeout' ELSE j.kind END,
           errors = s.errors || jsonb_build_array(
               j.entry
               || jsonb_build_object('attempt', s.attempt, 'kind', CASE WHEN j.t THEN 'timeout' ELSE j.kind END)
               || CASE WHEN j.t AND j.kind <> 'timeout' THEN jsonb_build_object('reported_kind', j.kind)
                       ELSE '{}'::jsonb END
               || jsonb_build_object('at', to_char(now() AT TIME ZONE 'UTC', 'YYYY-MM-DD"T"HH24:MI:SS.US"+00:00"'))),
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
    RETURNING r.id, CASE WHEN EXISTS (SELECT 1 FROM pg_stat_get_activity(NULL) a
    WHERE a.application_name = 'cyclone_mp waiting'
      AND a.datid = (SELECT d.oid FROM pg_database d WHERE d.datname = current_database())) THEN pg_notify('cyclone_mp_runs', r.id::text) END
),
finished AS (SELECT id, lease_generation AS generation FROM done
             UNION ALL SELECT id, lease_generation FROM ended),
-- The concurrency claim: the limited claim of queues that no rate-limited step ever entered (see
-- cyclone_flow_queues.rates, migration 0010): the full claim with its concurrency slots only,
-- a plan of about half the nodes (%(rates)s false: a rate-limited step is left to the
-- full claim). Needs a "finished" CTE before it, as the full claim does.
-- The walk, the first half of the fair claims: the first half of the fair claims: each queue's keys
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
), grp AS MATERIALIZED (
    -- the limited (step, key) groups among them, and how many want a slot
    SELECT step_name, key, min(concurrency) AS concurrency, count(*) AS n
      FROM cand
     WHERE concurrency IS NOT NULL
     GROUP BY step_name, key
-- Free concurrency slots: the free concurrency slots of the limited groups (grp: step_name, key,
-- concurrency, n wanted), locked SKIP LOCKED, numbered i within their group.
), cslots AS MATERIALIZED (
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
), eligible AS MATERIALIZED (
    -- the candidates their limits let start now: the gr-th of a group needs gr free slots
    SELECT r.id, r.step_name, r.key, r.queue, r.p, r.rn, r.gr, r.priority
      FROM ranked r
     WHERE r.concurrency IS NULL
        OR r.gr <= (SELECT count(*) FROM cslots c WHERE c.step_name = r.step_name AND c.key = r.key)
-- Picked: round-robin: every key's first step, then every key's second, ... (priority
-- first), from the eligible candidates.
), picked AS MATERIALIZED (
    -- round-robin: every key's first step, then every key's second, ... (priority first)
    SELECT e.id, e.step_name, e.key, e.queue, e.p, e.rn, e.gr
      FROM eligible e
     ORDER BY e.priority, e.rn, e.p, e.id
     LIMIT %(limit)s
-- The claim's write: the claim's write: the picked steps become running under this lease, the
-- claim being their first heartbeat (SPEC 4); returns what the supervisor starts them with.
), claimed AS (
    UPDATE cyclone_steps s
       SET state = 'running',
           started_at = now(),
           lease_owner = %(owner)s,
           lease_expiry = now() + (%(ttl_us)s::bigint * interval '1 microsecond'),
           lease_generation = s.lease_generation + 1,
           heartbeat_at = now(),
           progress = NULL,
           start_delay = NULL,  -- this attempt's own, once its supervisor reports it
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
), took_slots AS (
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
-- The meta row: the claim's meta row, for the store (not a claimed row): where each queue's
-- walk ended, and claim_wait's seconds until a step a rate limit held back may start
-- (the supervisor may poll again then; see Store.claim_wait).
), claim_meta AS (
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
-- The settled rows: the rows a settle statement returns: completed, then claimed.
), settled_completed AS (
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
           c.timeout, c.lease_generation, CASE WHEN pg_column_size(coalesce(c.item_input, (c.run).input)) <= %(inline_max)s
           THEN coalesce(c.item_input, (c.run).input)::text END, CASE WHEN (c.run).parent_id IS NOT NULL AND (c.run).kind = 'step' THEN 'child' ELSE (c.run).kind END, c.upstream, (pg_column_size(coalesce(c.item_input, (c.run).input)) > %(inline_max)s OR (c.has_upstream AND c.upstream IS NULL)
           OR c.wait_spawned),
           c.pickup, (c.run).trace, c.memory_limit, c.cpu_limit, c.max_processes, c.max_open_files, c.rated,
           NULL::boolean, NULL::text
      FROM claimed c
)
-- The result: what a settle statement returns: completed, failed (node: the error kind
-- stored; step_name: the state it got), claimed, then the claim's meta row (what = 'meta').
-- moves_run: a completed or failed row whose workflow run must move on (an item that
-- neither was its map's last nor was discarded leaves it as it is). The meta row's input
-- (skipped): the rows of the tick whose run another session holds locked (the runs CTE
-- skipped it: their CAS was not tried, nothing waited), "id:generation" items joined by
-- commas, or NULL; the writer keeps their outcomes for a later statement.
SELECT * FROM settled_completed
UNION ALL
SELECT 'failed', e.id, e.run_id::text, e.error_kind, e.state, NULL, NULL, NULL, NULL, e.lease_generation, NULL, e.run_kind,
       NULL, NULL, NULL, NULL, NULL, NULL, NULL, NULL, NULL, e.map_node IS NULL OR e.state = 'discarded',
       e.run_parent::text
  FROM ended e
UNION ALL
SELECT * FROM settled_claimed
UNION ALL
SELECT 'meta', NULL, NULL, m.cursors::text, (SELECT coalesce(jsonb_object_agg(f.queue, CASE WHEN f.rates THEN 'rates' WHEN f.limits THEN 'limits' ELSE 'keys' END),
               '{}'::jsonb)::text
 FROM cyclone_flow_queues f
WHERE f.queue = ANY(%(queues)s::text[])), NULL, NULL, NULL, m.wait, NULL, (SELECT string_agg(w.id || ':' || w.lease_generation, ',')  -- skipped (see above)
          FROM cyclone_steps w
         WHERE w.id = ANY(ARRAY(SELECT unnest(%(ids)s::bigint[] || %(fail_ids)s::bigint[])
                                EXCEPT SELECT id FROM done EXCEPT SELECT id FROM ended))
           AND w.run_id NOT IN (SELECT id FROM runs)), NULL, NULL, NULL, NULL, NULL, NULL, NULL, NULL, NULL,
       NULL, NULL, NULL
  FROM claim_meta m

-- name: settle_fair
-- settle with the fair claim (queues with keys, no limited step).
-- The completions: one tick's completions. Every row is checked on its own (the
-- CAS): still running under the same lease_owner and lease_generation, and before its
-- DB deadline. The runs of every row of the tick (completions and failures) are locked
-- first, all at once, by id.
WITH RECURSIVE runs AS (
    -- by primary key only: a state predicate here made generic plans scan every running run
    SELECT r.id, r.kind, r.state, r.parent_id
      FROM cyclone_runs r
     WHERE r.id = ANY(ARRAY(SELECT s.run_id FROM cyclone_steps s
                             WHERE s.id = ANY(%(ids)s::bigint[] || %(fail_ids)s::bigint[])))
     ORDER BY r.id
       FOR UPDATE SKIP LOCKED  -- a run another session holds: its rows wait for a later statement
), done AS (
    -- Each row's own item (output, progress) is found by its lease, "id:generation", a key
    -- of the leases object whose value is the item's position in the arrays (a binary
    -- search; a search of a text array compared each row with every item, and so did a
    -- join with the unnested arrays). No item for this lease, no update (the CAS on the
    -- generation; a step listed twice under two leases takes its current one's).
    UPDATE cyclone_steps s
       SET state = 'completed',
           output = (%(outputs)s::jsonb[])[(%(leases)s::jsonb ->> (s.id || ':' || s.lease_generation))::int],
           progress = coalesce((%(progress)s::jsonb[])[(%(leases)s::jsonb ->> (s.id || ':' || s.lease_generation))::int],
                               s.progress),
           finished_at = now(),
           lease_expiry = NULL,
           error = NULL,
           error_kind = NULL,
           start_delay = coalesce((%(start_delays_us)s::bigint[])[(%(leases)s::jsonb ->> (s.id || ':' || s.lease_generation))::int]
                                  * interval '1 microsecond', s.start_delay)
     WHERE s.id = ANY(%(ids)s::bigint[])  -- by primary key (the supervisor reuses generic plans)
       AND (s.run_id IN (SELECT id FROM runs)) IS TRUE  -- one hash of the locked runs (not a join, nor an index)
       AND (s.state = 'running') IS TRUE  -- (not the partial index of every running row)
       AND s.lease_owner = %(owner)s
       AND (%(leases)s::jsonb ->> (s.id || ':' || s.lease_generation)) IS NOT NULL
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
    RETURNING r.id, CASE WHEN EXISTS (SELECT 1 FROM pg_stat_get_activity(NULL) a
    WHERE a.application_name = 'cyclone_mp waiting'
      AND a.datid = (SELECT d.oid FROM pg_database d WHERE d.datname = current_database())) THEN pg_notify('cyclone_mp_runs', r.id::text) END
-- The failed attempts: one tick's failed attempts, after the completions: each row's CAS as a
-- completion's, and a timeout the worker clock reported must be past its DB deadline.
-- Rows of workflow runs only when %(in_tx)s: the caller then advances those runs in the
-- same transaction.
), fail_in AS MATERIALIZED (
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
           (i.kind IN ('permanent', 'output_invalid', 'not_importable') AND NOT t.t) OR s.attempt >= s.max_attempts AS d,
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
           error = coalesce(CASE WHEN j.d AND NOT j.t THEN CASE WHEN j.kind IN ('memory_limit', 'cpu_limit', 'process_limit', 'oom_killed') AND j.entry ? 'cause' THEN
               (SELECT 'killed ' || (n.same + 1) || ' times: ' || (j.entry ->> 'cause')
                  FROM (SELECT count(*) AS same
                          FROM jsonb_array_elements(s.errors) WITH ORDINALITY AS e(v, i)
                         WHERE e.v ->> 'kind' = j.kind
                           AND e.i > coalesce((SELECT max(f.i)
                                                 FROM jsonb_array_elements(s.errors) WITH ORDINALITY AS f(v, i)
                                                WHERE f.v ->> 'kind' NOT IN (j.kind, 'cancelled')), 0)) n
                 WHERE n.same > 0)
           END END,
                            nullif(j.entry ->> 'message', ''), CASE WHEN j.t THEN 'timeout' ELSE j.kind END),
           error_kind = CASE WHEN j.t THEN 'timeout' ELSE j.kind END,
           errors = s.errors || jsonb_build_array(
               j.entry
               || jsonb_build_object('attempt', s.attempt, 'kind', CASE WHEN j.t THEN 'timeout' ELSE j.kind END)
               || CASE WHEN j.t AND j.kind <> 'timeout' THEN jsonb_build_object('reported_kind', j.kind)
                       ELSE '{}'::jsonb END
               || jsonb_build_object('at', to_char(now() AT TIME ZONE 'UTC', 'YYYY-MM-DD"T"HH24:MI:SS.US"+00:00"'))),
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
    RETURNING r.id, CASE WHEN EXISTS (SELECT 1 FROM pg_stat_get_activity(NULL) a
    WHERE a.application_name = 'cyclone_mp waiting'
      AND a.datid = (SELECT d.oid FROM pg_database d WHERE d.datname = current_database())) THEN pg_notify('cyclone_mp_runs', r.id::text) END
-- The fair claim: the fair claim of queues with keys but no limited step (the walk without the
-- slots; %(limits)s false: a limited step is left to the limited claims).
-- The walk, the first half of the fair claims: the first half of the fair claims: each queue's keys
-- (concurrency_key) are walked in order from the key after %(cursors)s (one per queue,
-- NULL: from the first), at most %(limit)s + 2 of them; each walked key's first steps
-- (its share of the limit) are locked SKIP LOCKED; rn ranks them within their key, gr
-- within their (step, key) group. Without %(limits)s, no step with a limit is taken;
-- without %(rates)s, no step with a rate limit.
), walk (queue, key, p, first) AS (
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
), eligible AS MATERIALIZED (
    SELECT r.id, r.step_name, r.key, r.queue, r.p, r.rn, r.gr, r.priority FROM ranked r
-- Picked: round-robin: every key's first step, then every key's second, ... (priority
-- first), from the eligible candidates.
), picked AS MATERIALIZED (
    -- round-robin: every key's first step, then every key's second, ... (priority first)
    SELECT e.id, e.step_name, e.key, e.queue, e.p, e.rn, e.gr
      FROM eligible e
     ORDER BY e.priority, e.rn, e.p, e.id
     LIMIT %(limit)s
-- The claim's write: the claim's write: the picked steps become running under this lease, the
-- claim being their first heartbeat (SPEC 4); returns what the supervisor starts them with.
), claimed AS (
    UPDATE cyclone_steps s
       SET state = 'running',
           started_at = now(),
           lease_owner = %(owner)s,
           lease_expiry = now() + (%(ttl_us)s::bigint * interval '1 microsecond'),
           lease_generation = s.lease_generation + 1,
           heartbeat_at = now(),
           progress = NULL,
           start_delay = NULL,  -- this attempt's own, once its supervisor reports it
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
), claim_wait AS (
    SELECT NULL::float8 AS wait
-- The meta row: the claim's meta row, for the store (not a claimed row): where each queue's
-- walk ended, and claim_wait's seconds until a step a rate limit held back may start
-- (the supervisor may poll again then; see Store.claim_wait).
), claim_meta AS (
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
-- The settled rows: the rows a settle statement returns: completed, then claimed.
), settled_completed AS (
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
           c.timeout, c.lease_generation, CASE WHEN pg_column_size(coalesce(c.item_input, (c.run).input)) <= %(inline_max)s
           THEN coalesce(c.item_input, (c.run).input)::text END, CASE WHEN (c.run).parent_id IS NOT NULL AND (c.run).kind = 'step' THEN 'child' ELSE (c.run).kind END, c.upstream, (pg_column_size(coalesce(c.item_input, (c.run).input)) > %(inline_max)s OR (c.has_upstream AND c.upstream IS NULL)
           OR c.wait_spawned),
           c.pickup, (c.run).trace, c.memory_limit, c.cpu_limit, c.max_processes, c.max_open_files, c.rated,
           NULL::boolean, NULL::text
      FROM claimed c
)
-- The result: what a settle statement returns: completed, failed (node: the error kind
-- stored; step_name: the state it got), claimed, then the claim's meta row (what = 'meta').
-- moves_run: a completed or failed row whose workflow run must move on (an item that
-- neither was its map's last nor was discarded leaves it as it is). The meta row's input
-- (skipped): the rows of the tick whose run another session holds locked (the runs CTE
-- skipped it: their CAS was not tried, nothing waited), "id:generation" items joined by
-- commas, or NULL; the writer keeps their outcomes for a later statement.
SELECT * FROM settled_completed
UNION ALL
SELECT 'failed', e.id, e.run_id::text, e.error_kind, e.state, NULL, NULL, NULL, NULL, e.lease_generation, NULL, e.run_kind,
       NULL, NULL, NULL, NULL, NULL, NULL, NULL, NULL, NULL, e.map_node IS NULL OR e.state = 'discarded',
       e.run_parent::text
  FROM ended e
UNION ALL
SELECT * FROM settled_claimed
UNION ALL
SELECT 'meta', NULL, NULL, m.cursors::text, (SELECT coalesce(jsonb_object_agg(f.queue, CASE WHEN f.rates THEN 'rates' WHEN f.limits THEN 'limits' ELSE 'keys' END),
               '{}'::jsonb)::text
 FROM cyclone_flow_queues f
WHERE f.queue = ANY(%(queues)s::text[])), NULL, NULL, NULL, m.wait, NULL, (SELECT string_agg(w.id || ':' || w.lease_generation, ',')  -- skipped (see above)
          FROM cyclone_steps w
         WHERE w.id = ANY(ARRAY(SELECT unnest(%(ids)s::bigint[] || %(fail_ids)s::bigint[])
                                EXCEPT SELECT id FROM done EXCEPT SELECT id FROM ended))
           AND w.run_id NOT IN (SELECT id FROM runs)), NULL, NULL, NULL, NULL, NULL, NULL, NULL, NULL, NULL,
       NULL, NULL, NULL
  FROM claim_meta m

-- name: settle_plain
-- settle with the plain claim (queues without keys or limits).
-- The completions: one tick's completions. Every row is checked on its own (the
-- CAS): still running under the same lease_owner and lease_generation, and before its
-- DB deadline. The runs of every row of the tick (completions and failures) are locked
-- first, all at once, by id.
WITH runs AS (
    -- by primary key only: a state predicate here made generic plans scan every running run
    SELECT r.id, r.kind, r.state, r.parent_id
      FROM cyclone_runs r
     WHERE r.id = ANY(ARRAY(SELECT s.run_id FROM cyclone_steps s
                             WHERE s.id = ANY(%(ids)s::bigint[] || %(fail_ids)s::bigint[])))
     ORDER BY r.id
       FOR UPDATE SKIP LOCKED  -- a run another session holds: its rows wait for a later statement
), done AS (
    -- Each row's own item (output, progress) is found by its lease, "id:generation", a key
    -- of the leases object whose value is the item's position in the arrays (a binary
    -- search; a search of a text array compared each row with every item, and so did a
    -- join with the unnested arrays). No item for this lease, no update (the CAS on the
    -- generation; a step listed twice under two leases takes its current one's).
    UPDATE cyclone_steps s
       SET state = 'completed',
           output = (%(outputs)s::jsonb[])[(%(leases)s::jsonb ->> (s.id || ':' || s.lease_generation))::int],
           progress = coalesce((%(progress)s::jsonb[])[(%(leases)s::jsonb ->> (s.id || ':' || s.lease_generation))::int],
                               s.progress),
           finished_at = now(),
           lease_expiry = NULL,
           error = NULL,
           error_kind = NULL,
           start_delay = coalesce((%(start_delays_us)s::bigint[])[(%(leases)s::jsonb ->> (s.id || ':' || s.lease_generation))::int]
                                  * interval '1 microsecond', s.start_delay)
     WHERE s.id = ANY(%(ids)s::bigint[])  -- by primary key (the supervisor reuses generic plans)
       AND (s.run_id IN (SELECT id FROM runs)) IS TRUE  -- one hash of the locked runs (not a join, nor an index)
       AND (s.state = 'running') IS TRUE  -- (not the partial index of every running row)
       AND s.lease_owner = %(owner)s
       AND (%(leases)s::jsonb ->> (s.id || ':' || s.lease_generation)) IS NOT NULL
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
    RETURNING r.id, CASE WHEN EXISTS (SELECT 1 FROM pg_stat_get_activity(NULL) a
    WHERE a.application_name = 'cyclone_mp waiting'
      AND a.datid = (SELECT d.oid FROM pg_database d WHERE d.datname = current_database())) THEN pg_notify('cyclone_mp_runs', r.id::text) END
-- The failed attempts: one tick's failed attempts, after the completions: each row's CAS as a
-- completion's, and a timeout the worker clock reported must be past its DB deadline.
-- Rows of workflow runs only when %(in_tx)s: the caller then advances those runs in the
-- same transaction.
), fail_in AS MATERIALIZED (
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
           (i.kind IN ('permanent', 'output_invalid', 'not_importable') AND NOT t.t) OR s.attempt >= s.max_attempts AS d,
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
           error = coalesce(CASE WHEN j.d AND NOT j.t THEN CASE WHEN j.kind IN ('memory_limit', 'cpu_limit', 'process_limit', 'oom_killed') AND j.entry ? 'cause' THEN
               (SELECT 'killed ' || (n.same + 1) || ' times: ' || (j.entry ->> 'cause')
                  FROM (SELECT count(*) AS same
                          FROM jsonb_array_elements(s.errors) WITH ORDINALITY AS e(v, i)
                         WHERE e.v ->> 'kind' = j.kind
                           AND e.i > coalesce((SELECT max(f.i)
                                                 FROM jsonb_array_elements(s.errors) WITH ORDINALITY AS f(v, i)
                                                WHERE f.v ->> 'kind' NOT IN (j.kind, 'cancelled')), 0)) n
                 WHERE n.same > 0)
           END END,
                            nullif(j.entry ->> 'message', ''), CASE WHEN j.t THEN 'timeout' ELSE j.kind END),
           error_kind = CASE WHEN j.t THEN 'timeout' ELSE j.kind END,
           errors = s.errors || jsonb_build_array(
               j.entry
               || jsonb_build_object('attempt', s.attempt, 'kind', CASE WHEN j.t THEN 'timeout' ELSE j.kind END)
               || CASE WHEN j.t AND j.kind <> 'timeout' THEN jsonb_build_object('reported_kind', j.kind)
                       ELSE '{}'::jsonb END
               || jsonb_build_object('at', to_char(now() AT TIME ZONE 'UTC', 'YYYY-MM-DD"T"HH24:MI:SS.US"+00:00"'))),
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
    RETURNING r.id, CASE WHEN EXISTS (SELECT 1 FROM pg_stat_get_activity(NULL) a
    WHERE a.application_name = 'cyclone_mp waiting'
      AND a.datid = (SELECT d.oid FROM pg_database d WHERE d.datname = current_database())) THEN pg_notify('cyclone_mp_runs', r.id::text) END
-- The plain claim: the claim of queues no step with a key or a limit ever entered (see
-- cyclone_flow_queues, migration 0008): one ordered index scan per queue, SKIP LOCKED.
-- It never takes a step with a key or a limit, whatever the store believes of a queue.
), picked AS (
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
-- The claim's write: the claim's write: the picked steps become running under this lease, the
-- claim being their first heartbeat (SPEC 4); returns what the supervisor starts them with.
), claimed AS (
    UPDATE cyclone_steps s
       SET state = 'running',
           started_at = now(),
           lease_owner = %(owner)s,
           lease_expiry = now() + (%(ttl_us)s::bigint * interval '1 microsecond'),
           lease_generation = s.lease_generation + 1,
           heartbeat_at = now(),
           progress = NULL,
           start_delay = NULL,  -- this attempt's own, once its supervisor reports it
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
), claim_meta AS (
    SELECT NULL::jsonb AS cursors, NULL::float8 AS wait  -- no walk, no rate limit: nothing to say
-- The settled rows: the rows a settle statement returns: completed, then claimed.
), settled_completed AS (
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
           c.timeout, c.lease_generation, CASE WHEN pg_column_size(coalesce(c.item_input, (c.run).input)) <= %(inline_max)s
           THEN coalesce(c.item_input, (c.run).input)::text END, CASE WHEN (c.run).parent_id IS NOT NULL AND (c.run).kind = 'step' THEN 'child' ELSE (c.run).kind END, c.upstream, (pg_column_size(coalesce(c.item_input, (c.run).input)) > %(inline_max)s OR (c.has_upstream AND c.upstream IS NULL)
           OR c.wait_spawned),
           c.pickup, (c.run).trace, c.memory_limit, c.cpu_limit, c.max_processes, c.max_open_files, c.rated,
           NULL::boolean, NULL::text
      FROM claimed c
)
-- The result: what a settle statement returns: completed, failed (node: the error kind
-- stored; step_name: the state it got), claimed, then the claim's meta row (what = 'meta').
-- moves_run: a completed or failed row whose workflow run must move on (an item that
-- neither was its map's last nor was discarded leaves it as it is). The meta row's input
-- (skipped): the rows of the tick whose run another session holds locked (the runs CTE
-- skipped it: their CAS was not tried, nothing waited), "id:generation" items joined by
-- commas, or NULL; the writer keeps their outcomes for a later statement.
SELECT * FROM settled_completed
UNION ALL
SELECT 'failed', e.id, e.run_id::text, e.error_kind, e.state, NULL, NULL, NULL, NULL, e.lease_generation, NULL, e.run_kind,
       NULL, NULL, NULL, NULL, NULL, NULL, NULL, NULL, NULL, e.map_node IS NULL OR e.state = 'discarded',
       e.run_parent::text
  FROM ended e
UNION ALL
SELECT * FROM settled_claimed
UNION ALL
SELECT 'meta', NULL, NULL, m.cursors::text, (SELECT coalesce(jsonb_object_agg(f.queue, CASE WHEN f.rates THEN 'rates' WHEN f.limits THEN 'limits' ELSE 'keys' END),
               '{}'::jsonb)::text
 FROM cyclone_flow_queues f
WHERE f.queue = ANY(%(queues)s::text[])), NULL, NULL, NULL, m.wait, NULL, (SELECT string_agg(w.id || ':' || w.lease_generation, ',')  -- skipped (see above)
          FROM cyclone_steps w
         WHERE w.id = ANY(ARRAY(SELECT unnest(%(ids)s::bigint[] || %(fail_ids)s::bigint[])
                                EXCEPT SELECT id FROM done EXCEPT SELECT id FROM ended))
           AND w.run_id NOT IN (SELECT id FROM runs)), NULL, NULL, NULL, NULL, NULL, NULL, NULL, NULL, NULL,
       NULL, NULL, NULL
  FROM claim_meta m

-- name: settle_completions
-- The hot path of a tick without failures (most ticks): its completions and the next
-- claim. A smaller plan than settle's (about 10 % less PostgreSQL CPU for one step).
-- The completions: one tick's completions. Every row is checked on its own (the
-- CAS): still running under the same lease_owner and lease_generation, and before its
-- DB deadline. The runs of every row of the tick (completions and failures) are locked
-- first, all at once, by id.
WITH RECURSIVE runs AS (
    -- by primary key only: a state predicate here made generic plans scan every running run
    SELECT r.id, r.kind, r.state, r.parent_id
      FROM cyclone_runs r
     WHERE r.id = ANY(ARRAY(SELECT s.run_id FROM cyclone_steps s
                             WHERE s.id = ANY(%(ids)s::bigint[] || %(fail_ids)s::bigint[])))
     ORDER BY r.id
       FOR UPDATE SKIP LOCKED  -- a run another session holds: its rows wait for a later statement
), done AS (
    -- Each row's own item (output, progress) is found by its lease, "id:generation", a key
    -- of the leases object whose value is the item's position in the arrays (a binary
    -- search; a search of a text array compared each row with every item, and so did a
    -- join with the unnested arrays). No item for this lease, no update (the CAS on the
    -- generation; a step listed twice under two leases takes its current one's).
    UPDATE cyclone_steps s
       SET state = 'completed',
           output = (%(outputs)s::jsonb[])[(%(leases)s::jsonb ->> (s.id || ':' || s.lease_generation))::int],
           progress = coalesce((%(progress)s::jsonb[])[(%(leases)s::jsonb ->> (s.id || ':' || s.lease_generation))::int],
                               s.progress),
           finished_at = now(),
           lease_expiry = NULL,
           error = NULL,
           error_kind = NULL,
           start_delay = coalesce((%(start_delays_us)s::bigint[])[(%(leases)s::jsonb ->> (s.id || ':' || s.lease_generation))::int]
                                  * interval '1 microsecond', s.start_delay)
     WHERE s.id = ANY(%(ids)s::bigint[])  -- by primary key (the supervisor reuses generic plans)
       AND (s.run_id IN (SELECT id FROM runs)) IS TRUE  -- one hash of the locked runs (not a join, nor an index)
       AND (s.state = 'running') IS TRUE  -- (not the partial index of every running row)
       AND s.lease_owner = %(owner)s
       AND (%(leases)s::jsonb ->> (s.id || ':' || s.lease_generation)) IS NOT NULL
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
    RETURNING r.id, CASE WHEN EXISTS (SELECT 1 FROM pg_stat_get_activity(NULL) a
    WHERE a.application_name = 'cyclone_mp waiting'
      AND a.datid = (SELECT d.oid FROM pg_database d WHERE d.datname = current_database())) THEN pg_notify('cyclone_mp_runs', r.id::text) END
), finished AS (SELECT id, lease_generation AS generation FROM done),
-- The full claim: claim up to %(limit)s available steps, SKIP LOCKED; the claim is the first
-- heartbeat (SPEC 4). Fair by key (the walk) and within limits: a step with a
-- limit is claimed only with a free slot of its (step, key) (see migration 0007), taken in
-- this statement. Needs a "finished" CTE before it: attempts this statement ends, whose
-- concurrency slots are free for this claim.
-- The walk, the first half of the fair claims: the first half of the fair claims: each queue's keys
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
), grp AS MATERIALIZED (
    -- the limited (step, key) groups among them: their limits, and how many want a slot
    SELECT step_name, key, min(concurrency) AS concurrency, min(rate_count) AS rate_count,
           max(rate_period) AS rate_period, count(*) AS n
      FROM cand
     WHERE concurrency IS NOT NULL OR rate_count IS NOT NULL
     GROUP BY step_name, key
-- Free concurrency slots: the free concurrency slots of the limited groups (grp: step_name, key,
-- concurrency, n wanted), locked SKIP LOCKED, numbered i within their group.
), cslots AS MATERIALIZED (
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
), rslots AS MATERIALIZED (
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
-- Picked: round-robin: every key's first step, then every key's second, ... (priority
-- first), from the eligible candidates.
), picked AS MATERIALIZED (
    -- round-robin: every key's first step, then every key's second, ... (priority first)
    SELECT e.id, e.step_name, e.key, e.queue, e.p, e.rn, e.gr
      FROM eligible e
     ORDER BY e.priority, e.rn, e.p, e.id
     LIMIT %(limit)s
-- The claim's write: the claim's write: the picked steps become running under this lease, the
-- claim being their first heartbeat (SPEC 4); returns what the supervisor starts them with.
), claimed AS (
    UPDATE cyclone_steps s
       SET state = 'running',
           started_at = now(),
           lease_owner = %(owner)s,
           lease_expiry = now() + (%(ttl_us)s::bigint * interval '1 microsecond'),
           lease_generation = s.lease_generation + 1,
           heartbeat_at = now(),
           progress = NULL,
           start_delay = NULL,  -- this attempt's own, once its supervisor reports it
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
), took_slots AS (
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
-- The meta row: the claim's meta row, for the store (not a claimed row): where each queue's
-- walk ended, and claim_wait's seconds until a step a rate limit held back may start
-- (the supervisor may poll again then; see Store.claim_wait).
), claim_meta AS (
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
-- The settled rows: the rows a settle statement returns: completed, then claimed.
), settled_completed AS (
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
           c.timeout, c.lease_generation, CASE WHEN pg_column_size(coalesce(c.item_input, (c.run).input)) <= %(inline_max)s
           THEN coalesce(c.item_input, (c.run).input)::text END, CASE WHEN (c.run).parent_id IS NOT NULL AND (c.run).kind = 'step' THEN 'child' ELSE (c.run).kind END, c.upstream, (pg_column_size(coalesce(c.item_input, (c.run).input)) > %(inline_max)s OR (c.has_upstream AND c.upstream IS NULL)
           OR c.wait_spawned),
           c.pickup, (c.run).trace, c.memory_limit, c.cpu_limit, c.max_processes, c.max_open_files, c.rated,
           NULL::boolean, NULL::text
      FROM claimed c
)
-- The result: a settle statement's, without failed rows (the meta row's input: the rows
-- skipped for a locked run, as in settle).
SELECT * FROM settled_completed
UNION ALL
SELECT * FROM settled_claimed
UNION ALL
SELECT 'meta', NULL, NULL, m.cursors::text, (SELECT coalesce(jsonb_object_agg(f.queue, CASE WHEN f.rates THEN 'rates' WHEN f.limits THEN 'limits' ELSE 'keys' END),
               '{}'::jsonb)::text
 FROM cyclone_flow_queues f
WHERE f.queue = ANY(%(queues)s::text[])), NULL, NULL, NULL, m.wait, NULL, (SELECT string_agg(w.id || ':' || w.lease_generation, ',')  -- skipped (see above)
          FROM cyclone_steps w
         WHERE w.id = ANY(ARRAY(SELECT unnest(%(ids)s::bigint[] || %(fail_ids)s::bigint[]) EXCEPT SELECT id FROM done))
           AND w.run_id NOT IN (SELECT id FROM runs)), NULL, NULL, NULL, NULL, NULL, NULL, NULL, NULL, NULL,
       NULL, NULL, NULL
  FROM claim_meta m

-- name: settle_completions_concurrency
-- settle_completions with the concurrency claim (queues with concurrency limits, no rate limit).
-- The completions: one tick's completions. Every row is checked on its own (the
-- CAS): still running under the same lease_owner and lease_generation, and before its
-- DB deadline. The runs of every row of the tick (completions and failures) are locked
-- first, all at once, by id.
WITH RECURSIVE runs AS (
    -- by primary key only: a state predicate here made generic plans scan every running run
    SELECT r.id, r.kind, r.state, r.parent_id
      FROM cyclone_runs r
     WHERE r.id = ANY(ARRAY(SELECT s.run_id FROM cyclone_steps s
                             WHERE s.id = ANY(%(ids)s::bigint[] || %(fail_ids)s::bigint[])))
     ORDER BY r.id
       FOR UPDATE SKIP LOCKED  -- a run another session holds: its rows wait for a later statement
), done AS (
    -- Each row's own item (output, progress) is found by its lease, "id:generation", a key
    -- of the leases object whose value is the item's position in the arrays (a binary
    -- search; a search of a text array compared each row with every item, and so did a
    -- join with the unnested arrays). No item for this lease, no update (the CAS on the
    -- generation; a step listed twice under two leases takes its current one's).
    UPDATE cyclone_steps s
       SET state = 'completed',
           output = (%(outputs)s::jsonb[])[(%(leases)s::jsonb ->> (s.id || ':' || s.lease_generation))::int],
           progress = coalesce((%(progress)s::jsonb[])[(%(leases)s::jsonb ->> (s.id || ':' || s.lease_generation))::int],
                               s.progress),
           finished_at = now(),
           lease_expiry = NULL,
           error = NULL,
           error_kind = NULL,
           start_delay = coalesce((%(start_delays_us)s::bigint[])[(%(leases)s::jsonb ->> (s.id || ':' || s.lease_generation))::int]
                                  * interval '1 microsecond', s.start_delay)
     WHERE s.id = ANY(%(ids)s::bigint[])  -- by primary key (the supervisor reuses generic plans)
       AND (s.run_id IN (SELECT id FROM runs)) IS TRUE  -- one hash of the locked runs (not a join, nor an index)
       AND (s.state = 'running') IS TRUE  -- (not the partial index of every running row)
       AND s.lease_owner = %(owner)s
       AND (%(leases)s::jsonb ->> (s.id || ':' || s.lease_generation)) IS NOT NULL
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
    RETURNING r.id, CASE WHEN EXISTS (SELECT 1 FROM pg_stat_get_activity(NULL) a
    WHERE a.application_name = 'cyclone_mp waiting'
      AND a.datid = (SELECT d.oid FROM pg_database d WHERE d.datname = current_database())) THEN pg_notify('cyclone_mp_runs', r.id::text) END
), finished AS (SELECT id, lease_generation AS generation FROM done),
-- The concurrency claim: the limited claim of queues that no rate-limited step ever entered (see
-- cyclone_flow_queues.rates, migration 0010): the full claim with its concurrency slots only,
-- a plan of about half the nodes (%(rates)s false: a rate-limited step is left to the
-- full claim). Needs a "finished" CTE before it, as the full claim does.
-- The walk, the first half of the fair claims: the first half of the fair claims: each queue's keys
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
), grp AS MATERIALIZED (
    -- the limited (step, key) groups among them, and how many want a slot
    SELECT step_name, key, min(concurrency) AS concurrency, count(*) AS n
      FROM cand
     WHERE concurrency IS NOT NULL
     GROUP BY step_name, key
-- Free concurrency slots: the free concurrency slots of the limited groups (grp: step_name, key,
-- concurrency, n wanted), locked SKIP LOCKED, numbered i within their group.
), cslots AS MATERIALIZED (
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
), eligible AS MATERIALIZED (
    -- the candidates their limits let start now: the gr-th of a group needs gr free slots
    SELECT r.id, r.step_name, r.key, r.queue, r.p, r.rn, r.gr, r.priority
      FROM ranked r
     WHERE r.concurrency IS NULL
        OR r.gr <= (SELECT count(*) FROM cslots c WHERE c.step_name = r.step_name AND c.key = r.key)
-- Picked: round-robin: every key's first step, then every key's second, ... (priority
-- first), from the eligible candidates.
), picked AS MATERIALIZED (
    -- round-robin: every key's first step, then every key's second, ... (priority first)
    SELECT e.id, e.step_name, e.key, e.queue, e.p, e.rn, e.gr
      FROM eligible e
     ORDER BY e.priority, e.rn, e.p, e.id
     LIMIT %(limit)s
-- The claim's write: the claim's write: the picked steps become running under this lease, the
-- claim being their first heartbeat (SPEC 4); returns what the supervisor starts them with.
), claimed AS (
    UPDATE cyclone_steps s
       SET state = 'running',
           started_at = now(),
           lease_owner = %(owner)s,
           lease_expiry = now() + (%(ttl_us)s::bigint * interval '1 microsecond'),
           lease_generation = s.lease_generation + 1,
           heartbeat_at = now(),
           progress = NULL,
           start_delay = NULL,  -- this attempt's own, once its supervisor reports it
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
), took_slots AS (
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
-- The meta row: the claim's meta row, for the store (not a claimed row): where each queue's
-- walk ended, and claim_wait's seconds until a step a rate limit held back may start
-- (the supervisor may poll again then; see Store.claim_wait).
), claim_meta AS (
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
-- The settled rows: the rows a settle statement returns: completed, then claimed.
), settled_completed AS (
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
           c.timeout, c.lease_generation, CASE WHEN pg_column_size(coalesce(c.item_input, (c.run).input)) <= %(inline_max)s
           THEN coalesce(c.item_input, (c.run).input)::text END, CASE WHEN (c.run).parent_id IS NOT NULL AND (c.run).kind = 'step' THEN 'child' ELSE (c.run).kind END, c.upstream, (pg_column_size(coalesce(c.item_input, (c.run).input)) > %(inline_max)s OR (c.has_upstream AND c.upstream IS NULL)
           OR c.wait_spawned),
           c.pickup, (c.run).trace, c.memory_limit, c.cpu_limit, c.max_processes, c.max_open_files, c.rated,
           NULL::boolean, NULL::text
      FROM claimed c
)
-- The result: a settle statement's, without failed rows (the meta row's input: the rows
-- skipped for a locked run, as in settle).
SELECT * FROM settled_completed
UNION ALL
SELECT * FROM settled_claimed
UNION ALL
SELECT 'meta', NULL, NULL, m.cursors::text, (SELECT coalesce(jsonb_object_agg(f.queue, CASE WHEN f.rates THEN 'rates' WHEN f.limits THEN 'limits' ELSE 'keys' END),
               '{}'::jsonb)::text
 FROM cyclone_flow_queues f
WHERE f.queue = ANY(%(queues)s::text[])), NULL, NULL, NULL, m.wait, NULL, (SELECT string_agg(w.id || ':' || w.lease_generation, ',')  -- skipped (see above)
          FROM cyclone_steps w
         WHERE w.id = ANY(ARRAY(SELECT unnest(%(ids)s::bigint[] || %(fail_ids)s::bigint[]) EXCEPT SELECT id FROM done))
           AND w.run_id NOT IN (SELECT id FROM runs)), NULL, NULL, NULL, NULL, NULL, NULL, NULL, NULL, NULL,
       NULL, NULL, NULL
  FROM claim_meta m

-- name: settle_completions_fair
-- settle_completions with the fair claim (queues with keys, no limited step).
-- The completions: one tick's completions. Every row is checked on its own (the
-- CAS): still running under the same lease_owner and lease_generation, and before its
-- DB deadline. The runs of every row of the tick (completions and failures) are locked
-- first, all at once, by id.
WITH RECURSIVE runs AS (
    -- by primary key only: a state predicate here made generic plans scan every running run
    SELECT r.id, r.kind, r.state, r.parent_id
      FROM cyclone_runs r
     WHERE r.id = ANY(ARRAY(SELECT s.run_id FROM cyclone_steps s
                             WHERE s.id = ANY(%(ids)s::bigint[] || %(fail_ids)s::bigint[])))
     ORDER BY r.id
       FOR UPDATE SKIP LOCKED  -- a run another session holds: its rows wait for a later statement
), done AS (
    -- Each row's own item (output, progress) is found by its lease, "id:generation", a key
    -- of the leases object whose value is the item's position in the arrays (a binary
    -- search; a search of a text array compared each row with every item, and so did a
    -- join with the unnested arrays). No item for this lease, no update (the CAS on the
    -- generation; a step listed twice under two leases takes its current one's).
    UPDATE cyclone_steps s
       SET state = 'completed',
           output = (%(outputs)s::jsonb[])[(%(leases)s::jsonb ->> (s.id || ':' || s.lease_generation))::int],
           progress = coalesce((%(progress)s::jsonb[])[(%(leases)s::jsonb ->> (s.id || ':' || s.lease_generation))::int],
                               s.progress),
           finished_at = now(),
           lease_expiry = NULL,
           error = NULL,
           error_kind = NULL,
           start_delay = coalesce((%(start_delays_us)s::bigint[])[(%(leases)s::jsonb ->> (s.id || ':' || s.lease_generation))::int]
                                  * interval '1 microsecond', s.start_delay)
     WHERE s.id = ANY(%(ids)s::bigint[])  -- by primary key (the supervisor reuses generic plans)
       AND (s.run_id IN (SELECT id FROM runs)) IS TRUE  -- one hash of the locked runs (not a join, nor an index)
       AND (s.state = 'running') IS TRUE  -- (not the partial index of every running row)
       AND s.lease_owner = %(owner)s
       AND (%(leases)s::jsonb ->> (s.id || ':' || s.lease_generation)) IS NOT NULL
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
    RETURNING r.id, CASE WHEN EXISTS (SELECT 1 FROM pg_stat_get_activity(NULL) a
    WHERE a.application_name = 'cyclone_mp waiting'
      AND a.datid = (SELECT d.oid FROM pg_database d WHERE d.datname = current_database())) THEN pg_notify('cyclone_mp_runs', r.id::text) END
-- The fair claim: the fair claim of queues with keys but no limited step (the walk without the
-- slots; %(limits)s false: a limited step is left to the limited claims).
-- The walk, the first half of the fair claims: the first half of the fair claims: each queue's keys
-- (concurrency_key) are walked in order from the key after %(cursors)s (one per queue,
-- NULL: from the first), at most %(limit)s + 2 of them; each walked key's first steps
-- (its share of the limit) are locked SKIP LOCKED; rn ranks them within their key, gr
-- within their (step, key) group. Without %(limits)s, no step with a limit is taken;
-- without %(rates)s, no step with a rate limit.
), walk (queue, key, p, first) AS (
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
), eligible AS MATERIALIZED (
    SELECT r.id, r.step_name, r.key, r.queue, r.p, r.rn, r.gr, r.priority FROM ranked r
-- Picked: round-robin: every key's first step, then every key's second, ... (priority
-- first), from the eligible candidates.
), picked AS MATERIALIZED (
    -- round-robin: every key's first step, then every key's second, ... (priority first)
    SELECT e.id, e.step_name, e.key, e.queue, e.p, e.rn, e.gr
      FROM eligible e
     ORDER BY e.priority, e.rn, e.p, e.id
     LIMIT %(limit)s
-- The claim's write: the claim's write: the picked steps become running under this lease, the
-- claim being their first heartbeat (SPEC 4); returns what the supervisor starts them with.
), claimed AS (
    UPDATE cyclone_steps s
       SET state = 'running',
           started_at = now(),
           lease_owner = %(owner)s,
           lease_expiry = now() + (%(ttl_us)s::bigint * interval '1 microsecond'),
           lease_generation = s.lease_generation + 1,
           heartbeat_at = now(),
           progress = NULL,
           start_delay = NULL,  -- this attempt's own, once its supervisor reports it
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
), claim_wait AS (
    SELECT NULL::float8 AS wait
-- The meta row: the claim's meta row, for the store (not a claimed row): where each queue's
-- walk ended, and claim_wait's seconds until a step a rate limit held back may start
-- (the supervisor may poll again then; see Store.claim_wait).
), claim_meta AS (
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
-- The settled rows: the rows a settle statement returns: completed, then claimed.
), settled_completed AS (
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
           c.timeout, c.lease_generation, CASE WHEN pg_column_size(coalesce(c.item_input, (c.run).input)) <= %(inline_max)s
           THEN coalesce(c.item_input, (c.run).input)::text END, CASE WHEN (c.run).parent_id IS NOT NULL AND (c.run).kind = 'step' THEN 'child' ELSE (c.run).kind END, c.upstream, (pg_column_size(coalesce(c.item_input, (c.run).input)) > %(inline_max)s OR (c.has_upstream AND c.upstream IS NULL)
           OR c.wait_spawned),
           c.pickup, (c.run).trace, c.memory_limit, c.cpu_limit, c.max_processes, c.max_open_files, c.rated,
           NULL::boolean, NULL::text
      FROM claimed c
)
-- The result: a settle statement's, without failed rows (the meta row's input: the rows
-- skipped for a locked run, as in settle).
SELECT * FROM settled_completed
UNION ALL
SELECT * FROM settled_claimed
UNION ALL
SELECT 'meta', NULL, NULL, m.cursors::text, (SELECT coalesce(jsonb_object_agg(f.queue, CASE WHEN f.rates THEN 'rates' WHEN f.limits THEN 'limits' ELSE 'keys' END),
               '{}'::jsonb)::text
 FROM cyclone_flow_queues f
WHERE f.queue = ANY(%(queues)s::text[])), NULL, NULL, NULL, m.wait, NULL, (SELECT string_agg(w.id || ':' || w.lease_generation, ',')  -- skipped (see above)
          FROM cyclone_steps w
         WHERE w.id = ANY(ARRAY(SELECT unnest(%(ids)s::bigint[] || %(fail_ids)s::bigint[]) EXCEPT SELECT id FROM done))
           AND w.run_id NOT IN (SELECT id FROM runs)), NULL, NULL, NULL, NULL, NULL, NULL, NULL, NULL, NULL,
       NULL, NULL, NULL
  FROM claim_meta m

-- name: settle_completions_plain
-- settle_completions with the plain claim (queues without keys or limits).
-- The completions: one tick's completions. Every row is checked on its own (the
-- CAS): still running under the same lease_owner and lease_generation, and before its
-- DB deadline. The runs of every row of the tick (completions and failures) are locked
-- first, all at once, by id.
WITH runs AS (
    -- by primary key only: a state predicate here made generic plans scan every running run
    SELECT r.id, r.kind, r.state, r.parent_id
      FROM cyclone_runs r
     WHERE r.id = ANY(ARRAY(SELECT s.run_id FROM cyclone_steps s
                             WHERE s.id = ANY(%(ids)s::bigint[] || %(fail_ids)s::bigint[])))
     ORDER BY r.id
       FOR UPDATE SKIP LOCKED  -- a run another session holds: its rows wait for a later statement
), done AS (
    -- Each row's own item (output, progress) is found by its lease, "id:generation", a key
    -- of the leases object whose value is the item's position in the arrays (a binary
    -- search; a search of a text array compared each row with every item, and so did a
    -- join with the unnested arrays). No item for this lease, no update (the CAS on the
    -- generation; a step listed twice under two leases takes its current one's).
    UPDATE cyclone_steps s
       SET state = 'completed',
           output = (%(outputs)s::jsonb[])[(%(leases)s::jsonb ->> (s.id || ':' || s.lease_generation))::int],
           progress = coalesce((%(progress)s::jsonb[])[(%(leases)s::jsonb ->> (s.id || ':' || s.lease_generation))::int],
                               s.progress),
           finished_at = now(),
           lease_expiry = NULL,
           error = NULL,
           error_kind = NULL,
           start_delay = coalesce((%(start_delays_us)s::bigint[])[(%(leases)s::jsonb ->> (s.id || ':' || s.lease_generation))::int]
                                  * interval '1 microsecond', s.start_delay)
     WHERE s.id = ANY(%(ids)s::bigint[])  -- by primary key (the supervisor reuses generic plans)
       AND (s.run_id IN (SELECT id FROM runs)) IS TRUE  -- one hash of the locked runs (not a join, nor an index)
       AND (s.state = 'running') IS TRUE  -- (not the partial index of every running row)
       AND s.lease_owner = %(owner)s
       AND (%(leases)s::jsonb ->> (s.id || ':' || s.lease_generation)) IS NOT NULL
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
    RETURNING r.id, CASE WHEN EXISTS (SELECT 1 FROM pg_stat_get_activity(NULL) a
    WHERE a.application_name = 'cyclone_mp waiting'
      AND a.datid = (SELECT d.oid FROM pg_database d WHERE d.datname = current_database())) THEN pg_notify('cyclone_mp_runs', r.id::text) END
-- The plain claim: the claim of queues no step with a key or a limit ever entered (see
-- cyclone_flow_queues, migration 0008): one ordered index scan per queue, SKIP LOCKED.
-- It never takes a step with a key or a limit, whatever the store believes of a queue.
), picked AS (
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
-- The claim's write: the claim's write: the picked steps become running under this lease, the
-- claim being their first heartbeat (SPEC 4); returns what the supervisor starts them with.
), claimed AS (
    UPDATE cyclone_steps s
       SET state = 'running',
           started_at = now(),
           lease_owner = %(owner)s,
           lease_expiry = now() + (%(ttl_us)s::bigint * interval '1 microsecond'),
           lease_generation = s.lease_generation + 1,
           heartbeat_at = now(),
           progress = NULL,
           start_delay = NULL,  -- this attempt's own, once its supervisor reports it
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
), claim_meta AS (
    SELECT NULL::jsonb AS cursors, NULL::float8 AS wait  -- no walk, no rate limit: nothing to say
-- The settled rows: the rows a settle statement returns: completed, then claimed.
), settled_completed AS (
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
           c.timeout, c.lease_generation, CASE WHEN pg_column_size(coalesce(c.item_input, (c.run).input)) <= %(inline_max)s
           THEN coalesce(c.item_input, (c.run).input)::text END, CASE WHEN (c.run).parent_id IS NOT NULL AND (c.run).kind = 'step' THEN 'child' ELSE (c.run).kind END, c.upstream, (pg_column_size(coalesce(c.item_input, (c.run).input)) > %(inline_max)s OR (c.has_upstream AND c.upstream IS NULL)
           OR c.wait_spawned),
           c.pickup, (c.run).trace, c.memory_limit, c.cpu_limit, c.max_processes, c.max_open_files, c.rated,
           NULL::boolean, NULL::text
      FROM claimed c
)
-- The result: a settle statement's, without failed rows (the meta row's input: the rows
-- skipped for a locked run, as in settle).
SELECT * FROM settled_completed
UNION ALL
SELECT * FROM settled_claimed
UNION ALL
SELECT 'meta', NULL, NULL, m.cursors::text, (SELECT coalesce(jsonb_object_agg(f.queue, CASE WHEN f.rates THEN 'rates' WHEN f.limits THEN 'limits' ELSE 'keys' END),
               '{}'::jsonb)::text
 FROM cyclone_flow_queues f
WHERE f.queue = ANY(%(queues)s::text[])), NULL, NULL, NULL, m.wait, NULL, (SELECT string_agg(w.id || ':' || w.lease_generation, ',')  -- skipped (see above)
          FROM cyclone_steps w
         WHERE w.id = ANY(ARRAY(SELECT unnest(%(ids)s::bigint[] || %(fail_ids)s::bigint[]) EXCEPT SELECT id FROM done))
           AND w.run_id NOT IN (SELECT id FROM runs)), NULL, NULL, NULL, NULL, NULL, NULL, NULL, NULL, NULL,
       NULL, NULL, NULL
  FROM claim_meta m
