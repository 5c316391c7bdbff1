-- Unique runs (cy.Unique): a run holds its unique key while its state is one of those its
-- step named (unique_states: bits, running 1, paused 2, completed 4, discarded 8,
-- cancelled 16); a second enqueue of the same key then inserts nothing and gets the first
-- run's id. The partial unique index enforces it for every client at once.
ALTER TABLE cyclone_runs ADD COLUMN IF NOT EXISTS unique_key text,
                         ADD COLUMN IF NOT EXISTS unique_states smallint;
ALTER TABLE cyclone_runs_archive ADD COLUMN IF NOT EXISTS unique_key text,
                                 ADD COLUMN IF NOT EXISTS unique_states smallint;

CREATE OR REPLACE FUNCTION cyclone_unique_in(states smallint, state text) RETURNS boolean
    LANGUAGE sql IMMUTABLE PARALLEL SAFE AS $$
    SELECT (states & CASE state WHEN 'running' THEN 1 WHEN 'paused' THEN 2 WHEN 'completed' THEN 4
                                WHEN 'discarded' THEN 8 WHEN 'cancelled' THEN 16 ELSE 0 END) <> 0
$$;

CREATE UNIQUE INDEX IF NOT EXISTS cyclone_runs_unique_idx ON cyclone_runs (unique_key)
    WHERE unique_key IS NOT NULL AND cyclone_unique_in(unique_states, state);
