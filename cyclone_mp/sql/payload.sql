-- What a claimed step reads beside its claim: a big input or upstream object, a map's
-- outputs in pages, the runs it spawned.
-- Parameters are named placeholders: %(name)s.

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
