-- cy.Snooze: a handler asks to run again later without spending an attempt; snoozes counts
-- how many times the step did (its max_snoozes, a step option, bounds it).
ALTER TABLE cyclone_steps ADD COLUMN IF NOT EXISTS snoozes integer NOT NULL DEFAULT 0;
ALTER TABLE cyclone_steps_archive ADD COLUMN IF NOT EXISTS snoozes integer NOT NULL DEFAULT 0;
