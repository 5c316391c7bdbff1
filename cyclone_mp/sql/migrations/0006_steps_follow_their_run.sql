-- 0006: deleting runs deletes their steps again, whatever deletes them (0005 dropped the
-- foreign key whose ON DELETE CASCADE did it). Statement-level triggers cost nothing when
-- steps are inserted, where the key's check was paid per row. Without them a run deleted
-- by hand left its steps behind: a claimed orphan could never complete (its completion
-- needs the run) and its expired lease was skipped by every sweep.
CREATE FUNCTION cyclone_delete_steps_of_deleted_runs() RETURNS trigger
LANGUAGE plpgsql AS $$
BEGIN
    DELETE FROM cyclone_steps s USING deleted_runs d WHERE s.run_id = d.id;
    RETURN NULL;
END
$$;

CREATE TRIGGER cyclone_runs_delete_steps
    AFTER DELETE ON cyclone_runs
    REFERENCING OLD TABLE AS deleted_runs
    FOR EACH STATEMENT EXECUTE FUNCTION cyclone_delete_steps_of_deleted_runs();

CREATE FUNCTION cyclone_truncate_steps() RETURNS trigger
LANGUAGE plpgsql AS $$
BEGIN
    TRUNCATE cyclone_steps;
    RETURN NULL;
END
$$;

CREATE TRIGGER cyclone_runs_truncate_steps
    AFTER TRUNCATE ON cyclone_runs
    FOR EACH STATEMENT EXECUTE FUNCTION cyclone_truncate_steps();
