-- 0017: history that stays small (issue 22). Finished runs move, with their steps and
-- signals, from the hot tables (cyclone_runs, cyclone_steps: what the claim, the
-- renewals and the completions touch) to archive tables, in batches, by the supervisors'
-- maintenance (archive_after); retention (retain_completed, retain_discarded,
-- retain_cancelled) then drops whole archive partitions, and deletes rows only in the
-- one partition a cut-off falls in.
--
-- The archive is partitioned by (state, finished_at), one partition per finished state
-- and UTC day, so a state's history older than its retention is a DROP TABLE, never a
-- long DELETE. Every run in a partition has its steps in the steps partition of the
-- same (state, day): a run and its steps go together.
--
-- A column added to cyclone_runs or cyclone_steps must be added here too (and to the
-- column lists run_columns_expr / step_columns_expr of queries.sql): a test compares them.

CREATE TABLE cyclone_runs_archive (
    LIKE cyclone_runs,
    signals      jsonb NOT NULL DEFAULT '[]',          -- its cyclone_signals rows: [{name, payload, created_at}]
    archived_at  timestamptz NOT NULL DEFAULT now()
) PARTITION BY RANGE (state, finished_at);
ALTER TABLE cyclone_runs_archive ALTER COLUMN finished_at SET NOT NULL;

CREATE TABLE cyclone_steps_archive (
    LIKE cyclone_steps,
    run_state        text NOT NULL,                    -- its run's state and finished_at: the partition
    run_finished_at  timestamptz NOT NULL
) PARTITION BY RANGE (run_state, run_finished_at);

-- client.status, wait, result and retry of an archived run (by id); idempotency keys
-- stay unique across both tables (operations.py checks the archive at enqueue).
CREATE INDEX cyclone_runs_archive_id_idx ON cyclone_runs_archive (id);
CREATE INDEX cyclone_runs_archive_key_idx ON cyclone_runs_archive (idempotency_key)
    WHERE idempotency_key IS NOT NULL;
-- `cyclone-mp runs` and the dashboard's runs pages, newest first, optionally by name.
CREATE INDEX cyclone_runs_archive_created_idx ON cyclone_runs_archive (created_at, id);
CREATE INDEX cyclone_runs_archive_name_idx ON cyclone_runs_archive (name, created_at, id);
-- Retention's row deletes in the partition a cut-off falls in (rows come in finish order).
CREATE INDEX cyclone_runs_archive_finished_idx ON cyclone_runs_archive USING brin (finished_at);

CREATE INDEX cyclone_steps_archive_run_idx ON cyclone_steps_archive (run_id);
-- The dashboard's last hour (throughput, pickup, run times) and its kills, as 0002,
-- 0013 and 0016 index them on cyclone_steps.
CREATE INDEX cyclone_steps_archive_finished_idx ON cyclone_steps_archive USING brin (finished_at);
CREATE INDEX cyclone_steps_archive_kills_idx ON cyclone_steps_archive (((errors -> -1 ->> 'at')), id)
    WHERE (errors -> -1 ->> 'kind') IN ('timeout', 'child_exited', 'reclaim_limit',
                                        'memory_limit', 'cpu_limit', 'process_limit', 'oom_killed');
CREATE INDEX cyclone_steps_archive_last_error_at_idx ON cyclone_steps_archive (((errors -> -1 ->> 'at')))
    WHERE errors <> '[]'::jsonb;

-- The partitions of one (state, UTC day), runs and steps, made when missing. It takes an
-- ACCESS EXCLUSIVE lock on both archive tables for a moment (the hot tables are not
-- touched): maintenance gives it a short p_lock_timeout (SET LOCAL). Returns true when it
-- made them.
CREATE FUNCTION cyclone_archive_partition(p_state text, p_day date, p_lock_timeout text DEFAULT NULL)
RETURNS boolean
LANGUAGE plpgsql AS $$
DECLARE
    lo timestamptz := p_day::timestamp AT TIME ZONE 'UTC';
    suffix text := p_state || '_' || to_char(p_day, 'YYYYMMDD');
BEGIN
    IF p_state NOT IN ('completed', 'discarded', 'cancelled') THEN
        RAISE EXCEPTION 'not a finished state: %', p_state;
    END IF;
    IF p_lock_timeout IS NOT NULL THEN
        PERFORM set_config('lock_timeout', p_lock_timeout, true);
    END IF;
    IF to_regclass('cyclone_runs_archive_' || suffix) IS NOT NULL THEN
        RETURN false;
    END IF;
    EXECUTE format('CREATE TABLE %I PARTITION OF cyclone_runs_archive FOR VALUES FROM (%L, %L) TO (%L, %L)',
                   'cyclone_runs_archive_' || suffix, p_state, lo, p_state, lo + interval '1 day');
    EXECUTE format('CREATE TABLE %I PARTITION OF cyclone_steps_archive FOR VALUES FROM (%L, %L) TO (%L, %L)',
                   'cyclone_steps_archive_' || suffix, p_state, lo, p_state, lo + interval '1 day');
    RETURN true;
END
$$;

-- Drop the partitions of one (state, UTC day), runs and steps, once every run of that day
-- is past the state's retention; returns how many runs they held (counted first). The
-- DROP takes an ACCESS EXCLUSIVE lock on both archive tables for a moment: callers give
-- a short p_lock_timeout (SET LOCAL).
CREATE FUNCTION cyclone_drop_archive_partition(p_state text, p_day date, p_lock_timeout text DEFAULT NULL)
RETURNS bigint
LANGUAGE plpgsql AS $$
DECLARE
    suffix text := p_state || '_' || to_char(p_day, 'YYYYMMDD');
    n bigint := 0;
BEGIN
    IF p_lock_timeout IS NOT NULL THEN
        PERFORM set_config('lock_timeout', p_lock_timeout, true);
    END IF;
    IF to_regclass('cyclone_runs_archive_' || suffix) IS NOT NULL THEN
        EXECUTE format('SELECT count(*) FROM %I', 'cyclone_runs_archive_' || suffix) INTO n;
    END IF;
    EXECUTE format('DROP TABLE IF EXISTS %I, %I', 'cyclone_runs_archive_' || suffix, 'cyclone_steps_archive_' || suffix);
    RETURN n;
END
$$;

-- Deleting runs deletes their steps (0006's trigger): by the (run_id, node) index, one
-- probe per deleted run, whatever the planner guesses of the transition table (a batch
-- of archived runs, thousands at a time, must not make it scan cyclone_steps).
CREATE OR REPLACE FUNCTION cyclone_delete_steps_of_deleted_runs() RETURNS trigger
LANGUAGE plpgsql AS $$
BEGIN
    DELETE FROM cyclone_steps s WHERE s.run_id = ANY(ARRAY(SELECT d.id FROM deleted_runs d));
    RETURN NULL;
END
$$;
