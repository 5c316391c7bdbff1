-- Maintenance turns that work on every supported PostgreSQL, and that say when a task last
-- succeeded.
--
-- ran_at defaulted to '-infinity', and PostgreSQL before 17 refuses arithmetic between an
-- infinite timestamp and a finite one ("cannot subtract infinite timestamps"): a finite
-- default (the epoch) means "never ran" as well, on every version.
--
-- succeeded_at is when a pass of the task last ended without an error (set by the
-- supervisor that did it; NULL: never); every supervisor reads it with its turn, so the
-- fleet's "last successful sweep" is known to each (metrics, `cyclone-mp workers`).
ALTER TABLE cyclone_maintenance ALTER COLUMN ran_at SET DEFAULT 'epoch';
UPDATE cyclone_maintenance SET ran_at = 'epoch' WHERE NOT isfinite(ran_at);
ALTER TABLE cyclone_maintenance ADD COLUMN IF NOT EXISTS succeeded_at timestamptz;
