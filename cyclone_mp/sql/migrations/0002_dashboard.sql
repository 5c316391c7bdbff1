-- 0002: indexes for the operator dashboard (issue 7), so every page reads an index, not the tables.

-- The runs page, newest first, without a state filter (keyset on created_at, id).
CREATE INDEX cyclone_runs_created_idx ON cyclone_runs (created_at, id);
-- The runs page filtered by name; also the loose index scan of the distinct run names.
CREATE INDEX cyclone_runs_name_idx ON cyclone_runs (name, created_at, id);
-- Throughput: steps finished in the last minutes.
CREATE INDEX cyclone_steps_finished_idx ON cyclone_steps (finished_at) WHERE finished_at IS NOT NULL;
-- Recent kills: steps whose latest error entry is a kill, newest entry first. The entry's
-- "at" is an ISO 8601 UTC string written by the supervisor, so text order is time order.
CREATE INDEX cyclone_steps_kills_idx ON cyclone_steps (((errors -> -1 ->> 'at')), id)
    WHERE (errors -> -1 ->> 'kind') IN ('timeout', 'child_exited', 'reclaim_limit');
