-- Unique runs (cy.Unique): a run holds a place (cyclone_unique_places, its key unique) while
-- its state is one of those its step named (states: bits, running 1, paused 2, completed 4,
-- discarded 8, cancelled 16); a second enqueue of the same key then inserts nothing and
-- gets the holder's id. The place is a row of its own, not an index of cyclone_runs: an
-- index there covering state would make every run update (a completion) a non-HOT one.
-- A trigger gives the place back when the run's state leaves the bits; the run's deletion
-- (archive, prune) takes it along.
ALTER TABLE cyclone_runs ADD COLUMN IF NOT EXISTS unique_key text;
ALTER TABLE cyclone_runs_archive ADD COLUMN IF NOT EXISTS unique_key text;

CREATE TABLE IF NOT EXISTS cyclone_unique_places (
    unique_key  text PRIMARY KEY,
    run_id      uuid NOT NULL REFERENCES cyclone_runs (id) ON DELETE CASCADE,
    states      smallint NOT NULL
);
CREATE INDEX IF NOT EXISTS cyclone_unique_places_run_idx ON cyclone_unique_places (run_id);

CREATE OR REPLACE FUNCTION cyclone_unique_in(states smallint, state text) RETURNS boolean
    LANGUAGE sql IMMUTABLE PARALLEL SAFE AS $$
    SELECT (states & CASE state WHEN 'running' THEN 1 WHEN 'paused' THEN 2 WHEN 'completed' THEN 4
                                WHEN 'discarded' THEN 8 WHEN 'cancelled' THEN 16 ELSE 0 END) <> 0
$$;

CREATE OR REPLACE FUNCTION cyclone_unique_release() RETURNS trigger LANGUAGE plpgsql AS $$
BEGIN
    DELETE FROM cyclone_unique_places p
     WHERE p.unique_key = NEW.unique_key AND p.run_id = NEW.id AND NOT cyclone_unique_in(p.states, NEW.state);
    RETURN NULL;
END $$;

CREATE TRIGGER cyclone_runs_unique_release AFTER UPDATE OF state ON cyclone_runs
    FOR EACH ROW WHEN (NEW.unique_key IS NOT NULL AND OLD.state IS DISTINCT FROM NEW.state)
    EXECUTE FUNCTION cyclone_unique_release();
