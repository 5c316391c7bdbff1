-- 0005: cyclone_steps.run_id no longer has a foreign key (issue 8). Every step is inserted
-- in the transaction that inserts its run, and runs are deleted only by prune_runs, which
-- deletes their steps in the same statement. The key's check cost each inserted step a
-- lookup and a KEY SHARE lock on its run row: about a fifth of enqueue_many's PostgreSQL
-- CPU in a paired measurement. (Signals keep theirs: they are few.)
ALTER TABLE cyclone_steps DROP CONSTRAINT IF EXISTS cyclone_steps_run_id_fkey;
