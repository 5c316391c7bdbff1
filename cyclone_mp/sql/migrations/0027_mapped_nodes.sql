-- Mapped nodes (wf.map): when the node a map runs over completes with a JSON list, one
-- step row per item is inserted into the run, in the transaction of that completion (so a
-- late or repeated completion never maps twice: the map row has left 'pending' by then).
--
-- Map rows (kind 'map') hold the options their items are made with, and count them:
--   items_total: how many items the list had (NULL until it was mapped);
--   items_left: items not completed yet (each completion's statement counts its own down,
--     so the run moves on when the last one completes without reading the others);
--   allow_failures: discarded items do not discard the map (the join sees their errors).
-- Item rows (kind 'item') are ordinary claimable steps of the run:
--   map_node: their map row's node; item: their index in the list (0-based);
--   input: the list element, their handler's input (NULL for every other row: the run's).
ALTER TABLE cyclone_steps ADD COLUMN IF NOT EXISTS input jsonb,
                          ADD COLUMN IF NOT EXISTS map_node text,
                          ADD COLUMN IF NOT EXISTS item integer,
                          ADD COLUMN IF NOT EXISTS items_total integer,
                          ADD COLUMN IF NOT EXISTS items_left integer,
                          ADD COLUMN IF NOT EXISTS allow_failures boolean;
ALTER TABLE cyclone_steps_archive ADD COLUMN IF NOT EXISTS input jsonb,
                                  ADD COLUMN IF NOT EXISTS map_node text,
                                  ADD COLUMN IF NOT EXISTS item integer,
                                  ADD COLUMN IF NOT EXISTS items_total integer,
                                  ADD COLUMN IF NOT EXISTS items_left integer,
                                  ADD COLUMN IF NOT EXISTS allow_failures boolean;

-- The two new kinds. NOT VALID: every existing row has one of the old kinds, and
-- validating would read the whole table under an exclusive lock.
ALTER TABLE cyclone_steps DROP CONSTRAINT IF EXISTS cyclone_steps_kind_check;
ALTER TABLE cyclone_steps ADD CONSTRAINT cyclone_steps_kind_check
    CHECK (kind IN ('task', 'signal', 'timer', 'map', 'item')) NOT VALID;

-- A map's items in list order: the join's outputs, read in pages, and status's counts.
-- Partial: only item rows have an entry, so no other step pays for it.
CREATE INDEX IF NOT EXISTS cyclone_steps_items_idx ON cyclone_steps (run_id, map_node, item)
    WHERE map_node IS NOT NULL;
-- A map's discarded items (few): whether every item left has ended, in one probe.
CREATE INDEX IF NOT EXISTS cyclone_steps_failed_items_idx ON cyclone_steps (run_id, map_node)
    WHERE map_node IS NOT NULL AND state = 'discarded';
-- The map rows of a run (few): the run's maps are looked at without reading its items.
CREATE INDEX IF NOT EXISTS cyclone_steps_maps_idx ON cyclone_steps (run_id) WHERE kind = 'map';
CREATE INDEX IF NOT EXISTS cyclone_steps_archive_items_idx ON cyclone_steps_archive (run_id, map_node, item)
    WHERE map_node IS NOT NULL;
