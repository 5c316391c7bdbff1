-- Dashboard (issue 24): the kills of the last hour by trigger are read from the steps
-- whose latest error entry is recent (entries are appended in time order, so a kill in
-- the last hour means a latest entry at least as recent). 0002's index covers only
-- steps whose latest entry is a timeout, a child exit or a reclaim limit; a kill can end
-- in any kind (a protocol error, a cancel), so this one covers every step with errors.
CREATE INDEX cyclone_steps_last_error_at_idx ON cyclone_steps (((errors -> -1 ->> 'at')))
    WHERE errors <> '[]'::jsonb;
