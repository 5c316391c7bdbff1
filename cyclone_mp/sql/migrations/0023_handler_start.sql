-- When a step's handler started, beside when its row was claimed. started_at stays the
-- claim's now() (the base of the database-clock timeout, as the seed says); start_delay
-- is how long after it the handler started (its supervisor's own clock: the claimed row
-- may wait for a child, held ahead or queued behind a busy one), written with the
-- attempt's outcome or its renewal; NULL until the supervisor reports it.
ALTER TABLE cyclone_steps ADD COLUMN IF NOT EXISTS start_delay interval;
ALTER TABLE cyclone_steps_archive ADD COLUMN IF NOT EXISTS start_delay interval;
