-- Runs spawned by a handler (ctx.spawn): inserted in the transaction of the spawning
-- attempt's completion, only when its CAS held, so an attempt that loses its lease (or
-- fails) spawns nothing. A child run knows its parent:
--   parent_id: the run whose attempt spawned it; parent_node: that attempt's node;
--   parent_key: the spawn's key (unique per parent node: the child's id is derived from
--     the three, so the same spawn never makes two runs).
-- A node may wait for the runs its upstream nodes spawned (wait_spawned): it stays pending
-- until each of them has ended (completed, discarded or cancelled).
ALTER TABLE cyclone_runs ADD COLUMN IF NOT EXISTS parent_id uuid,
                         ADD COLUMN IF NOT EXISTS parent_node text,
                         ADD COLUMN IF NOT EXISTS parent_key text;
ALTER TABLE cyclone_runs_archive ADD COLUMN IF NOT EXISTS parent_id uuid,
                                 ADD COLUMN IF NOT EXISTS parent_node text,
                                 ADD COLUMN IF NOT EXISTS parent_key text;
ALTER TABLE cyclone_steps ADD COLUMN IF NOT EXISTS wait_spawned boolean;
ALTER TABLE cyclone_steps_archive ADD COLUMN IF NOT EXISTS wait_spawned boolean;

-- A run's children (few runs have any: partial), hot and archived.
CREATE INDEX IF NOT EXISTS cyclone_runs_parent_idx ON cyclone_runs (parent_id, parent_node)
    WHERE parent_id IS NOT NULL;
CREATE INDEX IF NOT EXISTS cyclone_runs_archive_parent_idx ON cyclone_runs_archive (parent_id, parent_node)
    WHERE parent_id IS NOT NULL;
