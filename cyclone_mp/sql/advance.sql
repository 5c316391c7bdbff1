-- Moving a workflow run on: ready nodes, map expansion, timers, parents, the run's state.
-- Parameters are named placeholders: %(name)s.

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
